"""The one config: config.pbtxt's parameters override ServerConfig by name and are checked once;
requests, the server's defaults and the bench read the same limits (engine-free)."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from ssd.config import K_MAX, DecodeConfig, ServerConfig

PBTXT = Path(__file__).resolve().parents[1] / "model_repository" / "ssd" / "config.pbtxt"


def pbtxt_parameters() -> dict[str, str]:
    return dict(re.findall(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', PBTXT.read_text()))


def test_the_shipped_config_pbtxt_states_the_dataclass_defaults():
    params = pbtxt_parameters()
    cfg = ServerConfig.from_parameters(params)
    assert cfg == ServerConfig()  # config.pbtxt restates the defaults; they cannot drift apart
    assert {f.name for f in fields(ServerConfig)} == set(params) - {"role"}


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
