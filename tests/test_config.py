"""The one config: config.pbtxt's parameters override ServerConfig (the `ssd` model) and
EngineConfig (the engine models) by name and are checked once; code, config.pbtxt, README and the
deployment specs state the same defaults; requests, the server's defaults and the bench read the
same limits (engine-free)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ssd.config import DECODE_INPUTS, K_MAX, DecodeConfig, EngineConfig, ServerConfig
from ssd_tools import deploy

REPO = Path(__file__).resolve().parents[1]
ENGINE_MODELS = ("target", "drafter_primary", "drafter_backup")
_PARAM = re.compile(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def pbtxt_parameters(model: str = "ssd", text: str | None = None) -> dict[str, str]:
    text = text if text is not None else (REPO / "model_repository" / model / "config.pbtxt").read_text()
    return dict(_PARAM.findall(text))


def test_the_shipped_config_pbtxt_states_the_dataclass_defaults():
    params = pbtxt_parameters()
    cfg = ServerConfig.from_parameters(params)
    assert cfg == ServerConfig()  # config.pbtxt restates the defaults; they cannot drift apart
    names = ServerConfig.parameter_names()  # the server's own and the scheduler's (PolicyConfig)
    assert set(names) == set(params) - {"role"} and len(set(names)) == len(names)


def test_the_engine_models_config_pbtxt_states_their_roles_defaults():
    for model in ENGINE_MODELS:
        params = pbtxt_parameters(model)
        assert EngineConfig.from_parameters(params, model) == EngineConfig.defaults(params["role"]), model


def test_every_deployment_spec_sets_known_parameters_with_valid_values():
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        for model, text in deploy.render(yaml.safe_load(path.read_text())).items():
            params = pbtxt_parameters(text=text)
            if 'backend: "tensorrtllm"' in text:  # Triton's TensorRT-LLM backend reads its own parameters
                continue
            if params["role"] == "orchestrator":
                ServerConfig.from_parameters(params, model)
            else:
                EngineConfig.from_parameters(params, model)


def readme_table(heading: str) -> list[list[str]]:
    """The rows of the first table under README's ``heading``, as lists of cells."""
    text = (REPO / "README.md").read_text().split(f"## {heading}\n", 1)[1]
    rows = [line.strip("|").split(" | ") for line in text.split("\n## ")[0].splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows[1:]]  # past the header


def readme_value(cell: str) -> str:
    """A default as config.pbtxt would spell it: `x` -> x, empty -> ""."""
    return "" if cell == "empty" else cell.strip("`")


def test_the_readme_states_the_defaults():
    """Every default README's model-repository table gives is the dataclass default of that model's
    role: the parameter set to README's value leaves the config as it is."""
    roles = {m: pbtxt_parameters(m)["role"] for m in ENGINE_MODELS}
    checked = 0
    for models, names, values in (row[:3] for row in readme_table("The model repository")):
        names = re.findall(r"`(\w+)`", names)
        values = values.split(" / ")
        values = values * len(names) if len(values) == 1 else values
        assert len(values) == len(names), (names, values)
        for model in re.findall(r"`(\w+)(\*?)`", models):
            expanded = [m for m in ENGINE_MODELS if m.startswith(model[0])] if model[1] else [model[0]]
            for m in expanded:
                for name, value in zip(names, values):
                    if m == "ssd":
                        assert ServerConfig.from_parameters({name: readme_value(value)}) == ServerConfig(), name
                    else:
                        cfg = EngineConfig.from_parameters({"role": roles[m], name: readme_value(value)}, m)
                        assert cfg == EngineConfig.defaults(roles[m]), (m, name)
                    checked += 1
    assert checked >= 40


def test_the_readme_states_every_decode_input_and_its_default():
    rows = {r[0].strip("`"): r[1] for r in readme_table("The request API")}
    defaults = DecodeConfig()
    for name, (field, _) in DECODE_INPUTS.items():
        given = ServerConfig.from_parameters({"default_mode" if name == "mode" else name: readme_value(rows[name])})
        assert getattr(given.decode_defaults(), field) == getattr(defaults, field), name


def test_a_bad_engine_parameter_is_refused_naming_it_and_the_model():
    params = pbtxt_parameters("target")
    with pytest.raises(ValueError, match=r"model 'target': parameter 'max_lenn': unknown \(known: .*max_len"):
        EngineConfig.from_parameters({**params, "max_lenn": "4096"}, "target")
    for name, value, why in (("max_len", "big", "expected a int"), ("threads", "-1", "must be >= 0"),
                             ("engine_backend", "onnx", "must be empty or one of"),
                             ("cores", "0;1", "comma-separated"), ("batch_invariant", "yes", "expected a bool"),
                             ("weight_quant", "int8", "batch_invariant false")):
        with pytest.raises(ValueError, match=f"model 'target': parameter '{name}': .*{why}"):
            EngineConfig.from_parameters({**params, name: value}, "target")
    drafter = {**pbtxt_parameters("drafter_primary"), "engine_backend": "llamacpp"}
    with pytest.raises(ValueError, match="model 'drafter_primary': parameter 'engine_backend': llamacpp serves the target"):
        EngineConfig.from_parameters(drafter, "drafter_primary")
    cfg = EngineConfig.from_parameters({**params, "max_len": "4096", "cache_ram_mb": ""}, "target")
    assert (cfg.max_len, cfg.cache_ram_mb) == (4096, 384.0)  # empty keeps the default


def test_the_scheduler_knobs_are_ssd_parameters():
    cfg = ServerConfig.from_parameters({"explore": "0.5", "flat_rows": "16"})
    assert (cfg.policy.explore, cfg.policy.flat_rows, cfg.policy.half_life_s) == (0.5, 16, 120.0)
    for name, value in (("half_life_s", "0"), ("explore", "-0.1"), ("flat_rows", "0")):
        with pytest.raises(ValueError, match=f"model 'ssd': parameter '{name}': must be"):
            ServerConfig.from_parameters({name: value})


def test_parameters_override_by_name_and_are_checked_once():
    cfg = ServerConfig.from_parameters({"num_draft_tokens": "6", "step_aside": "false", "coalesce_window_ms": "0",
                                        "force_mode": ""})
    assert (cfg.num_draft_tokens, cfg.step_aside, cfg.coalesce_window_ms, cfg.force_mode) == (6, False, 0.0, "")
    assert cfg.decode_defaults() == DecodeConfig(k=6, step_aside=False)
    for params, named in (({"num_draft_tokens": str(K_MAX + 1)}, "num_draft_tokens"),
                          ({"fanout_budget": "3"}, "fanout_budget"),  # below K + 1
                          ({"default_mode": "fast"}, "default_mode"),
                          ({"step_aside": "yes"}, "step_aside"),
                          ({"force_mode": "ssd"}, "force_mode"),
                          ({"max_tokens_limit": "8000"}, "max_seq_len"),
                          ({"num_draft_token": "4"}, "num_draft_token")):  # a typo is not ignored
        with pytest.raises(ValueError, match=f"parameter '{named}'"):
            ServerConfig.from_parameters(params)


def test_a_request_and_the_defaults_share_the_limits():
    DecodeConfig(k=K_MAX, fanout_budget=K_MAX + 1).validate()
    with pytest.raises(ValueError, match=f"input 'num_draft_tokens': must be in 1..{K_MAX}"):
        DecodeConfig(k=K_MAX + 1, fanout_budget=64).validate()
    with pytest.raises(ValueError, match="input 'saguaro_c'"):
        DecodeConfig(saguaro_c=2.0).validate()
    assert DecodeConfig(mode="ssd", backup="fast", step_aside=False).allowed() == ("ssd+fast",)
    assert DecodeConfig(mode="sd").allowed() == ("sd",)
