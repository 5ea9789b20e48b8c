"""Every sensible llama.cpp placement of a model on a GPU and host, priced, and the best one for the
user's goal: the question llama.cpp's users ask of `--n-cpu-moe` (which auto-fit does not answer),
answered before anything is downloaded."""

from __future__ import annotations

from dataclasses import dataclass, replace

from klotski_sim.advise.llamacpp import OP_OFFLOAD_MIN_BATCH, LlamaCppCosts, LlamaCppFlags, Memory, Speed, memory, speed
from klotski_sim.hardware.host_cpu import HostCpu
from klotski_sim.hardware.profile import HardwareProfile
from klotski_sim.util.errors import UsageError
from klotski_sim.workload.gguf import GgufSizes
from klotski_sim.workload.model import ModelSpec

GOALS = ("generation", "prompt", "balanced")
HOST_RESERVE_BYTES = 4 * 2**30  # the OS and the user's other programs: an assumption a user can see


@dataclass(frozen=True)
class Option:
    """One placement: its flags, what each side holds, its speeds (None where it does not fit) and why not."""

    flags: LlamaCppFlags
    memory: Memory
    speed: Speed | None
    refused: str = ""


@dataclass(frozen=True)
class Advice:
    model: ModelSpec
    sizes: GgufSizes
    options: tuple[Option, ...]
    best: Option
    goal: str
    gpu_room: float  # bytes the GPU can give llama.cpp
    host_room: float

    def why_not_more(self) -> str:
        """Why the best keeps the experts of neither fewer nor more blocks on the CPU."""
        index = self.options.index(self.best)
        lines = []
        if index > 0:
            fewer = self.options[index - 1]
            lines.append(
                f"--n-cpu-moe {fewer.flags.n_cpu_moe}: "
                + (
                    fewer.refused
                    if fewer.speed is None
                    else f"{_goal_rate(fewer.speed, self.goal):.1f} against {_goal_rate(self.best.speed, self.goal):.1f}"
                )
            )
        if index + 1 < len(self.options):
            more = self.options[index + 1]
            if more.speed is not None and self.best.speed is not None:
                lines.append(
                    f"--n-cpu-moe {more.flags.n_cpu_moe}: slower, {_goal_rate(more.speed, self.goal):.1f} "
                    f"against {_goal_rate(self.best.speed, self.goal):.1f}"
                )
        return "; ".join(lines)


def _goal_rate(s: Speed | None, goal: str) -> float:
    """The figure the goal maximises: generation tok/s, prompt tok/s, or their geometric mean."""
    if s is None:
        return 0.0
    if goal == "generation":
        return s.generation_tok_s
    prompt = s.prompt_tok_s or 0.0  # (a prompt not priced ranks last)
    if goal == "prompt":
        return prompt
    return (s.generation_tok_s * prompt) ** 0.5


def advise(
    model: ModelSpec,
    sizes: GgufSizes,
    gpu: HardwareProfile,
    host: HostCpu,
    costs: LlamaCppCosts,
    base: LlamaCppFlags,
    goal: str = "generation",
    prompt: int = 512,
    generated: int = 128,
) -> Advice:
    """Every `--n-cpu-moe` from 0 to the block count with `base`'s other flags, and the best that fits."""
    if goal not in GOALS:
        raise UsageError(f"--goal {goal}: one of {', '.join(GOALS)}")
    gpu_room = gpu.gpu.usable_bytes
    host_room = host.ram_bytes - HOST_RESERVE_BYTES
    options = []
    for n in range(model.num_layers + 1):
        flags = replace(base, n_cpu_moe=n)
        held = memory(model, sizes, flags)
        refused = ""
        if held.gpu > gpu_room:
            refused = f"the GPU would hold {held.gpu / 2**30:.1f} GiB, more than its {gpu_room / 2**30:.1f} GiB"
        elif held.host > host_room:
            refused = (
                f"the host would hold {held.host / 2**30:.1f} GiB, more than its {host.ram_bytes / 2**30:.0f} GiB "
                f"less {HOST_RESERVE_BYTES / 2**30:.0f} GiB for the system"
            )
        priced = None if refused else speed(model, sizes, flags, gpu, host, costs, prompt, generated)
        options.append(Option(flags, held, priced, refused))
    fitting = [o for o in options if o.speed is not None]
    if not fitting:
        # (the placement that overflows least: its larger share of a side's room)
        least = min(options, key=lambda o: max(o.memory.gpu / gpu_room, o.memory.host / max(host_room, 1.0)))
        short = "the GPU" if least.memory.gpu > gpu_room else "the host's RAM"
        raise UsageError(
            f"{model.name}@{sizes.file_type} ({sizes.total / 2**30:.1f} GiB) fits no placement on {gpu.gpu.name} "
            f"({gpu_room / 2**30:.1f} GiB) and {host.ram_bytes / 2**30:.0f} GiB of RAM: the closest, --n-cpu-moe "
            f"{least.flags.n_cpu_moe}, needs {least.memory.gpu / 2**30:.1f} GiB on the GPU and "
            f"{least.memory.host / 2**30:.1f} GiB on the host ({least.refused}); {short} is short: "
            + ("a shorter -c or a smaller quant" if short == "the GPU" else "more RAM or a smaller quant")
        )
    if goal != "generation" and not any(o.speed and o.speed.prompt_s is not None for o in fitting):
        raise UsageError(
            f"--goal {goal}: no placement's prompt is priced (the CPU would compute experts: --no-op-offload, or "
            f"-ub below {OP_OFFLOAD_MIN_BATCH}); use --goal generation"
        )
    best = max(fitting, key=lambda o: (_goal_rate(o.speed, goal), -o.flags.n_cpu_moe))
    return Advice(model, sizes, tuple(options), best, goal, gpu_room, host_room)
