from pathlib import Path

import pytest
import yaml

from klotski_sim.hardware.profile import (
    ProfileError,
    builtin_profile_names,
    load_profile,
    with_overrides,
)

from .conftest import run_cli


def test_builtin_profiles_load_with_sources():
    names = builtin_profile_names()
    assert {"rtx3090", "a100-80g", "h800", "h200"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.gpu.usable_bytes > 0
        assert p.sources, f"{name} cites no sources"


def _write(tmp_path, data):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _base():
    return load_profile("rtx3090").model_dump(mode="json")


def test_missing_field_names_file_and_field(tmp_path):
    data = _base()
    del data["gpu"]["peak_flops"]
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and "gpu.peak_flops" in str(err.value)


def test_negative_field_is_rejected(tmp_path):
    data = _base()
    data["links"]["pcie_h2d"]["bandwidth"] = -5
    with pytest.raises(ProfileError, match="links.pcie_h2d.bandwidth"):
        load_profile(_write(tmp_path, data))


def test_misspelled_field_suggests_the_right_one(tmp_path):
    data = _base()
    data["gpu"]["memory_bandwith"] = data["gpu"].pop("memory_bandwidth")
    with pytest.raises(ProfileError) as err:
        load_profile(_write(tmp_path, data))
    assert "gpu.memory_bandwith: unknown field" in str(err.value)
    assert "did you mean 'memory_bandwidth'" in str(err.value)
    # one line, the misspelling named before the field it left missing
    assert "\n" not in str(err.value)
    assert str(err.value).index("memory_bandwith") < str(err.value).index("gpu.memory_bandwidth: Field required")


def test_many_problems_are_one_line_with_their_count(tmp_path):
    data = {"name": "x", "gpu": {"memory_bandwith": 1}}
    with pytest.raises(ProfileError) as err:
        load_profile(_write(tmp_path, data))
    message = str(err.value)
    assert "\n" not in message and message.endswith("problems in all)") and message.count(";") == 6, message


def test_not_yaml_and_not_a_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu:\n  name: [unclosed\n  cores: 2\n")
    with pytest.raises(
        ProfileError,
        match=r"bad.yaml:3: not valid YAML \(did not find expected ',' or ']', while "
        r"parsing a flow sequence\)",
    ):
        load_profile(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ProfileError, match="must be a mapping"):
        load_profile(bad)


def test_unknown_profile_name_lists_builtins():
    with pytest.raises(ProfileError, match="rtx3090"):
        load_profile("tpu-v9")


def test_overrides_validate():
    p = with_overrides(load_profile("rtx3090"), {"links.pcie_h2d.bandwidth": 32e9})
    assert p.links.pcie_h2d.bandwidth == 32e9
    with pytest.raises(ProfileError, match="not a profile field"):
        with_overrides(p, {"links.pcie_h2d.bandwith": 1})
    with pytest.raises(ProfileError, match="gpu.peak_flops: Value error, 0 per second is below 1e\\+06"):
        with_overrides(p, {"gpu.peak_flops": 0})


def test_an_override_may_add_a_key_to_a_map_and_to_nothing_else():
    """`--set gpu.dispatch_overhead_by_category.expert=1e-5` was "not a profile field" while the
    profile's map had no `expert` key: a what-if could only change keys a file already gave."""
    p = load_profile("rtx3090")
    assert "expert" not in p.gpu.dispatch_overhead_by_category and "fp8" not in load_profile("h800").cpu.flops
    added = with_overrides(p, {"gpu.dispatch_overhead_by_category.expert": 1e-5, "sources.my_note": "a what-if"})
    assert added.gpu.dispatch_overhead_by_category["expert"] == 1e-5 and added.sources["my_note"] == "a what-if"
    assert with_overrides(load_profile("h800"), {"cpu.flops.fp8": 1e12}).cpu.flops["fp8"] == 1e12
    with pytest.raises(ProfileError, match="'expret' is no op category \\(did you mean 'expert'\\?\\)"):
        with_overrides(p, {"gpu.dispatch_overhead_by_category.expret": 1e-5})  # (the map's own checks still apply)
    for dotted in (
        "gpu.new_field",
        "gpu.dispatch_overhead_by_category.expert.deeper",
        "links.nvme.new_field",
        "new_section.x",
    ):
        with pytest.raises(ProfileError, match=f"'{dotted}' is not a profile field"):
            with_overrides(p, {dotted: 1})


def test_profile_roundtrips_through_yaml(tmp_path):
    p = load_profile("h200")
    path = tmp_path / "h200.yaml"
    path.write_text(p.to_yaml())
    assert load_profile(path) == p


def test_every_number_of_a_builtin_profile_has_a_source():
    """Spec sheet, published measurement or calibration: written next to the value."""
    from importlib import resources

    import yaml

    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                yield from leaves(value, path + ".")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                yield path

    for name in builtin_profile_names():
        ref = resources.files("klotski_sim.hardware") / "profiles" / f"{name}.yaml"
        data = yaml.safe_load(ref.read_text())
        sources = data.get("sources", {})
        body = {k: v for k, v in data.items() if k not in ("sources", "measured", "provenance")}
        missing = [path for path in leaves(body) if path not in sources]
        assert not missing, f"{name}: no source for {missing}"


REPOSITORY = Path(__file__).resolve().parent.parent
SHIPPED_PROFILES = sorted(p for p in (REPOSITORY / "experiments").rglob("*.yaml") if "\ngpu:\n" in p.read_text())


@pytest.mark.parametrize("path", SHIPPED_PROFILES, ids=lambda p: p.relative_to(REPOSITORY).as_posix())
def test_every_profile_the_repository_ships_loads(path):
    """experiments/results/cpu/*/profile.yaml, the records a README cites, were refused ("links.
    pageable_h2d_bandwidth has moved ...") after the field moved, each a command no one could rerun."""
    from klotski_sim.hardware.profile import load_profile_file

    assert len(SHIPPED_PROFILES) >= 8 and load_profile_file(path).name


def test_a_profile_measured_on_one_models_ops_is_refused_for_another_models():
    """A profile calibrated on tiny-mixtral timed small-mixtral's experts by tiny-mixtral's table
    (0.26 ms for 0.91 by the roofline) without a word: its tables key on category and tokens alone."""
    from klotski_sim.hardware.profile import load_profile_file
    from klotski_sim.runs.runner import check_measured_for
    from klotski_sim.util.errors import UsageError
    from klotski_sim.workload.model import get_model

    profile = load_profile_file(REPOSITORY / "experiments/results/cpu/tiny-mixtral/profile.yaml")
    assert profile.measured and profile.provenance["model_shapes"] == "tiny-mixtral"
    for same in ("tiny-mixtral", "tiny-mixtral:1"):  # (fewer layers: the same ops)
        check_measured_for(profile, get_model(same))
    with pytest.raises(
        UsageError,
        match="calibrated on tiny-mixtral's ops, not small-mixtral's \\(num_experts 4 vs "
        "8, hidden_size 64 vs 1024, ffn_size 128 vs 3584 ...\\); calibrate for this "
        "model \\(klotski-runtime calibrate --model small-mixtral\\)",
    ):
        check_measured_for(profile, get_model("small-mixtral"))
    with pytest.raises(UsageError, match="not tiny-mixtral@int4's \\(expert_bits 0 vs 4\\)"):
        check_measured_for(profile, get_model("tiny-mixtral@int4"))
    check_measured_for(profile.model_copy(update={"measured": {}}), get_model("small-mixtral"))  # (no table: roofline)
    deepseek = profile.model_copy(update={"provenance": {**profile.provenance, "model_shapes": "deepseek-v2-lite"}})
    for same in ("deepseek-v2-lite", "deepseek-v2-lite:4"):  # (its dense first layer: a copy of one layer is refused)
        check_measured_for(deepseek, get_model(same))
    rc, out, err = run_cli(
        "simulate",
        "--model",
        "small-mixtral",
        "--hardware",
        str(REPOSITORY / "experiments/results/cpu/tiny-mixtral/profile.yaml"),
    )
    assert rc == 2 and err.startswith("error: hardware profile 'calibrated-cpu': its measured op times were calibrated")


def test_a_built_in_name_that_is_also_a_file_here_is_refused_as_ambiguous(tmp_path, monkeypatch):
    """A calibrated profile saved as `./t4`, then `--hardware t4`: the built-in T4 ran, without a word;
    a link to nowhere was "unknown hardware profile"."""
    from klotski_sim.hardware.profile import load_profile_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t4").write_text(load_profile("h200").to_yaml())
    with pytest.raises(ProfileError, match="'t4' names a built-in profile and a file here: give ./t4 for the file"):
        load_profile("t4")
    assert load_profile("./t4") == load_profile_file(tmp_path / "t4") and load_profile("./t4").name == "h200"
    assert load_profile("h200").name == "h200"  # (no file of that name here)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere.yaml")
    with pytest.raises(ProfileError, match="dangling: cannot read profile \\(No such file or directory\\)"):
        load_profile("dangling")
