"""`klotski-runtime`: the real side — record routing traces from local checkpoints.

Bad input ends with a one-line `error:` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from klotski_sim.trace import TraceError

from .record import RecordError, read_texts, record, save_tiny_mixtral


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_record(args: argparse.Namespace) -> int:
    texts = read_texts(args.text)
    trace = record(args.model_dir, texts, max_tokens=args.max_tokens, gen_len=args.gen_len, device=args.device,
                   dataset=args.dataset or Path(args.text).name, model_name=args.model_name)
    trace.save(args.out)
    print(f"wrote {args.out}: {trace.num_sequences} sequences, {len(trace.experts)} tokens, "
          f"{trace.num_layers} layers, top-{trace.top_k} of {trace.num_experts} experts ({trace.meta['recorder']})")
    return 0


def cmd_tiny_checkpoint(args: argparse.Namespace) -> int:
    path = save_tiny_mixtral(args.out, seed=args.seed)
    print(f"wrote a tiny random Mixtral checkpoint to {path}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="klotski-runtime", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("record", help="record a routing trace from a local Hugging Face MoE checkpoint")
    p.add_argument("--model-dir", required=True, metavar="DIR", help="checkpoint directory (config.json + weights)")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text; blank-line separated paragraphs "
                                                                 "are sequences")
    p.add_argument("--max-tokens", type=_positive_int, default=512, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--gen-len", type=int, default=32, help="greedy tokens generated per sequence (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--dataset", help="dataset name for the provenance (default: the text file's name)")
    p.add_argument("--model-name", help="model name recorded in the trace, e.g. a klotski-sim preset "
                                        "(default: the checkpoint directory's name)")
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write (.npz)")
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("tiny-checkpoint", help="save a tiny random Mixtral checkpoint (for trying record/validate)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.func
    try:
        return handler(args)
    except (RecordError, TraceError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
