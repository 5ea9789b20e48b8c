"""Command-line value types shared by both CLIs: each refuses a bad value with a message that
argparse prints next to the flag's name (`argument --batch-size: expected a positive integer`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Sequence


class OneLineParser(argparse.ArgumentParser):
    """A bad argument ends in one `error:` line naming the flag and exit status 2, as every other
    bad input does (argparse would print its usage block first; `-h` still shows it). Flags are
    never abbreviated: `--policy` must not silently mean `--policy-file` where there is no `--policy`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.given: dict[str, tuple[str, Any]] = {}  # dest -> (flag, value) of this parse's single-value flags

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        self.given = {}  # (a parser is reused: the CLIs run in-process in tests and notebooks)
        return super().parse_known_args(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


class _StoreOnce(argparse._StoreAction):
    """A flag that takes one value refuses a second (`--ctx 1024 --ctx 2048`): argparse keeps the
    last one without a word, so a value typed early in a long command line would be dropped
    silently. Flags meant to repeat are declared `append`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        given = getattr(parser, "given", None)
        if option is not None and given is not None:
            if self.dest in given:
                first_flag, first = given[self.dest]
                parser.error(
                    f"argument {option}: given twice ({first_flag} {first}, then {option} {_as_typed(values)}); give it once"
                )
            given[self.dest] = (option, _as_typed(values))
        super().__call__(parser, namespace, values, option)


def _as_typed(value: Any) -> str:
    """A parsed flag value as a command line shows it (a comma-separated list parsed into a list)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def plain_int(text: str) -> int:
    """An integer written with ASCII digits and an optional sign (Python's `int` also takes `3_0`
    and other scripts' digits, which a command line should not)."""
    body = text.strip()
    if not body.lstrip("+-").isascii() or not body.lstrip("+-").isdigit() or body.count("-") + body.count("+") > 1:
        raise ValueError(f"not an integer: {text!r}")
    return int(body)


# The largest count a run takes (batch size, batches, prompt or generated tokens, sequences): larger
# ones overflow the 64-bit arithmetic of the planner and the generator, and no workload comes within
# a thousand-fold of it.
MAX_COUNT = (1 << 31) - 1
MAX_COUNT_TEXT = "2**31 - 1"
# The most worker processes a command starts (far more fail in the process pool's locks).
MAX_WORKERS = 1024


def _int_from(text: str, low: int, what: str, high: int | None = None) -> int:
    try:
        value = plain_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _count(text: str, low: int, what: str) -> int:
    value = _int_from(text, low, what)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected {what} up to {MAX_COUNT_TEXT}, got {value}")
    return value


def positive_int(text: str) -> int:
    """A count from 1 to MAX_COUNT."""
    return _count(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """A count from 0 to MAX_COUNT."""
    return _count(text, 0, "an integer >= 0")


def workers_int(text: str) -> int:
    """A number of worker processes, from 1 to MAX_WORKERS."""
    return _int_from(text, 1, f"a number of workers from 1 to {MAX_WORKERS}", high=MAX_WORKERS)


MAX_SEED = (1 << 63) - 1  # numpy's and torch's generators take seeds up to this (torch overflows beyond)


def seed_int(text: str) -> int:
    """A seed the simulator and the runtime both take: numpy's and torch's generators (torch's needs
    it to fit in 64 bits; a larger one, which the simulator accepts, would crash the runtime)."""
    return _int_from(text, 0, "a seed from 0 to 2**63 - 1", high=MAX_SEED)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high` (a count the machine can honour, e.g. threads)."""
    return lambda text: _int_from(text, low, f"an integer from {low} to {high}", high)


def layers_or_fill(text: str) -> int | str:
    """Layers kept whole on the GPU: a count, or `fill` (as many as the memory n batches leave allows)."""
    return "fill" if text == "fill" else _int_from(text, 0, "an integer >= 0 or fill")


def path_arg(text: str) -> str:
    """A file or folder the command reads (or names): not an empty name, which the file system
    reads as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name or a path, got an empty one")
    return text


def name_list(text: str) -> list[str]:
    """A comma-separated list of names: at least one, none twice."""
    names = [n.strip() for n in text.split(",")]
    if not any(names) or "" in names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    twice = first_repeat(names)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"{twice!r} is given twice")
    return names


def first_repeat(values: Sequence[Any]) -> Any | None:
    """The first value that appears again in `values` (None: each is there once), equal values
    counting as one (`2e10` and `20000000000`). A set, where a value hashes: looking back through
    the list is quadratic (a sweep axis of 80,000 values would take 24 s to read)."""
    seen: set[Any] = set()
    unhashable: list[Any] = []  # (an option's value may be a list or a mapping)
    for value in values:
        try:
            if value in seen:
                return value
            seen.add(value)
        except TypeError:
            if value in unhashable:
                return value
            unhashable.append(value)
    return None


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN, infinities, zero and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def bounded_float(low: float, high: float) -> Callable[[str], float]:
    """A finite number from `low` to `high` (a quantity the machine can have, e.g. GiB of RAM)."""

    def parse(text: str) -> float:
        value = positive_float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a number from {low:g} to {high:g}, got {text!r}")
        return value

    return parse


def batches(text: str) -> int | None:
    """A batch count, or `auto` for the planner's choice."""
    return None if text == "auto" else positive_int(text)
