"""Wall time and the peak of a command's whole process tree's resident memory (the sum over the
command and every process it starts, sampled every 10 ms): what the machine must hold, where
`/usr/bin/time` reports the largest single process. Linux only (/proc).

    python experiments/tree_memory.py klotski-sim simulate --policy klotski --out /tmp/out
"""

from __future__ import annotations

import subprocess
import sys
import time


def tree_resident_kb(root: int) -> int:
    """The resident memory of `root` and its descendants, in kB (processes that end meanwhile: skipped)."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                stack += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return total


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):  # (the command is everything after the script)
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) > 1 else 2)
    start = time.perf_counter()
    process = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_resident_kb(process.pid))
        time.sleep(0.01)
    print(f"{time.perf_counter() - start:.2f} s, process tree peak {peak / 1024:.0f} MB, exit {process.returncode}")


if __name__ == "__main__":
    main()
