"""The runtime executes the very schedules the simulator runs (CPU here; CUDA when present)."""

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from klotski_runtime.executor import ExecOptions, ExecutionError, execute  # noqa: E402
from klotski_runtime.kernels import WeightError, WeightStore  # noqa: E402
from klotski_runtime.record import save_tiny_mixtral  # noqa: E402
from klotski_sim.core.schedule import Schedule, ScheduleError  # noqa: E402
from klotski_sim.hardware.profile import load_profile  # noqa: E402
from klotski_sim.policies import POLICIES as REGISTERED  # noqa: E402
from klotski_sim.policies import Placement, PolicyInput, build_schedule  # noqa: E402
from klotski_sim.workload.model import get_model  # noqa: E402
from klotski_sim.workload.routing import RunShape  # noqa: E402
from klotski_sim.workload.trace import replay  # noqa: E402
from klotski_sim.workload.trace_synth import synthesize  # noqa: E402

from .timeline_checks import assert_respects  # noqa: E402

TINY = get_model("tiny-mixtral")
POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


def _input(placement=Placement(), n=2, bs=2, P=6, G=3, model=TINY, impl="as-published", options=None):
    shape = RunShape(bs, n, P, G)
    trace = synthesize(model, shape.num_sequences + 2, P, G, "calibrated", 0)
    rep = replay(trace, model, shape, warmup_sequences=2)
    return PolicyInput(
        model, load_profile("rtx3090"), rep.routing, placement, options or {}, warmup=rep.warmup, impl=impl
    )


@pytest.mark.parametrize(
    "category,change,message",
    [
        ("expert", {"expert": -1}, "expert -1 outside the model's 4 experts"),  # (ran as the last expert, silently)
        ("expert", {"expert": 99}, "expert 99 outside the model's 4 experts"),
        (
            "attention",
            {"batches": ()},
            "attention ops need their batches and step (got batches [], step",
        ),  # (KeyError: -1)
        ("embed", {"step": 99}, "step 99 outside the run's 3 steps"),
        ("gate", {"batches": (5,)}, "batches [5] outside the run's 2 batches"),
        ("gate", {"layer": 7}, "layer 7 outside the model's 2 layers"),
        ("expert", {"layer": -1}, "expert ops need their layer (got layer -1)"),  # (ran as the last layer's)
        ("gate", {"batches": (0, 0)}, "batches [0, 0] name a batch twice"),
        # (simulated as the op says, measured as the run computes it: a cross-check of two runs)
        ("expert", {"tokens": 999}, "tokens 999, but the routing sends "),
        ("attention", {"tokens": 5}, "tokens 5, but its batches' sequences pass 12 new tokens at step 0, layer 0"),
        ("attention", {"kv_len": 1}, "kv_len 1, but its sequences hold 6 tokens once step 0 has run"),
        ("lm_head", {"tokens": 7}, "tokens 7, but one per sequence of its batches: 2 at step 0"),
        ("gate", {"phase": "decode"}, "phase 'decode' at step 0 (step 0 is the prefill, later steps decode)"),
        # (each failed inside the run, naming neither file nor field: `attention impl must be one of ...`)
        (
            "attention",
            {"variant": "bogus"},
            "variant 'bogus': tiny-mixtral's attention on the gpu runs as 'fused' or 'eager'",
        ),
        ("expert", {"variant": "fused"}, "variant 'fused': tiny-mixtral's expert on the gpu runs as ''"),
    ],
)
def test_an_op_whose_tags_the_run_does_not_have_is_refused_before_it_runs(category, change, message):
    """A hand-edited schedule.json: each of these executed (or failed on an internal KeyError, or
    was simulated with other work than the runtime measured)."""
    from klotski_runtime.executor import check_compatible

    inp = _input()
    schedule = build_schedule("klotski", inp)
    k = next(k for k, op in enumerate(schedule.ops) if op.category == category and op.kind == "compute")
    ops = list(schedule.ops)
    ops[k] = ops[k]._replace(**change)
    edited = Schedule(tuple(ops), schedule.streams, schedule.preloaded, schedule.meta)
    check_compatible(schedule, TINY, None, inp.routing)  # (the schedule as built passes)
    with pytest.raises(ScheduleError, match=re.escape(f"op '{ops[k].id}': " + message)):
        check_compatible(edited, TINY, None, inp.routing)


def test_a_copy_tagged_with_another_steps_phase_is_refused_before_it_runs():
    """A KV copy of a decode step edited to `phase: prefill` (or one of the prefill to `decode`) was
    executed, and both timelines counted it in the other phase."""
    from klotski_runtime.executor import check_compatible

    inp = _input(Placement(kv="cpu"))
    schedule = build_schedule("klotski", inp)
    check_compatible(schedule, TINY, None, inp.routing)
    for step, other in ((0, "decode"), (2, "prefill")):
        k = next(k for k, op in enumerate(schedule.ops) if op.tensor == "kv" and op.step == step)
        ops = list(schedule.ops)
        ops[k] = ops[k]._replace(phase=other)
        with pytest.raises(
            ScheduleError,
            match=re.escape(
                f"op '{ops[k].id}': phase '{other}' at step {step} (step 0 is the prefill, later steps decode)"
            ),
        ):
            check_compatible(_edited(schedule, ops), TINY, None, inp.routing)


def test_a_copy_that_does_not_say_what_it_carries_is_refused_before_it_runs():
    """An expert copy edited to `tensor: ""` failed inside the run: `WeightError: no weights for ('', 0, 1)`."""
    from klotski_runtime.executor import check_compatible

    inp = _input()
    schedule = build_schedule("klotski", inp)
    k = next(k for k, op in enumerate(schedule.ops) if op.kind == "transfer" and op.tensor == "expert")
    ops = list(schedule.ops)
    ops[k] = ops[k]._replace(tensor="")
    with pytest.raises(
        ScheduleError,
        match=re.escape(
            f"op '{ops[k].id}': a copy must say what it carries (tensor: attention, gate, expert, kv or activation)"
        ),
    ):
        check_compatible(_edited(schedule, ops), TINY, None, inp.routing)


def _edited(schedule, ops=None, **meta):
    return Schedule(
        tuple(schedule.ops if ops is None else ops), schedule.streams, schedule.preloaded, {**schedule.meta, **meta}
    )


def test_a_schedule_edited_into_another_run_is_refused_before_it_runs():
    """Found by a fault battery: an expert copy of 1000x its bytes was "measured" five times slower
    (an emulated link is timed from the op's bytes); a schedule without its last lm_head, or whose
    meta claimed a million generated tokens, was measured as a whole run."""
    from klotski_runtime.executor import check_compatible

    inp = _input()
    schedule = build_schedule("klotski", inp)
    check_compatible(schedule, TINY, None, inp.routing)  # (as built: passes)
    ops = list(schedule.ops)
    k = next(k for k, op in enumerate(ops) if op.kind == "transfer" and op.tensor == "expert")
    ops[k] = ops[k]._replace(bytes=ops[k].bytes * 1000)
    with pytest.raises(
        ScheduleError,
        match=rf"op '{ops[k].id}': moves 49,152,000 bytes of expert weights; "
        rf"tiny-mixtral's expert is 49,152 bytes",
    ):
        check_compatible(_edited(schedule, ops), TINY, None, inp.routing)
    last = max(k for k, op in enumerate(schedule.ops) if op.category == "lm_head")
    without = [op for k, op in enumerate(schedule.ops) if k != last]
    with pytest.raises(ScheduleError, match=r"no lm_head op makes batch 1's tokens at step 2 \(1 of the run's 6 "):
        check_compatible(_edited(schedule, without), TINY, None, inp.routing)
    with pytest.raises(ScheduleError, match=r"meta.generated_tokens 1000000: the run makes 12 \(batch_size 2 x "):
        check_compatible(_edited(schedule, generated_tokens=1_000_000), TINY, None, inp.routing)


def _without(schedule, k):
    """The schedule without its op k (its id taken out of the deps of others, the buffers it
    allocated out of their frees): what a hand edit that deletes an op leaves."""
    gone = schedule.ops[k]
    mine = {name for name, _ in gone.alloc}
    return [
        op._replace(deps=tuple(d for d in op.deps if d != gone.id), free=tuple(f for f in op.free if f not in mine))
        for i, op in enumerate(schedule.ops)
        if i != k
    ]


def _twice(schedule, k):
    """The schedule with its op k issued a second time, right after it (under another id)."""
    again = schedule.ops[k]._replace(id=schedule.ops[k].id + "/again", alloc=(), free=())
    return [*schedule.ops[: k + 1], again, *schedule.ops[k + 1 :]]


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda s: _without(s, next(k for k, op in enumerate(s.ops) if op.category == "expert" and op.tokens)),
            r"no expert op computes expert \d+ of layer 0 for batch \d+ at step 0 \(the routing sends it \d+ token\(s\); 1 ",
        ),
        (
            lambda s: _twice(s, next(k for k, op in enumerate(s.ops) if op.category == "expert" and op.tokens)),
            r"expert \d+ of layer 0 is computed for batch \d+ at step 0 by 2 ops \(each token once\)",
        ),
        (
            lambda s: _without(s, next(k for k, op in enumerate(s.ops) if op.category == "gate")),
            r"batch 0 at step 0, layer 0: 0 gate or dense MLP ops \(one computes it\): not the run",
        ),
        (
            lambda s: _without(s, next(k for k, op in enumerate(s.ops) if op.category == "attention")),
            r"batch 0 at step 0, layer 0: 0 attention ops",
        ),
        (
            lambda s: _twice(s, next(k for k, op in enumerate(s.ops) if op.category == "lm_head")),
            r"batch 0 at step 0: 2 lm_head ops",
        ),
        (
            lambda s: _twice(s, next(k for k, op in enumerate(s.ops) if op.category == "embed")),
            r"batch 0 at step 0: 2 embed ops",
        ),
        (
            lambda s: [
                op._replace(bytes=op.bytes * 10**6) if op.id == "s0/L0/b0/attn/kv_store" else op for op in s.ops
            ],
            r"op 's0/L0/b0/attn/kv_store': moves 1,536,000,000 bytes of KV cache; the 6 new tokens of its batches' 2 "
            r"sequences at step 0 are 1,536 bytes",
        ),
        (
            lambda s: [op._replace(bytes=1) if op.id == "s1/L1/b1/attn/kv_load" else op for op in s.ops],
            r"moves 1 bytes of KV cache; the 6 cached tokens of its batches' 2 sequences at step 1 are 1,536 bytes",
        ),
    ],
    ids=[
        "expert-dropped",
        "expert-twice",
        "gate-dropped",
        "attention-dropped",
        "lm_head-twice",
        "embed-twice",
        "kv-store-bigger",
        "kv-load-smaller",
    ],
)
def test_a_schedule_that_computes_less_or_more_than_its_run_is_refused_before_it_runs(edit, message):
    """Found by a fault battery: with an expert op removed (or all of them) a schedule was measured as
    a whole run, its logits a model's with experts skipped; without a gate or an attention it failed
    inside an op (`KeyError: 0`, an empty StopIteration); a second lm_head ran; a KV store edited to a
    million times its bytes was measured at 4 s (an emulated link is timed from the op's bytes)."""
    from klotski_runtime.executor import check_compatible

    inp = _input(Placement(kv="cpu"))
    schedule = build_schedule("klotski", inp)
    check_compatible(schedule, TINY, None, inp.routing)  # (as built: passes)
    with pytest.raises(ScheduleError, match=message):
        check_compatible(_edited(schedule, edit(schedule)), TINY, None, inp.routing)


def test_a_kv_store_without_its_attention_among_its_deps_names_what_it_lacks():
    """It failed as `op '...' failed: StopIteration: ` (an empty message)."""
    inp = _input(Placement(kv="cpu"))
    s = build_schedule("klotski", inp)
    ops = [op._replace(deps=()) if op.id == "s0/L0/b0/attn/kv_store" else op for op in s.ops]
    with pytest.raises(
        ExecutionError,
        match=r"^op 's0/L0/b0/attn/kv_store': a KV store needs among its deps the "
        r"attention op whose new entries it stores",
    ):
        execute(_edited(s, ops), TINY, WeightStore.random(TINY), inp.routing)


@pytest.mark.parametrize("impl", ["as-published", "ideal"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "placement", [Placement(), Placement(kv="cpu"), Placement(experts="disk")], ids=["kv-gpu", "kv-cpu", "experts-disk"]
)
def test_every_policy_executes_on_cpu(policy, placement, impl):
    inp = _input(placement, impl=impl)
    schedule = build_schedule(policy, inp)
    weights = WeightStore.random(TINY)
    tl, runner = execute(schedule, TINY, weights, inp.routing)
    assert len(tl) == len(schedule) and tl.meta["source"] == "measured"
    assert_respects(schedule, tl)  # every op after its deps and its stream predecessor
    # each expert op computed exactly the tokens the schedule says
    for op in schedule.ops:
        if op.category == "expert":
            assert runner.expert_tokens[op.id] == op.tokens
    assert runner.in_use == runner.buffer_bytes.get("resident", 0)  # every buffer freed at the end
    assert tl.meta["peak_gpu_bytes"] > 0


@pytest.mark.parametrize(
    "options",
    [
        {"copy_memory_weights": "pageable", "copy_memory_kv": "pageable"},
        {"attention_impl": "eager"},
        {"sync": "per-expert", "expert_ops": "per-batch"},
        {"cold_order": "most-tokens-first"},
    ],
    ids=["pageable", "eager", "syncs", "order"],
)
def test_each_option_executes_and_pageable_copies_run_at_their_rate(options):
    inp = _input(Placement(kv="cpu"), impl="ideal", options=options)
    schedule = build_schedule("klotski", inp)
    rates = {"pcie_h2d": 200e6, "pcie_d2h": 200e6}
    slow = {"pcie_h2d": 50e6, "pcie_d2h": 50e6}
    tl, runner = execute(
        schedule, TINY, WeightStore.random(TINY), inp.routing, ExecOptions(emulate_links=rates, emulate_pageable=slow)
    )
    df = tl.df
    assert len(tl) == len(schedule)
    copies = df[df["resource"].isin(["pcie_h2d", "pcie_d2h"])]
    pageable = {o.id for o in schedule.ops if o.pageable}
    assert bool(pageable) == ("copy_memory_kv" in options)
    for row in copies.itertuples():
        rate = 50e6 if row.op_id in pageable else 200e6
        assert row.end - row.start >= row.bytes / rate * 0.99
    if pageable:  # emulating the link but not its pageable rate would silently copy pageable at the pinned rate
        with pytest.raises(ExecutionError, match="pageable"):
            execute(schedule, TINY, WeightStore.random(TINY), inp.routing, ExecOptions(emulate_links=rates))


def test_eager_and_fused_attention_agree():
    x = torch.randn(2, 5, TINY.hidden_size)
    w = WeightStore.random(TINY, dtype=torch.float32)
    from klotski_runtime import kernels

    args = (x, w.get("attention", 0), w.resident["norm1/0"], [], 0, TINY, 1e6, 1e-5)
    fused, _ = kernels.attention(*args, "fused")
    eager, _ = kernels.attention(*args, "eager")
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    past = [(torch.randn(2, TINY.num_kv_heads, 5, TINY.head_dim), torch.randn(2, TINY.num_kv_heads, 5, TINY.head_dim))]
    x1 = x[:, :1]
    fused, _ = kernels.attention(x1, *args[1:3], past, 5, TINY, 1e6, 1e-5, "fused")
    eager, _ = kernels.attention(x1, *args[1:3], past, 5, TINY, 1e6, 1e-5, "eager")
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)


def test_schedule_json_roundtrip_executes(tmp_path):
    inp = _input()
    schedule = build_schedule("klotski", inp)
    schedule.save(tmp_path / "schedule.json")
    tl, _ = execute(Schedule.load(tmp_path / "schedule.json"), TINY, WeightStore.random(TINY), inp.routing)
    assert len(tl) == len(schedule)


def test_link_emulation_is_labelled_and_slows_transfers():
    inp = _input()
    schedule = build_schedule("single-batch", inp)
    tl, _ = execute(
        schedule, TINY, WeightStore.random(TINY), inp.routing, ExecOptions(emulate_links={"pcie_h2d": 50e6})
    )
    assert "EMULATED" in tl.meta["emulated_links"]["note"]
    df = tl.df
    transfers = df[df["resource"] == "pcie_h2d"]
    assert ((transfers["end"] - transfers["start"]) >= transfers["bytes"] / 50e6 * 0.99).all()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_mixtral(tmp_path_factory.mktemp("ckpt") / "tiny", seed=1)


def test_matches_transformers_logits_with_unforced_routing(checkpoint):
    """The executor's math is Mixtral's: with the model routing itself (not forced), a run
    through the executor gives the logits of transformers' MixtralForCausalLM (fp32, atol 1e-4)."""
    from .test_checkpoints import hf_reference

    n, bs, P, G = 2, 2, 5, 3
    hf_logits, prompt, table = hf_reference(checkpoint, "MixtralForCausalLM", TINY, n, bs, P, G)
    weights = WeightStore.from_checkpoint(checkpoint, TINY, dtype=torch.float32)
    for policy in ("klotski", "flexgen"):
        schedule = build_schedule(policy, PolicyInput(TINY, load_profile("rtx3090"), table))
        tl, runner = execute(
            schedule, TINY, weights, table, ExecOptions(force_routing=False, record_logits=True, prompt=prompt.numpy())
        )
        for step in range(G):
            for b in range(n):
                torch.testing.assert_close(runner.logits[(step, b)], hf_logits[step][b], atol=1e-4, rtol=1e-4)


def test_bad_inputs_are_clear_errors(tmp_path):
    inp = _input()
    schedule = build_schedule("klotski", inp)
    small = get_model("small-mixtral")
    with pytest.raises(ScheduleError, match="built for model 'tiny-mixtral'"):
        execute(schedule, small, WeightStore.random(small, layers=1), inp.routing)
    with pytest.raises(ScheduleError, match="weights hold 1"):
        execute(schedule, TINY, WeightStore.random(TINY, layers=1), inp.routing)
    with pytest.raises(WeightError, match="no config.json"):
        WeightStore.from_checkpoint(tmp_path, TINY)
    if not torch.cuda.is_available():
        with pytest.raises(ExecutionError, match="CUDA was requested"):
            execute(schedule, TINY, WeightStore.random(TINY), inp.routing, ExecOptions(device="cuda"))


def test_checkpoint_for_another_model_is_refused(checkpoint):
    with pytest.raises(WeightError, match="does not match model 'small-mixtral'"):
        WeightStore.from_checkpoint(checkpoint, get_model("small-mixtral"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_executor_matches_the_cpu_twin():
    inp = _input()
    schedule = build_schedule("klotski", inp)
    weights = WeightStore.random(TINY, dtype=torch.float32)
    cpu_tl, cpu = execute(schedule, TINY, weights, inp.routing, ExecOptions(record_logits=True))
    gpu_tl, gpu = execute(schedule, TINY, weights, inp.routing, ExecOptions(device="cuda", record_logits=True))
    assert len(gpu_tl) == len(schedule)
    for key, logits in cpu.logits.items():
        torch.testing.assert_close(gpu.logits[key], logits, atol=1e-3, rtol=1e-3)


def _max_overlap(starts, ends) -> int:
    """The most intervals open at once (an end at t closes before a start at t)."""
    events = sorted([(e, -1) for e in ends] + [(s, 1) for s in starts])
    most = current = 0
    for _, delta in events:
        current += delta
        most = max(most, current)
    return most


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    impl=st.sampled_from(["as-published", "ideal"]),
    kv=st.sampled_from(["gpu", "cpu"]),
    n=st.integers(1, 3),
    seed=st.integers(0, 5),
)
def test_measured_timelines_respect_every_resources_capacity(policy, impl, kv, n, seed):
    """Two copy streams on one link never copy at once: the CPU runtime serves a resource's units
    as the simulator does (here: one unit each)."""
    from klotski_sim.core.engine import resource_capacities

    inp = _input(Placement(kv=kv), n=n, impl=impl)
    schedule = build_schedule(policy, inp)
    caps = resource_capacities(schedule, inp.profile)
    tl, _ = execute(
        schedule,
        TINY,
        WeightStore.random(TINY, seed=seed),
        inp.routing,
        ExecOptions(
            emulate_links={"pcie_h2d": 2e8, "pcie_d2h": 2e8},
            emulate_pageable={"pcie_h2d": 1e8, "pcie_d2h": 1e8},
            capacities=caps,
        ),
    )
    df = tl.df
    for resource, group in df.groupby("resource"):
        if resource == "host":  # the host thread's waits: one thread, trivially one at a time
            continue
        assert _max_overlap(group["start"].tolist(), group["end"].tolist()) <= caps[resource], resource
    assert tl.meta["capacities"] == caps


def test_weights_that_host_memory_cannot_hold_are_refused_before_allocating(monkeypatch):
    from klotski_runtime import kernels

    monkeypatch.setattr(kernels, "host_memory", lambda field="MemAvailable": 1 << 20)  # 1 MiB free
    with pytest.raises(WeightError, match="needs .* GiB of host memory"):
        WeightStore.random(get_model("small-mixtral"))


def _cpu_expert_run(policy, impl):
    """A schedule of `policy` that puts experts on the host CPU, run on the CPU runtime, and the
    runner of Klotski's all-GPU schedule of the same routing and weights (fp32)."""
    from .test_cpu_experts import cpu_profile

    base = _input(n=2, bs=2, P=6, G=3, impl=impl)
    profile = cpu_profile(memory_bytes=3.2e5, memory_bandwidth=1e12, flops={"bf16": 1e13})  # few experts fit
    inp = PolicyInput(TINY, profile, base.routing, base.placement, {}, base.warmup, impl)
    schedule = build_schedule(policy, inp)
    on_cpu = [o for o in schedule.ops if o.stream == "cpu_compute"]
    assert on_cpu, "the configuration must put experts on the CPU"
    weights = WeightStore.random(TINY, dtype=torch.float32)
    tl, runner = execute(schedule, TINY, weights, inp.routing, ExecOptions(record_logits=True))
    ref_schedule = build_schedule("klotski", PolicyInput(TINY, load_profile("rtx3090"), inp.routing, warmup=inp.warmup))
    _, ref = execute(ref_schedule, TINY, weights, inp.routing, ExecOptions(record_logits=True))
    return schedule, weights, inp, tl, runner, ref


@pytest.mark.parametrize("policy", ["fiddler", "llamacpp-moe", "klotski-hybrid"])
@pytest.mark.parametrize("impl", ["as-published", "ideal"])
def test_cpu_expert_policies_execute_and_compute_what_klotski_computes(policy, impl):
    """Experts on the host CPU stream: hidden states down, the expert on host weights, the output
    back into its batches — the same logits as Klotski's all-GPU schedule (fp32, forced routing)."""
    schedule, weights, inp, tl, runner, ref = _cpu_expert_run(policy, impl)
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)
    for op in schedule.ops:
        if op.category == "expert":
            assert runner.expert_tokens[op.id] == op.tokens
    assert set(tl.columns["resource"]) >= {"cpu", "pcie_d2h"}
    assert runner.in_use == runner.buffer_bytes.get("resident", 0)
    if torch.cuda.is_available():  # the CUDA driver: CPU experts on a host thread of their own, same logits
        _, gpu = execute(schedule, TINY, weights, inp.routing, ExecOptions(device="cuda", record_logits=True))
        for key, logits in ref.logits.items():
            torch.testing.assert_close(gpu.logits[key], logits, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("policy,impl", [("fiddler", "as-published"), ("klotski-hybrid", "ideal")])
def test_adds_into_one_output_from_two_threads_never_lose_one(policy, impl, monkeypatch):
    """A GPU expert (compute stream) and a CPU expert's output coming back (`h2d_act` stream) add
    into one batch's MoE output, in no order the schedule fixes (on CUDA each add is atomic). The
    CPU runtime runs them on two threads: with every add made a slow read-modify-write (what any
    add is there, in a narrower window), the logits are still Klotski's. Unlocked, 2 to 15 adds
    overlapped a run and lost one of them: logits differed (once in the suite, in 256 of 512)."""
    import time

    add = torch.Tensor.index_add_

    def slow_add(self, dim, index, source):
        before = self.clone()
        time.sleep(0.002)  # (another thread's add to `self` now is overwritten below)
        return self.copy_(add(before, dim, index, source))

    monkeypatch.setattr(torch.Tensor, "index_add_", slow_add)
    _, _, _, _, runner, ref = _cpu_expert_run(policy, impl)
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "policy", sorted(name for name, info in REGISTERED.items() if info.build.__module__.startswith("klotski_sim."))
)
@pytest.mark.parametrize("impl", ["as-published", "ideal"])
def test_every_add_into_a_batchs_output_comes_before_the_op_that_reads_it(policy, impl):
    """What makes those unordered adds safe: the op that next applies a batch's MoE output (its next
    attention, or its lm_head) has every op that wrote into it (gate, GPU expert, CPU expert's copy
    back) among its ancestors, deps and stream order, in every policy's schedule (a missing dep
    would read a partial sum only when the threads happen to race)."""
    from klotski_sim.core.schedule import topological_order

    from .test_cpu_experts import cpu_profile

    base = _input(n=2, bs=2, P=6, G=3, impl=impl)
    profile = cpu_profile(memory_bytes=3.2e5, memory_bandwidth=1e12, flops={"bf16": 1e13})  # some experts on the CPU
    schedule = build_schedule(policy, PolicyInput(TINY, profile, base.routing, base.placement, {}, base.warmup, impl))
    ops, resource = schedule.ops, schedule.streams
    ptr, succ, _, _ = schedule.graph
    ancestors = [0] * len(ops)  # (a bit per op)
    for i in topological_order(schedule):
        for s in succ[ptr[i] : ptr[i + 1]]:
            ancestors[s] |= ancestors[i] | (1 << i)

    def place(op):  # (step, layer) order within a batch; lm_head after the last layer
        return (op.step, 1 << 30 if op.category == "lm_head" else op.layer)

    writers = [
        i
        for i, op in enumerate(ops)
        if op.category in ("gate", "dense_mlp")
        or op.category == "expert"
        and resource[op.stream] == "gpu"
        or op.tensor == "activation"
        and op.dst == "gpu"
        and op.expert >= 0
    ]  # (a CPU expert's output)
    readers = [
        i
        for i, op in enumerate(ops)
        if op.category in ("attention", "attn_qkv", "lm_head") and resource[op.stream] == "gpu"
    ]
    checked = 0
    for w in writers:
        for b in ops[w].batches:
            later = [r for r in readers if b in ops[r].batches and place(ops[r]) > place(ops[w])]
            if later:
                r = min(later, key=lambda r: place(ops[r]))
                assert ancestors[r] >> w & 1, f"{ops[r].id} may read batch {b}'s output before {ops[w].id} adds to it"
                checked += 1
    assert checked >= len(writers)  # (each writer has a reader: none skipped unseen)


@pytest.mark.parametrize(
    "policy,placement,options",
    [
        ("klotski", Placement(kv="cpu"), {"attention_device": "cpu"}),
        ("fiddler", Placement(), {}),
        ("flexgen", Placement(experts="disk"), {}),
        ("klotski-hybrid", Placement(), {"expert_cache": 2}),
    ],
)
def test_logits_do_not_depend_on_how_the_stream_threads_interleave(policy, placement, options, monkeypatch):
    """Every op held back and let go by a random 0-2 ms (seeded), on every stream thread: an op that
    reads what another stream writes without a dependency on it would see it now and then
    unwritten. The logits stay Klotski's (run undisturbed)."""
    import random
    import threading
    import time

    from klotski_runtime.executor import OpRunner

    from .test_cpu_experts import cpu_profile

    base = _input(n=2, bs=2, P=6, G=3, impl="ideal")
    weights = WeightStore.random(TINY, dtype=torch.float32)
    reference = build_schedule("klotski", PolicyInput(TINY, load_profile("rtx3090"), base.routing, warmup=base.warmup))
    _, ref = execute(reference, TINY, weights, base.routing, ExecOptions(record_logits=True))
    profile = cpu_profile(
        memory_bytes=1e6 if placement.experts == "disk" else 3.2e5, memory_bandwidth=1e12, flops={"bf16": 1e13}
    )
    schedule = build_schedule(
        policy, PolicyInput(TINY, profile, base.routing, placement, options, base.warmup, "ideal")
    )
    draws, drawing, run = random.Random(0), threading.Lock(), OpRunner.run

    def jittered(self, op):
        with drawing:
            before, after = draws.uniform(0, 0.002), draws.uniform(0, 0.002)
        time.sleep(before)
        run(self, op)
        time.sleep(after)

    monkeypatch.setattr(OpRunner, "run", jittered)
    _, runner = execute(schedule, TINY, weights, base.routing, ExecOptions(record_logits=True))
    assert runner.logits.keys() == ref.logits.keys()
    for key, logits in ref.logits.items():
        torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)


def test_shared_experts_run_in_the_gate_op_with_the_bytes_the_simulator_counts():
    """Qwen-MoE style: a sigmoid-gated shared expert every token goes through, computed by the gate op."""
    from dataclasses import replace

    from klotski_runtime import kernels

    spec = replace(TINY, name="tiny-shared", num_shared_experts=1, shared_ffn_size=32, hf_model_type="qwen2_moe")
    weights = WeightStore.random(spec, dtype=torch.float32)
    gate = weights.get("gate", 0)
    assert sum(t.numel() for t in gate) * spec.dtype_bytes == spec.gate_bytes()
    h = torch.randn(2, 3, spec.hidden_size)
    norm = torch.ones(spec.hidden_size)
    z, w, ids, out = kernels.gate_step(h, norm, gate[0], spec.top_k, 1e-5, None, gate[1:])
    expected = kernels.expert(z, gate[2:5]) * torch.sigmoid(z @ gate[1].T)
    torch.testing.assert_close(out, expected)
    inp = _input(model=spec, n=2, bs=2, P=4, G=3)
    schedule = build_schedule("klotski", inp)
    tl, runner = execute(schedule, spec, weights, inp.routing)
    assert len(tl) == len(schedule) and runner.in_use == runner.buffer_bytes.get("resident", 0)


def test_a_deepseek_shaped_model_runs_mla_dense_and_shared_experts_with_the_simulated_bytes():
    """A small DeepSeek shape (first layer dense, MLA, shared experts): the runtime's weights are
    exactly the bytes the simulator counts, and every policy, with the KV cache on the GPU or in host
    memory, computes the same logits (the schedules move latent KV chunks, not per-head K and V)."""
    from dataclasses import replace

    spec = replace(
        get_model("deepseek-v2-lite"),
        name="mini-deepseek",
        num_layers=3,
        hidden_size=256,
        ffn_size=64,
        dense_ffn_size=512,
        num_heads=4,
        num_kv_heads=4,
        head_dim=48,
        vocab_size=512,
        kv_lora_rank=64,
        qk_rope_dim=16,
        qk_nope_dim=32,
        v_head_dim=32,
        shared_ffn_size=64,
    )
    weights = WeightStore.random(spec, dtype=torch.float32)
    assert sum(t.numel() for t in weights.get("attention", 0)) == spec.attention_params()
    for layer in (0, 1):
        assert sum(t.numel() for t in weights.get("gate", layer)) * spec.dtype_bytes == spec.gate_bytes(layer)
    reference = None
    for kv in ("gpu", "cpu"):
        for policy in ("klotski", "single-batch", "flexgen"):
            inp = _input(Placement(kv=kv), model=spec, n=2, bs=2, P=5, G=3)
            schedule = build_schedule(policy, inp)
            assert not [o for o in schedule.ops if o.layer == 0 and o.category == "expert"]
            tl, runner = execute(schedule, spec, weights, inp.routing, ExecOptions(record_logits=True))
            reference = reference or runner.logits
            for key, logits in reference.items():
                torch.testing.assert_close(runner.logits[key], logits, atol=1e-4, rtol=1e-4)
            kv_moves = [o.bytes for o in schedule.ops if o.tensor == "kv" and o.stream == "d2h_kv"]
            assert all(b % spec.kv_bytes_per_token() == 0 for b in kv_moves)


def test_a_stop_while_the_ops_run_leaves_no_stream_thread_running():
    """A stop (Ctrl-C, SIGTERM) during a CPU run raised out of the executor while its stream threads
    went on running ops; one inside torch as the interpreter ended aborted the process ("terminate
    called without an active exception", exit 134 after the stop's word: the fault battery, 10 of 35
    stops). Now they give up after their current op and are waited for."""
    import _thread
    import signal
    import threading

    inp = _input()
    schedule = build_schedule("single-batch", inp)
    # Python's own Ctrl-C handler for the test: a process started in the background by a shell without job
    # control inherits SIGINT ignored, and then interrupt_main does nothing (a CI run so started failed with
    # "DID NOT RAISE KeyboardInterrupt")
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = threading.Timer(0.3, _thread.interrupt_main)  # (as Ctrl-C: KeyboardInterrupt in the main thread)
        stop.start()
        with pytest.raises(KeyboardInterrupt):  # (links emulated slowly: the run takes seconds)
            execute(schedule, TINY, WeightStore.random(TINY), inp.routing, ExecOptions(emulate_links={"pcie_h2d": 2e6}))
        stop.join()
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert [t.name for t in threading.enumerate() if t.name.startswith("stream-")] == []


def test_compute_threads_leave_the_issuing_thread_a_core_beside_a_gpu() -> None:
    """A CPU device runs the threads asked for; beside a GPU one core stays with the issuing thread
    (it spins in CUDA event waits), whatever was asked, and cpu_threads restores the settings."""
    import sys

    from klotski_runtime.threads import compute_threads, cpu_threads
    from klotski_sim.util.machine import available_cores

    assert compute_threads("cpu", 3) == 3
    assert compute_threads("cpu", None) is None
    assert compute_threads("cuda", 1) == compute_threads("cuda:0", None) == max(1, available_cores() - 1)
    before = (torch.get_num_threads(), sys.getswitchinterval())
    with cpu_threads(1, quick_switch=True):
        assert torch.get_num_threads() == 1 and sys.getswitchinterval() < before[1]
    assert (torch.get_num_threads(), sys.getswitchinterval()) == before
