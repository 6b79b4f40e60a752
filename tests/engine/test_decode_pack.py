"""The decode graphs' host pack, on the CPU: the bulk packing writes what the per-row formula wrote, and the
tables' upload (hf2q.engine.graph_tables) leaves the device's tables equal to the host's."""
import pytest
import torch

from hf2q.engine.cuda_graphs import DecodeGraphs, pack_decode_rows
from hf2q.engine.graph_tables import GraphTables


class _Cache:
    def __init__(self, tables):
        self.tables = tables

    def block_table(self, slot):
        return self.tables[slot]


def _graphs(tables, buckets=(1, 2, 4, 8), width=6, block_size=4, pad_slot=9, pad_block=31):
    g = object.__new__(DecodeGraphs)
    g.cache, g.buckets, g.width, g.block_size = _Cache(tables), buckets, width, block_size
    g.pad_slot, g.pad_block, g._copied = pad_slot, pad_block, None
    n = buckets[-1]
    g._host = torch.zeros(5 * n + n * width, dtype=torch.long)  # as DecodeGraphs allocates it
    g._host[:5 * n] = -7  # fields: each step must write its rows
    g._dev = g._host.clone()
    g._tables = GraphTables(g._host, g._dev, 5 * n, n, width)
    return g


def _reference(g, b, ids, positions, slots):
    """The per-row packing DecodeGraphs used before (one tensor write per field per row)."""
    host = g._host.clone()
    h_ids, h_pos, h_slots, h_map, h_lens, h_tab = g._views(host, b)
    n, bs = len(positions), g.block_size
    h_tab.zero_()
    for i in range(b):
        if i < n:
            slot, pos, table = slots[i], positions[i], g.cache.block_table(slots[i])
        else:
            slot, pos, table = g.pad_slot, 0, [g.pad_block]
        h_pos[i], h_slots[i], h_lens[i] = pos, slot, pos + 1
        h_map[i] = table[pos // bs] * bs + pos % bs
        h_tab[i, :len(table)] = torch.tensor(table, dtype=torch.long)
    h_ids[:n] = torch.tensor(ids, dtype=torch.long)
    h_ids[n:] = 0
    return host


STEPS = [(1, [0], [0]), (4, [5, 0, 13], [2, 0, 1]), (8, [23, 3], [1, 2]), (2, [4], [1]), (8, [1, 2, 3], [0, 1, 2])]


@pytest.mark.parametrize("b,positions,slots", STEPS)
def test_fill_host_matches_per_row_packing(b, positions, slots):
    check_steps([(b, positions, slots)])


def test_fill_host_steps_in_a_row_leave_no_stale_block_table_cells():
    check_steps(STEPS)


def check_steps(steps):
    tables = {0: [3], 1: [4, 8, 1, 0, 2, 5], 2: [7, 6]}
    g = _graphs(tables)
    n = g.buckets[-1]
    for b, positions, slots in steps:
        ids = [11 + i for i in range(len(positions))]
        want = _reference(g, b, ids, positions, slots)
        g._fill_host(b, ids, positions, slots)
        for k in range(5):  # each field's first b rows (the rest of a field is never read by bucket b)
            assert g._host[k * n: k * n + b].tolist() == want[k * n: k * n + b].tolist()
        used = 5 * n + b * g.width
        assert g._host[5 * n: used].tolist() == want[5 * n: used].tolist()
        g._tables.upload()  # the device's tables: all of them equal the host's after each step's upload
        assert g._dev[5 * n:].tolist() == g._host[5 * n:].tolist()


def test_pack_rejects_a_table_wider_than_the_graph():
    with pytest.raises(ValueError, match="exceeds"):
        pack_decode_rows(1, [1], [0], [0], [[1] * 7], pad_slot=9, pad_block=3, block_size=4, width=6)


def test_pack_of_device_ids_writes_zero_ids():
    fields, cells, values = pack_decode_rows(2, None, [5], [0], [[2, 3]], pad_slot=9, pad_block=4, block_size=4,
                                             width=3)
    assert fields == [0, 0, 5, 0, 0, 9, 3 * 4 + 1, 4 * 4, 6, 1]
    assert (cells, values) == ([0, 1, 3], [2, 3, 4])


def test_rotary_positions_apart_from_the_cache_positions():
    """A request with images rotates its token by index + delta but stores it at its index."""
    fields, _, _ = pack_decode_rows(2, [7], [5], [0], [[2, 3]], pad_slot=9, pad_block=4, block_size=4, width=3,
                                    rope_positions=[2])
    assert fields == [7, 0, 2, 0, 0, 9, 3 * 4 + 1, 4 * 4, 6, 1]


def test_rows_after_their_sequences_first_get_no_table():
    """With `firsts` (a prefill graph's rows, several of one sequence), only a sequence's first row and the padding
    rows get block-table cells (the attention kernel reads the first row's for them all); the slot mapping and
    context lengths are each row's own."""
    table, width, bs = [7, 3, 5], 4, 4
    plain = pack_decode_rows(5, [1, 2, 3], [4, 5, 9], [0, 0, 0], [table] * 3, 9, 31, bs, width)
    fields, cells, values = pack_decode_rows(5, [1, 2, 3], [4, 5, 9], [0, 0, 0], [table] * 3, 9, 31, bs, width,
                                             firsts=[0, 0, 0])
    assert fields == plain[0]
    assert cells == [0, 1, 2, 3 * width, 4 * width] and values == table + [31, 31]
