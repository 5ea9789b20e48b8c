"""The calibrated generator's what-ifs (`calibrated:domain=..,decode_drift=..,reuse=..`), the
statistics `trace stats` reports on them, and Klotski's spatio-temporal predictor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klotski_sim.policies.prefetch import spatio_temporal
from klotski_sim.runs.runner import RunSpec, run
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.model import get_model
from klotski_sim.workload.trace import Trace
from klotski_sim.workload.trace_stats import layer_stats, summary
from klotski_sim.workload.trace_synth import MIXED, base_popularity, domain_names, params_for, synthesize

from .conftest import run_cli

MIXTRAL = get_model("mixtral-8x7b:4")
FINE = get_model("qwen3-30b-a3b:3")  # top-8 of 128: the generator's sorted path


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), fine=st.booleans())
def test_token_by_token_draw_is_the_vectorised_one_without_bias(seed: int, fine: bool) -> None:
    """The reuse path draws a token at a time; with a bias too small to move a float32 logit it must
    choose exactly what the vectorised draw chooses (stickiness included)."""
    model = FINE if fine else MIXTRAL
    plain = synthesize(model, 5, 9, 4, "calibrated", seed, with_weights=True)
    token_by_token = synthesize(model, 5, 9, 4, "calibrated:reuse=1e-30", seed, with_weights=True)
    assert np.array_equal(plain.experts, token_by_token.experts)
    assert plain.weights is not None and token_by_token.weights is not None
    assert np.array_equal(plain.weights, token_by_token.weights)


def test_knobs_at_zero_draw_plain_calibrated() -> None:
    plain = synthesize(MIXTRAL, 8, 16, 4, "calibrated", 3)
    zero = synthesize(MIXTRAL, 8, 16, 4, "calibrated:decode_drift=0,reuse=0", 3)
    assert np.array_equal(plain.experts, zero.experts)
    assert zero.meta["generator"]["params"] == plain.meta["generator"]["params"]  # (off knobs not recorded)
    assert "reuse_bias" not in plain.meta["generator"]["params"]


def test_coupling_knobs_at_the_calibrated_values_draw_plain_calibrated_and_raise_mi_above() -> None:
    plain = synthesize(MIXTRAL, 8, 16, 4, "calibrated", 3)
    same = synthesize(MIXTRAL, 8, 16, 4, "calibrated:coupling=0.3,type_coupling=1.8", 3)
    assert np.array_equal(plain.experts, same.experts)
    full = get_model("mixtral-8x7b")
    low, high = (
        layer_stats(synthesize(full, 32, 8, 8, routing, 0))["mi_next_excess_bits"].mean()
        for routing in ("calibrated", "calibrated:coupling=0.8,type_coupling=3")
    )
    assert high > 2 * low > 0


def test_reuse_bias_raises_reuse_and_drift_removes_prefill_decode_correlation() -> None:
    def stats(routing: str) -> dict[str, float]:
        return summary(synthesize(MIXTRAL, 64, 24, 24, routing, 0))

    plain, one, two, drift = (
        stats(r) for r in ("calibrated", "calibrated:reuse=1", "calibrated:reuse=2", "calibrated:decode_drift=1")
    )
    assert plain["reuse_share"] + 0.05 < one["reuse_share"] < two["reuse_share"] - 0.05
    assert two["stick_any"] > plain["stick_any"] + 0.15
    # a prompt predicts its own decode routing better than another request's ...
    assert plain["pd_sim"] > plain["pd_sim_other"] + 0.04
    # ... unless the decode shares are drawn apart from the prompt's
    assert abs(drift["pd_sim"] - drift["pd_sim_other"]) < 0.02
    assert drift["reuse_share"] == pytest.approx(plain["reuse_share"], abs=0.02)  # (drift changes nothing else)


@pytest.mark.parametrize("model", [MIXTRAL, FINE], ids=["mixtral", "fine-grained"])
def test_domains_have_their_own_popularity_with_the_same_experts(model) -> None:
    names = domain_names(model)
    assert len(names) >= 5
    rng = np.random.default_rng
    overall = base_popularity(model, params_for("calibrated", model), rng(0))
    mixed = base_popularity(model, params_for("calibrated:domain=mixed", model), rng(0))
    assert np.array_equal(overall, mixed)  # (a mixed workload's corpus is every domain)
    code = base_popularity(model, params_for("calibrated:domain=code", model), rng(0))
    math = base_popularity(model, params_for("calibrated:domain=math", model), rng(0))
    for shares in (code, math):
        assert np.allclose(shares.sum(axis=1), 1.0)
        # a domain moves shares among the same layer's experts, it does not reshuffle them: the
        # domain's shares correlate with the overall ones layer by layer
        assert np.mean([np.corrcoef(shares[j], overall[j])[0, 1] for j in range(len(shares))]) > 0.3
    assert np.abs(code - math).sum(axis=1).mean() > 0.05  # total variation between two domains' layers


def test_mixed_domains_skew_requests_more_than_one_domain() -> None:
    one = summary(synthesize(FINE, 48, 16, 8, "calibrated:domain=code", 0))
    mixed = summary(synthesize(FINE, 48, 16, 8, "calibrated:domain=mixed", 0))
    # each request of a mixed workload routes by its own domain: farther from the corpus it is part of
    assert mixed["pd_sim"] - mixed["pd_sim_other"] > one["pd_sim"] - one["pd_sim_other"]


@pytest.mark.parametrize(
    ("routing", "says"),
    [
        ("calibrated:domain=chat", "no routing of domain 'chat' is measured for a model with 8 experts; measured:"),
        ("calibrated:reuse=21", "reuse must be from 0 to 20"),
        ("calibrated:reuse=nan", "reuse must be a number, got 'nan'"),
        ("calibrated:reuse=1_0", "reuse must be a number, got '1_0'"),
        ("calibrated:reuse=\u0661", "reuse must be a number, got '\u0661'"),  # (an Arabic-Indic 1: a \\d of re)
        ("calibrated:decode_drift=-0.1", "decode_drift must be from 0 to 1"),
        ("calibrated:decode_drift=x", "decode_drift must be a number, got 'x'"),
        ("calibrated:reuse=1,reuse=2", "reuse is given twice"),
        (
            "calibrated:seed=3",
            "unknown setting 'seed'; choose from domain, decode_drift, reuse, coupling, type_coupling",
        ),
        ("calibrated:coupling=21", "coupling must be from 0 to 20"),
        ("calibrated:type_coupling=-1", "type_coupling must be from 0 to 20"),
        ("calibrated:reuse", "write its settings as KEY=VALUE"),
        ("calibrated:", "write its settings as KEY=VALUE"),
    ],
)
def test_bad_knobs_are_refused_in_one_line(routing: str, says: str) -> None:
    with pytest.raises(UsageError, match="^--routing " + routing.replace("?", r"\?") + ": ") as err:
        params_for(routing, MIXTRAL)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_an_unmeasured_domain(tmp_path) -> None:
    code, out, err = run_cli(
        "trace", "synth", "--model", "tiny-mixtral", "--sequences", "2", "--prompt-len", "4", "--gen-len", "2",
        "--routing", "calibrated:domain=chat", "--out", str(tmp_path / "t.npz"),
    )  # fmt: skip
    assert code == 2 and "domain 'chat'" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.npz").exists()


def _trace(tokens: list[list[int]], prompt_len: int) -> Trace:
    """One request over one layer of 8 experts, top-2."""
    experts = np.array(tokens, dtype=np.uint8)[:, None, :]
    meta = {"model": "hand", "num_experts": 8, "top_k": 2, "num_layers": 1}
    return Trace(experts, np.array([0, len(tokens)]), np.array([prompt_len], dtype=np.int32), meta)


def test_reuse_share_by_hand() -> None:
    # token 1 keeps expert 1 of token 0's {0, 1} (1 of its 2 slots), token 2 keeps none
    row = layer_stats(_trace([[0, 1], [1, 2], [3, 4]], 3)).iloc[0]
    assert row["reuse_share"] == pytest.approx((1 / 2 + 0) / 2)
    assert row["stick_any"] == pytest.approx(1 / 2)


def test_prefill_decode_similarity_by_hand() -> None:
    """Two requests: the first decodes with its prompt's experts, the second with others."""
    experts = np.array([[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [4, 5]], dtype=np.uint8)[:, None, :]
    meta = {"model": "hand", "num_experts": 8, "top_k": 2, "num_layers": 1}
    trace = Trace(experts, np.array([0, 3, 6]), np.array([2, 2], dtype=np.int32), meta)
    row = layer_stats(trace).iloc[0]
    assert row["pd_sim"] == pytest.approx((1.0 + 0.0) / 2)  # cosine 1 for the first, 0 for the second
    # against the other request's decode: {4, 5} for the first, {0, 1} for the second: both 0
    assert row["pd_sim_other"] == pytest.approx(0.0)


def test_spatio_temporal_ranking_by_hand() -> None:
    # layer scores favour 0 then 1; the previous token used 2 three times and 1 once
    ranked = spatio_temporal(np.array([3.0, 1.0, 0.0, 0.0]), np.array([0, 1, 3, 0]))
    # shares added: 0 -> 0.75, 1 -> 0.25 + 0.25, 2 -> 0.75, 3 -> 0: the tie 0/2 to the lower id
    assert ranked == [0, 2, 1, 3]
    assert spatio_temporal(np.zeros(3), np.zeros(3)) == [0, 1, 2]  # (nothing known: expert order)


def test_spatio_temporal_predictor_runs_and_reports_its_hits() -> None:
    def prefetch(predictor: str) -> dict:
        spec = RunSpec(
            policy="klotski", model="mixtral-8x7b:4", batch_size=1, num_batches=1, prompt_len=8, gen_len=6,
            impl="ideal", routing="calibrated:reuse=2", options={"predictor": predictor},
        )  # fmt: skip
        return run(spec).timeline.summary().extra["prefetch"]

    layer, both = prefetch("layer"), prefetch("layer+token")
    assert layer["predictions"] == both["predictions"] == 6 * 4
    assert layer != both  # the previous token changes the predictions of decode steps


def test_predictor_option_is_validated_and_absent_where_no_table_predicts() -> None:
    code, _, err = run_cli(
        "simulate", "--policy", "klotski", "--option", "predictor=bogus", "--model", "mixtral-8x7b:2"
    )
    assert code == 2 and "predictor" in err and "layer+token" in err, err
    code, _, err = run_cli(
        "simulate", "--policy", "klotski-oracle", "--option", "predictor=layer", "--model", "mixtral-8x7b:2"
    )
    assert code == 2 and "predictor" in err, err


def test_mixed_is_a_domain_word() -> None:
    assert MIXED == "mixed" and params_for("calibrated:domain=mixed", FINE).domain == MIXED
    assert params_for("calibrated:domain=code", FINE).domain == "github"


def test_a_sweep_names_its_routings_field_for_a_bad_what_if():
    from klotski_sim.runs.sweep import SweepError, parse_spec

    with pytest.raises(SweepError, match=r"^sweep spec: routings: calibrated:reuse=99: reuse must be from 0 to 20"):
        parse_spec({"models": ["tiny-mixtral"], "policies": ["klotski"], "routings": ["calibrated:reuse=99"]})
