"""ColPaliForRetrieval and ColQwen2ForRetrieval forwards: a query's or a page's multi-vector rows.

The frontend runs the model's own processor (server/models/retrieval.py), so a query arrives as
the token sequence ColPaliProcessor / ColQwen2Processor build (prefix, text, ten augmentation
tokens, newline) and a page as its pixels plus the sequence built around its image tokens. The
model's `embeddings` (unit vectors, zero at padding) at every real position are returned,
prompt tokens included: the rows `processor.score_retrieval` scores.

Batches are right-padded: ColPali attends bidirectionally over the whole (prefix) sequence and
ColQwen2 causally, both with positions counted from the first token, so a row never depends on
the rows padded beside it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..contract.protocol import MediaBatch, Ragged, TokenBatch
from .base import padded

# The longest query a warm-up runs. A retrieval model's max_length is its language model's context
# (Qwen2-VL: 32768), and warming up two inputs of that length took a 2B ColQwen2 over ten minutes
# on 2 cores; queries are tens of tokens (prefix, text, ten augmentation tokens).
WARMUP_QUERY_TOKENS = 64

# PaliGemma attends bidirectionally over positions whose token type is 0; the processor returns
# token_type_ids of 0 for queries and pages and `model(**processor(...))` passes them on. Without
# them the text model would attend causally: other vectors.
_PREFIX_LM_TYPES = ("colpali",)


def query_rows(model, inputs: dict[str, torch.Tensor]) -> Ragged:
    """A padded text batch (input_ids, attention_mask) of processor-built query sequences."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    return _rows(model(input_ids=ids, attention_mask=mask, **_token_types(model, ids)).embeddings, mask)


def page_rows(model, batch: MediaBatch, device: torch.device) -> Ragged:
    """A page batch: pixels and the token sequences around their image tokens; with grids
    (ColQwen2) its pixels are the pages' patch rows back to back, padded per page here as the
    processor pads them."""
    if batch.token_ids is None or batch.token_cu is None:
        raise ValueError("a retrieval model's image batch carries the token sequences built around its images")
    ids_np, mask_np, _ = padded(TokenBatch(batch.batch_id, batch.token_ids, batch.token_cu))
    ids, mask = torch.from_numpy(ids_np).to(device), torch.from_numpy(mask_np).to(device)
    pixels = torch.tensor(batch.features, dtype=model.dtype, device=device)  # a copy: frames are read-only
    if batch.grids is None:
        out = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, **_token_types(model, ids))
        return _rows(out.embeddings, mask)
    grids = torch.from_numpy(np.asarray(batch.grids, dtype=np.int64)).to(device)
    out = model(input_ids=ids, attention_mask=mask, pixel_values=_per_page(pixels, grids), image_grid_thw=grids)
    return _rows(out.embeddings, mask)


def _token_types(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"token_type_ids": torch.zeros_like(ids)} if model.config.model_type in _PREFIX_LM_TYPES else {}


def _per_page(rows: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """(total rows, d) patch rows -> (pages, most rows, d), zero-padded: ColQwen2Processor's layout."""
    counts = grids.prod(dim=1).tolist()
    out = rows.new_zeros((len(counts), max(counts), rows.shape[1]))
    for page, piece in enumerate(torch.split(rows, counts)):
        out[page, : len(piece)] = piece
    return out


def _rows(embeddings: torch.Tensor, mask: torch.Tensor) -> Ragged:
    """The real positions' rows, ragged. The model normalized them in its own dtype; in float32
    again here, since a bfloat16 norm is off by up to ~0.4% (float32 rows change by an ulp)."""
    keep = mask.bool()
    rows = F.normalize(embeddings[keep].float(), dim=-1)  # row-major: input 0's positions first, as packed
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(keep.sum(dim=1).cpu(), dim=0, out=cu[1:])
    return Ragged(rows.cpu().numpy(), cu.numpy())
