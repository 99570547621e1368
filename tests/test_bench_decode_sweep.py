"""The decode sweep's block tables (its timing needs a GPU): each row holds the blocks its
context needs, and every block of the cache belongs to one row."""
import torch

from pagedserve.bench.decode_sweep import BLOCK_SIZE, CASES, case_tables


def test_every_block_in_one_row_and_each_row_long_enough():
    torch.manual_seed(0)
    lens, table, num_blocks = case_tables(40, 150, 1100, device="cpu")
    assert lens.min() >= 150 and lens.max() <= 1100
    needed = (-(-lens // BLOCK_SIZE)).tolist()
    used = [block for row, count in zip(table.tolist(), needed) for block in row[:count]]
    assert sorted(used) == list(range(num_blocks))
    assert table.shape == (40, max(needed))


def test_a_fixed_context_is_that_context_in_every_row():
    lens, table, num_blocks = case_tables(*CASES["16x600"], device="cpu")
    assert lens.tolist() == [600] * 16 and num_blocks == 16 * -(-600 // BLOCK_SIZE)
