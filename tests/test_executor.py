"""The runtime executes the very schedules the simulator runs (CPU here; CUDA when present)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from klotski_runtime.executor import ExecOptions, ExecutionError, execute  # noqa: E402
from klotski_runtime.kernels import WeightStore, WeightError  # noqa: E402
from klotski_runtime.record import save_tiny_mixtral  # noqa: E402
from klotski_sim.hardware import load_profile  # noqa: E402
from klotski_sim.model import get_model  # noqa: E402
from klotski_sim.policies import Placement, PolicyInput, build_schedule  # noqa: E402
from klotski_sim.routing import RoutingTable, RunShape  # noqa: E402
from klotski_sim.schedule import Schedule, ScheduleError  # noqa: E402
from klotski_sim.trace import replay  # noqa: E402
from klotski_sim.trace_synth import synthesize  # noqa: E402

TINY = get_model("tiny-mixtral")
POLICIES = ("single-batch", "multi-batch", "hot-prefetch", "klotski", "klotski-oracle", "flexgen")


def _input(placement=Placement(), n=2, bs=2, P=6, G=3, model=TINY):
    shape = RunShape(bs, n, P, G)
    trace = synthesize(model, shape.num_sequences + 2, P, G, "calibrated", 0)
    rep = replay(trace, model, shape, warmup_sequences=2)
    return PolicyInput(model, load_profile("rtx3090"), rep.routing, placement, {}, warmup=rep.warmup)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("placement", [Placement(), Placement(kv="cpu"), Placement(experts="disk")],
                         ids=["kv-gpu", "kv-cpu", "experts-disk"])
def test_every_policy_executes_on_cpu(policy, placement):
    inp = _input(placement)
    schedule = build_schedule(policy, inp)
    weights = WeightStore.random(TINY)
    tl, runner = execute(schedule, TINY, weights, inp.routing)
    df = tl.df.set_index("op_id")
    assert len(tl) == len(schedule) and tl.meta["source"] == "measured"
    for op in schedule.ops:  # every op ran once, after its deps and its stream predecessor
        for d in op.deps:
            assert df.at[d, "end"] <= df.at[op.id, "start"] + 1e-9
    for stream, group in df.groupby("stream"):
        order = [o.id for o in schedule.ops if o.stream == stream]
        starts = group.loc[order, "start"].to_numpy()
        assert np.all(np.diff(starts) >= 0)
    # each expert op computed exactly the tokens the schedule says
    for op in schedule.ops:
        if op.category == "expert":
            assert runner.expert_tokens[op.id] == op.tokens
    assert runner.in_use == runner.buffer_bytes.get("resident", 0)  # every buffer freed at the end
    assert tl.meta["peak_gpu_bytes"] > 0


def test_schedule_json_roundtrip_executes(tmp_path):
    inp = _input()
    schedule = build_schedule("klotski", inp)
    schedule.save(tmp_path / "schedule.json")
    tl, _ = execute(Schedule.load(tmp_path / "schedule.json"), TINY, WeightStore.random(TINY), inp.routing)
    assert len(tl) == len(schedule)


def test_link_emulation_is_labelled_and_slows_transfers():
    inp = _input()
    schedule = build_schedule("single-batch", inp)
    tl, _ = execute(schedule, TINY, WeightStore.random(TINY), inp.routing,
                    ExecOptions(emulate_links={"pcie_h2d": 50e6}))
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
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(checkpoint).eval()
    n, bs, P, G = 2, 2, 5, 3
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, TINY.vocab_size, (n, bs, P), generator=gen)
    # the model's own routing and greedy tokens, from transformers
    hf_logits = []
    with torch.no_grad():
        ids = prompt.reshape(n * bs, P)
        for step in range(G):
            out = hf(input_ids=ids, output_router_logits=True)
            hf_logits.append(out.logits[:, -1].reshape(n, bs, -1))
            if step < G - 1:
                ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)
        routing = torch.stack([torch.topk(torch.softmax(r.float(), -1), 2, -1).indices.reshape(n * bs, -1, 2)
                               for r in out.router_logits], dim=2)  # [seqs, tokens, layers, k]
    table = RoutingTable(routing.reshape(n, bs, P + G - 1, TINY.num_layers, 2).numpy().astype(np.int16),
                         RunShape(bs, n, P, G), TINY.num_experts, "transformers")
    weights = WeightStore.from_checkpoint(checkpoint, TINY, dtype=torch.float32)
    for policy in ("klotski", "flexgen"):
        schedule = build_schedule(policy, PolicyInput(TINY, load_profile("rtx3090"), table))
        tl, runner = execute(schedule, TINY, weights, table, ExecOptions(force_routing=False, record_logits=True,
                                                                         prompt=prompt.numpy()))
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
