"""An on-disk cache of synthetic routing traces, so that runs of the same workload in other
processes (sweep workers, repeated CLI runs) do not generate the same trace again.

A trace is stored under a hash of everything that determines it — the model's shape, the routing
kind, the seed, the sizes and the generator's own code — so a changed generator never serves an
old trace. Files are written atomically (`npzfile.write_npz`: a per-process temp name, then a
rename) and stored uncompressed, ids in a byte up to 256 experts, so that a run maps the ids
rather than reading them (`mapped.py`: a long prompt's routing is not held whole). `KLOTSKI_CACHE_DIR` sets the
folder (default `~/.cache/klotski`); `off` disables it. A cache that cannot be written is simply
not used.

The cache is bounded: `KLOTSKI_CACHE_MAX_GB` (default 2) caps its traces; the least recently used
go first, and a trace larger than the cap is not kept (a sweep over seeds and prompt lengths left
709 traces, 14 GB, in a cache without a bound).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import UsageError
from .mapped import map_stored_array
from .model import ModelSpec
from .npzfile import write_npz
from .trace import Trace

DEFAULT_MAX_GB = 2.0


def cache_dir() -> Path | None:
    setting = os.environ.get("KLOTSKI_CACHE_DIR", "").strip()  # (" off" made a folder named " off")
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "klotski"


def cache_max_bytes() -> int:
    """The cap on the cache's traces, from `KLOTSKI_CACHE_MAX_GB` (GiB; default 2)."""
    setting = os.environ.get("KLOTSKI_CACHE_MAX_GB", "")
    try:
        gib = float(setting) if setting else DEFAULT_MAX_GB
    except ValueError:
        gib = float("nan")
    if not gib >= 0 or gib == float("inf"):
        raise UsageError(f"KLOTSKI_CACHE_MAX_GB={setting!r}: must be a number of GiB >= 0 (0 keeps no trace)")
    return int(gib * 2**30)


def _generator_fingerprint() -> str:
    code = (resources.files("klotski_sim") / "trace_synth.py").read_bytes()
    return hashlib.sha1(code).hexdigest()[:12]


def cached_trace(model: ModelSpec, routing: str, seed: int, sequences: int, prompt_len: int, gen_len: int,
                 make: Callable[[], Trace]) -> Trace:
    """The synthetic trace for these inputs: from the cache when it is there, else made and stored."""
    folder = cache_dir()
    if folder is None:
        return make()
    max_bytes = cache_max_bytes()
    key = json.dumps({"model": asdict(model), "routing": routing, "seed": seed, "sequences": sequences,
                      "prompt_len": prompt_len, "gen_len": gen_len, "code": _generator_fingerprint()},
                     sort_keys=True)
    path = folder / "traces" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.npz"
    try:
        experts = map_stored_array(path, "experts")  # (the largest part: its pages read as a run needs them)
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            trace = Trace(z["experts"] if experts is None else experts, z["seq_offsets"], z["prompt_lens"], meta)
        os.utime(path)  # (used now: the last to be evicted)
        return trace
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or unreadable (a truncated file is a ValueError/BadZipFile): make it
    trace = make()
    if trace.experts.nbytes > max_bytes:  # larger than the whole cache may be: not kept (and the cap applied)
        if path.parent.is_dir():
            evict(path.parent, max_bytes)
        return trace
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_npz(path, dict(experts=trace.experts, seq_offsets=trace.seq_offsets, prompt_lens=trace.prompt_lens,
                             meta=np.array(json.dumps(dict(trace.meta)))), level=None)  # (read back often)
        evict(path.parent, max_bytes, keep=path)
    except (OSError, UsageError):  # (a cache that cannot be written is not used)
        pass
    return trace


_OWN_NAME = re.compile(r"[0-9a-f]{20}\.npz")  # what `cached_trace` names a trace: its key's hash


def evict(folder: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Delete the least recently used traces in `folder` until they take at most `max_bytes`
    (never `keep`, the one just written). Only the cache's own files, by their hashed names, count
    and go: KLOTSKI_CACHE_DIR pointed at a project whose `traces/` held the user's own .npz files
    deleted them. Another process may evict the same file: that is fine."""
    entries = []
    for path in folder.glob("*.npz"):
        if not _OWN_NAME.fullmatch(path.name):
            continue
        try:
            info = path.stat()
        except OSError:
            continue
        entries.append((info.st_mtime, path, info.st_size))
    total = sum(size for _, _, size in entries)
    for _, path, size in sorted(entries):
        if total <= max_bytes:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
