"""BlockTable / MultiGroupBlockTable: incremental row updates and vectorised slot mapping."""
import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from runtime.worker.block_table import BlockTable, MultiGroupBlockTable  # noqa: E402


def _row(t: BlockTable, row: int) -> list[int]:
    return t.np[row, : t.num_blocks_per_row[row]].tolist()


def test_shapes_and_dtypes():
    t = BlockTable(max_num_reqs=3, max_num_blocks_per_req=5, block_size=4)
    assert t.np.shape == (3, 5) and t.np.dtype == np.int32
    assert t.tensor.shape == (3, 5) and t.tensor.dtype == torch.int32
    assert t.num_blocks_per_row.tolist() == [0, 0, 0]
    assert not t.np.any()


def test_add_and_append_row():
    t = BlockTable(3, 5, 4)
    t.add_row([7, 3], 1)
    assert _row(t, 1) == [7, 3]
    assert t.num_blocks_per_row.tolist() == [0, 2, 0]
    t.append_row([9], 1)
    t.append_row([], 1)                  # no-op
    t.append_row([2, 5], 1)
    assert _row(t, 1) == [7, 3, 9, 2, 5]
    assert t.np[1].tolist() == [7, 3, 9, 2, 5]
    assert t.np[0].tolist() == [0] * 5 and t.np[2].tolist() == [0] * 5
    # add_row restarts the row.
    t.add_row([4], 1)
    assert _row(t, 1) == [4]
    assert t.num_blocks_per_row[1] == 1


def test_overflow_raises_and_changes_nothing():
    t = BlockTable(2, 3, 4)
    t.add_row([1, 2], 0)
    with pytest.raises(ValueError, match="row 0 would hold 4 blocks > 3"):
        t.append_row([3, 4], 0)
    assert _row(t, 0) == [1, 2]
    assert t.np[0].tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="row 1 would hold 4 blocks > 3"):
        t.add_row([1, 2, 3, 4], 1)
    assert t.num_blocks_per_row[1] == 0
    assert t.np[1].tolist() == [0, 0, 0]
    t.append_row([3], 0)                 # exactly full is fine
    assert _row(t, 0) == [1, 2, 3]


def test_clear_row():
    t = BlockTable(2, 4, 4)
    t.add_row([5, 6, 7], 0)
    t.add_row([8], 1)
    t.clear_row(0)
    assert t.num_blocks_per_row.tolist() == [0, 1]
    assert t.np[0].tolist() == [0, 0, 0, 0]
    assert t.np[1].tolist() == [8, 0, 0, 0]
    t.append_row([2], 0)
    assert _row(t, 0) == [2]


def test_move_row_overwrites_and_zeroes_tail():
    t = BlockTable(3, 4, 4)
    t.add_row([1, 2, 3, 4], 0)
    t.add_row([5, 6], 2)
    t.move_row(2, 0)
    assert t.np[0].tolist() == [5, 6, 0, 0]
    assert t.num_blocks_per_row[0] == 2
    # The source row is left as it was (the caller clears it).
    assert t.np[2].tolist() == [5, 6, 0, 0]
    assert t.num_blocks_per_row[2] == 2
    t.append_row([9], 0)
    assert _row(t, 0) == [5, 6, 9]
    t.move_row(1, 0)                     # an empty row
    assert t.np[0].tolist() == [0, 0, 0, 0] and t.num_blocks_per_row[0] == 0


def test_add_row_zeroes_stale_tail():
    t = BlockTable(1, 4, 4)
    t.add_row([1, 2, 3, 4], 0)
    t.add_row([7], 0)
    assert t.np[0].tolist() == [7, 0, 0, 0]


def test_tensor_shares_memory_with_numpy():
    t = BlockTable(2, 3, 4)
    assert t.tensor.data_ptr() == t.np.ctypes.data
    t.add_row([11, 12], 1)
    assert t.tensor[1].tolist() == [11, 12, 0]
    t.move_row(1, 0)
    assert t.tensor.tolist() == [[11, 12, 0], [11, 12, 0]]
    t.clear_row(1)
    assert t.tensor[1].tolist() == [0, 0, 0]
    t.tensor[0, 2] = 42                  # and the other way round
    assert t.np[0, 2] == 42


def test_slot_mapping_matches_hand_computation():
    bs = 4
    t = BlockTable(3, 4, bs)
    t.add_row([5, 2, 9], 0)
    t.add_row([7], 1)
    t.add_row([3, 1, 8, 6], 2)
    # Row 0 decodes position 9, row 2 prefills 0..5 and continues 13..14, row 1 positions 0..3.
    req_rows = np.array([0, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1])
    positions = np.array([9, 0, 1, 2, 3, 4, 5, 13, 14, 0, 1, 2, 3])
    expected = [9 * bs + 1,                                      # pos 9: block idx 2 (id 9), off 1
                3 * bs + 0, 3 * bs + 1, 3 * bs + 2, 3 * bs + 3,  # row 2, block 3
                1 * bs + 0, 1 * bs + 1,                          # row 2, block 1
                6 * bs + 1, 6 * bs + 2,                          # pos 13, 14: block idx 3 (id 6)
                7 * bs + 0, 7 * bs + 1, 7 * bs + 2, 7 * bs + 3]
    got = t.slot_mapping(req_rows, positions)
    assert got.dtype == np.int64
    assert got.tolist() == expected
    # And a loop over tokens, for a random batch.
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 3, size=50)
    pos = np.array([rng.integers(0, t.num_blocks_per_row[r] * bs) for r in rows])
    loop = [int(t.np[r, p // bs]) * bs + p % bs for r, p in zip(rows, pos)]
    assert t.slot_mapping(rows, pos).tolist() == loop


def test_slot_mapping_no_int32_overflow():
    bs = 16
    t = BlockTable(1, 2, bs)
    big = 2**31 // bs + 5               # block_id * block_size > int32 max
    t.add_row([big], 0)
    assert t.slot_mapping(np.array([0]), np.array([3])).tolist() == [big * bs + 3]


def test_multigroup_sizes_and_moves_all_groups():
    m = MultiGroupBlockTable(max_num_reqs=3, max_model_len=17, block_sizes=[4, 8])
    assert len(m) == 2
    assert m[0].np.shape == (3, 5) and m[1].np.shape == (3, 3)   # ceil(17/4), ceil(17/8)
    assert m[0].block_size == 4 and m[1].block_size == 8
    m.add_row([[1, 2], [3]], 0)
    m.add_row([[4], [5, 6]], 2)
    m.append_row([[7], []], 0)
    assert _row(m[0], 0) == [1, 2, 7] and _row(m[1], 0) == [3]
    m.move_row(2, 0)
    assert _row(m[0], 0) == [4] and _row(m[1], 0) == [5, 6]
    assert m[0].np[0].tolist() == [4, 0, 0, 0, 0]
    assert m[1].np[0].tolist() == [5, 6, 0]
    m.clear_row(2)
    assert m[0].num_blocks_per_row[2] == 0 and m[1].num_blocks_per_row[2] == 0
    assert not m[0].np[2].any() and not m[1].np[2].any()
    with pytest.raises(ValueError, match="row 1 would hold 4 blocks > 3"):
        m.add_row([[1], [1, 2, 3, 4]], 1)
