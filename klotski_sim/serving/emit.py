"""One serving iteration as Schedule ops: a mixed batch of prefill chunks and decode tokens, costed
from the model's shapes as the offline policies' ops are (klotski_sim.workload.model), so the engine,
the timeline and its exports treat them alike.

Per iteration: the embedding of its tokens, per layer an attention op over every scheduled
request's new tokens and cache, the gate (with any shared experts or a dense MLP), the routed
experts of the layer in one fused op (`moe`, vLLM's `fused_moe`: one kernel over every active
expert), then the logits of the requests that sample, and the host waiting for the sampled tokens
(the end of the iteration: the scheduler decides the next one from them).

Which experts a batch activates follows the model's calibrated per-layer popularity
(klotski_sim.workload.trace_synth.base_popularity): a token picks expert e with probability
min(1, top_k x share_e), so T tokens activate sum_e 1 - (1 - that)^T experts on average, and
that many experts' weights are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from klotski_sim.core.schedule import ScheduleBuilder
from klotski_sim.names import ALLREDUCE_STREAM
from klotski_sim.serving.batcher import Iteration
from klotski_sim.workload.model import ModelSpec
from klotski_sim.workload.trace_synth import base_popularity, params_for


def expert_pick_probability(model: ModelSpec, seed: int = 0) -> np.ndarray:
    """`[layers, experts]`: the chance one token routes to each expert (calibrated shares x top_k)."""
    shares = base_popularity(model, params_for("calibrated", model), np.random.default_rng(seed))
    return np.minimum(1.0, model.top_k * shares)


@dataclass(frozen=True)
class BatchShape:
    """What the costs of one iteration depend on."""

    tokens: int  # new tokens computed
    samples: int  # requests sampling a token at the end
    visible: int  # query-key pairs attention scores (causal within a prefill chunk)
    context: int  # cached tokens read by attention (every request's context)
    sequences: int
    prefill: bool

    @property
    def timing_key(self) -> tuple[int, int, int, bool]:
        """What every op's cost but attention's depends on (`IterationEmitter.attention_cost`)."""
        return self.tokens, self.samples, self.sequences, self.prefill

    @classmethod
    def of(cls, iteration: Iteration) -> "BatchShape":
        tokens = visible = context = samples = 0
        prefill = False
        for s in iteration.seqs:
            n, c = s.new_tokens, s.context
            tokens += n
            context += c
            visible += n * (c - n) + n * (n + 1) // 2
            samples += s.samples
            prefill = prefill or s.prefill
        return cls(tokens, samples, visible, context, len(iteration.seqs), prefill)


class IterationEmitter:
    """Emits one iteration's ops into a builder shared by the whole run (op ids `it{k}/...`)."""

    def __init__(self, model: ModelSpec, builder: ScheduleBuilder, pick: np.ndarray, group: int = 1) -> None:
        """`group`: the GPUs of a tensor-parallel group the iteration runs on (parallel.tensor): above
        one, attention and each layer's MLP side end in an all-reduce of the iteration's hidden states."""
        self.model, self.b, self.pick, self.group = model, builder, pick, group
        m = model
        # score FLOPs per visible query-key pair: attention_flops is linear in the cache length
        self._per_visible = m.attention_flops(1, 1, 1) - m.attention_flops(1, 1, 0)
        # the model's per-token constants, read for every layer of every iteration
        self._attention_params, self._attention_bytes = m.attention_params(), m.attention_bytes()
        self._kv_per_token, self._hidden_per_token = m.kv_bytes_per_token(), m.hidden_bytes(1)
        self._expert_weights = {False: m.expert_params() * m.dtype_bytes, True: m.expert_bytes()}
        self._miss = 1.0 - pick  # [layers, experts]
        self._active_cache: dict[tuple[int, int], float] = {}

    def begin(self, iteration: Iteration, shape: BatchShape | None = None) -> None:
        self.it = iteration
        self.at = f"it{iteration.index}"
        self.shape = shape or BatchShape.of(iteration)
        self.phase = "prefill" if self.shape.prefill else "decode"
        self.first = len(self.b.ops)
        self.context_ops: list[int] = []  # (within the iteration) the ops whose costs grow with the context

    def _tags(self, layer: int = -1) -> dict:
        return dict(step=self.it.index, phase=self.phase, layer=layer, tokens=self.shape.tokens)

    def active_experts(self, layer: int, tokens: int) -> float:
        """Experts of `layer` that `tokens` tokens activate, on average (module docstring)."""
        key = (layer, tokens)
        if key not in self._active_cache:
            self._active_cache[key] = float(np.sum(1.0 - self._miss[layer] ** tokens))
        return self._active_cache[key]

    # ---- ops -----------------------------------------------------------------------------------
    def embed(self, deps: Sequence[str | None]) -> str:
        return self.b.compute(
            f"{self.at}/embed", "embed", deps, bytes=self.model.hidden_bytes(self.shape.tokens), **self._tags()
        )

    def attention_cost(self, sh: BatchShape) -> tuple[int, int, int]:
        """FLOPs, bytes and mean context of one layer's attention over `sh`: the one op cost that
        changes from one iteration to the next of a steady batch (klotski_sim.core.maxplus)."""
        flops = 2 * sh.tokens * self._attention_params + self._per_visible * sh.visible
        nbytes = self._attention_bytes + sh.context * self._kv_per_token + 2 * sh.tokens * self._hidden_per_token
        return flops, nbytes, sh.context // max(1, sh.sequences)

    def attention(self, layer: int, deps: Sequence[str | None], free: tuple[str, ...] = ()) -> str:
        """The layer's attention (and, on a tensor-parallel group, its output's all-reduce: what the
        router and the experts read)."""
        flops, nbytes, mean_context = self.attention_cost(self.shape)
        self.context_ops.append(len(self.b.ops) - self.first)
        attention = self.b.compute(
            f"{self.at}/L{layer}/attn",
            "attention",
            deps,
            flops=flops,
            bytes=nbytes,
            kv_len=mean_context,
            variant="fused",
            free=free,
            **self._tags(layer),
        )
        return self.all_reduce(layer, attention, "attn") if self.group > 1 else attention

    def all_reduce(self, layer: int, after: str, part: str) -> str:
        """A tensor-parallel group's all-reduce of the iteration's hidden states after `after`."""
        return self.b.compute(
            f"{self.at}/L{layer}/{part}/allreduce",
            "allreduce",
            [after],
            stream=ALLREDUCE_STREAM,
            bytes=self._hidden_per_token * self.shape.tokens,
            **self._tags(layer),
        )

    def gate(self, layer: int, deps: Sequence[str | None], free: tuple[str, ...] = ()) -> str:
        """The router, with the shared experts (or the dense MLP of a dense layer)."""
        m, t = self.model, self.shape.tokens
        category = "gate" if m.is_moe(layer) else "dense_mlp"
        return self.b.compute(
            f"{self.at}/L{layer}/gate",
            category,
            deps,
            flops=m.gate_flops(t, layer),
            bytes=m.gate_io_bytes(t, layer),
            free=free,
            **self._tags(layer),
        )

    def moe_cost(self, layer: int, stored: bool = False) -> tuple[int, int, float]:
        """FLOPs and bytes of the layer's routed experts for this batch, and how many are active."""
        m, t = self.model, self.shape.tokens
        active = self.active_experts(layer, t)
        nbytes = int(active * self._expert_weights[stored]) + 2 * t * m.top_k * self._hidden_per_token
        return m.expert_flops(t * m.top_k), nbytes, active

    def moe(self, layer: int, deps: Sequence[str | None], free: tuple[str, ...] = ()) -> str:
        flops, nbytes, _ = self.moe_cost(layer)
        return self.b.compute(
            f"{self.at}/L{layer}/moe", "moe", deps, flops=flops, bytes=nbytes, free=free, **self._tags(layer)
        )

    def lm_head(self, deps: Sequence[str | None]) -> str:
        m, n = self.model, max(1, self.shape.samples)
        return self.b.compute(
            f"{self.at}/lm_head",
            "lm_head",
            deps,
            flops=m.lm_head_flops(n),
            bytes=m.lm_head_io_bytes(n),
            step=self.it.index,
            phase=self.phase,
            tokens=n,
        )

    def end(self, waits_for: list[str]) -> str:
        """The host waits for the sampled tokens (and anything still in flight): the iteration's end."""
        return self.b.host_wait(f"{self.at}/sync", "sync", waits_for, step=self.it.index, phase=self.phase)
