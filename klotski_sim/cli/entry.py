"""The console scripts (`klotski-sim`, `klotski-runtime`): a stop is taken from the process's first
instant. A command's own handler (`cli.guarded`) is set once its module is imported, half a second
in (numpy, pydantic, the policies); a Ctrl-C before that would end in a KeyboardInterrupt traceback,
a SIGTERM or SIGHUP silently. This module imports nothing heavy before taking them."""

from __future__ import annotations

import importlib

from klotski_sim.util.stopping import restore_stops, stopped, take_stops


def run_main(module: str) -> int:
    """Import `module` with the stops taken, then run its `main()`."""
    _, replaced = take_stops()
    try:
        return importlib.import_module(module).main()  # (its command takes the stops itself, in turn)
    except KeyboardInterrupt as stop:  # (one before, or between the import and the command's handler)
        return stopped(stop)
    finally:
        restore_stops(replaced)


def simulator() -> int:
    return run_main("klotski_sim.cli.main")


def runtime() -> int:
    return run_main("klotski_runtime.cli")
