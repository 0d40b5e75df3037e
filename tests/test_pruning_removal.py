"""Pruning's head removal per group of batch rows (`row_removal`: cross-fitted folds and the
lone-head passes) against removing each row's heads on that row alone (`cw_lens.remove_heads`).

Tolerance: `ATOL` on the logits (float32; the same operations on a batch and on one row differ
only in the order of the matrix products' sums).
"""

from __future__ import annotations

import pytest
import torch

import cw_lens
from cw_lens.analyses.pruning.lone_heads import row_removal
from cw_lens.data.inputs import TokenBatch, prepare_inputs
from cw_lens.data.scoring import run_logits

TEXTS = ["the first of four rows", "a second row", "the third row of text", "and a fourth"]
ATOL = 1e-4


@pytest.mark.parametrize(
    "removed",
    [
        [[(0, 1)], [(1, 0), (1, 3), (0, 2)]],  # two folds, a layer in both
        [[], [(1, 2)], [(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 1)]],  # a group removes nothing
    ],
)
def test_rows_lose_their_own_groups_heads(llama, removed):
    batch = prepare_inputs(llama, TEXTS)
    group_of_row = torch.arange(len(TEXTS)) % len(removed)
    got = run_logits(llama, batch, row_removal(group_of_row, removed, llama.cfg.n_heads))
    for row in range(len(TEXTS)):
        one = TokenBatch(
            batch.tokens[row : row + 1], batch.mask[row : row + 1], True, batch.bos_token, [0]
        )
        heads = removed[int(group_of_row[row])]
        hooks = cw_lens.remove_heads(llama, heads).hooks if heads else ()
        want = run_logits(llama, one, hooks)[0]
        real = batch.mask[row]
        assert torch.allclose(got[row][real], want[real], atol=ATOL), row
    clean = run_logits(llama, batch)
    assert not torch.allclose(got[1], clean[1], atol=1e-3)  # the removal changed something
