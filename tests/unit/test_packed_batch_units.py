"""PackedBatch (workers/backends/packed_pieces.py): each token's offset in its sequence, the longest
sequence and the sequence bounds, the same through the one-sequence path a live query takes as
through the general one."""

from __future__ import annotations

import pytest
import torch

from encoderd.workers.backends.packed_pieces import PackedBatch


@pytest.mark.parametrize("lengths", [[10], [1], [3, 7], [1, 1, 1], [5, 1, 12]])
def test_offsets_longest_and_bounds_per_sequence(lengths):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.arange(sum(lengths), dtype=torch.long)
    batch = PackedBatch.of(ids, cu_seqlens)
    expected = torch.cat([torch.arange(n) for n in lengths])
    assert batch.offsets.dtype == torch.int64 and torch.equal(batch.offsets, expected)
    assert batch.longest == max(lengths) and isinstance(batch.longest, int)
    assert batch.bounds == cu_seqlens.tolist()


def test_one_sequence_keeps_its_token_types():
    types = torch.zeros(4, dtype=torch.long)
    batch = PackedBatch.of(torch.arange(4), torch.tensor([0, 4], dtype=torch.int32), types)
    assert batch.types is types
