"""Token embeddings read from the engine file on demand instead of held in memory.

A tied model's output head is packed into oneDNN's layout for the GEMM, and the packed copy cannot
be indexed by token; the embedding table itself (0.47 GB for the default 1.5B target, 0.27 GB for
the 0.5B drafter) is only ever read a few rows at a time. So the table stays in the file: a
read-only map of just its bytes, whose pages join the process when a token is first looked up (the
page cache holds them; RSS counts the rows a server's traffic has used, not the vocabulary). The
values are the file's, converted exactly as a loaded table would be.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16), "F32": (np.float32, torch.float32)}


class MappedEmbedding:
    def __init__(self, path: str | Path, name: str, dtype: torch.dtype):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            info = json.loads(f.read(n))[name]
        np_dtype, self.file_dtype = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        self.shape = tuple(info["shape"])
        self.rows = np.memmap(path, dtype=np_dtype, mode="r", offset=8 + n + start, shape=self.shape)
        assert (end - start) == self.rows.nbytes
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (any shape), [..., hidden] in the engine's dtype."""
        flat = ids.reshape(-1).cpu().numpy()
        out = torch.from_numpy(np.ascontiguousarray(self.rows[flat]))
        if self.file_dtype == torch.bfloat16:
            out = out.view(torch.bfloat16)
        return out.to(self.dtype).reshape(*ids.shape, self.shape[1])
