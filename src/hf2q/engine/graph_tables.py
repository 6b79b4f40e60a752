"""The block tables inside a captured graph's int64 pack, written on the host and uploaded by the corner that changed.

A graph's tables are as wide as the longest sequence it may meet (`max_model_len / block_size` columns: 16,384 at
262,144 tokens, 8 MiB for 64 rows of int64), but a step's sequences fill only their own first few columns. The host
pack clears the cells the previous step wrote and writes this step's, so the pack differs from what the device holds
only inside the rows and columns of the two steps' cells. That corner alone is packed contiguous, uploaded, and put
in place by one device-side copy, instead of every row's full width crossing the bus each step.
"""
from __future__ import annotations

import numpy as np
import torch


class GraphTables:
    """The [rows, width] block tables at `offset` in a graph's pinned host pack and its device copy."""

    def __init__(self, host_pack: torch.Tensor, dev_pack: torch.Tensor, offset: int, rows: int, width: int):
        self.rows, self.width = rows, width
        size = rows * width
        self._host = host_pack.numpy()[offset:offset + size]
        self._dev = dev_pack[offset:offset + size].view(rows, width)
        pinned = dev_pack.device.type == "cuda"
        self._stage_host = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self._stage_dev = torch.zeros(size, dtype=torch.long, device=dev_pack.device)
        self._cells = np.zeros(0, dtype=np.int64)  # the host's non-zero cells (flat indices in the tables)
        self._extent = (0, 0)  # rows and columns those cells span
        self._on_device = (0, 0)  # the extent of the cells the device holds

    def write(self, cells: list[int], values: list[int]) -> None:
        """Make `cells` (flat indices into the tables) hold `values` and every other cell zero, on the host."""
        self._host[self._cells] = 0
        self._cells = np.asarray(cells, dtype=np.int64)
        self._host[self._cells] = values
        if self._cells.size:
            self._extent = (int(self._cells.max()) // self.width + 1, int((self._cells % self.width).max()) + 1)
        else:
            self._extent = (0, 0)

    def synced(self) -> None:
        """The whole pack was just copied to the device: it holds the host's cells."""
        self._on_device = self._extent

    def upload(self) -> None:
        """Bring the device's tables level with the host's (queued on the current stream): the corner spanned by
        the host's cells and the device's. The host pack and its staging may be rewritten once the stream has
        passed this copy (the graphs' `_copied` event, recorded after it)."""
        rows = max(self._extent[0], self._on_device[0])
        cols = max(self._extent[1], self._on_device[1])
        self._on_device = self._extent
        if not rows or not cols:
            return
        corner = self._stage_host.numpy()[:rows * cols].reshape(rows, cols)
        np.copyto(corner, self._host.reshape(self.rows, self.width)[:rows, :cols])
        staged = self._stage_dev[:rows * cols]
        staged.copy_(self._stage_host[:rows * cols], non_blocking=True)
        self._dev[:rows, :cols].copy_(staged.view(rows, cols))
