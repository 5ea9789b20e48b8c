"""Writing a run's routing (`routing.npz`, what `klotski-sim simulate --out` writes for the runtime)
and a trace: numpy's `savez_compressed` (zlib's default level 6; int16 ids, as klotski 0.1 wrote
routing files) against `npzfile.write_npz` (deflate level 1; ids in a byte up to 256 experts), on
the same arrays in one run: seconds, megabytes and the ratio. Both files are read back and compared.

    python experiments/bench_npz.py [--prompt-len 4096] [--gen-len 8] [--repeat 3] [--quick]

`--quick` (for tests): the first 2 of Mixtral-8x7B's layers, prompt 128, 2 generated tokens, each
writer once.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from klotski_sim.files.npzfile import write_npz
from klotski_sim.runs.runner import RunSpec, prepare
from klotski_sim.workload.routing import expert_id_type


def best_seconds(write, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        write()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 layers, prompt 128, gen 2, once (seconds)")
    args = parser.parse_args()
    model = "mixtral-8x7b:2" if args.quick else "mixtral-8x7b"
    if args.quick:
        args.prompt_len, args.gen_len, args.repeat = 128, 2, 1
    prep = prepare(
        RunSpec(
            model=model,
            policy="klotski",
            impl="ideal",
            num_batches=None,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
        )
    )  # (n from the planner, as the CLI chooses it)
    routing = prep.replay.routing
    ids = routing.ids
    print(
        f"routing of the default Klotski run of {model} at prompt {args.prompt_len}, gen {args.gen_len} "
        f"(n = {prep.num_batches}): ids {ids.shape}, {ids.size * 2 / 1e6:.1f} MB as int16"
    )
    with tempfile.TemporaryDirectory() as tmp:
        old, new = Path(tmp) / "old.npz", Path(tmp) / "new.npz"
        t_old = best_seconds(lambda: np.savez_compressed(old, ids=ids.astype(np.int16)), args.repeat)
        t_new = best_seconds(
            lambda: write_npz(new, {"ids": ids.astype(expert_id_type(routing.num_experts))}), args.repeat
        )
        with np.load(old) as a, np.load(new) as b:
            same = np.array_equal(a["ids"], b["ids"].astype(np.int16))
        mb_old, mb_new = old.stat().st_size / 1e6, new.stat().st_size / 1e6
    print(f"numpy savez_compressed, int16   : {t_old:6.2f} s  {mb_old:7.1f} MB")
    print(
        f"write_npz level 1, {np.dtype(expert_id_type(routing.num_experts)).name:5} ids   : "
        f"{t_new:6.2f} s  {mb_new:7.1f} MB"
    )
    print(
        f"ratio                           : {t_old / t_new:6.1f}x faster, file {mb_new / mb_old:.2f}x the size; "
        f"same ids: {same}"
    )


if __name__ == "__main__":
    main()
