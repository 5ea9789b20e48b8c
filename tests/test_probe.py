"""n by simulated probes (klotski_sim/planning/probe.py): the search, and klotski-hybrid's auto n end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.cli.main import main
from klotski_sim.planning.probe import TIE, Probe, candidates, search
from klotski_sim.runs.runner import RunSpec, prepare, run


def probe_of(curve):
    calls = []

    def measure(n: int) -> Probe:
        calls.append(n)
        return Probe(n, 0, 1.0, 0.1, curve(n), 0.0)

    return measure, calls


def test_candidates_are_powers_of_two_and_the_largest_n():
    assert candidates(1) == [1]
    assert candidates(16) == [1, 2, 4, 8, 16]
    assert candidates(17) == [1, 2, 4, 8, 16, 17]


def test_search_refines_around_the_best_coarse_candidate():
    # a throughput curve that peaks at 26: the coarse grid finds 32, its midpoints 24 and 48
    measure, calls = probe_of(lambda n: 1000 - (n - 26) ** 2)
    found = search(measure, 67)
    assert calls == [1, 2, 4, 8, 16, 32, 64, 67, 24, 48]
    assert found.chosen.n == 24
    assert [p.n for p in found.probes] == sorted(calls)


def test_a_tie_goes_to_the_smaller_n():
    measure, _ = probe_of(lambda n: 100.0 if n >= 8 else 100.0 * (1 - 2 * TIE))
    assert search(measure, 64).chosen.n == 8  # 8..64 all predict 100: the smallest wins


@settings(max_examples=200, deadline=None)
@given(n_max=st.integers(1, 300), values=st.lists(st.floats(0, 1e4, allow_nan=False), min_size=301, max_size=301))
def test_the_chosen_probe_is_the_smallest_within_the_tie_of_the_best(n_max, values):
    measure, calls = probe_of(lambda n: values[n])
    found = search(measure, n_max)
    assert n_max in calls and all(1 <= n <= n_max for n in calls) and len(calls) == len(set(calls))
    best = max(values[n] for n in calls)
    assert found.chosen.predicted_tok_s >= best * (1 - TIE)
    assert not any(values[n] >= best * (1 - TIE) for n in calls if n < found.chosen.n)


# a 4-layer Mixtral streamed from host memory on the L4: small enough to probe in a second or two
HYBRID = RunSpec(
    model="mixtral-8x7b:4",
    hardware="l4",
    policy="klotski-hybrid",
    impl="ideal",
    batch_size=32,
    prompt_len=256,
    gen_len=8,
    num_batches=None,
    resident_layers=0,
)


@pytest.fixture(scope="module")
def hybrid_run():
    return run(HYBRID)


def test_hybrid_auto_n_is_the_chosen_probe_and_its_prediction_holds(hybrid_run):
    found = hybrid_run.probes
    s = hybrid_run.timeline.summary()
    assert s.num_batches == found.chosen.n < found.probes[-1].n  # not simply the largest n that fits
    assert hybrid_run.schedule.meta["placement"]["resident_layers"] == found.chosen.resident_layers
    # the whole run predicted from its prefill and two decode steps
    assert s.throughput_tok_s == pytest.approx(found.chosen.predicted_tok_s, rel=0.03)
    # ... and the larger n it passed over is no faster in a whole run either
    larger = run(replace(HYBRID, num_batches=found.probes[-1].n)).timeline.summary()
    assert larger.throughput_tok_s <= s.throughput_tok_s * (1 + 2 * TIE + 0.03)


def test_hybrid_n_is_the_same_alone_and_in_a_comparison(hybrid_run):
    shared = prepare(replace(HYBRID, policy="klotski"))  # what compare prepares for all its policies
    again = run(HYBRID, prepared=shared)
    assert again.probes == hybrid_run.probes
    assert again.timeline.summary() == hybrid_run.timeline.summary()


def test_a_given_n_is_not_probed():
    assert run(replace(HYBRID, num_batches=4)).probes is None


def test_plan_prints_the_probes_and_simulate_runs_the_chosen_n(capsys, hybrid_run):
    args = [
        "--model",
        "mixtral-8x7b:4",
        "--hardware",
        "l4",
        "--impl",
        "ideal",
        "--batch-size",
        "32",
        "--prompt-len",
        "256",
        "--gen-len",
        "8",
        "--resident-layers",
        "0",
    ]
    assert main(["plan", "--policy", "klotski-hybrid", *args]) == 0
    out = capsys.readouterr().out
    chosen = hybrid_run.probes.chosen.n
    assert f"=> n = {chosen} (predictions within" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith("<=")] == [str(chosen)]
    assert main(["simulate", "--policy", "klotski-hybrid", "--num-batches", "auto", *args]) == 0
    assert f"n = {chosen} chosen by {len(hybrid_run.probes.probes)} simulated probes" in capsys.readouterr().out
