from google.api import annotations_pb2 as _annotations_pb2
from google.api import httpbody_pb2 as _httpbody_pb2
from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "raw_scores", "max_tokens_per_doc", "max_chunks_per_doc")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_DOC_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_PER_DOC_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _struct_pb2.Value
    top_n: int
    return_documents: bool
    raw_scores: bool
    max_tokens_per_doc: int
    max_chunks_per_doc: int
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., max_tokens_per_doc: _Optional[int] = ..., max_chunks_per_doc: _Optional[int] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...
