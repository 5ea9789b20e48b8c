"""Cold experts computed on the CPU instead of moved: Fiddler (Kamahori et al., ICLR'25) and
llama.cpp's rule (docs/cpu-experts.md has the citations).

The non-expert weights (attention, gate) stay on the GPU with the KV cache, and as many experts as
fit beside them — the most popular first, counted on the warm-up sequences (never on the run's own
routing). For every other expert a batch routes tokens to, each step and layer chooses:

- **CPU**: the tokens' hidden states go to host memory (one copy per layer), the expert runs on the
  CPU where its weights already are, and its output comes back over PCIe;
- **GPU**: its weights are copied to the GPU and it runs there.

`rule=cost` (the Fiddler paper) picks the CPU when the cost model says the CPU path for these
tokens is faster than the transfer path; `rule=expert-tokens` (Fiddler's released code) when fewer
than `min_batch` tokens (10) are routed to the expert; `rule=layer-tokens` (llama.cpp's
`ggml_backend_cuda_device_offload_op`) keeps the whole layer's experts on the CPU unless the
layer's op has at least `min_batch` tokens (32 upstream) — and then uploads the whole expert
tensor of the layer, every expert in it. One batch at a time, each through its whole generation,
like single-batch: neither system pipelines batches.

Options: `cpu_blocks_host` (the CPU expert runs on the issuing Python thread, so nothing more is
issued to the GPU until it returns — a PyTorch CPU op is synchronous), `act_per_expert` (each CPU
expert's inputs go down with a blocking `.to("cpu")`, instead of one async copy per layer),
`expert_buffers` (1: one GPU placeholder every copied expert goes through; 2: double-buffered).
`--impl as-published` is what each system's released code does, `ideal` the same idea done well.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.core.schedule import CPU_STREAMS, DEFAULT_STREAMS, Schedule, ScheduleBuilder
from klotski_sim.policies.base import OpEmitter, PolicyInput, PolicyTraits, cpu_expert_seconds, register
from klotski_sim.policies.cache import ExpertCache
from klotski_sim.policies.options import option

RULES = ("cost", "expert-tokens", "layer-tokens")
LLAMA_CPP_MIN_BATCH = 32  # ggml-cuda.cu: ops with fewer tokens stay with CPU-resident weights


@dataclass(frozen=True)
class CpuExpertOptions:
    """Fiddler's switches (the defaults are its `ideal` preset; see the module docstring)."""

    rule: str = option(
        "cost",
        "when a cold expert runs on the CPU: cost (the cost model), expert-tokens (< min_batch tokens routed to "
        "it), layer-tokens (the layer's op has < min_batch tokens)",
        choices=RULES,
    )
    min_batch: int = option(10, "the token threshold of the expert-tokens and layer-tokens rules", minimum=1)
    cpu_blocks_host: bool = option(False, "a CPU expert runs on the issuing thread: nothing else is issued meanwhile")
    act_per_expert: bool = option(
        False, "each CPU expert's input goes down with a blocking copy (else one async copy per layer)"
    )
    expert_buffers: int = option(
        2, "GPU placeholders copied experts go through (1: one; 2: double-buffered)", minimum=1, maximum=2
    )


def gpu_expert_slots(inp: PolicyInput, streaming_buffers: int) -> int:
    """How many experts stay on the GPU: what memory holds beside the resident weights, all
    layers' attention and gate, the KV cache of every batch, the prompt activations and the
    buffers that copied experts go through."""
    m, sh = inp.model, inp.shape
    kv = (
        m.num_layers * m.kv_bytes(sh.batch_size * sh.num_batches, sh.prompt_len + sh.gen_len)
        if inp.placement.kv == "gpu"
        else 0
    )
    fixed = (
        m.resident_bytes()
        + m.non_expert_bytes()
        + kv
        + sh.num_batches * m.hidden_bytes(sh.batch_size * sh.prompt_len)
        + streaming_buffers * m.expert_buffer_bytes()
        + (m.expert_bytes() if m.quantised else 0)
    )
    spare = inp.profile.gpu.usable_bytes - fixed
    moe_experts = m.routed_experts
    return int(max(0, min(moe_experts, spare // m.expert_buffer_bytes())))


def popular_experts(inp: PolicyInput, slots: int) -> set[tuple[int, int]]:
    """The `slots` most used (layer, expert) pairs on the warm-up sequences (ties: lower layer,
    then lower expert id); without warm-up data, the first layers' experts."""
    m = inp.model
    moe_experts = m.routed_experts
    return set(
        ExpertCache.hot_set(
            inp.warmup.experts if inp.warmup is not None else None,
            m.num_layers,
            m.num_experts,
            min(slots, moe_experts),
            m.moe_layers,
        )
    )


class CpuOrTransfer:
    """The per-expert choice, priced by the same cost model that will time the ops."""

    def __init__(self, inp: PolicyInput, rule: str, min_batch: int, policy: str) -> None:
        self.inp, self.rule, self.min_batch = inp, rule, min_batch
        self.cost = CostModel(inp.profile)
        inp.profile.require_cpu(f"policy {policy!r}")

    def cpu_seconds(self, tokens: int, hidden_down: bool) -> float:
        """The CPU path: (the layer's hidden states down,) the expert on the CPU, its output up."""
        return cpu_expert_seconds(self.cost, self.inp.model, tokens, hidden_down)

    def gpu_seconds(self, tokens: int) -> float:
        """The transfer path: the weights over PCIe, then the expert on the GPU."""
        m, c = self.inp.model, self.cost
        dequant = c.compute_seconds("dequant", m.dequant_flops(), m.dequant_io_bytes()) if m.quantised else 0.0
        return (
            c.transfer_seconds("pcie_h2d", m.expert_bytes())
            + dequant
            + c.compute_seconds("expert", m.expert_flops(tokens), m.expert_io_bytes(tokens), tokens)
        )

    def on_cpu(self, tokens: int, hidden_down: bool) -> bool:
        """For `rule=layer-tokens` pass the layer's token count."""
        if self.rule in ("expert-tokens", "layer-tokens"):
            return tokens < self.min_batch
        return self.cpu_seconds(tokens, hidden_down) < self.gpu_seconds(tokens)


def _build(inp: PolicyInput, name: str) -> Schedule:
    opts = inp.options
    rule, min_batch, buffers = opts["rule"], opts["min_batch"], opts["expert_buffers"]
    decide = CpuOrTransfer(inp, rule, min_batch, name)
    # the policy places weights itself: attention and gate all resident, experts by popularity
    inp = replace(inp, placement=replace(inp.placement, resident_layers=0))
    em = OpEmitter(inp, ScheduleBuilder({**DEFAULT_STREAMS, **CPU_STREAMS}))
    m, sh, counts = inp.model, inp.shape, inp.routing.counts
    em.b.preload("resident/attention+gate", m.non_expert_bytes())
    slots = gpu_expert_slots(inp, 2 * m.num_experts if rule == "layer-tokens" else buffers)
    on_gpu = popular_experts(inp, slots)
    em.b.preload("resident/experts", len(on_gpu) * m.expert_buffer_bytes())  # dequantised once, when quantised
    placed = {"gpu": 0, "cpu": 0, "transfer": 0}
    streamed: list[str] = []  # expert ops that used a streaming buffer, in order

    def down(at: str, step: int, layer: int, batch: int, tokens: int, after: str, expert: int = -1) -> str:
        """Hidden states to host memory: blocking `.to("cpu")` as published, or one async copy per layer."""
        op = em.hidden_down(
            f"{at}/hidden_down" + (f"_E{expert}" if expert >= 0 else ""), step, layer, (batch,), tokens, [after], expert
        )
        if opts["act_per_expert"]:
            em.sync(f"{at}/hidden_down_E{expert}", [op])
        return op

    for batch in range(sh.num_batches):
        for step in range(sh.num_steps):
            prefix = f"b{batch}/s{step}"
            em.embed(f"{prefix}/embed", step, batch)
            layer_out: list[str] = []
            for layer in range(m.num_layers):
                at = f"{prefix}/L{layer}"
                attention = em.attention(f"{at}/attn", step, layer, batch, layer_out)
                gate = em.gate(f"{at}/gate", step, layer, batch, [attention])
                tokens = counts[step, layer, batch]
                active = [int(e) for e in np.flatnonzero(tokens)]
                per_layer_down = not opts["act_per_expert"]
                whole_layer = rule == "layer-tokens"
                if whole_layer:
                    cold = [e for e in active if (layer, e) not in on_gpu]
                    cpu_side = cold if decide.on_cpu(sh.batch_size * em.new_tokens(step), True) else []
                    if cold and not cpu_side:  # the op runs on the GPU: the layer's expert tensor is uploaded whole
                        uploaded = em.fetch_moe_layer(at, step, layer, streamed[-buffers:][:1] + [gate])
                else:
                    cpu_side = [
                        e
                        for e in active
                        if (layer, e) not in on_gpu and decide.on_cpu(int(tokens[e]), hidden_down=True)
                    ]
                layer_out = []
                # GPU experts first (resident ones, then those whose weights are copied), as Fiddler issues them
                for e in [e for e in active if e not in cpu_side]:
                    n = int(tokens[e])
                    if em.impl.sync_experts:
                        em.sync(f"{at}/E{e}/rows", [gate])
                    if (layer, e) in on_gpu:
                        placed["gpu"] += 1
                        layer_out.append(em.expert(f"{at}/E{e}", step, layer, e, (batch,), n, [gate]))
                        continue
                    placed["transfer"] += 1
                    if whole_layer:
                        layer_out.append(em.expert(f"{at}/E{e}", step, layer, e, (batch,), n, [uploaded[e]]))
                        continue
                    load = em.fetch(
                        f"{at}/load_E{e}",
                        "experts",
                        m.expert_bytes(),
                        "moe_weights",
                        "h2d_weights",
                        streamed[-buffers:][:1] + [gate],
                        step=step,
                        layer=layer,
                        expert=e,
                    )
                    op = em.expert(f"{at}/E{e}", step, layer, e, (batch,), n, [load], free=(load,))
                    streamed.append(op)
                    layer_out.append(op)
                if whole_layer and cold and not cpu_side:  # the upload is freed once the layer's experts are done
                    done = em.b.compute(
                        f"{at}/moe_done",
                        "combine",
                        layer_out + uploaded,
                        free=em.releasable(uploaded),
                        step=step,
                        phase=em.phase(step),
                        layer=layer,
                        batches=(batch,),
                    )
                    streamed.append(done)
                    layer_out = [done]
                hidden = (
                    down(at, step, layer, batch, sh.batch_size * em.new_tokens(step), gate)
                    if cpu_side and per_layer_down
                    else None
                )
                for e in cpu_side:
                    n = int(tokens[e])
                    placed["cpu"] += 1
                    if em.impl.sync_experts:
                        em.sync(f"{at}/cpu_E{e}/rows", [gate])
                    src = hidden or down(at, step, layer, batch, n, gate, e)
                    layer_out.append(
                        em.cpu_expert(f"{at}/cpu_E{e}", step, layer, e, (batch,), n, src, opts["cpu_blocks_host"])
                    )
                if not layer_out:
                    layer_out = [gate]
            em.lm_head(f"{prefix}/lm_head", step, batch, layer_out)
    resident = [["attention", j, -1] for j in range(m.num_layers)] + [["gate", j, -1] for j in range(m.num_layers)]
    resident += [["expert", j, e] for j, e in sorted(on_gpu)]
    return em.build(name, gpu_expert_slots=slots, expert_placement=placed, resident_weights=resident)


# Fiddler's released code (efeslab/fiddler src/fiddler/mixtral.py @f2c111c2, docs/cpu-experts.md):
# CPU iff 7 x tokens < 70 (latency_cpu/latency_gpu, so at most 9 tokens); GPU experts first, each
# after a `.tolist()`, copied by `load_state_dict` into one placeholder from unpinned parameters;
# CPU experts on the issuing thread, each input sent with a blocking `.to("cpu")`.
FIDDLER_AS_PUBLISHED = {
    "rule": "expert-tokens",
    "min_batch": 10,
    "cpu_blocks_host": True,
    "act_per_expert": True,
    "expert_buffers": 1,
    "sync": "per-expert",
    "copy_memory_weights": "pageable",
}
# The paper's intent implemented well: the cost model decides, the CPU has its own thread, one
# hidden-state copy per layer, double-buffered pinned expert copies.
FIDDLER_IDEAL = {
    "rule": "cost",
    "min_batch": 10,
    "cpu_blocks_host": False,
    "act_per_expert": False,
    "expert_buffers": 2,
    "sync": "none",
    "copy_memory_weights": "pinned",
}
# llama.cpp: host-resident expert tensors are uploaded (whole) only for ops of >= 32 tokens
# (ggml-cuda.cu, GGML_OP_OFFLOAD_MIN_BATCH); the scheduler runs the CPU split on the calling thread
# after a blocking copy of its inputs; weights are mmap-ed from the model file (pageable).
LLAMACPP_AS_PUBLISHED = dict(
    FIDDLER_AS_PUBLISHED, rule="layer-tokens", min_batch=LLAMA_CPP_MIN_BATCH, act_per_expert=False, sync="none"
)
LLAMACPP_IDEAL = dict(FIDDLER_IDEAL, rule="layer-tokens", min_batch=LLAMA_CPP_MIN_BATCH)
IMPL_OPTIONS = ("sync", "copy_memory_weights")


@register(
    "fiddler",
    "Fiddler: popular experts on the GPU; each other expert on the CPU when that beats moving "
    "it (as published: at most 9 tokens; ideal: the cost model decides)",
    options=CpuExpertOptions,
    impl_options=IMPL_OPTIONS,
    traits=PolicyTraits(one_batch=True, needs_cpu=True),
    presets={"as-published": FIDDLER_AS_PUBLISHED, "ideal": FIDDLER_IDEAL, "v0.1": FIDDLER_IDEAL},
)
def build_fiddler(inp: PolicyInput) -> Schedule:
    return _build(inp, "fiddler")


@register(
    "llamacpp-moe",
    "llama.cpp's rule: experts not on the GPU run on the CPU unless the op has >= 32 "
    "tokens (then their weights are copied over)",
    options=CpuExpertOptions,
    defaults={"rule": "layer-tokens", "min_batch": LLAMA_CPP_MIN_BATCH},
    impl_options=IMPL_OPTIONS,
    traits=PolicyTraits(one_batch=True, needs_cpu=True),
    presets={"as-published": LLAMACPP_AS_PUBLISHED, "ideal": LLAMACPP_IDEAL, "v0.1": LLAMACPP_IDEAL},
)
def build_llamacpp(inp: PolicyInput) -> Schedule:
    return _build(inp, "llamacpp-moe")
