"""PackedBatch (workers/backends/packed_pieces.py): each token's offset in its sequence, the longest
sequence and the sequence bounds, the same through the one-sequence path a live query takes as
through the general one."""

from __future__ import annotations

import pytest
import torch

from encoderd.workers.backends import packed_encoder
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


@pytest.mark.parametrize("lengths,multiple,filler", [([10], 8, 6), ([3, 5], 8, 0), ([1], 8, 7), ([5, 1, 12], 16, 14)])
def test_with_filler_rounds_the_tokens_up_by_one_more_sequence(lengths, multiple, filler):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(lengths)
    batch = PackedBatch.of(torch.arange(1, tokens + 1), cu_seqlens, torch.ones(tokens, dtype=torch.long))
    rounded, added = batch.with_filler(multiple)
    assert added == filler and rounded.ids.shape[0] == tokens + filler and rounded.ids.shape[0] % multiple == 0
    if not filler:
        assert rounded is batch
        return
    assert rounded.bounds == [*cu_seqlens.tolist(), tokens + filler]  # the filler is a sequence of its own
    assert rounded.cu_seqlens.dtype == torch.int32
    assert torch.equal(rounded.ids[:tokens], batch.ids) and not rounded.ids[tokens:].any()
    assert torch.equal(rounded.types[:tokens], batch.types) and not rounded.types[tokens:].any()
    assert torch.equal(rounded.offsets, torch.cat([batch.offsets, torch.arange(filler)]))
    assert rounded.longest == max(*lengths, filler)


def test_the_gemm_rows_multiple_grows_with_the_batch_and_keeps_its_filler_share():
    """8 rows for a short query; for bigger batches a multiple that keeps the filler under 1/32 of the rows
    (32 row counts per doubling: oneDNN's primitive cache keeps them), up to 128 (one filler sequence)."""
    multiple_of = packed_encoder.gemm_rows_multiple
    assert [multiple_of(n) for n in (1, 511, 512, 1024, 4095, 4096, 8192, 50_000)] == [8, 8, 16, 32, 64, 128, 128, 128]
    for tokens in range(1, 20_000, 7):
        multiple = multiple_of(tokens)
        assert multiple % 8 == 0 and multiple <= packed_encoder.GEMM_ROWS_MAX_MULTIPLE
        assert multiple == 8 or (multiple - 1) * packed_encoder.GEMM_ROWS_FILLER_SHARE < tokens
    assert len({-(-n // multiple_of(n)) * multiple_of(n) for n in range(4097, 8193)}) == 32
