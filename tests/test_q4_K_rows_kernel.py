"""The Q4_K kernel tools/llamacpp/patches/q4_K-rows-vnni.patch adds to the served llama.cpp build,
called through ctypes on random weights against llama.cpp's own repacked kernels in the same library.

For any number of rows (groups of four in the interleaved Q8_K layout, then one to three rows of
their own) and any column count (blocks of sixteen, then a last block of eight), every output must
equal bit for bit what llama.cpp's 4-row GEMM and one-row GEMV give, and stay close to its plain C
reference. The kernel is built for CPUs with AVX-512 VNNI only; elsewhere the build must not have it.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

QK_K = 256
Q4_KX8_BYTES = 2 * 8 * 2 + 96 + 1024  # d[8], dmin[8] (fp16), 6-bit scales and mins, 4-bit quants
Q8_K_BYTES = 4 + QK_K + 2 * QK_K // 16  # d (float), quants, sums of 16


def _cpu_has_avx512_vnni() -> bool:
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return {"avx512_vnni", "avx512bw", "avx512dq"} <= set(line.split(":", 1)[1].split())


@pytest.fixture(scope="module")
def ggml_cpu():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()  # fills the fp16 table every kernel reads its scales through
    return lib


def _weights(rng, cols: int, n: int) -> np.ndarray:
    """Random block_q4_Kx8 groups: cols / 8 groups of n / 256 super-blocks, finite fp16 scales."""
    blocks = np.empty((cols // 8, n // QK_K, Q4_KX8_BYTES), np.uint8)
    halves = rng.uniform(1e-3, 2e-2, size=(cols // 8, n // QK_K, 16)).astype(np.float16)
    blocks[..., :32] = halves.view(np.uint8).reshape(cols // 8, n // QK_K, 32)
    blocks[..., 32:] = rng.integers(0, 256, size=(cols // 8, n // QK_K, Q4_KX8_BYTES - 32), dtype=np.uint8)
    return blocks


def _activations(lib, rng, rows: int, n: int) -> np.ndarray:
    """Rows quantized as the repacked product quantizes them: groups of four interleaved, then rows."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    out = np.zeros(rows * (n // QK_K) * Q8_K_BYTES, np.uint8)
    row_bytes = (n // QK_K) * Q8_K_BYTES
    for r in range(0, rows - rows % 4, 4):
        lib.ggml_quantize_mat_q8_K_4x8(x[r:].ctypes.data_as(ctypes.c_void_p),
                                       out[r * row_bytes:].ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    for r in range(rows - rows % 4, rows):
        lib.quantize_row_q8_K(x[r].ctypes.data_as(ctypes.c_void_p),
                              out[r * row_bytes:].ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n))
    return out


def _call(fn, n, out, bs, w, a, rows, cols):
    fn(ctypes.c_int(n), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(bs), w.ctypes.data_as(ctypes.c_void_p),
       a.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(rows), ctypes.c_int(cols))


def _llama_cpp_kernels(lib, n, w, a, rows, cols) -> np.ndarray:
    """What llama.cpp's repacked product computes: the GEMM for the groups of four, a GEMV a row."""
    out = np.full((rows, cols), np.nan, np.float32)
    groups = rows - rows % 4
    if groups:
        _call(lib.ggml_gemm_q4_K_8x8_q8_K, n, out, cols, w, a, groups, cols)
    row_bytes = (n // QK_K) * Q8_K_BYTES
    for r in range(groups, rows):
        _call(lib.ggml_gemv_q4_K_8x8_q8_K, n, out[r], cols, w, a[r * row_bytes:], 1, cols)
    return out


@pytest.mark.parametrize("cols", [8, 16, 40])
def test_rows_kernel_gives_llama_cpp_kernels_bits(ggml_cpu, cols):
    if not _cpu_has_avx512_vnni():
        assert not hasattr(ggml_cpu, "ggml_gemm_q4_K_8x8_q8_K_rows"), "built without AVX-512 VNNI, kept llama.cpp's"
        return
    rng = np.random.default_rng(cols)
    n = 3 * QK_K
    w = _weights(rng, cols, n)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9):
        a = _activations(ggml_cpu, rng, rows, n)
        ours = np.full((rows, cols), np.nan, np.float32)
        _call(ggml_cpu.ggml_gemm_q4_K_8x8_q8_K_rows, n, ours, cols, w, a, rows, cols)
        theirs = _llama_cpp_kernels(ggml_cpu, n, w, a, rows, cols)
        assert np.isfinite(theirs).all()
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), f"{rows} rows x {cols} columns"
        if rows % 4 == 0:  # llama.cpp's plain C GEMM: other float order, same products
            ref = np.full((rows, cols), np.nan, np.float32)
            _call(ggml_cpu.ggml_gemm_q4_K_8x8_q8_K_generic, n, ref, cols, w, a, rows, cols)
            np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
