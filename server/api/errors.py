"""The errors a call raises, under the name the in-process API documents for them
(docs/getting-started.md: `encoderd.server.api.errors`). They live in server/base/errors.py, below
every layer that raises them (models, scheduling); nothing in the repository imports this module.
"""

from ..base.errors import (
    BackendError,
    EncoderdError,
    InvalidInput,
    ModelNotFound,
    OutOfMemory,
    Overloaded,
    Unavailable,
    Unsupported,
    WrongModelKind,
)

__all__ = [
    "BackendError",
    "EncoderdError",
    "InvalidInput",
    "ModelNotFound",
    "OutOfMemory",
    "Overloaded",
    "Unavailable",
    "Unsupported",
    "WrongModelKind",
]
