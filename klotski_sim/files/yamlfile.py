"""Reading the YAML files a user hands us (profiles, sweep specs) without letting one of them
exhaust the machine: a size cap, and a cap on aliases (a "billion laughs" document expands
aliases of aliases into gigabytes; its events, counted first, are few)."""

from __future__ import annotations

from typing import Any

import yaml

from klotski_sim.util.errors import KlotskiError

MAX_BYTES = 1 << 20  # no profile or sweep spec comes near a megabyte
MAX_ALIASES = 100
# values a document holds once its aliases are expanded: 72 aliases nested 8 deep (a 382-byte sweep
# spec) make a list of 43 million, whose validation and error message run for minutes
MAX_VALUES = 100_000
# libyaml's parser where PyYAML has it (the same safe constructors; a profile parses in a sixth of the time)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(_SAFE_LOADER):  # type: ignore[valid-type,misc]
    """The safe loader, refusing a key given twice in one mapping (YAML keeps the last one silently:
    `models:` written twice would sweep only the second list). A merge key (`<<: *defaults`) is no
    key of the mapping: the keys it brings may be given again beside it, which is what it is for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # (constructing it fails: "no constructor for ...merge")
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                twice = key in seen
            except TypeError:  # an unhashable key: the base loader names it
                break
            if twice:  # (the error's mark: load_yaml names the line)
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        value = super().construct_yaml_int(node)
        _refuse_yaml11_number(node, value)
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        _refuse_yaml11_number(node, value)
        return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def _refuse_yaml11_number(node: yaml.ScalarNode, value: float) -> None:
    """A number that YAML 1.1 (PyYAML) reads otherwise than it looks, and than YAML 1.2 would: a
    leading zero makes it octal (`copy_engines: 010` is 8) and colons base 60 (`1:30` is 90)."""
    digits = node.value.replace("_", "").lstrip("+-")
    if ":" in digits:
        problem = "is a base-60 number in YAML 1.1"
    elif node.tag.endswith(":int") and len(digits) > 1 and digits[0] == "0" and digits[1] not in "xXbB":
        problem = "has a leading zero, which makes it octal in YAML 1.1"
    else:
        return
    raise yaml.constructor.ConstructorError(
        None,
        None,
        f"{node.value!r} {problem} (read as {value:g}); write the number in decimal, or quote it if it is text",
        node.start_mark,
    )


def load_yaml(text: str, where: str, error: type[KlotskiError] = KlotskiError) -> Any:
    """Parse `text` with the safe loader; `where` names the file in every error."""
    if len(text) > MAX_BYTES:
        raise error(f"{where}: {len(text):,} bytes is too large for a YAML file here (at most {MAX_BYTES:,})")
    try:
        aliases, values = _expanded_size(text)  # (before anything is built: counting costs no memory)
        if aliases > MAX_ALIASES:
            raise error(
                f"{where}: {aliases} YAML aliases (at most {MAX_ALIASES}): refused, it could expand without bound"
            )
        if values > MAX_VALUES:  # (a long list without aliases is not said to be "aliases that expand")
            held = f"its YAML aliases expand to {values:,} values" if aliases else f"it holds {values:,} values"
            raise error(f"{where}: {held} (at most {MAX_VALUES:,}): refused")
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise error(f"{where}{_line_of(err)}: not valid YAML ({_problem_of(err)})") from err
    except KlotskiError:
        raise
    except ValueError as err:  # (an integer of more than 4300 digits, which Python will not convert)
        raise error(f"{where}: not valid YAML here ({str(err).split(';')[0]})") from None


def _line_of(err: yaml.YAMLError) -> str:
    """`:LINE` of where the parser found the problem (the `file:line` form editors jump to)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f":{mark.line + 1}" if mark is not None else ""


def _problem_of(err: yaml.YAMLError) -> str:
    """What is wrong, with what the parser was reading (PyYAML's first line alone says only the latter)."""
    problem, context = getattr(err, "problem", None), getattr(err, "context", None)
    if problem and context:
        return f"{problem}, {context}"
    return problem or context or str(err).splitlines()[0]


def _expanded_size(text: str) -> tuple[int, int]:
    """The aliases of a document and the scalar values it holds with every alias expanded, counted
    from its parse events (an anchored node's count is kept for the aliases to it)."""
    sizes: dict[str, int]  # an anchor -> the scalar values of its node
    aliases, sizes, stack = 0, {}, [0]  # stack: the values of the collections being read
    anchors: list[str | None] = []
    for event in yaml.parse(text, Loader=_SAFE_LOADER):
        if isinstance(event, yaml.AliasEvent):
            aliases += 1
            stack[-1] += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            stack[-1] += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            stack.append(0)
            anchors.append(event.anchor)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            count = stack.pop()
            anchor = anchors.pop()
            if anchor:
                sizes[anchor] = count
            stack[-1] += count
    return aliases, stack[0]
