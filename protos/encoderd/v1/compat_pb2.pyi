from google.api import annotations_pb2 as _annotations_pb2
from google.api import httpbody_pb2 as _httpbody_pb2
from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenAIEmbeddingsRequest(_message.Message):
    __slots__ = ("input", "model", "encoding_format", "dimensions", "user", "modality")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    input: _struct_pb2.Value
    model: str
    encoding_format: str
    dimensions: int
    user: str
    modality: str
    def __init__(self, input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., model: _Optional[str] = ..., encoding_format: _Optional[str] = ..., dimensions: _Optional[int] = ..., user: _Optional[str] = ..., modality: _Optional[str] = ...) -> None: ...

class CohereRerankRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "raw_scores", "max_tokens_per_doc", "max_chunks_per_doc", "rank_fields")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_DOC_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_PER_DOC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _struct_pb2.Value
    top_n: int
    return_documents: bool
    raw_scores: bool
    max_tokens_per_doc: int
    max_chunks_per_doc: int
    rank_fields: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., max_tokens_per_doc: _Optional[int] = ..., max_chunks_per_doc: _Optional[int] = ..., rank_fields: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RootRerankRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "texts", "top_n", "return_documents", "return_text", "raw_scores", "truncate", "truncation_direction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _struct_pb2.Value
    texts: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    return_text: bool
    raw_scores: bool
    truncate: bool
    truncation_direction: str
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., texts: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., return_text: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[str] = ...) -> None: ...

class InfinityClassifyRequest(_message.Message):
    __slots__ = ("model", "input", "raw_scores")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    model: str
    input: _struct_pb2.Value
    raw_scores: bool
    def __init__(self, model: _Optional[str] = ..., input: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., raw_scores: _Optional[bool] = ...) -> None: ...

class CohereEmbedRequest(_message.Message):
    __slots__ = ("model", "texts", "images", "inputs", "input_type", "embedding_types", "truncate", "output_dimension", "max_tokens", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TYPES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    images: _containers.RepeatedScalarFieldContainer[str]
    inputs: _struct_pb2.Value
    input_type: str
    embedding_types: _containers.RepeatedScalarFieldContainer[str]
    truncate: str
    output_dimension: int
    max_tokens: int
    priority: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., images: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., input_type: _Optional[str] = ..., embedding_types: _Optional[_Iterable[str]] = ..., truncate: _Optional[str] = ..., output_dimension: _Optional[int] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class TeiParameters(_message.Message):
    __slots__ = ("normalize", "truncate", "truncation_direction", "prompt_name", "dimensions", "function_to_apply", "top_k")
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_TO_APPLY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    normalize: bool
    truncate: bool
    truncation_direction: str
    prompt_name: str
    dimensions: int
    function_to_apply: str
    top_k: int
    def __init__(self, normalize: _Optional[bool] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., prompt_name: _Optional[str] = ..., dimensions: _Optional[int] = ..., function_to_apply: _Optional[str] = ..., top_k: _Optional[int] = ...) -> None: ...

class TeiEmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "prompt_name", "normalize", "dimensions", "parameters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _struct_pb2.Value
    truncate: bool
    truncation_direction: str
    prompt_name: str
    normalize: bool
    dimensions: int
    parameters: TeiParameters
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., prompt_name: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., parameters: _Optional[_Union[TeiParameters, _Mapping]] = ...) -> None: ...

class TeiPredictRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "raw_scores", "parameters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _struct_pb2.Value
    truncate: bool
    truncation_direction: str
    raw_scores: bool
    parameters: TeiParameters
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., raw_scores: _Optional[bool] = ..., parameters: _Optional[_Union[TeiParameters, _Mapping]] = ...) -> None: ...

class TeiSimilarityInputs(_message.Message):
    __slots__ = ("source_sentence", "sentences")
    SOURCE_SENTENCE_FIELD_NUMBER: _ClassVar[int]
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    source_sentence: str
    sentences: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, source_sentence: _Optional[str] = ..., sentences: _Optional[_Iterable[str]] = ...) -> None: ...

class TeiSimilarityRequest(_message.Message):
    __slots__ = ("model", "inputs", "parameters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: TeiSimilarityInputs
    parameters: TeiParameters
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Union[TeiSimilarityInputs, _Mapping]] = ..., parameters: _Optional[_Union[TeiParameters, _Mapping]] = ...) -> None: ...

class TeiTokenizeRequest(_message.Message):
    __slots__ = ("model", "inputs", "add_special_tokens", "prompt_name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _struct_pb2.Value
    add_special_tokens: bool
    prompt_name: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class TeiDecodeRequest(_message.Message):
    __slots__ = ("model", "ids", "skip_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    ids: _struct_pb2.Value
    skip_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., ids: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class TeiInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TeiRootRequest(_message.Message):
    __slots__ = ("model", "inputs", "truncate", "truncation_direction", "prompt_name", "normalize", "dimensions", "parameters", "raw_scores", "query", "texts", "return_text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _struct_pb2.Value
    truncate: bool
    truncation_direction: str
    prompt_name: str
    normalize: bool
    dimensions: int
    parameters: TeiParameters
    raw_scores: bool
    query: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    return_text: bool
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., prompt_name: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., parameters: _Optional[_Union[TeiParameters, _Mapping]] = ..., raw_scores: _Optional[bool] = ..., query: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., return_text: _Optional[bool] = ...) -> None: ...
