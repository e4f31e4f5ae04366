"""The llama.cpp engine's load-time checks: a row's logits must not depend on the forward it is in.

llama.cpp picks its kernels by the number of rows in a product (docs/cpu_engine.md); the engine
serves exactly only if every forward it runs gives each row the bits a one-row step gives it.
These checks run those forwards at load and pick the engine's ``logit_rows`` (the most rows it puts
in one forward), or refuse the build.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .engine import ExtendCall

# the most logit rows a forward may hold: 32 rows cost 4-5 one-row steps (a lookup's verify of 31
# drafts); 16, 5-8; below the tiled kernels (8); below an unpatched build's 4-row GEMM (4)
LOGIT_ROW_CHOICES = (32, 16, 7, 3, 1)
PATCHED_FLOOR = 16  # the patched build's kernels keep bits up to here on every CPU it supports
STEPPED = 16  # rows each probe steps one at a time (the reference for forwards of up to 16 rows)
ROW_PROBES = ((16, 7919), (23, 104729), (37, 15485863), (50, 32452843))  # (prefix length, token stride)
# forward sizes around llama.cpp's kernel switches: the 4-row Q4_K GEMM and its leftover rows, the
# Q6_K kernel of 2-7 rows, the tiled kernels from 8, a 16-row forward
BOUNDARY_ROWS = (3, 4, 5, 7, 8, 9, 16)
# forward sizes past STEPPED, checked against forwards of STEPPED rows (whose rows the sizes up to
# STEPPED were found to keep): leftover rows past groups of four and of 16, the largest forward
WIDE_ROWS = (17, 19, 24, 31, 32)
PREFILL_PROBE = 24  # tokens of the prefill check's history: a prefill of them takes the multi-row kernels


def patched_build() -> bool:
    """Whether the installed llama-cpp-python is this project's patched build: its install script
    (tools/llamacpp/install_llama_cpp_python.sh) leaves the build options beside the package."""
    from pathlib import Path

    import llama_cpp

    stamp = Path(llama_cpp.__file__).parent / ".ssd_build_options"
    return stamp.exists() and "patches:" in stamp.read_text()


@contextmanager
def probing(engine):
    """A load-time check's forwards: they change logit_rows and are timed like any call; neither
    the setting nor their timings and reused prefixes outlive the check."""
    saved = engine.logit_rows
    try:
        yield
    finally:
        engine.logit_rows = saved
        engine.timing.clear()
        engine.reused.clear()

def probe_ids(engine, count: int, step: int) -> list[int]:
    return [(step * i) % (engine.vocab_size - 10) + 10 for i in range(count)]

def logits_in_forwards(engine, seq: str, ids: list[int], start: int, rows: int) -> torch.Tensor:
    """The logits of ``ids[start:]`` for ``seq``, which holds ``ids[:start]``, computed in forwards of
    ``rows`` rows (the last may hold fewer): a check's reference."""
    engine.logit_rows = rows
    return torch.cat([engine.extend([ExtendCall(seq, ids[: min(lo + rows, len(ids))], min(rows, len(ids) - lo))])[0]
                      for lo in range(start, len(ids), rows)])


def row_counts_keeping_bits(engine) -> dict[int, bool]:
    """For each forward size 2..LOGIT_ROW_CHOICES[0]: whether its rows get the logits they get one
    at a time (llama.cpp's kernel choice by row count is internal to the library: checked, not
    assumed). Every size up to STEPPED is checked, not only the ones logit_rows may take: a forward
    of 5 or 6 rows takes kernel paths a 4-row or 16-row one does not (the leftover rows after a
    group of four, the Q6_K kernel of 2-7 rows), and packed forwards have any size up to logit_rows.
    Several probes: where two kernels round differently, some inputs still give equal bits (on
    AVX2, about one in six 4-row forwards), so one probe can pass a size that changes other rows.
    Each probe steps STEPPED rows one at a time once, then reruns the first n of them as one
    forward: every n for the first two probes, the sizes where llama.cpp changes kernels
    (BOUNDARY_ROWS) for the others. Past STEPPED the reference is forwards of STEPPED rows, checked
    by the same probe (16 more one-row steps cost five forwards of 16 rows), at the WIDE_ROWS sizes
    for the first two probes and the largest for the others: a larger forward takes no kernel a
    smaller one skips, it repeats their groups. This keeps the check to a few seconds at load."""
    top = LOGIT_ROW_CHOICES[0]
    ok = {n: True for n in range(2, top + 1)}
    probe = "__rows_probe"
    with probing(engine):
        for k, (prefix, step) in enumerate(ROW_PROBES):
            ids = probe_ids(engine, prefix + top, step)
            engine.logit_rows = 1
            engine.extend([ExtendCall(probe, ids[:prefix], 1)])
            one = logits_in_forwards(engine, probe, ids[: prefix + STEPPED], prefix, 1)
            if top > STEPPED:
                one = torch.cat([one, logits_in_forwards(engine, probe, ids, prefix + STEPPED, STEPPED)])
            if k < 2:
                sizes = list(range(2, STEPPED + 1)) + [n for n in WIDE_ROWS if n <= top]
            else:
                sizes = list(BOUNDARY_ROWS) + ([top] if top > STEPPED else [])
            for n in sizes:
                engine.truncate(probe, prefix)  # the same prefix KV under both
                engine.logit_rows = n
                together = engine.extend([ExtendCall(probe, ids[: prefix + n], n)])[0]
                ok[n] = ok[n] and torch.equal(one[:n], together)
            engine.release(probe, keep_prefix=False)
    return ok

def sequences_keep_bits(engine, rows: int) -> bool:
    """Whether a forward holding several sequences (``rows`` rows in all, the same number from
    each, as pack_forwards builds them; sequences of different lengths) gives each row the
    logits its single-sequence forwards give it: one-row steps, or forwards of up to STEPPED rows
    where row_counts_keeping_bits found those sizes exact."""
    per = max(1, rows // 3)
    seqs = [(f"__seq_probe_{j}", probe_ids(engine, prefix + per, step))
            for j, (prefix, step) in enumerate(ROW_PROBES[:3])]
    with probing(engine):
        engine.logit_rows = 1
        one = []
        for name, ids in seqs:
            start = len(ids) - per
            engine.extend([ExtendCall(name, ids[:start], 1)])
            one.append(logits_in_forwards(engine, name, ids, start, 1 if rows <= STEPPED else STEPPED))
            engine.truncate(name, start)
        engine.logit_rows = per * len(seqs)
        together = engine.extend([ExtendCall(name, ids, per) for name, ids in seqs])
        for name, _ in seqs:
            engine.release(name, keep_prefix=False)
    return all(torch.equal(a, b) for a, b in zip(one, together))

def prefill_keeps_bits(engine) -> bool:
    """Whether the last row of a history prefilled in one forward (the multi-row kernels) gets the
    logits it gets when the history is stepped one row at a time."""
    ids = probe_ids(engine, PREFILL_PROBE, ROW_PROBES[0][1])
    probe = "__prefill_probe"
    with probing(engine):
        engine.logit_rows = 1
        for i in range(1, len(ids) + 1):
            stepped = engine.extend([ExtendCall(probe, ids[:i], 1)])[0]
        engine.release(probe, keep_prefix=False)
        once = engine.extend([ExtendCall(probe, ids, 1)])[0]
        engine.release(probe, keep_prefix=False)
        return torch.equal(stepped, once)


def choose_logit_rows(engine) -> int:
    """The largest of LOGIT_ROW_CHOICES whose every forward size up to it keeps a row's bits, alone
    and with several sequences in the forward. The project's patched build must reach
    PATCHED_FLOOR (docs/cpu_engine.md): one that does not is a kernel regression, and the engine
    refuses to load rather than serve at a fraction of its speed or with a changed kernel. Past the
    floor the check decides alone: a CPU whose kernels change a row's bits in a larger forward
    serves with the floor's forwards."""
    ok = row_counts_keeping_bits(engine)
    fits = [n for n in LOGIT_ROW_CHOICES if all(ok[m] for m in range(2, n + 1))]
    chosen = next((n for n in fits if n == 1 or sequences_keep_bits(engine, n)), 1)
    if patched_build() and chosen < PATCHED_FLOOR:
        bad = [n for n, same in ok.items() if not same and n <= PATCHED_FLOOR]
        raise RuntimeError(
            f"{engine.folder}: the patched llama.cpp build changes a row's logits in forwards of "
            f"{bad or 'several sequences'} rows (threads {engine.threads}): its kernels for this file's weight types "
            "no longer agree with the one-row kernel; rebuild llama-cpp-python (make venv)")
    return chosen
