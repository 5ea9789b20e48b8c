"""What this machine (the one running klotski, not the simulated one) has to spare.

Read from Linux's own accounting: `MemAvailable` (what can be allocated without swapping, page
cache included) and the memory cgroups this process runs in (v2 or v1), each level's limit less
its usage — a container's, a CI runner's, a Slurm job's or a systemd slice's limit is often far
below the host's. Where neither can be read (macOS, Windows) the answer is None: a caller then
refuses nothing. And the cores this process may run on (its affinity): a comparison's worker
processes and a synthetic draw's threads are as many.
"""

from __future__ import annotations

import os
from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
_PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroups: "0::/path" (v2), "4:memory:/path" (v1)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_LIMIT_FILES = {
    "v2": ("", "memory.max", "memory.current"),  # (folder under the root, limit, usage)
    "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
}


def available_memory_bytes() -> int | None:
    """Bytes this process may still allocate without swapping or being killed: the smaller of
    `MemAvailable` and the cgroup's limit less its usage; None where neither is known."""
    found = [_mem_available(), _cgroup_room()]
    known = [b for b in found if b is not None]
    return min(known) if known else None


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resident_bytes() -> int | None:
    """This process's resident memory now (`/proc/self/statm`), None where unknown."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _mem_available() -> int | None:
    try:
        with _MEMINFO.open() as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # (kB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """The least room (limit less usage) among this process's memory cgroup and its ancestors: a
    limit may be set on any of them (a Slurm job's, a systemd slice's, a container's). A cgroup
    folder that is not there (a container's own view of the tree) is skipped."""
    rooms = []
    for version, own in _own_cgroups():
        folder, limit_name, usage_name = _LIMIT_FILES[version]
        base = _CGROUP_ROOT / folder if folder else _CGROUP_ROOT
        level = base / own.strip("/")
        while True:
            room = _room(level / limit_name, level / usage_name)
            if room is not None:
                rooms.append(room)
            if level == base or base not in level.parents:
                break
            level = level.parent
    return min(rooms) if rooms else None


def _own_cgroups() -> list[tuple[str, str]]:
    """(version, path) of this process's memory cgroups, from /proc/self/cgroup."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found.append(("v2", parts[2]))
        elif "memory" in parts[1].split(","):
            found.append(("v1", parts[2]))
    return found


def _room(limit_path: Path, usage_path: Path) -> int | None:
    """Limit less usage, or None where there is no limit (v2's "max", v1's huge number) or no files."""
    try:
        limit_text = limit_path.read_text().strip()
        usage = int(usage_path.read_text().strip())
        limit = int(limit_text)
    except (OSError, ValueError):  # (not there, or "max")
        return None
    if limit >= 1 << 60:
        return None
    return max(0, limit - usage)


def machine_load() -> dict[str, float]:
    """What distorts a measurement on a shared machine: the 1-minute load average per core, and
    the CPU time stolen by the hypervisor (cumulative jiffies; compare two readings)."""
    out = {
        "load_per_core": os.getloadavg()[0] / max(1, os.cpu_count() or 1),
        "steal_jiffies": 0.0,
        "total_jiffies": 0.0,
    }
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        out["total_jiffies"] = sum(fields)
        out["steal_jiffies"] = fields[7] if len(fields) > 7 else 0.0
    except (OSError, ValueError):
        pass
    return out


def steal_share(before: dict[str, float], after: dict[str, float]) -> float:
    """The share of CPU time the hypervisor took between two `machine_load` readings."""
    total = after["total_jiffies"] - before["total_jiffies"]
    return (after["steal_jiffies"] - before["steal_jiffies"]) / total if total > 0 else 0.0


def cpu_model() -> str:
    """The processor's marketing name (`platform.processor()` is empty on most Linux systems)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# The time constants that estimates use (run_size's seconds an op, the synthetic draw's seconds an
# element) were measured on one machine: a 2-core AMD EPYC (AVX2), quiet. SPEED_PROBE_REFERENCE_S is
# what `_speed_probe` took there (median of 5, `python -c "from klotski_sim.util.machine import
# _speed_probe; print(_speed_probe())"`); the ratio to what it takes here and now scales them, so an
# estimate is of this machine, under its present load, not of that one.
SPEED_PROBE_REFERENCE_S = 0.0051  # (4.7-6.3 ms over five processes, load 1.0 falling)


def _speed_probe() -> float:
    """Median seconds of a small mix of the interpreter and numpy work a simulation does."""
    import time

    import numpy as np

    samples = []
    for _ in range(5):
        t = time.perf_counter()
        total = 0
        for i in range(20_000):  # (the engine's event loop: Python calls and small objects)
            total += len((i, i + 1)) + (i & 7)
        a = np.arange(20_000, dtype=np.float64)
        for _ in range(20):  # (the generator's and the timeline's vector work)
            a = np.sqrt(a * 1.0001 + 1.0)
        samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


_slowdown: list[float] = []


def slowdown() -> float:
    """How many times longer work takes here, now, than on the machine the estimates' constants were
    measured on (at least 0.25: a fast machine's estimate is still not promised below a quarter).
    Measured once a process (about 0.1 s)."""
    if not _slowdown:
        _slowdown.append(max(0.25, _speed_probe() / SPEED_PROBE_REFERENCE_S))
    return _slowdown[0]
