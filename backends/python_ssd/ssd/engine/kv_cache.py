"""Per-sequence KV storage: one growable [kv_heads, capacity, head_dim] tensor pair per layer.

Slots are storage indices. A sequence's committed tokens occupy slots 0..len-1 in order; rows of a
speculation tree live in scratch slots after them. Rolling back is just forgetting slots (the engine
tracks the committed length); committing a branch copies its scratch slots down into place.
"""
from __future__ import annotations

import torch


class SequenceKV:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256,
                 device: torch.device | str = "cpu"):
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.reserve(capacity)

    def reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        new_cap = max(slots, 2 * self.capacity, 64)
        shape = (self.kv_heads, new_cap, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for i in range(len(self.k)):  # amortised doubling: copies are rare
            k[i][:, : self.capacity] = self.k[i]
            v[i][:, : self.capacity] = self.v[i]
        self.k, self.v, self.capacity = k, v, new_cap

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[1]
        self.k[layer][:, start:start + n] = k
        self.v[layer][:, start:start + n] = v

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self.k[layer][:, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.v[layer][:, :end]

    def move_slots(self, src: list[int], dst_start: int) -> None:
        """Copies slots ``src`` (in order) to ``dst_start, dst_start+1, ...`` in every layer."""
        if not src:
            return
        idx = torch.tensor(src, dtype=torch.long, device=self.device)
        n = len(src)
        for layer in range(self.layers):
            self.k[layer][:, dst_start:dst_start + n] = self.k[layer].index_select(1, idx)
            self.v[layer][:, dst_start:dst_start + n] = self.v[layer].index_select(1, idx)

    def nbytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.capacity * self.head_dim * self.k[0].element_size()
