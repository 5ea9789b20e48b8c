"""What this machine has, as Linux tells it (/proc, /sys/fs/cgroup): memory available to this
process and its own resident size. 0 where the platform does not say: each caller decides what
unknown means."""

from __future__ import annotations

import os
from pathlib import Path

_NO_LIMIT = 1 << 60  # (cgroup v1 writes "no limit" as a number near 2**63)


def host_memory(field: str = "MemAvailable", root: Path = Path("/")) -> int:
    """A /proc/meminfo field in bytes (`MemAvailable`, `MemTotal`); 0 when unknown."""
    try:
        with open(root / "proc" / "meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def available_memory(root: Path = Path("/")) -> int:
    """The memory this process may still take: the machine's available memory, or less where its
    control group's limit leaves less (cgroup v2's memory.max, or v1's memory.limit_in_bytes, less
    what the group uses: in a container the machine's figure overstates it). 0 when unknown."""
    available = host_memory(root=root)
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return available
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2
            group, limit_name, usage_name = root / "sys/fs/cgroup" / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            group = root / "sys/fs/cgroup/memory" / path.lstrip("/")
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        try:
            limit_text = (group / limit_name).read_text().strip()
            usage = int((group / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < _NO_LIMIT:
            left = max(0, int(limit_text) - usage)
            available = min(available, left) if available else left
    return available


def resident_bytes() -> int:
    """This process's resident memory in bytes (/proc/self/statm); 0 when unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
