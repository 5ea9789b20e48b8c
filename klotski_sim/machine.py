"""What this machine (the one running klotski, not the simulated one) has to spare.

Read from Linux's own accounting: `MemAvailable` (what can be allocated without swapping, page
cache included) and, inside a container, the cgroup's limit less its usage — a CI runner's or a
notebook server's limit is usually far below the host's. Where neither can be read (macOS,
Windows) the answer is None: a caller then refuses nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
_CGROUP_LIMITS = (  # (limit, usage): cgroup v2, then v1
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
)


def available_memory_bytes() -> int | None:
    """Bytes this process may still allocate without swapping or being killed: the smaller of
    `MemAvailable` and the cgroup's limit less its usage; None where neither is known."""
    found = [_mem_available(), _cgroup_room()]
    known = [b for b in found if b is not None]
    return min(known) if known else None


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
    for limit_path, usage_path in _CGROUP_LIMITS:
        try:
            limit_text = limit_path.read_text().strip()
            usage = int(usage_path.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":  # (v2: no limit)
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            return None
        if limit >= 1 << 60:  # (v1 says "no limit" with a huge number)
            return None
        return max(0, limit - usage)
    return None
