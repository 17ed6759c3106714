"""moe_compile/config.py: defaults, validation errors that name the key, patch, environment variables."""
import dataclasses
import json

import pytest
import torch

from moe_compile.config import (
    INNER_COMPILERS,
    ConfigError,
    InnerCompiler,
    Kernels,
    MoECompileConfig,
    PauseMPSchedule,
    ScheduleName,
    config,
)


def _field_names():
    return [f.name for f in dataclasses.fields(MoECompileConfig)]


def test_defaults_keep_the_models_semantics():
    cfg = MoECompileConfig()
    assert cfg.debug_dir is None
    assert cfg.inner == "auto"
    assert cfg.rewrite is True
    assert cfg.capacity_factor is None
    assert cfg.verify_regions is True
    assert cfg.verify_rtol == 1e-4 and cfg.verify_atol == 1e-5
    assert cfg.validate() is cfg


def test_from_env_without_variables_is_the_defaults():
    assert MoECompileConfig.from_env({}) == MoECompileConfig()


def test_merged_applies_options_to_a_copy():
    base = MoECompileConfig()
    merged = base.merged({"inner": "eager", "capacity_factor": 0})
    assert (merged.inner, merged.capacity_factor) == ("eager", 0)
    assert (base.inner, base.capacity_factor) == ("auto", None)
    assert base.merged(None) == base


def test_unknown_key_names_it_and_lists_the_allowed_keys():
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged({"compresor": 1})
    message = str(info.value)
    assert "compresor" in message
    for name in _field_names():
        assert name in message


def test_unknown_key_close_to_a_field_suggests_it():
    with pytest.raises(ConfigError, match="did you mean 'capacity_factor'"):
        MoECompileConfig().merged({"capacity_factr": 1.0})


@pytest.mark.parametrize("value", ["x", True, float("nan"), [1.0]])
def test_bad_capacity_factor_names_the_key(value):
    with pytest.raises(ConfigError, match="capacity_factor"):
        MoECompileConfig().merged({"capacity_factor": value})


@pytest.mark.parametrize("value", [1.25, 0, -2, None])
def test_good_capacity_factors(value):
    assert MoECompileConfig().merged({"capacity_factor": value}).capacity_factor == value


def test_bad_inner_names_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged({"inner": "tvm"})
    message = str(info.value)
    assert "inner" in message and "'tvm'" in message
    for name in INNER_COMPILERS:
        assert name in message


@pytest.mark.parametrize("name", ["rewrite", "verify_regions"])
@pytest.mark.parametrize("value", [1, 0, "False", None])
def test_bool_fields_reject_non_bools(name, value):
    with pytest.raises(ConfigError, match=name):
        MoECompileConfig().merged({name: value})


@pytest.mark.parametrize("name", ["verify_rtol", "verify_atol"])
@pytest.mark.parametrize("value", [-1e-3, "small", True])
def test_tolerances_must_be_non_negative_numbers(name, value):
    with pytest.raises(ConfigError, match=name):
        MoECompileConfig().merged({name: value})


def test_debug_dir_must_be_a_path():
    with pytest.raises(ConfigError, match="debug_dir"):
        MoECompileConfig().merged({"debug_dir": 3})


def test_patch_changes_and_restores():
    before = config.as_dict()
    with config.patch(inner="eager", capacity_factor=2.0) as cfg:
        assert cfg is config
        assert (config.inner, config.capacity_factor) == ("eager", 2.0)
    assert config.as_dict() == before


def test_patch_restores_when_the_body_raises():
    before = config.as_dict()
    with pytest.raises(RuntimeError, match="body"):
        with config.patch(verify_regions=not config.verify_regions, debug_dir="/tmp/somewhere"):
            assert config.debug_dir == "/tmp/somewhere"
            raise RuntimeError("body")
    assert config.as_dict() == before


def test_patch_with_a_bad_value_raises_and_restores():
    before = config.as_dict()
    with pytest.raises(ConfigError, match="inner"):
        with config.patch(inner="bogus"):
            pass
    assert config.as_dict() == before


def test_patch_with_an_unknown_key_raises():
    with pytest.raises(ConfigError, match="compresor"):
        with config.patch(compresor="int8"):
            pass
    assert not hasattr(config, "compresor")


def test_from_env_parses_each_type():
    cfg = MoECompileConfig.from_env({
        "MOE_COMPILE_DEBUG_DIR": "/tmp/x",
        "MOE_COMPILE_VERIFY_REGIONS": "0",
        "MOE_COMPILE_CAPACITY_FACTOR": "1.5",
        "MOE_COMPILE_EP_GROUP": "world",
        "MOE_COMPILE_CAPACITY_BUCKET": "16",
        "MOE_COMPILE_ALL_TO_ALL": "2dh",
        "MOE_COMPILE_RANKS_PER_NODE": "8",
    })
    assert cfg.all_to_all == "2dh" and cfg.ranks_per_node == 8
    assert cfg.ep_group == "world" and cfg.capacity_bucket == 16
    assert cfg.debug_dir == "/tmp/x"
    assert cfg.verify_regions is False
    assert cfg.capacity_factor == 1.5
    assert cfg.inner == "auto" and cfg.rewrite is True
    # dp_backward_compute_ms defaults to None but is a number (the process-wide config; the dependency on
    # dp_placement="timeline" is checked per compile, in merged)
    assert MoECompileConfig.from_env({"MOE_COMPILE_DP_BACKWARD_COMPUTE_MS": "42.5"}).dp_backward_compute_ms == 42.5


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("ON", True), ("no", False), ("False", False)])
def test_from_env_bool_spellings(raw, expected):
    assert MoECompileConfig.from_env({"MOE_COMPILE_REWRITE": raw}).rewrite is expected


def test_from_env_ignores_other_variables(recwarn):
    assert MoECompileConfig.from_env({"MOE_COMPILE": "1", "COMPILE_INNER": "eager"}) == MoECompileConfig()
    assert not [w for w in recwarn if "moe_compile" in str(w.message)]


def test_unknown_env_variable_warns_with_the_closest_name():
    with pytest.warns(UserWarning, match=r"MOE_COMPILE_COMPRESOR is not a moe_compile option and is ignored "
                                         r"\(did you mean MOE_COMPILE_COMPRESSOR\?\)") as caught:
        cfg = MoECompileConfig.from_env({"MOE_COMPILE_COMPRESOR": "int8", "MOE_COMPILE_INNER": "eager",
                                         "MOE_COMPILE_ZZZ": "1"})
    assert cfg.compressor == "none" and cfg.inner == "eager"
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2 and messages[1].startswith("MOE_COMPILE_ZZZ is not a moe_compile option and is "
                                                         "ignored; the variables are MOE_COMPILE_<FIELD>"), messages


@pytest.mark.parametrize("variable, raw", [
    ("MOE_COMPILE_VERIFY_REGIONS", "maybe"),
    ("MOE_COMPILE_REWRITE", "2"),
    ("MOE_COMPILE_CAPACITY_FACTOR", "lots"),
    ("MOE_COMPILE_VERIFY_ATOL", "loose"),
    ("MOE_COMPILE_CAPACITY_BUCKET", "eight"),
])
def test_unparsable_env_value_names_the_variable(variable, raw):
    with pytest.raises(ConfigError) as info:
        MoECompileConfig.from_env({variable: raw})
    assert variable in str(info.value) and repr(raw) in str(info.value)


@pytest.mark.parametrize("variable, raw", [
    ("MOE_COMPILE_INNER", "tvm"), ("MOE_COMPILE_VERIFY_RTOL", "-1"),
    ("MOE_COMPILE_EP_GROUP", "everyone"), ("MOE_COMPILE_CAPACITY_BUCKET", "0"),
])
def test_invalid_env_value_names_the_field(variable, raw):
    field = variable.removeprefix("MOE_COMPILE_").lower()
    with pytest.raises(ConfigError, match=field):
        MoECompileConfig.from_env({variable: raw})


@pytest.mark.parametrize("variable, raw", [("MOE_COMPILE_INNER", "tvm"), ("MOE_COMPILE_VERIFY_RTOL", "-1")])
def test_invalid_env_value_names_the_variable(variable, raw):
    with pytest.raises(ConfigError, match=variable):
        MoECompileConfig.from_env({variable: raw})


@pytest.mark.parametrize("value", [0, -8, 2.5, True, "8"])
def test_capacity_bucket_must_be_a_positive_int(value):
    with pytest.raises(ConfigError, match=r"options\['capacity_bucket'\].*integer >= 1"):
        MoECompileConfig().merged({"capacity_bucket": value})


@pytest.mark.parametrize("options, match", [
    ({"all_to_all": "3dh"}, r"options\['all_to_all'\]='3dh': not a registered all-to-all; choose one of flat, 1dh, 2dh, pipe"),
    ({"all_to_all": "2dh"}, r"options\['all_to_all'\]='2dh' needs options\['ranks_per_node'\]"),
    ({"ranks_per_node": 0}, r"options\['ranks_per_node'\]=0: expected an integer >= 1 or None"),
    ({"verify_collectives": "yes"}, r"options\['verify_collectives'\]='yes': expected True or False"),
])
def test_all_to_all_options(options, match):
    with pytest.raises(ConfigError, match=match):
        MoECompileConfig().merged(options)
    merged = MoECompileConfig().merged({"all_to_all": "pipe", "ranks_per_node": 2, "ep_group": "world"})
    assert merged.all_to_all == "pipe"


# --------------------------------------------------------------------------- every field, dependencies

#: For every option: values of a wrong type or out of range. A new field must be added here.
BAD_VALUES = {
    "debug_dir": [3, ["/tmp"]],
    "inner": ["tvm", 1, None],
    "tier_up_after": [-1, True, "10", float("nan"), float("inf"), [1.0]],
    "rewrite": [1, "yes", None],
    "fused_activations": [1, "yes", None],
    "capacity_factor": ["1", True, float("nan"), float("inf"), -float("inf"), [1.0]],
    "verify_regions": [0, "no"],
    "agree_layers": [1, "yes", None],
    "verify_rtol": [-1e-3, "1e-4", True, float("nan"), None],
    "verify_atol": [-1.0, "0", False, None],
    "ep_group": ["everyone", 0, ["world"]],
    "capacity_bucket": [0, -8, 2.5, True, "8", None],
    "compressor": ["int4", 8, None],
    "nan_check": [1, "true"],
    "kernels": ["cuda", None],
    "all_to_all": ["3dh", 2, None],
    "ranks_per_node": [0, -1, 1.5, True, "2"],
    "verify_collectives": ["yes", 1],
    "schedule": ["fast", None, 1],
    "num_chunks": [0, -1, 1.5, True, "2", None],
    "cost_models": [1, ["a.json"]],
    "emulate_link": [{"alpha_us": -1, "gbps": 25}, {"gbps": 0}, "fast", 3],
    "mp_group": ["everyone", 1],
    "esp_group": ["everyone", 1],
    "pause_mp": ["s3", None, True],
    "sample_placement": ["fastmoe", None, 1, True],
    "dp_group": ["everyone", 0, ["world"]],
    "dp_bucket_mb": [0, -1.0, True, "25", float("inf"), None],
    "dp_placement": ["bubbles", None, 1],
    "dp_slice_gradients": ["yes", 1, None],
    "dp_backward_compute_ms": [0, -1.0, True, "40", float("nan"), float("inf"), [40.0]],
    "parallelism": ["p3", True, 2],
}


def test_every_option_has_bad_values_listed():
    assert sorted(BAD_VALUES) == sorted(_field_names())


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD_VALUES.items() for v in values],
                         ids=lambda v: repr(v)[:20])
def test_bad_value_raises_config_error_naming_the_option(name, value):
    """Each wrong type / range is a ConfigError that names the option (with an EP group, so that
    dependency checks do not answer first)."""
    options = {name: value}
    if name != "ep_group":
        options["ep_group"] = "world"
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged(options)
    assert f"options[{name!r}]" in str(info.value) or (name == "emulate_link" and "emulate_link" in str(info.value))


@pytest.mark.parametrize("options, needs", [
    ({"compressor": "int8"}, "ep_group"),
    ({"num_chunks": 2}, "ep_group"),
    ({"num_chunks": "auto"}, "ep_group"),
    ({"schedule": "sequential"}, "ep_group"),
    ({"emulate_link": {"alpha_us": 10, "gbps": 25}}, "ep_group"),
    ({"all_to_all": "2dh", "ranks_per_node": 2}, "ep_group"),
    ({"all_to_all": "auto"}, "ep_group"),
    ({"nan_check": True}, "compressor"),
    ({"ep_group": "world", "nan_check": True}, "compressor"),
    ({"mp_group": "world"}, "ep_group"),
    ({"esp_group": "world"}, "ep_group"),
    ({"dp_placement": "fsmoe"}, "dp_group"),
    ({"dp_placement": "end"}, "dp_group"),
    ({"dp_placement": "timeline"}, "dp_group"),
    ({"dp_backward_compute_ms": 40.0}, "dp_placement"),
    ({"parallelism": "adaptive", "ep_group": "world"}, "esp_group"),
])
def test_option_that_would_do_nothing_names_the_option_it_needs(options, needs):
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged(options)
    message = str(info.value)
    assert f"options[{needs!r}]" in message
    assert any(f"options[{name!r}]" in message for name in options if name != needs), message


@pytest.mark.parametrize("options", [
    {"ep_group": "world", "compressor": "int8", "nan_check": True},
    {"ep_group": "world", "num_chunks": "auto", "schedule": "tutel"},
    {"ep_group": "world", "emulate_link": {"alpha_us": 10, "gbps": 25}},
    {"ep_group": "world", "all_to_all": "auto"},
    {"compressor": "none", "num_chunks": 1, "schedule": "optimal", "all_to_all": "flat"},  # the "off" values
])
def test_consistent_options_are_accepted(options):
    merged = MoECompileConfig().merged(options)
    assert all(getattr(merged, k) == v for k, v in options.items())


def test_dependencies_are_checked_per_compile_not_in_the_process_config():
    """The environment or config.patch may set compressor while each torch.compile call brings ep_group."""
    cfg = MoECompileConfig.from_env({"MOE_COMPILE_COMPRESSOR": "int8"})
    assert cfg.compressor == "int8"
    with config.patch(num_chunks=2):
        assert config.merged({"ep_group": "world"}).num_chunks == 2
        with pytest.raises(ConfigError, match=r"options\['num_chunks'\]=2.*options\['ep_group'\]"):
            config.merged({})


# --------------------------------------------------------------------------- through torch.compile


@pytest.mark.parametrize("options, key", [({"compresor": 1}, "compresor"), ({"capacity_factor": "x"}, "capacity_factor")])
def test_torch_compile_options_are_validated(options, key):
    model = torch.compile(torch.nn.Linear(4, 4), backend="moe", options=options)
    with pytest.raises(Exception) as info:  # Dynamo wraps backend errors in BackendCompilerFailed
        model(torch.randn(2, 4))
    assert key in str(info.value)


def test_default_cache_dir_follows_xdg_cache_home(tmp_path):
    from pathlib import Path

    from moe_compile.config import default_cache_dir

    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "moe_compile"
    home_cache = Path.home() / ".cache" / "moe_compile"
    assert default_cache_dir({}) == home_cache
    assert default_cache_dir({"XDG_CACHE_HOME": ""}) == home_cache  # empty = unset (XDG)



@pytest.mark.parametrize("name, enum_type", [
    ("inner", InnerCompiler), ("kernels", Kernels), ("schedule", ScheduleName), ("pause_mp", PauseMPSchedule),
])
def test_choice_options_are_validated_into_str_enums(name, enum_type):
    """Each member equals, prints, formats and JSON-dumps as the string the user gave."""
    options = {"ep_group": "world"} if name == "schedule" else {}
    for member in enum_type:
        value = getattr(MoECompileConfig().merged({**options, name: member.value}), name)
        assert type(value) is enum_type and value is member
        assert value == member.value and {member.value: 1}[value] == 1
        assert str(value) == f"{value}" == format(value) == "%s" % value == member.value
        assert format(value, ">12") == format(member.value, ">12")
        assert json.dumps({"v": value, value: 0}, indent=1) == json.dumps({"v": member.value, member.value: 0}, indent=1)
    assert type(getattr(MoECompileConfig(), name)) is enum_type  # defaults are members too


def test_choice_options_from_env_and_patch_are_enums():
    cfg = MoECompileConfig.from_env({"MOE_COMPILE_SCHEDULE": "tutel", "MOE_COMPILE_KERNELS": "torch"})
    assert cfg.schedule is ScheduleName.TUTEL and cfg.kernels is Kernels.TORCH
    with config.patch(inner="eager"):
        assert config.inner is InnerCompiler.EAGER
    assert isinstance(config.inner, InnerCompiler)


def test_dependency_error_shows_the_plain_value():
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged({"schedule": "sequential"})
    assert "options['schedule']='sequential' acts on" in str(info.value)
    assert "leave schedule at 'optimal'" in str(info.value)
