"""Policy options: one typed spec per option, from which validation and `klotski-sim policies` come."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from klotski_sim.cli.main import main
from klotski_sim.policies import POLICIES, get_policy
from klotski_sim.policies.base import register, resolve_options
from klotski_sim.policies.options import OptionSpec, option, specs_from_defaults, specs_of
from klotski_sim.util.errors import UsageError

ALL_SPECS = [(name, spec) for name, info in POLICIES.items() for spec in info.option_specs().values()]
values = st.one_of(
    st.booleans(),
    st.integers(-5, 100),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["lru", "code", "per-expert", "cost", "gpu", "pinned"]),
)


def accepted(spec: OptionSpec, value: object) -> bool:
    """The rule, said independently of OptionSpec.check: right kind, then choices, then range."""
    if isinstance(value, bool) != (spec.kind is bool):
        return False
    if spec.kind is int and not isinstance(value, int):
        return False
    if spec.kind is float and not (isinstance(value, (int, float)) and value == value and abs(value) != float("inf")):
        return False
    if spec.kind is str and not isinstance(value, str):
        return False
    if spec.choices and value not in spec.choices:
        return False
    if spec.minimum is not None and value < spec.minimum:  # type: ignore[operator]
        return False
    return spec.maximum is None or value <= spec.maximum  # type: ignore[operator]


@pytest.mark.parametrize("policy,spec", ALL_SPECS, ids=[f"{p}.{s.name}" for p, s in ALL_SPECS])
def test_every_option_has_help_and_its_own_default_passes(policy: str, spec: OptionSpec) -> None:
    assert spec.help, f"{policy}: option {spec.name} has no help text"
    spec.check(policy, spec.default)
    for preset in ("as-published", "ideal", "v0.1"):
        spec.check(policy, get_policy(policy).preset(preset).get(spec.name, spec.default))


@given(st.sampled_from(ALL_SPECS), values)
def test_resolve_options_accepts_exactly_what_the_spec_says(item: tuple[str, OptionSpec], value: object) -> None:
    policy, spec = item
    options = {spec.name: value}
    if spec.name == "cache_policy":
        options["expert_cache"] = 4  # (a cache policy needs a cache)
    if accepted(spec, value):
        assert resolve_options(policy, "ideal", options)[spec.name] == value
    else:
        with pytest.raises(UsageError, match=f"policy '{policy}': option {spec.name} must be "):
            resolve_options(policy, "ideal", options)


def test_an_unknown_option_names_the_known_ones_and_where_they_are_explained() -> None:
    with pytest.raises(UsageError) as err:
        resolve_options("flexgen", "ideal", {"overlpa": "model"})
    assert "overlap" in str(err.value) and "klotski-sim policies flexgen" in str(err.value)


def test_a_shared_options_class_takes_per_policy_defaults() -> None:
    fiddler, llama = get_policy("fiddler").defaults, get_policy("llamacpp-moe").defaults
    assert (fiddler["rule"], fiddler["min_batch"]) == ("cost", 10)
    assert (llama["rule"], llama["min_batch"]) == ("layer-tokens", 32)
    assert set(fiddler) == set(llama)


def test_bad_option_classes_are_refused_when_registered() -> None:
    @dataclass(frozen=True)
    class TupleOption:
        slots: tuple = option((), "a tuple is no option type")  # type: ignore[type-arg]

    with pytest.raises(UsageError, match="type must be bool, int, float or str"):
        specs_of(TupleOption)

    @dataclass(frozen=True)
    class OutOfRange:
        slots: int = option(0, "at least one", minimum=1)

    with pytest.raises(UsageError, match="slots must be a whole number >= 1, got 0"):
        register("test-out-of-range", "x", options=OutOfRange)(lambda inp: None)  # type: ignore[arg-type,return-value]
    assert "test-out-of-range" not in POLICIES
    with pytest.raises(UsageError, match="default must be a bool, int, float or string"):
        specs_from_defaults({"slots": None})


def test_a_plugin_with_an_options_class_is_validated_like_a_built_in() -> None:
    @dataclass(frozen=True)
    class SlotOptions:
        slots: int = option(8, "GPU expert slots", minimum=1)

    name = "test-options-plugin"
    try:
        register(name, "a test policy", options=SlotOptions)(POLICIES["single-batch"].build)
        assert resolve_options(name, "ideal", {"slots": 3})["slots"] == 3
        with pytest.raises(UsageError, match="option slots must be a whole number >= 1, got 0"):
            resolve_options(name, "ideal", {"slots": 0})
    finally:
        POLICIES.pop(name, None)


def test_the_policies_command_lists_every_option_with_its_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in POLICIES)
    for name, info in POLICIES.items():
        assert main(["policies", name]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
        assert set(rows) == set(info.option_specs()), name
        published = info.preset("as-published")
        for key, spec in info.option_specs().items():
            shown = rows[key][len(spec.accepts().split()) + 1]
            expected = published.get(key, spec.default)
            assert shown == (str(expected).lower() if isinstance(expected, bool) else str(expected)), (name, key)


def test_the_policies_command_lists_the_serving_policies_and_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    from klotski_sim.policies.options import specs_of
    from klotski_sim.serving.policies import SERVING_POLICIES

    assert main(["policies"]) == 0
    listing = capsys.readouterr().out
    assert "serving policies (klotski-sim serve):" in listing and all(name in listing for name in SERVING_POLICIES)
    for name, cls in SERVING_POLICIES.items():
        assert main(["policies", name]) == 0
        out = capsys.readouterr().out
        shown = {line.split()[0] for line in out.splitlines()[2:]} - {"(no"}
        assert shown == {spec.name for spec in specs_of(cls.Options)}, name
