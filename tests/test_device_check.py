"""tools/device_check.py (run on a GPU machine by hand) keeps working: here on the CPU with small
random Qwen2-shaped configs, the same code path as on CUDA except the device."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _config(hidden: int, layers: int, heads: int, kv_heads: int, tie: bool) -> dict:
    return {"model_type": "qwen2", "vocab_size": 512, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": tie, "max_position_embeddings": 512}


def test_device_check_on_cpu(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(_config(64, 2, 4, 2, True)))
    (tmp_path / "d.json").write_text(json.dumps(_config(32, 1, 2, 1, False)))
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "device_check.py"), "--device", "cpu",
                    "--target-config", str(tmp_path / "t.json"), "--drafter-config", str(tmp_path / "d.json"),
                    "--tokens", "16", "--prompts", "3", "--batches", "1,2", "--out", str(out)], check=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["all_exact"]
    runs = {(x["drafter"], x["mode"], x["batch"]) for x in r["exactness"]}
    for drafter in ("random", "self", "self_graphs"):
        assert {(drafter, "sd", 1), (drafter, "ssd", 1), (drafter, "sd", 3), (drafter, "ssd", 3)} <= runs
    # The target drafting for itself gets (nearly) every draft accepted: speculation really ran.
    for name in ("self", "self_graphs"):  # the static (CUDA-graph) engine drafts as the target does
        self_sd = next(x for x in r["exactness"] if x["drafter"] == name and x["mode"] == "sd")
        assert self_sd["acceptance_length"] > 3
    assert r["device_scope_ok"] and r["device_scope"]["forwards_checked"] > 0 and r["wall_s"] > 0
    assert r["graph_capture"] == {"cuda_graphs": False, "shapes": 0, "capture_s": 0.0}
    assert set(r["gemm_rows"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert [t["batch"] for t in r["timings"]] == [1, 2] and all(t["target_5row_tiled_ms"] > 0 for t in r["timings"])
    graphs = r["drafter_graphs"]  # the static drafter ran (eagerly here: graphs are captured on cuda only)
    assert [t["batch"] for t in graphs] == [1, 2] and not any(t["cuda_graphs"] for t in graphs)
    assert all(t["drafter_graph_1row_ms"] > 0 and t["drafter_graph_8row_ms"] > 0 and t["drafter_over_target"] > 0
               for t in graphs)


def test_the_default_pair_shapes_need_no_files():
    """On the GPU machine no engine folder exists: the default pair's shapes are built in."""
    from ssd_tools.device_check import DEFAULT_PAIR

    from ssd.engine.model import ModelConfig

    target, drafter = (ModelConfig.from_hf(DEFAULT_PAIR[r]) for r in ("target", "drafter"))
    assert (target.hidden_size, target.num_layers, target.num_heads, target.num_kv_heads) == (1536, 28, 12, 2)
    assert (drafter.hidden_size, drafter.num_layers, drafter.num_heads, drafter.num_kv_heads) == (896, 24, 14, 2)
    assert target.vocab_size == drafter.vocab_size == 151936
