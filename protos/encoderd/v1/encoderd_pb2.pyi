from google.api import annotations_pb2 as _annotations_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_DIRECTION_UNSPECIFIED: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_RIGHT: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_LEFT: _ClassVar[TruncationDirection]

class OutputDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_DTYPE_UNSPECIFIED: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_FLOAT32: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_FLOAT16: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_INT8: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_UINT8: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_BINARY: _ClassVar[OutputDtype]
    OUTPUT_DTYPE_UBINARY: _ClassVar[OutputDtype]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BULK: _ClassVar[Priority]
TRUNCATION_DIRECTION_UNSPECIFIED: TruncationDirection
TRUNCATION_DIRECTION_RIGHT: TruncationDirection
TRUNCATION_DIRECTION_LEFT: TruncationDirection
OUTPUT_DTYPE_UNSPECIFIED: OutputDtype
OUTPUT_DTYPE_FLOAT32: OutputDtype
OUTPUT_DTYPE_FLOAT16: OutputDtype
OUTPUT_DTYPE_INT8: OutputDtype
OUTPUT_DTYPE_UINT8: OutputDtype
OUTPUT_DTYPE_BINARY: OutputDtype
OUTPUT_DTYPE_UBINARY: OutputDtype
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BULK: Priority

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "normalize", "dimensions", "truncate", "truncation_direction", "prompt", "priority", "prompt_name", "output_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    dimensions: int
    truncate: bool
    truncation_direction: TruncationDirection
    prompt: str
    priority: Priority
    prompt_name: str
    output_dtype: OutputDtype
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., prompt: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., prompt_name: _Optional[str] = ..., output_dtype: _Optional[_Union[OutputDtype, str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "data")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    data: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "embeddings", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class EmbedStreamRequest(_message.Message):
    __slots__ = ("model", "id", "input", "normalize", "dimensions", "truncate", "prompt", "prompt_name", "output_dtype", "priority", "truncation_direction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    id: str
    input: str
    normalize: bool
    dimensions: int
    truncate: bool
    prompt: str
    prompt_name: str
    output_dtype: OutputDtype
    priority: Priority
    truncation_direction: TruncationDirection
    def __init__(self, model: _Optional[str] = ..., id: _Optional[str] = ..., input: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., truncate: _Optional[bool] = ..., prompt: _Optional[str] = ..., prompt_name: _Optional[str] = ..., output_dtype: _Optional[_Union[OutputDtype, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ...) -> None: ...

class EmbedStreamResponse(_message.Message):
    __slots__ = ("id", "embedding", "error", "prompt_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    embedding: Embedding
    error: _status_pb2.Status
    prompt_tokens: int
    def __init__(self, id: _Optional[str] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "raw_scores", "truncate", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    raw_scores: bool
    truncate: bool
    priority: Priority
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("model", "results", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("model", "inputs", "raw_scores", "truncate", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    raw_scores: bool
    truncate: bool
    priority: Priority
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("labels",)
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[LabelScore]
    def __init__(self, labels: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("model", "results", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "inputs", "add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenSpan(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("ids", "tokens", "offsets")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedCompositeFieldContainer[TokenSpan]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[_Union[TokenSpan, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("model", "results")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[TokenizedInput]
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TokenizedInput, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "kind", "max_input_tokens", "dimensions", "engine", "device", "dtype", "labels", "status", "replicas", "fidelity_status", "fidelity")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_STATUS_FIELD_NUMBER: _ClassVar[int]
    FIDELITY_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    max_input_tokens: int
    dimensions: int
    engine: str
    device: str
    dtype: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    status: str
    replicas: _containers.RepeatedCompositeFieldContainer[ModelReplica]
    fidelity_status: str
    fidelity: _containers.RepeatedCompositeFieldContainer[FidelityFigure]
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., dimensions: _Optional[int] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., status: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ModelReplica, _Mapping]]] = ..., fidelity_status: _Optional[str] = ..., fidelity: _Optional[_Iterable[_Union[FidelityFigure, _Mapping]]] = ...) -> None: ...

class FidelityFigure(_message.Message):
    __slots__ = ("metric", "value", "bound", "passed")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    metric: str
    value: float
    bound: float
    passed: bool
    def __init__(self, metric: _Optional[str] = ..., value: _Optional[float] = ..., bound: _Optional[float] = ..., passed: _Optional[bool] = ...) -> None: ...

class ModelReplica(_message.Message):
    __slots__ = ("device", "pid", "status", "restarts")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    device: str
    pid: int
    status: str
    restarts: int
    def __init__(self, device: _Optional[str] = ..., pid: _Optional[int] = ..., status: _Optional[str] = ..., restarts: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class Media(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class Content(_message.Message):
    __slots__ = ("text", "image", "audio")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Media
    audio: Media
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Media, _Mapping]] = ..., audio: _Optional[_Union[Media, _Mapping]] = ...) -> None: ...

class EmbedMultimodalRequest(_message.Message):
    __slots__ = ("model", "inputs", "normalize", "dimensions", "truncate", "output_dtype", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[Content]
    normalize: bool
    dimensions: int
    truncate: bool
    output_dtype: OutputDtype
    priority: Priority
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Content, _Mapping]]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., truncate: _Optional[bool] = ..., output_dtype: _Optional[_Union[OutputDtype, str]] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class EmbedMultimodalResponse(_message.Message):
    __slots__ = ("model", "embeddings", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class EmbedMultiVectorRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "prompt", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[Content]
    truncate: bool
    prompt: str
    priority: Priority
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Content, _Mapping]]] = ..., truncate: _Optional[bool] = ..., prompt: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class MultiVector(_message.Message):
    __slots__ = ("rows", "values")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedMultiVectorResponse(_message.Message):
    __slots__ = ("model", "embeddings", "dimensions", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[MultiVector]
    dimensions: int
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[MultiVector, _Mapping]]] = ..., dimensions: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class MaxSimRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "truncate", "priority", "query_prompt", "document_prompt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUERY_PROMPT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _containers.RepeatedCompositeFieldContainer[Content]
    top_n: int
    return_documents: bool
    truncate: bool
    priority: Priority
    query_prompt: str
    document_prompt: str
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[_Union[Content, _Mapping]]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., truncate: _Optional[bool] = ..., priority: _Optional[_Union[Priority, str]] = ..., query_prompt: _Optional[str] = ..., document_prompt: _Optional[str] = ...) -> None: ...

class MaxSimResponse(_message.Message):
    __slots__ = ("model", "results", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class EmbedSparseRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "prompt", "priority", "top_k", "threshold")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    truncate: bool
    truncation_direction: TruncationDirection
    prompt: str
    priority: Priority
    top_k: int
    threshold: float
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., prompt: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., top_k: _Optional[int] = ..., threshold: _Optional[float] = ...) -> None: ...

class SparseEmbedding(_message.Message):
    __slots__ = ("indices", "values")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedSparseResponse(_message.Message):
    __slots__ = ("model", "embeddings", "dimensions", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[SparseEmbedding]
    dimensions: int
    usage: Usage
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[SparseEmbedding, _Mapping]]] = ..., dimensions: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
