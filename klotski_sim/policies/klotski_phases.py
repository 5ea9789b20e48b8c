"""The phases of Klotski's decode step (KLOTSKI.md, "Klotski decode step"), one method each, and
the decisions that configure them for a rung of the ablation ladder and an implementation preset.

`klotski.build_pipeline` calls the phases in the paper's order; everything that differs between
the rungs (multi-batch ... klotski-hybrid) or between the presets (as-published, ideal) is decided
once, in `Decisions.of`, and every phase reads its choice from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from klotski_sim.core.cost import CostModel
from klotski_sim.core.schedule import CPU_STREAMS, DEFAULT_STREAMS, Schedule, ScheduleBuilder
from klotski_sim.policies.base import ExpertOp, OpEmitter, PolicyInput, cpu_expert_seconds
from klotski_sim.policies.impl import Impl
from klotski_sim.policies.prefetch import CorrelationTable, PrefetchStats, spatio_temporal
from klotski_sim.workload.model import ModelSpec


@dataclass(frozen=True)
class Rung:
    """Which of Klotski's ideas are on."""

    hot_prefetch: bool  # gate + hot experts during attention, the rest on demand
    reorder: bool  # hot experts first, then cold ones in arrival order
    oracle: bool = False  # perfect knowledge of the group's experts
    cpu_cold: bool = False  # cold experts may run on the host CPU instead of loading


WEIGHTS = ("whole-layer", "at-gate", "expert-aware")


@dataclass(frozen=True)
class Decisions:
    """Every choice of the loop that depends on the rung or on the implementation preset."""

    # how a streamed layer's weights reach the GPU:
    # - `whole-layer`:  attention, gate and every expert, one layer ahead (+multi-batch, `moe_load=layer-ahead`)
    # - `at-gate`:      attention and gate ahead, every expert once the gate sub-layer starts (+multi-batch as
    #                   published: the port has no predictor, so its MoE layer loads at the gate sub-layer)
    # - `expert-aware`: the gate and the hot experts during attention (the paper's step 1)
    weights: str
    hot: str | None  # who names the hot experts: `table` (the correlation table), `oracle`, or None (no one)
    cold_on_demand: bool  # each batch's gate issues the loads of the experts it selected that are not requested
    attention_during_moe: bool  # the next layer's attention weights load during this MoE layer
    expert_order: str  # `arrival` (hot first, then cold in issue order: the reorder rung) or `expert-id`
    cold_to_cpu: bool  # a cold expert may run on the host CPU instead of loading (klotski-hybrid)
    sync_sublayers: bool  # the host waits at every sub-layer's end and reads each gate's routed ids
    per_batch_experts: bool  # one op per expert and batch instead of one over the group

    def __post_init__(self) -> None:
        assert self.weights in WEIGHTS and self.hot in ("table", "oracle", None)
        assert self.expert_order in ("arrival", "expert-id")

    @classmethod
    def of(cls, rung: Rung, impl: Impl) -> "Decisions":
        """The loop a rung runs under an implementation: the only place either is read."""
        if rung.hot_prefetch:
            weights = "expert-aware"
        else:
            weights = "at-gate" if impl.moe_load == "at-gate" else "whole-layer"
        return cls(
            weights=weights,
            hot=("oracle" if rung.oracle else "table") if rung.hot_prefetch else None,
            cold_on_demand=rung.hot_prefetch,
            attention_during_moe=weights != "whole-layer",
            expert_order="arrival" if rung.reorder else "expert-id",
            cold_to_cpu=rung.cpu_cold,
            sync_sublayers=impl.sync_sublayers,
            per_batch_experts=impl.per_batch_experts,
        )

    @property
    def learns(self) -> bool:
        """Whether the correlation table is warmed up, learns online and has its hits reported."""
        return self.hot == "table"


class ColdSplit:
    """Per layer, which cold experts run on the CPU: each goes to whichever side would finish it
    first given what that side already has in this layer (the link: the cold loads issued; the
    CPU: the experts given to it), priced by the cost model that will time the ops."""

    def __init__(self, model: ModelSpec, cost: CostModel) -> None:
        cost.profile.require_cpu("policy 'klotski-hybrid'")
        self.model, self.cost = model, cost
        self.load = cost.transfer_seconds("pcie_h2d", model.expert_bytes())
        self._on_cpu: dict[int, float] = {}
        self.link_busy = self.cpu_busy = 0.0

    def new_layer(self) -> None:
        self.link_busy = self.cpu_busy = 0.0

    def cpu_seconds(self, tokens: float) -> float:
        """An expert over `tokens` tokens on the CPU, its output back up included."""
        tok = max(1, int(round(tokens)))
        if tok not in self._on_cpu:
            self._on_cpu[tok] = cpu_expert_seconds(self.cost, self.model, tok)
        return self._on_cpu[tok]

    def to_cpu(self, tokens: float) -> bool:
        on_cpu, load = self.cpu_seconds(tokens), self.load
        if self.cpu_busy + on_cpu < self.link_busy + load:
            self.cpu_busy += on_cpu
            return True
        self.link_busy += load
        return False


@dataclass(slots=True)
class Layer:
    """Layer j at one step, as its phases fill it in."""

    step: int
    j: int
    at: str  # op id prefix
    resident: bool
    group_tokens: np.ndarray  # tokens per expert over the n batches
    prev_moe: str | None  # the last op of the previous MoE layer
    attn_w: str | None = None  # weight buffers (load op ids); None when resident
    gate_w: str | None = None
    expert_w: dict[int, str] = field(default_factory=dict)
    load_order: list[int] = field(default_factory=list)  # experts in the order their loads were issued
    prefetched: list[str] = field(default_factory=list)  # this layer's loads a sub-layer's sync waits for
    attn_ops: list[str] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)
    last_gate: str = ""
    cpu_experts: list[int] = field(default_factory=list)
    moe_done: str = ""  # the layer's last expert op


class Pipeline:
    """The state of one run of the loop (emitter, predictor, what the previous layer left behind)
    and its phases, in the order `klotski.build_pipeline` calls them."""

    def __init__(self, inp: PolicyInput, decide: Decisions) -> None:
        self.decide = decide
        self.split = ColdSplit(inp.model, CostModel(inp.profile)) if decide.cold_to_cpu else None
        self.em = OpEmitter(inp, ScheduleBuilder({**DEFAULT_STREAMS, **CPU_STREAMS}) if self.split else None)
        self.model, self.shape, self.routing = inp.model, inp.shape, inp.routing
        self.counts = inp.routing.counts  # [step, layer, batch, expert]
        self.batches = tuple(range(self.shape.num_batches))
        self.expert_bytes = self.model.expert_bytes()
        if decide.learns:
            self.table = CorrelationTable(self.model.num_layers, self.model.num_experts, self.model.top_k)
            if inp.warmup is not None:
                self.table.warm_up(inp.warmup)  # the pre-run on sequences never evaluated
        self.stats = PrefetchStats()
        self.predictor = inp.options.get("predictor", "layer")
        self.fetch_streamed = {
            "whole-layer": self._fetch_whole_layer,
            "at-gate": self._fetch_attention_and_gate,
            "expert-aware": self._fetch_gate_and_hot,
        }[decide.weights]
        self.layer_done: list[str] = []  # last MoE op of each layer, in order of use
        self.next_attention: str | None = None  # attention weights fetched during the previous MoE layer
        self.cpu_out: list[str] = []  # the previous layer's CPU expert outputs, back on the GPU
        self.on_cpu_count = 0

    def embed(self, step: int) -> None:
        """Each batch's embedding starts its step."""
        for b in self.batches:
            self.em.embed(f"s{step}/b{b}/embed", step, b)

    # ---- step 1: while attention runs, fetch what the layer needs next ---------------------------
    def fetch_ahead(self, step: int, j: int) -> Layer:
        """The paper's first step: the gate and the K hot experts load while attention runs (or,
        below the hot-prefetch rung, the whole layer); a resident layer loads nothing."""
        em, done = self.em, self.layer_done
        layer = Layer(
            step, j, f"s{step}/L{j}", em.is_resident(j), self.counts[step, j].sum(axis=0), done[-1] if done else None
        )
        if not layer.resident:
            self.fetch_streamed(layer)
        self.next_attention = None
        return layer

    def _fetch_whole_layer(self, layer: Layer) -> None:
        """+multi-batch: the whole layer, double-buffered (it may load once layer g-2 is done)."""
        after = [self.layer_done[-2]] if len(self.layer_done) >= 2 else []
        layer.attn_w, layer.gate_w, loads = self.em.fetch_layer(layer.at, layer.step, layer.j, after)
        layer.expert_w = dict(enumerate(loads))
        layer.load_order = list(range(self.model.num_experts))
        layer.prefetched = [layer.gate_w, *loads]

    def _fetch_attention_and_gate(self, layer: Layer) -> None:
        """+multi-batch as published: the attention weights (fetched during the previous MoE layer,
        or double-buffered) and the gate once the previous MoE layer is done; the experts wait for
        the gate sub-layer (`gates`)."""
        em, at, step, j = self.em, layer.at, layer.step, layer.j
        after = [self.layer_done[-2]] if len(self.layer_done) >= 2 else []
        layer.attn_w = self.next_attention or em.fetch_attention(at, step, j, after)
        layer.gate_w = em.fetch_gate(at, step, j, [layer.prev_moe])
        layer.prefetched = [layer.gate_w]

    def _fetch_gate_and_hot(self, layer: Layer) -> None:
        """Expert-aware prefetch: the gate and the predicted hot experts on the expert stream,
        issued as the previous MoE layer ends, so that they load during this layer's attention."""
        em, at, step, j, prev = self.em, layer.at, layer.step, layer.j, layer.prev_moe
        layer.attn_w = self.next_attention or em.fetch_attention(at, step, j)
        hot = self.hot_experts(layer)
        layer.gate_w = em.fetch_gate(at, step, j, [prev], stream="h2d_experts")
        expert_w, order, nbytes = layer.expert_w, layer.load_order, self.expert_bytes
        for e in hot:
            expert_w[e] = em.fetch(
                f"{at}/load_hot_E{e}",
                "experts",
                nbytes,
                "hot_expert",
                "h2d_experts",
                [prev],
                step=step,
                layer=j,
                expert=e,
            )
            order.append(e)
        layer.prefetched = [layer.gate_w, *expert_w.values()]

    def hot_experts(self, layer: Layer) -> list[int]:
        """The correlation-aware prefetcher (KLOTSKI.md, "Hot experts"): the top K of the table's
        scores given the previous layer's expert counts over the group — what is known once its
        gates ran. The oracle instead names every expert the group uses, most-used first."""
        j, step = layer.j, layer.step
        if not self.model.is_moe(j):  # a dense layer: no experts to predict
            return []
        if self.decide.hot == "oracle":
            tokens = layer.group_tokens
            return [int(e) for e in np.argsort(-tokens, kind="stable") if tokens[e] > 0]
        prev_counts = self.counts[step, j - 1].sum(axis=0) if j > 0 else None
        if self.predictor == "layer+token" and step > 0:  # the previous token's routing is known by now
            hot = spatio_temporal(self.table.scores(j, prev_counts), self.counts[step - 1, j].sum(axis=0))
            hot = hot[: self.model.top_k]
        else:
            hot = self.table.predict(j, prev_counts, self.model.top_k)
        self.stats.record(hot, layer.group_tokens)
        return hot

    # ---- step 2: attention, gate, experts --------------------------------------------------------
    def attention(self, layer: Layer) -> None:
        """Attention over the n batches, one after another, each with its own KV cache; it waits
        for the previous layer's CPU experts' outputs. As published, the host then waits for the
        sub-layer's loads."""
        em, at, attn_w = self.em, layer.at, layer.attn_w
        layer.attn_ops = em.attentions(
            at, layer.step, layer.j, self.batches, [attn_w, *self.cpu_out], free_last=(attn_w,) if attn_w else ()
        )
        if self.decide.sync_sublayers:
            em.sync(f"{at}/attn", layer.prefetched or [layer.attn_ops[-1]])

    def gates(self, layer: Layer) -> None:
        """The gate, batch by batch: as soon as batch b's gate is done, every expert it selected that
        is neither hot nor requested yet is put on the expert-transfer queue (or, klotski-hybrid, on
        the CPU). A multi-batch layer loaded at the gate issues its experts first."""
        em, decide, at, step, j = self.em, self.decide, layer.at, layer.step, layer.j
        if decide.weights == "at-gate" and not layer.resident:
            loads = em.fetch_moe_layer(at, step, j, [layer.prev_moe])
            layer.expert_w = dict(enumerate(loads))
            layer.load_order = list(range(self.model.num_experts))
            layer.prefetched = loads
        if self.split:
            self.split.new_layer()
        sync = decide.sync_sublayers
        load_cold = self._cold_loads(layer) if decide.cold_on_demand and not layer.resident else None
        gate_w, gates, last_gate = layer.gate_w, layer.gates, ""
        gate_ops = em.gate_ops(
            [(f"{at}/b{b}/gate", b) for b in self.batches], step, j, [gate_w], free_last=(gate_w,) if gate_w else ()
        )
        for b, gate_op in zip(self.batches, gate_ops):
            last_gate = em.b.append(gate_op)
            if load_cold:
                if sync:  # the routed ids are read on the host (`.tolist()`)
                    em.sync(last_gate, [last_gate])
                load_cold(b, last_gate)
            gates.append(last_gate)
        layer.last_gate = last_gate
        if sync:  # end of the gate sub-layer
            em.sync(f"{at}/gates", layer.prefetched or [last_gate])

    def _cold_loads(self, layer: Layer) -> Callable[[int, str], None]:
        """On-demand loads: `load(b, gate)` issues, in `cold_order`, the loads of what batch b
        selected and nobody requested yet, each depending on the gate that revealed it;
        klotski-hybrid sends an expert to the CPU instead when it would finish there first, its
        token count estimated from the gates run so far. (One closure per layer: it runs for every
        batch of every layer.)"""
        em, split, expert_w, cpu, order = self.em, self.split, layer.expert_w, layer.cpu_experts, layer.load_order
        at, step, j, nbytes, n = layer.at, layer.step, layer.j, self.expert_bytes, len(self.batches)
        cold_orders = em.cold_orders(step, j)  # per batch: the experts it selected
        seen_by = np.cumsum(self.counts[step, j], axis=0)  # per batch: tokens per expert over the gates run so far

        def load(b: int, gate: str) -> None:
            seen = seen_by[b]
            for e in cold_orders[b]:
                if e in expert_w or e in cpu:  # (requested already: most of them)
                    continue
                if split and split.to_cpu(seen[e] * n / (b + 1)):
                    cpu.append(e)
                    continue
                expert_w[e] = em.fetch(
                    f"{at}/load_cold_E{e}",
                    "experts",
                    nbytes,
                    "cold_expert",
                    "h2d_experts",
                    [gate],
                    step=step,
                    layer=j,
                    expert=e,
                )
                order.append(e)

        return load

    # ---- step 3: the next layer's loads overlap this MoE layer -----------------------------------
    def fetch_next_attention(self, layer: Layer) -> None:
        """While the MoE layer computes, the next layer's attention weights load (after this
        layer's cold loads, which its gates issued)."""
        step, j, em = layer.step, layer.j, self.em
        nxt_step, nxt_layer = (step, j + 1) if j + 1 < self.model.num_layers else (step + 1, 0)
        if self.decide.attention_during_moe and nxt_step < self.shape.num_steps and not em.is_resident(nxt_layer):
            self.next_attention = em.fetch_attention(
                f"s{nxt_step}/L{nxt_layer}", nxt_step, nxt_layer, [layer.attn_ops[-1], layer.last_gate]
            )

    def gpu_experts(self, layer: Layer) -> None:
        """The MoE layer: each expert over its tokens from all n batches — hot experts first, then
        the cold ones in the order their loads were issued (the reorder rung), or in expert-id
        order, the natural loop of an MoE layer. Each frees its weights when done; the last also
        frees the experts loaded and never used."""
        decide, tokens, expert_w, at, step, j = (
            self.decide,
            layer.group_tokens,
            layer.expert_w,
            layer.at,
            layer.step,
            layer.j,
        )
        if decide.expert_order == "arrival" and not layer.resident:
            order = [e for e in layer.load_order if tokens[e] > 0]
        else:
            cpu = layer.cpu_experts
            order = [e for e in range(self.model.num_experts) if tokens[e] > 0 and e not in cpu]
        wasted = tuple(w for e, w in expert_w.items() if tokens[e] == 0)
        batches = self.batches
        per_batch = decide.per_batch_experts
        batch_rows = self.counts[step, j].tolist() if per_batch else []  # [batch][expert] tokens
        batch_tuple = self.em.batch_tuple
        expert_ops: list[ExpertOp] = []  # (op id, expert, batches, tokens, deps, frees)
        for e in order:
            own = (expert_w[e],) if e in expert_w else ()
            if per_batch:  # one op per batch: the weights are read again for each
                expert_ops += [
                    (f"{at}/b{b}/E{e}", e, batch_tuple[b], batch_rows[b][e], own, ())
                    for b in batches
                    if batch_rows[b][e]
                ]
            else:
                expert_ops.append((f"{at}/E{e}", e, batches, int(tokens[e]), own, ()))
            op_id, op_expert, op_batches, op_tokens, op_deps, _ = expert_ops[-1]
            expert_ops[-1] = (op_id, op_expert, op_batches, op_tokens, op_deps, own)  # its last op frees its weights
        layer.moe_done = self.em.expert_chain(step, j, layer.last_gate, expert_ops, last_also=wasted)
        self.layer_done.append(layer.moe_done)

    def cpu_experts(self, layer: Layer) -> None:
        """klotski-hybrid's CPU experts, issued after the GPU's (whose work is then in flight): the
        group's hidden states go down once every gate has run, each expert runs over the group's
        tokens on the CPU, and its output comes back before the next layer."""
        self.cpu_out = []
        if not layer.cpu_experts:
            return
        em, at, step, j, batches = self.em, layer.at, layer.step, layer.j, self.batches
        tokens_now = self.shape.batch_size * em.new_tokens(step) * len(batches)
        down = em.hidden_down(f"{at}/hidden_down", step, j, batches, tokens_now, layer.gates)
        self.cpu_out = [
            em.cpu_expert(f"{at}/cpu_E{e}", step, j, e, batches, int(layer.group_tokens[e]), down)
            for e in layer.cpu_experts
        ]
        self.on_cpu_count += len(layer.cpu_experts)

    def end_moe(self, layer: Layer) -> None:
        """As published, the host waits at the end of the MoE sub-layer for the weight stream (the
        next attention weights, else the layer's last expert)."""
        if self.decide.sync_sublayers:
            self.em.sync(f"{layer.at}/moe", [self.next_attention] if self.next_attention else [layer.moe_done])

    def end_step(self, step: int) -> None:
        """The table learns online from the step's every MoE layer; each batch's logits follow the
        last layer's CPU experts."""
        if self.decide.learns:
            self.table.observe_tokens(self.routing.step_block(step))
        for b in self.batches:
            self.em.lm_head(f"s{step}/b{b}/lm_head", step, b, self.cpu_out)
        self.cpu_out = []

    def build(self, name: str, rung: Rung) -> Schedule:
        """The schedule, with the predictor's hit rates and the experts the CPU ran."""
        extra: dict[str, Any] = {"prefetch": self.stats.to_dict()} if self.decide.learns else {}
        if self.split:
            extra["cpu_experts"] = self.on_cpu_count
        return self.em.build(
            name, rung={"hot_prefetch": rung.hot_prefetch, "reorder": rung.reorder, "oracle": rung.oracle}, **extra
        )
