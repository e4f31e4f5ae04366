#!/usr/bin/env python3
"""The torch engine on a CUDA GPU: exactness and step timings of the default pair's architectures.

No real weights reach the GPU machine (nothing is downloadable there and at most 64 MiB travels),
so the engines get random bf16 weights in the real shapes (from the engines' config.json). That is
enough for what this measures:
1. GEMM rows on this device: does a row's result depend on how many rows share the GEMM? (On the
   CPU, oneDNN gives the same bits for 2..32 rows; the invariant tiles of engine/model.py rely on
   it. cuBLAS picks kernels by shape, so the answer can differ there.)
2. Exactness end to end, through the same workers and decoding loop as the server: greedy SD and
   SSD tokens equal AR's, with a random drafter (nearly every draft rejected) and with the target
   as its own drafter (nearly every draft accepted), alone and with 4 concurrent sequences.
3. Step timings: target forwards of b sequences x r rows (r = 1: an AR step, r = K+1: a verify),
   in batch-invariant tiles and as one GEMM; drafter steps; decode tok/s of each mode at batch 1.
4. The GPU drafter (engine/static_engine.py: static KV cache, CUDA graphs on cuda): its decode
   step and a 2K-row step against the target's one-row step (the goal on a GPU: under 0.3), the
   time it takes to capture every graph shape at load, and exactness with it as the drafter
   (the target's own weights: greedy acceptance is total, so every round runs the graphs).
5. The device scope: on a machine with several GPUs the engines run on the last one (a non-zero
   index) while the current device stays 0, and every forward, capture and replay is checked to
   run with the engine's GPU current; with one GPU the same check runs on cuda:0.
Needs only PyTorch and CUDA: the default pair's shapes are built in (no config files, no
downloads). Runs on the CPU as well (``--device cpu`` with small configs), which is how the tests
keep it working.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ssd.algorithm.sampling import SamplingParams
from ssd.decoding.coalescer import CoalescingClient
from ssd.decoding.generator import DecodeConfig, Generation, SharedState
from ssd.decoding.local_client import LocalClient
from ssd.engine.engine import ExtendCall, TorchEngine
from ssd.engine.model import ModelConfig
from ssd.engine.static_engine import StaticEngine, StaticStep
from ssd.workers.drafter import DrafterWorker
from ssd.workers.fast_backup import NgramWorker
from ssd.workers.target import TargetWorker

REPO = Path(__file__).resolve().parents[1]
# The default pair's shapes (Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct config.json), so the
# check needs no engine folder on the GPU machine.
QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "tie_word_embeddings": True, "max_position_embeddings": 32768, "hidden_act": "silu"}
DEFAULT_PAIR = {
    "target": {**QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2},
    "drafter": {**QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                "num_attention_heads": 14, "num_key_value_heads": 2},
}


def ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7, 8] -> '1-3, 7-8'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out) or "none"


def log(msg: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_engine(hf_config: dict, folder: Path, seed: int, device: str) -> Path:
    """An engine folder with random bf16 weights in ``hf_config``'s shapes. Projections have gain
    1.5 / sqrt(fan_in), so the next token depends on the context (greedy text is not one token
    repeated); Qwen2 gets its q/k/v biases."""
    c = ModelConfig.from_hf(hf_config)
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    def proj(out_f: int, in_f: int) -> torch.Tensor:
        return rnd(out_f, in_f, std=1.5 / math.sqrt(in_f))

    h, d = c.hidden_size, c.head_dim
    w = {"model.embed_tokens.weight": rnd(c.vocab_size, h, std=1.0), "model.norm.weight": torch.ones(h) * 0.5}
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w[a + "q_proj.weight"] = proj(c.num_heads * d, h)
        w[a + "k_proj.weight"] = proj(c.num_kv_heads * d, h)
        w[a + "v_proj.weight"] = proj(c.num_kv_heads * d, h)
        w[a + "o_proj.weight"] = proj(h, c.num_heads * d)
        if hf_config.get("model_type") == "qwen2":
            for name, n in (("q", c.num_heads * d), ("k", c.num_kv_heads * d), ("v", c.num_kv_heads * d)):
                w[a + f"{name}_proj.bias"] = rnd(n, std=0.1)
        w[p + "mlp.gate_proj.weight"] = proj(c.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = proj(c.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = proj(h, c.intermediate_size)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = rnd(c.vocab_size, h, std=1.0)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    # No token ends a generation: every run decodes exactly the tokens asked for.
    (folder / "config.json").write_text(json.dumps({**hf_config, "eos_token_id": -1}))
    (folder / "engine.json").write_text(json.dumps({"dtype": "bfloat16"}))
    return folder


# -- 1. GEMM rows -----------------------------------------------------------------------------------
def gemm_rows(engine: TorchEngine, max_rows: int = 64) -> dict:
    """For each projection of layer 0 and the output head: the row counts M (1..max_rows) at which
    row 0 of an M-row GEMM has the same bits as in a 2-row GEMM, and whether a row deep inside a
    32-row GEMM matches the same row in a 2-row GEMM (the offset question)."""
    m, c = engine.model, engine.config
    layer = m.layers[0]
    fan_in = {"qkv": c.hidden_size, "o": c.num_heads * c.head_dim, "gate_up": c.hidden_size,
              "down": c.intermediate_size}
    out = {}
    g = torch.Generator(device=m.device).manual_seed(0)
    for name, lin in [*((k, layer[k]) for k in fan_in), ("lm_head", m.lm_head)]:
        x = torch.randn(max_rows, fan_in.get(name, c.hidden_size), generator=g, device=m.device).to(m.dtype)
        ref = lin._gemm(x[:2])[0]
        same = [rows for rows in range(1, max_rows + 1) if torch.equal(lin._gemm(x[:rows])[0], ref)]
        offset_ok = torch.equal(lin._gemm(x[:32])[17], lin._gemm(x[17:19])[0])
        out[name] = {"rows_equal_to_2": same, "offset_17_in_32_equal": offset_ok}
    return out


# -- 2. exactness through the decoding loop --------------------------------------------------------
async def _decode(client, seq: str, prompt: list[int], cfg: DecodeConfig, n: int, shared: SharedState) -> dict:
    g = Generation(client, seq, list(prompt), SamplingParams(), 0, cfg, shared)
    return {"ids": await g.take(n), **g.stats.to_dict()}


def run_mode(client, prompts, cfg: DecodeConfig, n: int, concurrent: bool) -> list[dict]:
    shared = SharedState()
    if not concurrent:
        return [asyncio.run(_decode(client, f"{cfg.mode}-{i}", p, cfg, n, shared)) for i, p in enumerate(prompts)]
    co = CoalescingClient(client, expected=lambda: shared.active)

    async def all_at_once():
        return await asyncio.gather(*(_decode(co, f"c{cfg.mode}-{i}", p, cfg, n, shared) for i, p in enumerate(prompts)))
    return list(asyncio.run(all_at_once()))


def exactness(target, drafters: dict, prompts, n: int, k: int) -> list[dict]:
    ar_client = LocalClient(TargetWorker(target), DrafterWorker(next(iter(drafters.values()))), NgramWorker())
    t0 = time.perf_counter()
    ar = run_mode(ar_client, prompts, DecodeConfig(mode="ar"), n, False)
    reference = [r["ids"] for r in ar]
    rows = [{"drafter": None, "mode": "ar", "batch": 1, "equal_to_ar": len(prompts), "prompts": len(prompts),
             "wall_s": round(time.perf_counter() - t0, 2), "acceptance_length": 1.0, "p_hit": 0.0,
             "decode_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in ar)}]  # the reference
    for name, drafter in drafters.items():
        client = LocalClient(TargetWorker(target), DrafterWorker(drafter), NgramWorker())
        for mode, concurrent in (("ar", True), ("sd", False), ("ssd", False), ("sd", True), ("ssd", True)):
            if mode == "ar" and name != next(iter(drafters)):
                continue  # AR does not use the drafter: once is enough
            cfg = DecodeConfig(mode=mode, k=k, step_aside=False)
            t0 = time.perf_counter()
            res = run_mode(client, prompts, cfg, n, concurrent)
            equal = sum(r["ids"] == ref for r, ref in zip(res, reference))
            row = {"drafter": name, "mode": mode, "batch": len(prompts) if concurrent else 1,
                   "equal_to_ar": equal, "prompts": len(prompts), "wall_s": round(time.perf_counter() - t0, 2),
                   "acceptance_length": statistics.mean(r["acceptance_length"] for r in res),
                   "p_hit": statistics.mean(r["p_hit"] for r in res),
                   "decode_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in res)}
            rows.append(row)
            log(f"{mode} drafter={name} batch={row['batch']}: {equal}/{len(prompts)} equal to AR, "
                f"accept len {row['acceptance_length']:.2f}, {row['decode_tokens_per_s']:.1f} tok/s per sequence")
    return rows


# -- 3. step timings --------------------------------------------------------------------------------
def step_ms(engine: TorchEngine, batch: int, rows: int, exact: bool, context: int = 128, reps: int = 5) -> float:
    """Median wall time of one forward adding ``rows`` tokens to each of ``batch`` sequences that
    hold ``context`` tokens (logits for every new row, copied to the host as the workers need)."""
    g = torch.Generator().manual_seed(batch * 100 + rows)
    base = [torch.randint(0, engine.vocab_size, (context + rows,), generator=g).tolist() for _ in range(batch)]
    ids = [f"t{batch}-{rows}-{i}" for i in range(batch)]
    engine.extend([ExtendCall(s, b[:context]) for s, b in zip(ids, base)])
    saved, engine.exact = engine.exact, exact
    times = []
    for _ in range(reps + 1):
        for s in ids:
            engine.truncate(s, context)
        t0 = time.perf_counter()
        engine.extend([ExtendCall(s, b, n_logits=rows) for s, b in zip(ids, base)])
        times.append(time.perf_counter() - t0)
    engine.exact = saved
    for s in ids:
        engine.release(s)
    return 1000 * statistics.median(times[1:])  # the first one warms up


def timings(target, drafter, k: int, batches: list[int]) -> list[dict]:
    rows = []
    for b in batches:
        row = {"batch": b}
        for r in (1, k + 1):
            row[f"target_{r}row_tiled_ms"] = step_ms(target, b, r, exact=True)
            row[f"target_{r}row_onegemm_ms"] = step_ms(target, b, r, exact=False)
        row["drafter_1row_ms"] = step_ms(drafter, b, 1, exact=False)
        row[f"drafter_{2 * k}row_ms"] = step_ms(drafter, b, 2 * k, exact=False)
        rows.append({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
        log(f"timings batch {b}: " + ", ".join(f"{key} {v}" for key, v in rows[-1].items() if key != "batch"))
    return rows


def drafter_graph_timings(drafter_dir: Path, target, device: str, k: int, batches: list[int],
                          context: int = 128) -> tuple[list[dict], dict]:
    """The drafter on the static engine (CUDA graphs on cuda) against the target's one-row step."""
    drafter = StaticEngine(drafter_dir, device=device, exact=False, max_sequences=max(batches),
                           static_len=context + 2 * k + 64)
    capture = {"cuda_graphs": drafter.use_graphs, "shapes": len(drafter.shapes()) if drafter.use_graphs else 0,
               "capture_s": round(drafter.capture_s, 2)}
    log(f"GPU drafter: {capture['shapes']} graph shapes captured at load in {capture['capture_s']} s")
    rows = []
    for b in batches:
        row = {"batch": b, "cuda_graphs": drafter.use_graphs,
               "drafter_graph_1row_ms": step_ms(drafter, b, 1, exact=False),
               f"drafter_graph_{2 * k}row_ms": step_ms(drafter, b, 2 * k, exact=False),
               "target_1row_onegemm_ms": step_ms(target, b, 1, exact=False)}
        row["drafter_over_target"] = row["drafter_graph_1row_ms"] / row["target_1row_onegemm_ms"]
        rows.append({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()})
        log(f"GPU drafter batch {b}: " + ", ".join(f"{key} {v}" for key, v in rows[-1].items() if key != "batch"))
    return rows, capture


class DeviceWatch:
    """Records, for every forward of a torch engine and every static step (capture and eager
    forward alike), whether the engine's GPU was the current CUDA device."""

    def __init__(self, device: torch.device):
        self.device, self.calls, self.wrong = device, 0, 0
        self._undo = []

    def _check(self) -> None:
        self.calls += 1
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            self.wrong += 1

    def install(self) -> "DeviceWatch":
        from ssd.engine.model import Transformer

        for cls in (Transformer, StaticStep):
            original = cls.forward

            def forward(obj, *a, _original=original, **kw):
                self._check()
                return _original(obj, *a, **kw)

            cls.forward = forward
            self._undo.append((cls, original))
        return self

    def remove(self) -> None:
        for cls, original in self._undo:
            cls.forward = original

    def to_dict(self) -> dict:
        return {"engine_device": str(self.device), "forwards_checked": self.calls, "forwards_off_device": self.wrong}


def pick_device(requested: str) -> torch.device:
    """``cuda`` alone: the last GPU, so that with two or more the engines run on a non-zero index
    while the current device stays cuda:0 (what a drafter on GPU 4 of the paper's layout sees)."""
    dev = torch.device(requested)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.device_count() - 1)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    return dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target-config", type=Path, default=None, help="default: Qwen2.5-Coder-1.5B's shapes")
    ap.add_argument("--drafter-config", type=Path, default=None, help="default: Qwen2.5-Coder-0.5B's shapes")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt in the exactness runs")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--out", type=Path, required=True, help="JSON report")
    a = ap.parse_args()
    started = time.perf_counter()
    dev = pick_device(a.device)
    device = str(dev)
    report: dict = {"device": device, "torch": torch.__version__}
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)
        report["gpus"] = torch.cuda.device_count()
    watch = DeviceWatch(dev).install()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tcfg = json.loads(a.target_config.read_text()) if a.target_config else DEFAULT_PAIR["target"]
        dcfg = json.loads(a.drafter_config.read_text()) if a.drafter_config else DEFAULT_PAIR["drafter"]
        tdir = random_engine(tcfg, Path(tmp) / "target", 1, device)
        ddir = random_engine(dcfg, Path(tmp) / "drafter", 2, device)
        target = TorchEngine(tdir, device=device, exact=True)
        # the target drafting for itself, eagerly and on the CUDA-graph engine: total greedy acceptance
        drafters = {"random": TorchEngine(ddir, device=device, exact=False),
                    "self": TorchEngine(tdir, device=device, exact=False),
                    "self_graphs": StaticEngine(tdir, device=device, exact=False, max_sequences=max(4, a.prompts),
                                                static_len=256)}
        log(f"random engines built and loaded in {time.perf_counter() - t0:.0f} s")
        report["gemm_rows"] = gemm_rows(target)
        for name, r in report["gemm_rows"].items():
            log(f"GEMM {name}: row 0 equals its 2-row result at M = {ranges(r['rows_equal_to_2'])}; "
                f"offset 17 in 32 equal: {r['offset_17_in_32_equal']}")
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, target.vocab_size, (16 + 8 * i,), generator=g).tolist() for i in range(a.prompts)]
        report["exactness"] = exactness(target, drafters, prompts, a.tokens, a.k)
        report["all_exact"] = all(r["equal_to_ar"] == r["prompts"] for r in report["exactness"])
        batches = [int(b) for b in a.batches.split(",")]
        report["timings"] = timings(target, drafters["random"], a.k, batches)
        report["drafter_graphs"], report["graph_capture"] = drafter_graph_timings(ddir, target, device, a.k, batches)
    watch.remove()
    report["device_scope"] = watch.to_dict()
    report["device_scope_ok"] = watch.calls > 0 and watch.wrong == 0
    report["wall_s"] = round(time.perf_counter() - started, 1)
    a.out.write_text(json.dumps(report, indent=1))
    log(f"all exact: {report['all_exact']}; device scope ok: {report['device_scope_ok']}; "
        f"{report['wall_s']} s; report in {a.out}")


if __name__ == "__main__":
    main()
