"""ColPali / ColQwen2 inputs, built by the model's own processor (ColPaliProcessor, ColQwen2Processor).

A query becomes the token sequence `processor(text=[query])` builds: ColPali's
"<bos>Question: {query}" or ColQwen2's "Query: {query}", ten augmentation tokens (the pad token)
and a newline. A page becomes what `processor(images=[page])` builds: its pixel values (ColPali:
one size; ColQwen2: a page's patch rows at its own resolution, and their grid) and the token
sequence around its image tokens (the visual prompt, "Describe the image."). The processor itself
builds both, so a prefix, an augmentation count or a resolution setting in the model's
processor_config.json is honoured without encoderd knowing it.

A page's batch cost is the length of that sequence, the tokens the language model reads: ColQwen2
pages of different sizes cost differently, and queue and batch budgets count them so.
"""

from __future__ import annotations

import numpy as np

from ..base.errors import InvalidInput
from .media import MediaLimits, Preprocessed, decode_image


class RetrievalProcessor:
    """The model's processor: pages (called like the other preprocessors) and queries (query_ids)."""

    modality = "image"

    def __init__(self, model_dir: str, limits: MediaLimits):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.limits = limits

    def __call__(self, data: bytes, what: str) -> Preprocessed:
        image = decode_image(data, self.limits, what)
        try:
            built = self.processor(images=[image])
        except Exception as exc:  # noqa: BLE001 - exotic modes (16-bit, CMYK variants...) the processor rejects
            raise InvalidInput(f"{what}: cannot preprocess the image ({image.mode}, {image.size}): {exc}") from None
        ids = built["input_ids"][0].numpy().astype(np.int32)
        pixels = np.ascontiguousarray(built["pixel_values"][0].float().numpy())
        grid = built.get("image_grid_thw")
        return Preprocessed(pixels, len(ids), ids=ids, grid=None if grid is None else grid[0].numpy().astype(np.int32))

    def query_ids(self, text: str) -> np.ndarray:
        """The query's token ids, prefix and augmentation tokens included, as the processor builds them."""
        return self.processor(text=[text])["input_ids"][0].numpy().astype(np.int32)
