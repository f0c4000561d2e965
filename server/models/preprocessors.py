"""Which preprocessor each media modality of a model gets: media.py's image and audio ones, or a
retrieval model's own processor (retrieval.py, built on media.py's decoding): above both, so
neither imports the other's user.
"""

from __future__ import annotations

import logging
import threading

from ...workers.contract.model_spec import ModelKind, ModelSpec, modalities
from .media import PREPROCESSORS, MediaLimits
from .retrieval import RetrievalProcessor

log = logging.getLogger("encoderd.media")

# transformers' lazy imports are not thread-safe: two models loading processors at once can
# see a half-imported module ("cannot import name AutoImageProcessor").
_LOAD_LOCK = threading.Lock()


def load_preprocessors(spec: ModelSpec, limits: MediaLimits) -> dict:
    """modality -> preprocessor for the model's media modalities ({} for text-only kinds); a
    retrieval model's (ColPali, ColQwen2) is its processor, which builds its queries too."""
    loaded = {}
    for modality in modalities(spec.kind):
        if modality in PREPROCESSORS:
            make = RetrievalProcessor if spec.kind == ModelKind.COLPALI else PREPROCESSORS[modality]
            with _LOAD_LOCK:
                loaded[modality] = make(spec.path, limits)
            log.info(
                "%s: %s inputs via %s",
                spec.name,
                modality,
                type(getattr(loaded[modality], "processor", getattr(loaded[modality], "extractor", None))).__name__,
            )
    return loaded
