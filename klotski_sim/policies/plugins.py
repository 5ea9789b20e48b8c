"""Policies from outside the package: a Python file (`--policy-file my_policy.py`) or an installed
package's entry point in the group `klotski.policies`. Either one registers its policy with
`klotski_sim.policies.register`, and from then on it is a policy like the built-in ones: in
`simulate`, `compare --policies`, sweeps (`policy_files:`) and the runtime's `validate`.
docs/own-schedule.md walks through an example.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from klotski_sim.policies.base import POLICIES, line_in
from klotski_sim.util.errors import KlotskiError, UsageError
from klotski_sim.util.stopping import stop_received
from klotski_sim.util.terminal import one_line
from klotski_sim.util.timelimit import PolicyTimeout, policy_time_limit

ENTRY_POINT_GROUP = "klotski.policies"
_loaded: dict[str, list[str]] = {}  # resolved path -> the policies it registered


def load_policy_file(path: str | Path) -> list[str]:
    """Import a file that registers policies (once per process); returns their names. A missing
    file, a syntax error or an exception while importing is one line naming the file and line."""
    p = Path(path)
    if not p.is_file():
        why = (
            "is a folder, not a Python file"
            if p.is_dir()
            else "not a regular file (a device or a pipe?), not a Python file"
            if p.exists()
            else "no such file"
        )
        raise UsageError(f"--policy-file {path}: {why}")
    key = str(p.resolve())
    if key in _loaded:
        return _loaded[key]
    before = dict(POLICIES)
    module_name = "klotski_policy_file_" + hashlib.sha1(key.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise UsageError(f"--policy-file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with policy_time_limit(f"{path}: importing it"):
            spec.loader.exec_module(module)
    except SyntaxError as err:
        sys.modules.pop(module_name, None)
        where = f"{path}:{err.lineno}" if err.lineno else str(path)  # (a binary file has no line)
        raise UsageError(f"{where}: syntax error: {err.msg}") from None
    except PolicyTimeout:
        sys.modules.pop(module_name, None)
        raise
    except KlotskiError as err:
        sys.modules.pop(module_name, None)
        raise UsageError(f"{path}: {err}") from None
    except KeyboardInterrupt as err:  # (the file's own raise, not Ctrl-C: named as any other exception is)
        sys.modules.pop(module_name, None)
        if stop_received():
            raise
        found = line_in(err, p)
        line = f":{found}" if found is not None else ""
        raise UsageError(
            f"{path}{line}: raises {type(err).__name__} while being imported (no stop was received); a policy "
            f"file only registers policies"
        ) from None
    except (Exception, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - the user's file: name where it failed
        sys.modules.pop(module_name, None)
        found = line_in(err, p)
        line = f":{found}" if found is not None else ""
        if isinstance(err, SystemExit):  # (else the command would end there, with no word of why)
            raise UsageError(
                f"{path}{line}: exits (sys.exit({err.code!r})) while being imported; a policy file "
                f"only registers policies"
            ) from None
        raise UsageError(f"{path}{line}: {type(err).__name__}: {err}") from err
    touched = sorted(name for name, info in before.items() if POLICIES.get(name) is not info)
    if touched:  # (a file that replaces a policy, e.g. `klotski`, is refused and the registry put back)
        POLICIES.clear()
        POLICIES.update(before)
        raise UsageError(
            f"{path}: replaces or removes the registered policy {touched[0]!r} (register yours under another name)"
        )
    added = sorted(set(POLICIES) - set(before))
    if not added:
        raise UsageError(f"{path}: registers no policy (decorate a build function with klotski_sim.policies.register)")
    _loaded[key] = added
    return added


def load_policy_files(paths: Iterable[str | Path]) -> list[str]:
    return [name for path in paths for name in load_policy_file(path)]


def load_entry_points() -> list[str]:
    """Policies of installed packages (entry point group `klotski.policies`, each naming a module
    that registers policies when imported)."""
    from importlib.metadata import entry_points

    before = set(POLICIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except KlotskiError:
            raise
        except (Exception, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - an installed plugin that does not import
            raise UsageError(
                f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP} does not load: "
                f"{type(err).__name__}: {err}"
            ) from None if isinstance(err, SystemExit) else err
    return sorted(set(POLICIES) - before)


class PolicyName(str):
    """A policy named on the command line: parsed as any text, checked once the command's own
    `--policy-file`s are loaded (after argparse has accepted the whole command line, so that a
    policy file is run only by a command that takes it, and only when the rest of its arguments
    are right)."""


def policy_name(text: str) -> PolicyName:
    return PolicyName(text)


def load_for_command_line(argv: Sequence[str]) -> int | None:
    """Both CLIs, before building their parsers: installed policies (the entry points of packages
    installed into this environment). A bad one is one `error:` line and exit status 2 (None: all
    loaded); `--debug` shows its traceback. `--policy-file`s are the parsed command's
    (`load_for_command`)."""
    try:
        load_entry_points()
    except KlotskiError as err:
        if "--debug" in argv:
            raise
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    return None


def load_for_command(args: Any) -> None:
    """After parsing: the command's own `--policy-file`s run (a command without the flag runs
    none), then each policy it names (a `PolicyName`) checked against what is registered."""
    load_policy_files(getattr(args, "policy_file", None) or [])
    value = getattr(args, "policy", None)
    if isinstance(value, PolicyName) and value not in POLICIES:
        raise UsageError(
            f"--policy {value}: unknown policy; policies: {', '.join(POLICIES)} (your own: --policy-file FILE.py)"
        )
