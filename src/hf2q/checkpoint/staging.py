"""Tensor bytes from the memory-mapped GGUF to the device in large transfers through reused pinned buffers.

Copying a memory-mapped array straight to CUDA goes through the driver's small pageable staging, one
synchronous step at a time. Here each tensor is cut into CHUNK_BYTES pieces that alternate between two
pinned buffers: while one piece is on its way to the GPU (non_blocking), the next is read from the file's
pages into the other buffer, so reading the file overlaps the transfers. Bytes only: conversions and the
K-quant re-layout happen on the device afterwards.
"""
from __future__ import annotations

import numpy as np
import torch

CHUNK_BYTES = 64 << 20


class StagedCopier:
    """Copies host arrays (memory-mapped file pages) to `device` as flat uint8 tensors."""

    def __init__(self, device, chunk_bytes: int = CHUNK_BYTES):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)]
        self._in_flight: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def copy(self, src: np.ndarray) -> torch.Tensor:
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        out = torch.empty(flat.size, dtype=torch.uint8, device=self.device)
        chunk = self._buffers[0].numel()
        for start in range(0, flat.size, chunk):
            n = min(chunk, flat.size - start)
            i, self._turn = self._turn, self._turn ^ 1
            if self._in_flight[i] is not None:  # the buffer's previous piece must have left it
                self._in_flight[i].synchronize()
            staged = self._buffers[i][:n]
            staged.numpy()[:] = flat[start:start + n]
            out[start:start + n].copy_(staged, non_blocking=self._cuda)
            if self._cuda:
                self._in_flight[i] = torch.cuda.Event()
                self._in_flight[i].record()
        return out
