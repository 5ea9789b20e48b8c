"""The quantile table of a request-length CSV, as klotski_sim/serving/data/*.json ships it.

    python experiments/length_quantiles.py LENGTHS.csv PROMPT_COLUMN OUTPUT_COLUMN NAME "SOURCE" OUT.json
    python experiments/length_quantiles.py --quick    (a small made-up CSV, into a temporary folder)

made klotski_sim/serving/data/sharegpt4-sarathi.json from microsoft/sarathi-serve
data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv @72339db5 (sha256 6d6c2963...):

    python experiments/length_quantiles.py sharegpt_8k_filtered_stats_llama2_tokenizer.csv \
        num_prefill_tokens num_decode_tokens sharegpt4-sarathi "..." klotski_sim/serving/data/sharegpt4-sarathi.json
"""

from __future__ import annotations

import csv
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

PROBABILITIES = [round(i / 100, 2) for i in range(101)]


def table(values: np.ndarray) -> list[list[float | int]]:
    # rounded half up (a quantile between two whole lengths), never below one token
    quantiles = np.quantile(values, PROBABILITIES, method="linear")
    return [[p, max(1, int(np.floor(q + 0.5)))] for p, q in zip(PROBABILITIES, quantiles)]


def main(argv: list[str]) -> int:
    if argv == ["--quick"]:
        folder = Path(tempfile.mkdtemp())
        rng = np.random.default_rng(0)
        rows = "\n".join(f"{a},{b}" for a, b in zip(rng.integers(1, 500, 300), rng.integers(1, 200, 300)))
        (folder / "l.csv").write_text("p,o\n" + rows + "\n")
        argv = [str(folder / "l.csv"), "p", "o", "quick", "made up", str(folder / "q.json")]
    path, prompt_col, output_col, name, source, out = argv
    data = Path(path).read_bytes()
    rows = list(csv.DictReader(data.decode().splitlines()))
    prompts = np.array([int(r[prompt_col]) for r in rows])
    outputs = np.array([int(r[output_col]) for r in rows])
    result = {
        "name": name,
        "source": f"{source} ({len(rows):,} requests; sha256 {hashlib.sha256(data).hexdigest()[:16]}; quantiles by "
        f"experiments/length_quantiles.py)",
        "prompt_mean": round(float(prompts.mean()), 2),
        "output_mean": round(float(outputs.mean()), 2),
        "prompt_quantiles": table(prompts),
        "output_quantiles": table(outputs),
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{name}: {len(rows):,} requests, prompt mean {prompts.mean():.1f} P50 {np.median(prompts):.0f} max "
        f"{prompts.max()}, output mean {outputs.mean():.1f} P50 {np.median(outputs):.0f} max {outputs.max()} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
