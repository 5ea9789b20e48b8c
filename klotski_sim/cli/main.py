"""`klotski-sim`: simulate offloaded MoE inference schedules from the command line.

Every subcommand runs on built-in defaults (Mixtral-8x7B on an RTX 3090 profile); bad input
ends with a one-line `error:` message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Any, Callable, Sequence

from klotski_sim.cli.common import (
    leaf_parsers,
    made_folders,
    remove_empty_made_folders,
)
from klotski_sim.cli.parser import build_parser
from klotski_sim.files.outfiles import follow_symlinks
from klotski_sim.policies.plugins import load_for_command, load_for_command_line
from klotski_sim.util.argtypes import positive_float
from klotski_sim.util.errors import KlotskiError
from klotski_sim.util.stopping import restore_stops, stopped, take_stops
from klotski_sim.util.terminal import PrintableStream, one_line
from klotski_sim.util.timelimit import set_policy_timeout

RUNTIME_MODULES = ("torch", "transformers", "safetensors")  # the `runtime` extra's
RUNTIME_INSTALL = (
    "pip install 'klotski[runtime]' (from a checkout: pip install -e '.[runtime]'); on a machine "
    "without CUDA install the CPU build of torch first: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def guarded(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, run the subcommand, and turn the user's errors (KlotskiError, and OSError for files)
    into one `error:` line (exit 2). Anything else is a bug and shows its traceback; `--debug`
    shows the traceback of a user error too. What the command prints, argparse's words included,
    goes through `util.terminal.printable`: no control character of a user's reaches the terminal."""
    stderr, sys.stderr = sys.stderr, PrintableStream(sys.stderr)
    try:
        return _guarded(parser, argv)
    finally:
        sys.stderr = stderr


def _guarded(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    for leaf in leaf_parsers(parser):
        leaf.add_argument(  # (every command that writes: refused through a planted link unless asked)
            "--follow-symlinks",
            action="store_true",
            help="write an output whose name is a symbolic link through the link (refused otherwise)",
        )
        if any("--policy-file" in action.option_strings for action in leaf._actions):  # (a limit on its time)
            leaf.add_argument(
                "--policy-timeout",
                type=positive_float,
                metavar="SECONDS",
                help="stop a --policy-file's code (its import, each schedule it builds) after SECONDS, in one "
                "line (default: no limit)",
            )
    args = parser.parse_args(argv)
    follow_symlinks(args.follow_symlinks)
    set_policy_timeout(getattr(args, "policy_timeout", None))
    handler: Callable[[argparse.Namespace], int] = args.func
    made_token = made_folders.set([])
    stops, replaced = take_stops()
    if isinstance(sys.stdout, io.TextIOWrapper):  # (to a file or a pipe, lines as they are printed, not at the end)
        sys.stdout.reconfigure(line_buffering=True)
    stdout, sys.stdout = sys.stdout, ReaderMayGo(PrintableStream(sys.stdout))
    try:
        try:
            load_for_command(args)  # (the command's own policy files: only now that its command line is right)
            return handler(args)
        finally:
            stops.done = True  # (a stop from here on ends the process with its word: no traceback)
    except BrokenPipeError:  # a reader other than stdout's has gone (stdout's is `ReaderMayGo`'s)
        return 0
    except (KlotskiError, OSError) as err:
        remove_empty_made_folders()
        if getattr(args, "debug", False):
            raise
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        remove_empty_made_folders()
        return stopped(stop)
    except ModuleNotFoundError as err:
        if err.name not in RUNTIME_MODULES or getattr(args, "debug", False):
            raise
        remove_empty_made_folders()
        print(
            f"error: {err.name} is not installed, and this command runs models with it: {RUNTIME_INSTALL}",
            file=sys.stderr,
        )
        return 2
    except (MemoryError, RuntimeError) as err:  # (torch's allocators raise RuntimeError: "... can't allocate ...")
        if str(err).startswith("Symlink loop from ") and not getattr(args, "debug", False):
            # (a path given through a link that points back at itself: pathlib's resolve() on Python < 3.13;
            # from 3.13 it is an OSError, ELOOP, said above)
            print(
                f"error: {one_line(str(err).removeprefix('Symlink loop from '))}: a symbolic link that loops back "
                f"on itself",
                file=sys.stderr,
            )
            return 2
        if "can't start new thread" in str(err) and not getattr(args, "debug", False):  # (a process or memory limit)
            print(f"error: the machine refused another thread ({err}): ask for fewer --threads", file=sys.stderr)
            return 2
        if getattr(args, "debug", False) or not (isinstance(err, MemoryError) or "allocate" in str(err)):
            raise
        said = " ".join(str(err).split())[:200]
        print(
            f"error: out of memory{': ' + said if said else ''} (a smaller configuration, or --debug for where)",
            file=sys.stderr,
        )
        return 2
    finally:
        sys.stdout = stdout
        restore_stops(replaced)
        made_folders.reset(made_token)


class ReaderMayGo:
    """A command's stdout: once its reader has gone (`| true`, `| head` done reading), what it prints
    goes nowhere and the command goes on, rather than stopping at its first flushed line (a
    BrokenPipeError) before its files are written, silently, exit 0."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_nowhere()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_nowhere()

    def _to_nowhere(self) -> None:
        """The stream's file pointed at /dev/null (what it still buffers is flushed there, also at exit,
        where Python would say `Exception ignored ... BrokenPipeError`), or the stream replaced."""
        try:
            nowhere = os.open(os.devnull, os.O_WRONLY)
            os.dup2(nowhere, self._stream.fileno())
            os.close(nowhere)
        except (OSError, ValueError, AttributeError):  # (no file behind it: a test's capture)
            self._stream = open(os.devnull, "w")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    failed = load_for_command_line(argv)  # policies from outside first: --policy's choices must include them
    return failed if failed is not None else guarded(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
