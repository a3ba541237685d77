"""Block tables: per KV cache group, a 2-D buffer [max_num_reqs, max_num_blocks_per_req].

Rows belong to rows of the runner's persistent batch. They are updated incrementally (new
block ids appended, rows moved when the batch condenses), never rebuilt each step. The numpy
buffer and the torch tensor share memory, so the host side is written with numpy and the
model reads the tensor without a copy.
"""
from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int):
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.tensor = torch.from_numpy(self.np)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.np[row, len(block_ids):] = 0   # unused slots hold the null block
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {end} blocks > {self.max_num_blocks_per_req}")
        self.np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def clear_row(self, row: int) -> None:
        self.np[row, : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks_per_row[src]
        self.np[dst, :n] = self.np[src, :n]
        self.np[dst, n:] = 0
        self.num_blocks_per_row[dst] = n

    def slot_mapping(self, req_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat cache slot of each token: block id of its position times block_size plus
        the offset inside the block. Vectorised over the whole step."""
        block_ids = self.np[req_rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size


class MultiGroupBlockTable:
    """One BlockTable per KV cache group, moved together."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int]):
        self.tables = [BlockTable(max_num_reqs, -(-max_model_len // bs), bs) for bs in block_sizes]

    def __getitem__(self, group: int) -> BlockTable:
        return self.tables[group]

    def __len__(self) -> int:
        return len(self.tables)

    def add_row(self, block_ids: list[list[int]], row: int) -> None:
        for table, ids in zip(self.tables, block_ids):
            table.add_row(ids, row)

    def append_row(self, block_ids: list[list[int]], row: int) -> None:
        for table, ids in zip(self.tables, block_ids):
            table.append_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.tables:
            table.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.tables:
            table.move_row(src, dst)
