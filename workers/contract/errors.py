"""Why a batch failed, as the worker tells the frontend: a code on the wire, not only a message.

The worker sends each failed batch's code in its ResultHeader (protocol.py); the frontend maps
the code to a gRPC status in one table (server/base/errors.py: WORKER_FAILURES). An engine raises one
of the exceptions below where it can name the failure; the worker classifies the rest
(workers/process.py: error_code).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    NONE = 0  # the batch succeeded
    INTERNAL = 1  # a bug or an engine failure: the message says which
    INVALID_INPUT = 2  # an input this model cannot take (the frontend checks first; this guards the wire)
    UNSUPPORTED = 3  # work this model or engine does not do (images to an ONNX engine)
    OUT_OF_MEMORY = 4  # the device ran out of memory, even on a batch of one input


class WorkerError(Exception):
    """A batch failure the worker can name; `code` travels to the frontend."""

    code = ErrorCode.INTERNAL


class InputRefused(WorkerError, ValueError):
    code = ErrorCode.INVALID_INPUT


class Unsupported(WorkerError, ValueError):
    code = ErrorCode.UNSUPPORTED
