"""What the commands share: their one-line error, `KEY=VALUE` flags, and the output folder made (and
removed again when empty, after an error) for a command's files."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Sequence

from klotski_sim.files.outfiles import temporary_beside
from klotski_sim.util.errors import KlotskiError
from klotski_sim.util.machine import available_cores
from klotski_sim.util.stopping import signals_deferred
from klotski_sim.util.units import counted
from klotski_sim.workload.trace_synth import DEFAULT_ROUTING


class CliError(KlotskiError):
    """A user-facing error: printed as one line, exit status 2."""


def parse_overrides(items: Sequence[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs of `flag` (--set, --option); values are JSON when they parse as JSON."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> the item as typed (`=1e9`, not `=1000000000.0`)
    for item in items:
        if "=" not in item:
            raise CliError(f"{flag}: expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key or not value.strip():  # (refused, not taken as the text "")
            raise CliError(f"{flag} {item}: expected KEY=VALUE with both given")
        if key in out:  # (else the last one silently wins)
            raise CliError(f"{flag} {key} is given twice ({given[key]} and {item.strip()})")
        given[key] = item.strip()
        try:
            out[key] = json.loads(value)
        except ValueError:  # (not JSON, or a number too long for an int: the text as it is)
            out[key] = value
    return out


def add_option_argument(parser: argparse.ArgumentParser, metavar: str, help: str) -> None:
    """`--option` (repeatable, into `args.options`): simulate's KEY=VALUE, compare's and serve's
    POLICY.KEY=VALUE (`per_policy_options` reads those)."""
    parser.add_argument("--option", dest="options", action="append", default=[], metavar=metavar, help=help)


def per_policy_options(
    items: Sequence[str], policies: Sequence[str], what: str = "served"
) -> dict[str, dict[str, Any]]:
    """`--option POLICY.KEY=VALUE` pairs, by policy: each names one of `policies` (serve's,
    compare's), refused in one line otherwise."""
    out: dict[str, dict[str, Any]] = {p: {} for p in policies}
    for key, value in parse_overrides(items, "--option").items():
        policy, _, name = key.rpartition(".")
        if policy not in out:
            raise CliError(f"--option {key}: name a policy being {what} as POLICY.KEY ({', '.join(policies)})")
        out[policy][name] = value
    return out


# the folders the running command made for its output, resolved (`..` and links followed); set by `guarded`
made_folders: ContextVar[list[Path] | None] = ContextVar("made_folders", default=None)


def remove_empty_made_folders() -> None:
    """After an error or a stop: the output folders this command made and left empty, with the
    parents it made for them, deepest first (so that a refused run leaves no empty folder behind;
    `--out a/x/../y` makes `a`, `a/x` and `a/y`)."""
    made = made_folders.get() or []
    for folder in sorted(set(made), key=lambda folder: len(folder.parts), reverse=True):
        try:
            folder.rmdir()  # (only an empty one)
        except OSError:
            pass
    made.clear()


def leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of a command line's commands (those without subcommands of their own)."""
    subs = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    seen: dict[int, argparse.ArgumentParser] = {}
    for action in subs:
        for sub in action.choices.values():
            for leaf in leaf_parsers(sub):
                seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def output_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """The folder a command writes to, made and checked before any work: a simulation is not run
    only to find that its results cannot be written."""
    if not str(path).strip():  # (Path("") is the current folder)
        raise CliError(f"{flag}: expected a folder, got an empty name")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CliError(f"{flag} {out}: exists and is not a folder")
    made, missing = [], out  # (the folders this makes: `out` and its missing parents, as written)
    while not missing.exists() and missing.parent != missing:
        made.append(missing)
        missing = missing.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CliError(f"{flag} {out}: cannot create the folder ({err.strerror or err})") from None
    tracked = made_folders.get()
    if tracked is not None:
        tracked.extend(folder.resolve() for folder in made)  # (`x/..` is the folder above `x`: made once)
    try:
        with signals_deferred():  # (a stop in between would leave the probe behind)
            temporary_beside(out, ".klotski-write-test-", "").unlink()
    except OSError as err:
        raise CliError(f"{flag} {out}: cannot write there ({err.strerror or err})") from None
    return out


def routing_kind(routing: str | None, trace: str | None) -> str:
    """The synthetic routing a run draws (--routing, else the default). A trace replays its own
    routing: --routing beside --trace would be ignored, so the pair is refused."""
    if routing is not None and trace is not None:
        raise CliError(f"--routing {routing} and --trace {trace}: a trace replays its own routing; give one of them")
    return DEFAULT_ROUTING if routing is None else routing


def not_an_input(out: Path, flag: str, reads: Sequence[str | os.PathLike]) -> None:
    """Refuse writing where the command reads (`trace stats t.npz --csv t.npz` would replace the
    trace with its table). A folder it reads (a checkpoint) is read whole: none of its files may be
    replaced."""
    for read in reads:
        source = Path(read)
        try:
            same = out.exists() and source.exists() and os.path.samefile(out, source)
        except OSError:
            same = False
        if same or out.resolve() == source.resolve():
            raise CliError(f"{flag} {out}: is what this command reads ({read}); writing there would replace it")
        if source.is_dir() and out.exists() and out.resolve().is_relative_to(source.resolve()):
            raise CliError(
                f"{flag} {out}: is a file of {read}, which this command reads; writing there would replace it"
            )


def output_file(path: str | os.PathLike, flag: str = "--out", reads: Sequence[str | os.PathLike] = ()) -> Path:
    """A file a command will write, checked before any work (not after a whole table or a
    calibration): not a folder, in a folder that exists and can be written, not a device or a
    pipe (the file is written whole beside it and renamed onto it: `write_file`), and none of the
    files it `reads`."""
    if not str(path).strip():
        raise CliError(f"{flag}: expected a file name, got an empty one")
    out = Path(path)
    try:
        out.exists()
    except OSError as err:  # (a name too long for the file system: the check itself fails)
        raise CliError(f"{flag} {str(path)[:80]}: {err.strerror or err}") from None
    not_an_input(out, flag, reads)
    if out.is_dir():
        raise CliError(f"{flag} {out}: is a folder; give a file name")
    if out.exists() and not out.is_file():  # (the rename onto it would fail only after the work)
        raise CliError(f"{flag} {out}: not a regular file (a device, a pipe or a socket); give a file name")
    folder = out.resolve().parent
    if not folder.is_dir():
        raise CliError(f"{flag} {out}: {folder} {'is not a folder' if folder.exists() else 'does not exist'}")
    if not os.access(folder, os.W_OK):
        raise CliError(f"{flag} {out}: cannot write in {folder}")
    return out


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def local_workers(args: argparse.Namespace) -> None:
    """`--workers` held to the cores this process may use, where the workers are its own processes
    (not a remote Dask cluster's), said on stderr: the runs are CPU-bound, so more workers than cores
    finish no sooner and each takes its own memory (~100 MB a process)."""
    cores = available_cores()
    remote = getattr(args, "dask", None) not in (None, "local")
    if args.workers is not None and args.workers > cores and not remote:
        note(
            f"--workers {args.workers}: this process may use {cores} core(s); running {counted(cores, 'worker')} "
            f"(the runs are CPU-bound: more would finish no sooner, each taking its own memory)"
        )
        args.workers = cores
