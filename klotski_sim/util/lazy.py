"""pandas, imported when a module first reads one of its names: it takes 0.23 s of the CLI's
0.39 s start (`python -X importtime -c "import klotski_sim.cli.main"`), and a command that only runs
and summarises (`simulate` without `--out`, `plan`, `models`, `profiles`, an argument refused)
never needs it: a summary groups without it (klotski_sim/util/grouping.py)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for a module until a name of it is read, then forwards every read to it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # (called only for names this object lacks: the module's)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


pd: Any = LazyModule("pandas")
