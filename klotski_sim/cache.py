"""An on-disk cache of synthetic routing traces, so that runs of the same workload in other
processes (sweep workers, repeated CLI runs) do not generate the same trace again.

A trace is stored under a hash of everything that determines it — the model's shape, the routing
kind, the seed, the sizes and the generator's own code — so a changed generator never serves an
old trace. Files are written atomically (a per-process temp name, then a rename) and read back
uncompressed. `KLOTSKI_CACHE_DIR` sets the folder (default `~/.cache/klotski`); `off` disables it.
A cache that cannot be written is simply not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from .model import ModelSpec
from .trace import Trace


def cache_dir() -> Path | None:
    setting = os.environ.get("KLOTSKI_CACHE_DIR", "")
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "klotski"


def _generator_fingerprint() -> str:
    code = (resources.files("klotski_sim") / "trace_synth.py").read_bytes()
    return hashlib.sha1(code).hexdigest()[:12]


def cached_trace(model: ModelSpec, routing: str, seed: int, sequences: int, prompt_len: int, gen_len: int,
                 make: Callable[[], Trace]) -> Trace:
    """The synthetic trace for these inputs: from the cache when it is there, else made and stored."""
    folder = cache_dir()
    if folder is None:
        return make()
    key = json.dumps({"model": asdict(model), "routing": routing, "seed": seed, "sequences": sequences,
                      "prompt_len": prompt_len, "gen_len": gen_len, "code": _generator_fingerprint()},
                     sort_keys=True)
    path = folder / "traces" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return Trace(z["experts"], z["seq_offsets"], z["prompt_lens"], meta)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not there yet, or unreadable (a truncated file is a ValueError/BadZipFile): make it
    trace = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, experts=trace.experts, seq_offsets=trace.seq_offsets, prompt_lens=trace.prompt_lens,
                     meta=np.array(json.dumps(dict(trace.meta))))
        os.replace(tmp, path)
    except OSError:
        pass
    return trace
