"""An expert-parallel schedule (`klotski-sim parallel --timing events`, klotski_sim/parallel/events.py)
executed on G ranks emulated on one host, so that the contract of ranked resources (`gpu@k`,
`pcie_h2d@k`, `fabric@k`, the shared `cpu`) is exercised op by op without G GPUs.

Each of the schedule's streams is a thread, as in the one-device CPU runtime (`executor._run_cpu`,
which drives this runner too): rank k's compute, copies, decompression and its part of every
all-to-all run on threads of their own, in the schedule's order, each op waiting for its deps.
What an op does is what the simulated op stands for, on real tensors:

- a rank's attention (with its gate) over its micro-batch's sequences, their KV cache its own;
  the shared experts or a dense layer's MLP likewise;
- its part of a dispatch gathers, from every rank, the tokens the plan assigns it
  (`EpLayer.compute_rank`): the exchange's bytes really move (a gather into the rank's receive
  buffer), and with `ExecOptions.emulate_fabric` the op lasts at least the pairwise exchange's time
  (`collectives.all_to_all_time`: EMULATED);
- the fused kernel of its resident experts and each expert it does not hold, over its tokens,
  from the staging buffer a copy filled (a clone of the host weights, held to `emulate_links` when
  given) or a decompression wrote (the lossless coder's real decode, `lossless.py`); CPU experts
  run on the host tensors between their activations' copies down and up;
- its part of a combine adds, for its own sequences, the outputs every rank computed.

The decode steps start from a random prompt's KV cache (`prompt_cache`) and random tokens; the
plan's routing is forced. `reference_decode` computes the same steps on one device in plain
order: the EP run's hidden states must equal it, and every token's every expert slot must have been
computed exactly once (`EpRunner.computed`). The CUDA executor does not run these schedules yet:
they need G devices, and the one-device executor refuses them in one line."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from klotski_sim.core.schedule import Op, Schedule
from klotski_sim.core.timeline import Timeline
from klotski_sim.names import resource_rank
from klotski_sim.parallel.decode import EpLayer, EpPlan
from klotski_sim.parallel.events import collective_of, held_on_ranks, micro_batch_of
from klotski_sim.workload.model import ModelSpec

from . import kernels, lossless
from .executor import ExecOptions, ExecutionError, measure_run, tensor_bytes
from .kernels import WeightStore


@dataclass(frozen=True)
class EpInputs:
    """What the ranks start from, the same for the EP run and its reference: each decode step's
    tokens `[step, sequence]` and each layer's prompt KV cache (all sequences)."""

    tokens: torch.Tensor
    prompt_kv: tuple[tuple[torch.Tensor, ...], ...]
    prompt_len: int


def prompt_cache(
    spec: ModelSpec, sequences: int, prompt_len: int, steps: int, dtype: torch.dtype, seed: int = 0
) -> EpInputs:
    """Random decode tokens and a random prompt KV cache of every layer, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (steps, sequences), generator=gen)
    kv = tuple(kernels.kv_chunk(spec, sequences, prompt_len, dtype, generator=gen) for _ in range(spec.num_layers))
    return EpInputs(tokens, kv, prompt_len)


class EpRunner:
    """The effect of each op of an EP schedule on real tensors (module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        spec: ModelSpec,
        weights: WeightStore,
        plan: EpPlan,
        micro_batch: np.ndarray,
        inputs: EpInputs,
    ) -> None:
        if weights.num_layers < spec.num_layers:
            raise ExecutionError(f"the weights hold {weights.num_layers} layers; {spec.name} has {spec.num_layers}")
        self.schedule, self.spec, self.weights, self.plan, self.inputs = schedule, spec, weights, plan, inputs
        self.G = plan.setup.gpus
        self.dtype = next(iter(weights.resident.values())).dtype
        self.ops_by_id = {op.id: op for op in schedule.ops}
        self.planned: dict[tuple[int, int], EpLayer] = {(p.step + 1, p.layer): p for p in plan.layers}
        # each rank's sequences, micro-batch by micro-batch (`[rank][m]`: sequence indices)
        M = int(micro_batch.max()) + 1 if len(micro_batch) else 1
        self.groups = [
            [np.flatnonzero((plan.home_rank == k) & (micro_batch == m)) for m in range(M)] for k in range(self.G)
        ]
        self.lock = threading.Lock()
        self.in_use = self.peak = 0
        self.memory_trace: list[tuple[float, int]] = []
        self.t0 = time.perf_counter()
        self.ranks = None  # (not a tensor-parallel group: `measure_run` reads this)
        self.x: dict[tuple[int, int], torch.Tensor] = {}  # (rank, m) -> hidden states entering the next layer
        self.h: dict[tuple[int, int], torch.Tensor] = {}  # (rank, m) -> after this layer's attention
        self.kv: dict[tuple[int, int, int], list[tuple[torch.Tensor, ...]]] = {}  # (layer, rank, m) -> chunks
        self.layer_state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (step, layer) -> z, gate, y, shared
        self.received: dict[tuple[int, int, int, int], tuple[np.ndarray, ...]] = {}  # (step, layer, rank, m)
        self.received_z: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.staged: dict[str, tuple[torch.Tensor, ...]] = {}  # staging buffer -> an expert's weights
        self.on_host: dict[str, torch.Tensor] = {}  # a CPU expert's op prefix -> its activations or outputs
        self.computed: dict[tuple[int, int], np.ndarray] = {}  # (step, layer) -> [sequence, slot] times computed
        self.outputs: dict[int, torch.Tensor] = {}  # step -> the last layer's hidden states [sequence, h]
        self.compressed = self._compress()

    # ---- memory accounting (the ranks' staging buffers together) ----------------------------------
    def _alloc(self, nbytes: int) -> None:
        with self.lock:
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.memory_trace.append((time.perf_counter() - self.t0, self.in_use))

    def _free(self, name: str) -> None:
        tensors = self.staged.pop(name, None)
        if tensors is not None:
            self._alloc(-tensor_bytes(tensors))

    def _compress(self) -> dict[tuple[int, int], tuple[lossless.Compressed, ...]]:
        """The compressed tier's experts, coded for real (each rank decodes its own copy's image)."""
        wanted = {(op.layer, op.expert) for op in self.schedule.ops if op.category == "decompress"}
        if wanted and self.dtype != torch.bfloat16:
            raise ExecutionError(f"the schedule decompresses experts: its weights must be bf16, not {self.dtype}")
        return {
            key: tuple(lossless.encode(t.reshape(-1)) for t in self.weights.get("expert", *key))
            for key in sorted(wanted)
        }

    # ---- dispatch -------------------------------------------------------------------------------
    def run(self, op: Op) -> None:
        rank, m = resource_rank(op.stream), micro_batch_of(op.id)
        if op.kind == "transfer" and op.tensor == "expert":
            self._stage(op, tuple(t.clone() for t in self.weights.get("expert", op.layer, op.expert)))
        elif op.kind == "transfer" and op.tensor == "activation":
            self._activations(op, rank, m)
        elif op.category == "decompress":
            images = self.compressed[(op.layer, op.expert)]
            shapes = [t.shape for t in self.weights.get("expert", op.layer, op.expert)]
            self._stage(op, tuple(lossless.decode(c).reshape(s) for c, s in zip(images, shapes)))
        elif op.category == "attention":
            self._attention(op, rank, m)
        elif op.category == "dense_mlp":
            self._dense_mlp(op, rank, m)
        elif op.category == "expert" and op.expert < 0:
            self._shared(op, rank, m)
        elif op.category == "alltoall":
            (self._dispatch if collective_of(op.id) == "dispatch" else self._combine)(op, rank, m)
        elif op.category == "moe" and op.expert < 0:  # (the fused kernel of the rank's resident experts)
            held = held_on_ranks(self.plan, self.planned[(op.step, op.layer)], self.spec.num_experts)[:, rank]
            self._experts(op, rank, m, [e for e in range(self.spec.num_experts) if held[e]], None)
        elif op.expert >= 0 and self.schedule.streams[op.stream] == "cpu":
            prefix = op.id.rsplit("/", 1)[0]
            rows = self.on_host.pop(prefix + "/down")
            self.on_host[prefix + "/out"] = kernels.expert(rows, self.weights.get("expert", op.layer, op.expert))
        elif op.expert >= 0:  # (an expert the rank does not hold, from the buffer its copy filled)
            self._experts(op, rank, m, [op.expert], self._staged_weights(op))
        elif op.category != "remap":  # (a remap only frees the slots of prefetched experts not used)
            raise ExecutionError(f"op {op.id!r}: no EP kernel for {op.kind} {op.category!r}")
        for name in op.free:
            self._free(name)

    def _stage(self, op: Op, tensors: tuple[torch.Tensor, ...]) -> None:
        (buffer, _), *_ = op.alloc
        self.staged[buffer] = tensors
        self._alloc(tensor_bytes(tensors))

    def _staged_weights(self, op: Op) -> tuple[torch.Tensor, ...]:
        for dep in op.deps:
            d = self.ops_by_id[dep]
            if d.alloc and d.expert == op.expert and d.layer == op.layer:
                try:
                    return self.staged[d.alloc[0][0]]
                except KeyError:
                    raise ExecutionError(
                        f"op {op.id!r}: staging buffer {d.alloc[0][0]!r} was freed before use"
                    ) from None
        raise ExecutionError(f"op {op.id!r}: expert {op.expert} is neither held on rank nor copied in before it")

    def _state(self, step: int, layer: int) -> dict[str, torch.Tensor]:
        """One layer's step-wide tensors, every sequence's row (each rank writes its rows only)."""
        with self.lock:
            state = self.layer_state.get((step, layer))
            if state is None:
                n, k, h = len(self.plan.home_rank), self.spec.top_k, self.spec.hidden_size
                state = {
                    "z": torch.zeros(n, h, dtype=self.dtype),
                    "gate": torch.zeros(n, k, dtype=torch.float32),
                    "y": torch.zeros(n, k, h, dtype=self.dtype),
                    "shared": torch.zeros(n, h, dtype=self.dtype),
                }
                self.layer_state[(step, layer)] = state
                self.computed[(step, layer)] = np.zeros((n, k), dtype=np.int64)
            return state

    # ---- the ranks' own sequences --------------------------------------------------------------
    def _attention(self, op: Op, rank: int, m: int) -> None:
        seqs, layer, step = self.groups[rank][m], op.layer, op.step
        if layer == 0:
            self.x[(rank, m)] = kernels.embed(self.inputs.tokens[step - 1, seqs], self.weights.resident["embed"])[
                :, None
            ]
        cache = self.kv.setdefault((layer, rank, m), [tuple(t[seqs] for t in self.inputs.prompt_kv[layer])])
        resident, eps = self.weights.resident, self.weights.rms_eps
        qk = kernels.qk_norms(resident, self.spec, layer)
        pos0 = self.inputs.prompt_len + step - 1
        h, chunk = kernels.attention(
            self.x[(rank, m)], self.weights.get("attention", layer), resident[f"norm1/{layer}"], cache, pos0, self.spec,
            self.weights.rope_theta, eps, "fused", qk,
        )  # fmt: skip
        cache.append(chunk)
        self.h[(rank, m)] = h
        planned = self.planned.get((step, layer))
        if planned is None:  # (a dense layer: its MLP op follows)
            return
        router_w = self.weights.get("gate", layer)[0]
        forced = planned.ids[seqs].astype(np.int64)
        z, gate, _, _ = kernels.gate_step(
            h, resident[f"norm2/{layer}"], router_w, self.spec.top_k, eps, forced, (), self.spec.norm_topk_prob
        )
        state = self._state(step, layer)
        index = torch.as_tensor(seqs)
        state["z"].index_copy_(0, index, z)
        state["gate"].index_copy_(0, index, gate.float())

    def _shared(self, op: Op, rank: int, m: int) -> None:
        seqs = self.groups[rank][m]
        state = self._state(op.step, op.layer)
        _, *shared = self.weights.get("gate", op.layer)
        index = torch.as_tensor(seqs)
        state["shared"].index_copy_(0, index, kernels.shared_experts(state["z"][index], tuple(shared)))

    def _dense_mlp(self, op: Op, rank: int, m: int) -> None:
        h = self.h[(rank, m)]
        z = kernels.rms_norm(h, self.weights.resident[f"norm2/{op.layer}"], self.weights.rms_eps)
        self._leave_layer(op, rank, m, h + kernels.expert(z, self.weights.get("gate", op.layer)))

    def _leave_layer(self, op: Op, rank: int, m: int, x: torch.Tensor) -> None:
        self.x[(rank, m)] = x
        if op.layer == self.spec.num_layers - 1:
            with self.lock:
                out = self.outputs.setdefault(
                    op.step, torch.zeros(len(self.plan.home_rank), x.shape[-1], dtype=x.dtype)
                )
            out.index_copy_(0, torch.as_tensor(self.groups[rank][m]), x[:, 0])

    # ---- the exchange and the experts ------------------------------------------------------------
    def _dispatch(self, op: Op, rank: int, m: int) -> None:
        """Rank `rank`'s receive side of micro-batch m's dispatch: every (token, slot) the plan has it
        compute, gathered from the ranks the tokens live on."""
        planned = self.planned[(op.step, op.layer)]
        seqs = np.concatenate([self.groups[k][m] for k in range(self.G)])
        tokens, slots = np.nonzero(planned.compute_rank[seqs] == rank)
        tokens = seqs[tokens]
        key = (op.step, op.layer, rank, m)
        self.received[key] = (tokens, slots, planned.ids[tokens, slots])
        self.received_z[key] = self._state(op.step, op.layer)["z"][torch.as_tensor(tokens)]

    def _experts(self, op: Op, rank: int, m: int, experts: list[int], weights: tuple[torch.Tensor, ...] | None) -> None:
        """Each of `experts` over the tokens of micro-batch m the rank received for it; its
        gate-weighted output into the tokens' slots (`y`), each slot counted once computed."""
        state = self._state(op.step, op.layer)
        key = (op.step, op.layer, rank, m)
        tokens, slots, ids = self.received[key]
        z = self.received_z[key]
        for e in experts:
            chosen = np.flatnonzero(ids == e)
            if len(chosen):
                w = weights if weights is not None else self.weights.get("expert", op.layer, e)
                self._into_slots(state, op, tokens[chosen], slots[chosen], kernels.expert(z[chosen], w))

    def _into_slots(
        self, state: dict[str, torch.Tensor], op: Op, tokens: np.ndarray, slots: np.ndarray, y: torch.Tensor
    ) -> None:
        t, s = torch.as_tensor(tokens), torch.as_tensor(slots)
        state["y"][t, s] = y * state["gate"][t, s][:, None].to(y.dtype)
        with self.lock:
            np.add.at(self.computed[(op.step, op.layer)], (tokens, slots), 1)

    def _activations(self, op: Op, rank: int, m: int) -> None:
        """A CPU expert's tokens down to the host, or its outputs back up into their slots."""
        prefix = op.id.rsplit("/", 1)[0]
        key = (op.step, op.layer, rank, m)
        tokens, slots, ids = self.received[key]
        chosen = np.flatnonzero(ids == op.expert)
        if op.dst == "cpu":
            self.on_host[prefix + "/down"] = self.received_z[key][chosen].clone()
        else:
            y = self.on_host.pop(prefix + "/out")
            self._into_slots(self._state(op.step, op.layer), op, tokens[chosen], slots[chosen], y)

    def _combine(self, op: Op, rank: int, m: int) -> None:
        """Rank `rank`'s own sequences of micro-batch m: their slots' outputs, wherever computed, added."""
        state = self._state(op.step, op.layer)
        index = torch.as_tensor(self.groups[rank][m])
        moe = state["shared"][index] + state["y"][index].sum(dim=1)
        self._leave_layer(op, rank, m, self.h[(rank, m)] + moe[:, None])
        for key in [k for k in self.received if k[:3] == (op.step, op.layer, rank) and k[3] == m]:
            del self.received[key], self.received_z[key]


def execute_ep(
    schedule: Schedule,
    spec: ModelSpec,
    weights: WeightStore,
    plan: EpPlan,
    micro_batch: np.ndarray,
    inputs: EpInputs,
    options: ExecOptions = ExecOptions(),
) -> tuple[Timeline, EpRunner]:
    """Run every op of an EP schedule on emulated ranks (module docstring); the measured Timeline
    and the runner (its `outputs` and `computed` for checks)."""
    if options.device != "cpu":
        raise ExecutionError(
            f"an expert-parallel schedule of {plan.setup.gpus} ranks runs on the CPU runtime (--device cpu), its "
            f"ranks emulated as threads; executing it on {plan.setup.gpus} real GPUs is not built yet"
        )
    runner = EpRunner(schedule, spec, weights, plan, micro_batch, inputs)
    fabric = options.emulate_fabric
    meta: dict[str, Any] = {
        "expert_parallel_ranks": plan.setup.gpus,
        "emulated_fabric_bytes_per_s": fabric.bandwidth if fabric else None,
        "note": "EMULATED ranks: threads of one host; all-to-alls gather in host memory",
    }
    return measure_run(schedule, runner, options, weights, meta), runner  # type: ignore[arg-type]


def reference_decode(spec: ModelSpec, weights: WeightStore, plan: EpPlan, inputs: EpInputs) -> dict[int, torch.Tensor]:
    """The same decode steps on one device, every sequence at once, with the plan's routing: each
    step's last-layer hidden states `[sequence, h]`."""
    resident, eps = weights.resident, weights.rms_eps
    planned = {(p.step + 1, p.layer): p for p in plan.layers}
    caches = [[chunk] for chunk in inputs.prompt_kv]
    outputs = {}
    for step in range(1, inputs.tokens.shape[0] + 1):
        x = kernels.embed(inputs.tokens[step - 1], resident["embed"])[:, None]
        for layer in range(spec.num_layers):
            qk = kernels.qk_norms(resident, spec, layer)
            h, chunk = kernels.attention(
                x, weights.get("attention", layer), resident[f"norm1/{layer}"], caches[layer],
                inputs.prompt_len + step - 1, spec, weights.rope_theta, eps, "fused", qk,
            )  # fmt: skip
            caches[layer].append(chunk)
            z = kernels.rms_norm(h, resident[f"norm2/{layer}"], eps).reshape(-1, spec.hidden_size)
            p = planned.get((step, layer))
            if p is None:
                x = h + kernels.expert(z, weights.get("gate", layer))[:, None]
                continue
            router_w, *shared = weights.get("gate", layer)
            gate = kernels.forced_weights(z, router_w, torch.as_tensor(p.ids.astype(np.int64)), spec.norm_topk_prob)
            moe = kernels.shared_experts(z, tuple(shared))
            for t in range(z.shape[0]):
                for slot, e in enumerate(p.ids[t]):
                    y = kernels.expert(z[t : t + 1], weights.get("expert", layer, int(e)))
                    moe[t] += y[0] * gate[t, slot].to(y.dtype)
            x = h + moe[:, None]
        outputs[step] = x[:, 0]
    return outputs
