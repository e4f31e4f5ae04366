"""llama-cpp-python's prompt lookup as a bench peer: ``Llama(draft_model=LlamaPromptLookupDecoding(...))``
on the target's GGUF, in a process of its own (its memory apart from the servers'), pinned with
taskset to the cores the others use.

The library is this project's build of llama-cpp-python (tools/llamacpp/install_llama_cpp_python.sh:
the pinned release with the project's batch-invariant multi-row kernels), so the peer is
llama-cpp-python's prompt lookup on that build. ``Llama.generate`` drafts up to ``num_pred_tokens``
tokens a round by matching the sequence's last 1..``max_ngram_size`` tokens against the prompt and
output so far, evaluates them with the last token in one forward and keeps the greedy tokens up to
the first mismatch. The process reads one JSON request a line on stdin ({"ids", "max_tokens"}) and
answers one JSON line on stdout: the output ids (up to the first end-of-generation token, left
out as llama-cpp-python's completions leave it out), the prefill seconds (up to the first token)
and the decode tokens/s over the tokens after the first, as llama.cpp's ``predicted_per_second``,
and the drafted and accepted tokens.

    PromptLookupPeer(gguf, pred_tokens=10, n_ctx=2048) as peer: peer.complete(ids, 256)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


class CountingLookup:
    """LlamaPromptLookupDecoding that keeps its last draft and the tokens it drafted in all."""

    def __init__(self, max_ngram_size: int, num_pred_tokens: int):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.inner = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.pending: list[int] = []
        self.drafted = 0

    def __call__(self, input_ids: np.ndarray, /, **kw) -> np.ndarray:
        draft = self.inner(input_ids, **kw)
        self.pending = [int(t) for t in draft]
        self.drafted += len(self.pending)
        return draft

    def accepted(self, token: int) -> bool:
        """Whether ``token`` (the next one ``generate`` yields) is the next of the last draft; the
        first one that is not ends that draft (the target's own token)."""
        if self.pending and self.pending[0] == token:
            self.pending.pop(0)
            return True
        self.pending = []
        return False


def generate(llm, lookup: CountingLookup, ids: list[int], max_tokens: int) -> dict:
    import llama_cpp

    lookup.drafted, lookup.pending = 0, []
    llm.reset()  # no prefix reuse: every request prefills its prompt, as the other sides
    out, accepted, stamps = [], 0, []
    t0 = time.perf_counter()
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        accepted += lookup.accepted(token)
        out.append(int(token))
        if len(out) >= max_tokens:
            break
    n = len(out)
    decode_s = stamps[n - 1] - stamps[0] if n > 1 else 0.0
    return {"ids": out, "tokens": n, "prefill_s": stamps[0] - t0 if stamps else 0.0,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 else 0.0,
            "draft_n": lookup.drafted, "draft_n_accepted": accepted}


def serve(a) -> None:
    """The worker: load, say ready, answer requests until stdin closes."""
    from llama_cpp import Llama

    lookup = CountingLookup(a.max_ngram_size, a.pred_tokens)
    # logits_all=True: with a draft model the library keeps every position's logits (its eval writes
    # them all), but it sizes that array from the logits_all argument: n_batch (512) rows when False,
    # so a sequence past 512 tokens fails with "could not broadcast ... into shape (0,)".
    llm = Llama(model_path=str(a.model), n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                draft_model=lookup, logits_all=True, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            req = json.loads(line)
            print(json.dumps(generate(llm, lookup, req["ids"], req["max_tokens"])), flush=True)


class PromptLookupPeer:
    """The worker process; a context manager that ends it on exit."""

    def __init__(self, model: Path, pred_tokens: int = 10, max_ngram_size: int = 2, n_ctx: int = 2048,
                 cores: str = "0,1", threads: int = 2, log_file: Path | None = None):
        self.cmd = ["taskset", "-c", cores, sys.executable, "-m", "ssd_tools.bench.lcpp_lookup", "--model", str(model),
                    "--pred-tokens", str(pred_tokens), "--max-ngram-size", str(max_ngram_size), "--n-ctx", str(n_ctx),
                    "--threads", str(threads)]
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PromptLookupPeer":
        log = open(self.log_file, "w") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        if json.loads(self._line()).get("ready") is not True:
            raise RuntimeError("llama-cpp-python's prompt lookup worker did not start")
        return self

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prompt lookup worker exited with code {self.proc.wait()}"
                               + (f" (log: {self.log_file})" if self.log_file else ""))
        return line

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": list(ids), "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def __exit__(self, *_) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a GGUF file")
    ap.add_argument("--pred-tokens", type=int, default=10, help="LlamaPromptLookupDecoding's num_pred_tokens")
    ap.add_argument("--max-ngram-size", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048, help="the longest prompt + max_tokens + pred-tokens fit")
    ap.add_argument("--threads", type=int, default=2)
    serve(ap.parse_args())


if __name__ == "__main__":
    main()
