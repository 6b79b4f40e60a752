"""A graph's block tables uploaded by the corner that changed (hf2q.engine.graph_tables): after every step the
device's tables equal the host's, whole, though each upload copies only the rows and columns of the cells."""
from __future__ import annotations

import random

import torch

from hf2q.engine.graph_tables import GraphTables


def test_the_device_tables_follow_the_host_through_growing_and_shrinking_steps():
    rows, width, offset = 8, 64, 5
    host, dev = torch.zeros(offset + rows * width + 3, dtype=torch.long), torch.full((offset + rows * width + 3,), -1)
    dev[offset:offset + rows * width] = 0
    tables = GraphTables(host, dev, offset, rows, width)
    rng = random.Random(0)
    for step in range(40):
        n = rng.randint(0, rows)  # sequences this step, each with its own table length
        lengths = [rng.randint(1, width if step % 10 == 9 else 6) for _ in range(n)]
        cells = [i * width + c for i, k in enumerate(lengths) for c in range(k)]
        tables.write(cells, [rng.randint(1, 10 ** 6) for _ in cells])
        tables.upload()
        assert torch.equal(dev[offset:offset + rows * width], host[offset:offset + rows * width]), step
    # the pack's other fields were never written by the tables
    assert (dev[:offset] == -1).all() and (dev[offset + rows * width:] == -1).all()


def test_an_upload_copies_the_corner_not_the_full_width(monkeypatch):
    rows, width = 4, 1024
    host, dev = torch.zeros(rows * width, dtype=torch.long), torch.zeros(rows * width, dtype=torch.long)
    tables = GraphTables(host, dev, 0, rows, width)
    sizes = []
    real = torch.Tensor.copy_

    def spy(self, src, *args, **kwargs):
        sizes.append(src.numel())
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    tables.write([0, 1, 2, width, width + 1], [7, 8, 9, 10, 11])  # two sequences of 3 and 2 blocks
    tables.upload()
    tables.write([0], [5])  # one sequence of one block: last step's corner is cleared too
    tables.upload()
    monkeypatch.undo()
    assert sizes == [6, 6, 6, 6] and torch.equal(dev, host)
