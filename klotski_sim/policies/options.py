"""Policy options as typed dataclasses: one place that says each option's type, choices, range and
meaning, from which `--option` validation, `klotski-sim policies NAME` and the error messages are
all generated.

A policy declares its own switches as a frozen dataclass whose fields are made with `option()`:

    @dataclass(frozen=True)
    class FlexGenOptions:
        overlap: str = option("code", "when the next layer's load may start", choices=("code", "model"))

Plugins may still pass a plain `defaults={"slots": 8}` dict to `register`; its types are then taken
from the default values (an int option takes whole numbers, a float option any finite number).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Mapping, get_type_hints

from klotski_sim.policies.cache import CACHE_POLICIES
from klotski_sim.util.errors import UsageError

_KINDS = (bool, int, float, str)


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    """A dataclass field that is a policy option (typed by its annotation)."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum, "maximum": maximum})


@dataclass(frozen=True)
class OptionSpec:
    """One option: what `--option NAME=VALUE` accepts and what it means."""

    name: str
    default: Any
    help: str
    kind: type
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None

    def with_default(self, default: Any) -> "OptionSpec":
        """The same option with another default (a policy that shares an options class)."""
        spec = OptionSpec(self.name, default, self.help, self.kind, self.choices, self.minimum, self.maximum)
        spec.check("", default)  # a default outside its own range is the policy author's typo
        return spec

    def accepts(self) -> str:
        """What a value must be, in words (`one of code, model`; `a whole number >= 1`)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        noun = "a whole number" if self.kind is int else "a number" if self.kind is float else "a string"
        if self.minimum is not None and self.maximum is not None:
            return f"{noun} from {self.minimum:g} to {self.maximum:g}"
        if self.minimum is not None:
            return f"{noun} >= {self.minimum:g}"
        return noun

    def check(self, who: str, value: Any) -> None:
        """Refuse a value this option cannot take, in one line naming `who` (a policy) and the option."""
        if self.kind is bool or isinstance(value, bool):
            ok = isinstance(value, bool) and self.kind is bool
        elif self.kind is int:
            ok = isinstance(value, int)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and math.isfinite(value)
        else:
            ok = isinstance(value, self.kind)
        if ok and self.choices:
            ok = value in self.choices
        if ok and self.minimum is not None:
            ok = value >= self.minimum
        if ok and self.maximum is not None:
            ok = value <= self.maximum
        if not ok:
            prefix = f"policy {who!r}: " if who else ""
            raise UsageError(f"{prefix}option {self.name} must be {self.accepts()}, got {value!r}")


def specs_of(options: type) -> tuple[OptionSpec, ...]:
    """The options an `option()`-field dataclass declares, in field order."""
    if not (isinstance(options, type) and is_dataclass(options)):
        raise UsageError(f"options must be a dataclass whose fields are option(...), got {options!r:.80}")
    hints = get_type_hints(options)
    out = []
    for f in fields(options):
        kind = hints[f.name]
        if kind not in _KINDS:
            raise UsageError(f"option {options.__name__}.{f.name}: type must be bool, int, float or str, got {kind}")
        if f.default is MISSING:
            raise UsageError(f"option {options.__name__}.{f.name} has no default")
        meta = f.metadata
        spec = OptionSpec(
            f.name,
            f.default,
            meta.get("help", ""),
            kind,
            meta.get("choices", ()),
            meta.get("minimum"),
            meta.get("maximum"),
        )
        spec.check(options.__name__, f.default)
        out.append(spec)
    return tuple(out)


def specs_from_defaults(defaults: Mapping[str, Any]) -> tuple[OptionSpec, ...]:
    """Options given as a plain `{name: default}` dict (a plugin's): typed by their defaults."""
    out = []
    for name, default in defaults.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"option name {name!r}: use letters, digits and '_'")
        kind = next((k for k in _KINDS if type(default) is k), None)
        if kind is None:
            raise UsageError(f"option {name}: default must be a bool, int, float or string, got {default!r:.80}")
        out.append(OptionSpec(name, default, "", kind))
    return tuple(out)


@dataclass(frozen=True)
class GenericOptions:
    """Options every policy has: the emitter carries them out, whatever the schedule."""

    expert_cache: int = option(
        0, "GPU slots of an expert cache kept across steps (0: none); a hit skips the expert's load", minimum=0
    )
    cache_policy: str = option("lru", "which expert the cache evicts", choices=CACHE_POLICIES)
    attention_device: str = option(
        "gpu",
        "where decode attention runs; cpu reads the KV cache in host memory (needs --kv cpu)",
        choices=("gpu", "cpu"),
    )


GENERIC_SPECS = specs_of(GenericOptions)
