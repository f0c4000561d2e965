"""Text Embeddings Inference's REST routes (/embed, /embed_all, /embed_sparse, /predict,
/similarity, /rerank with `texts`, /tokenize, /decode, /info) in TEI's shapes: bare
JSON lists, rendered here for the Compat service (server/api/compat.py).

TEI serves one model and its requests name none; here `model` (an extension) picks
one when several of the route's kind are served. Options come either at the top
level (TEI's API) or nested under `parameters` (huggingface_hub's InferenceClient);
the nested ones win (tei_options.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from google.api import httpbody_pb2
from google.protobuf import json_format

from ...v1 import compat_pb2 as cpb
from ...workers.contract.model_spec import MULTI_VECTOR_KINDS, ModelKind
from ..base.errors import InvalidInput
from ..models import multimodal, postprocess
from ..models.media import Content
from ..models.request_options import RerankOptions
from ..scheduling.scheduler import Priority
from .messages import Serialized
from .rest import (
    embedding_inputs,
    float_rows,
    json_answer,
    json_body,
    json_list,
    nested_float_rows,
    reject_set,
    string_list,
)
from .tei_options import ACTIVATIONS, embed_options, predict_options, side
from .token_states import embed_token_states


def pick_model(service, name: str, kinds: tuple[ModelKind, ...], route: str) -> str:
    """The name of the model `route` serves: the named one, else the one of `kinds`, an embedding
    model first (server/models/model_resolver.py)."""
    return service.registry.get(name, kinds, prefer=(ModelKind.EMBEDDING,), call=route).spec.name


# ------------------------------------------------------------------- routes
async def embed(service, request) -> Serialized:
    opts = embed_options(request, "/embed")
    texts, token_ids = embedding_inputs(request.inputs)
    name = pick_model(service, request.model, (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP), "/embed")
    if texts is not None:
        model, pooled, _ = await service.registry.embed(name, texts, opts)
    else:
        if opts.prompt_name or opts.side != "right" or not opts.truncate:
            raise InvalidInput(
                "token-id inputs are used as given: `prompt_name`, `truncate` and "
                "`truncation_direction` apply to text inputs only"
            )
        model, pooled, _ = await service.registry.embed_ids(name, token_ids, opts)
    # TEI normalizes unless told not to, whatever the model's own default.
    vectors = postprocess.finish_embeddings(
        pooled, normalize=opts.normalize is not False, dimensions=opts.dimensions, truncate_dim=model.spec.truncate_dim
    )
    return await json_answer(json_list(await float_rows(model.spec.name, vectors)))


def _texts(request, route: str) -> list[str]:
    texts, _ = embedding_inputs(request.inputs)
    if texts is None:
        raise InvalidInput(f"{route} takes text inputs, not token ids")
    return texts


EMBED_ALL_KINDS = (ModelKind.EMBEDDING, *MULTI_VECTOR_KINDS)


async def embed_all(service, request) -> Serialized:
    """Per input, one vector per token: a plain embedder's last hidden states (as TEI), a
    multi-vector model's token (and patch) vectors."""
    opts = embed_options(request, "/embed_all", embedding_options=False)
    texts = _texts(request, "/embed_all")
    name = pick_model(service, request.model, EMBED_ALL_KINDS, "/embed_all")
    served = service.registry.get(name, EMBED_ALL_KINDS)
    if served.spec.kind == ModelKind.EMBEDDING:
        model, rows, _ = await embed_token_states(service.registry, name, texts, opts)
    else:
        if opts.side != "right":
            raise InvalidInput("/embed_all cuts a multi-vector model's over-long inputs on the right only")
        prompt = service.registry.prompt_text(served, "", opts.prompt_name)
        model, rows, _ = await multimodal.embed_multivector(
            service.registry, name, [Content(text=t) for t in texts], replace(opts, prompt=prompt, prompt_name="")
        )
    return await json_answer(json_list(await nested_float_rows(model.spec.name, rows)))


async def embed_sparse(service, request) -> httpbody_pb2.HttpBody:
    opts = embed_options(request, "/embed_sparse", embedding_options=False)
    texts = _texts(request, "/embed_sparse")
    name = pick_model(service, request.model, (ModelKind.SPARSE,), "/embed_sparse")
    prompt = service.registry.prompt_text(service.registry.get(name, ModelKind.SPARSE), "", opts.prompt_name)
    _, vectors, _ = await multimodal.embed_sparse(
        service.registry, name, texts, replace(opts, prompt=prompt, prompt_name="")
    )
    return json_body(
        [
            [{"index": int(i), "value": float(v)} for i, v in zip(indices, values, strict=True)]
            for indices, values in vectors
        ]
    )


PREDICT_SHAPES = (
    'a string, a pair of strings ["text", "text_pair"], or a batch of one-string lists and '
    'pairs [["text"], ["text", "text_pair"], ...]'
)


def _strings(values) -> list[str] | None:
    """The strings of a JSON list that holds only strings, else None."""
    if not all(v.WhichOneof("kind") == "string_value" for v in values):
        return None
    return [v.string_value for v in values]


def predict_inputs(value) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's /predict `inputs` -> (inputs, batched), each input a text or a (text, text_pair)
    pair. As TEI reads it: "a" is one text, ["a", "b"] one pair, [["a"], ["b", "c"]] a batch."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [value.string_value], False
    items = list(value.list_value.values) if kind == "list_value" else []
    if not items:
        raise InvalidInput(f"`inputs` is required: {PREDICT_SHAPES}")
    if items[0].WhichOneof("kind") == "string_value":  # not a batch: one text, or one pair
        strings = _strings(items)
        if strings is None or len(strings) > 2:
            raise InvalidInput(f"`inputs` must be {PREDICT_SHAPES}")
        return [strings[0] if len(strings) == 1 else (strings[0], strings[1])], False
    batch = []
    for i, item in enumerate(items):
        strings = _strings(item.list_value.values) if item.WhichOneof("kind") == "list_value" else None
        if strings is None or len(strings) not in (1, 2):
            raise InvalidInput(f'inputs[{i}] must be ["text"] or ["text", "text_pair"]: `inputs` is {PREDICT_SHAPES}')
        batch.append(strings[0] if len(strings) == 1 else (strings[0], strings[1]))
    return batch, True


# As TEI: a cross-encoder (one label) predicts too, its sigmoid score under its one label.
PREDICT_KINDS = (ModelKind.CLASSIFIER, ModelKind.RERANKER)


async def predict(service, request) -> httpbody_pb2.HttpBody:
    options, function_to_apply, top_k = predict_options(request)
    texts, batched = predict_inputs(request.inputs)
    # No model named: the one classifier, else the one reranker (a classifier of one label).
    name = service.registry.get(request.model, PREDICT_KINDS, prefer=(ModelKind.CLASSIFIER,), call="/predict").spec.name
    activation = ACTIVATIONS[function_to_apply]
    _, results, _ = await service.classifications(name, texts, options, PREDICT_KINDS)
    if activation:  # monotonic within a row: the best-first order of the logits holds
        results = [_activated(row, activation) for row in results]
    results = [row[: top_k or None] for row in results]
    return json_body(results if batched else results[0])


def _activated(row: list[dict], activation) -> list[dict]:
    scores = activation(np.array([label["score"] for label in row], dtype=np.float32))
    return [{**label, "score": float(score)} for label, score in zip(row, scores, strict=True)]


# The models /similarity compares texts with: those /embed serves.
SIMILARITY_KINDS = (ModelKind.EMBEDDING, ModelKind.CLIP, ModelKind.CLAP)


async def similarity(service, request) -> httpbody_pb2.HttpBody:
    opts = embed_options(request, "/similarity", embedding_options=False)
    source, sentences = request.inputs.source_sentence, list(request.inputs.sentences)
    if not source or not sentences:
        raise InvalidInput("`inputs` needs a non-empty `source_sentence` and a non-empty list of `sentences`")
    name = pick_model(service, request.model, SIMILARITY_KINDS, "/similarity")
    # Checked here, named as the caller sent them: past this point they are one list, source first.
    service.registry.check_text(source, "inputs.source_sentence")
    service.registry.check_inputs(sentences, "inputs.sentences")
    model, pooled, _ = await service.registry.embed(name, [source, *sentences], opts)
    # Cosine over the served width (a truncate_dim model's first dimensions), as sentence-transformers'
    # similarity computes it on the vectors encode returns.
    vectors = postprocess.finish_embeddings(pooled, normalize=True, dimensions=model.spec.served_width(pooled.shape[1]))
    return json_body([float(s) for s in vectors[1:] @ vectors[0]])


async def rerank(service, request) -> httpbody_pb2.HttpBody:
    """TEI's /rerank (`texts`): [{index, score, text?}], best first."""
    reject_set(request, ("top_n", "return_documents"), "with `texts` (TEI's /rerank; it returns every text)")
    name = pick_model(service, request.model, (ModelKind.RERANKER,), "/rerank")
    texts = list(request.texts)
    if not texts:
        raise InvalidInput("`texts` is required: a non-empty list of strings")
    options = RerankOptions.for_call(
        truncate=request.truncate if request.HasField("truncate") else True,
        side=side(request.truncation_direction),
        raw_scores=request.raw_scores,
    )
    _, scores, _ = await service.rerank_scores(name, request.query, texts, options)
    results = []
    for i in postprocess.rank(scores, 0).tolist():
        result = {"index": i, "score": float(scores[i])}
        if request.return_text:
            result["text"] = texts[i]
        results.append(result)
    return json_body(results)


async def tokenize(service, request) -> httpbody_pb2.HttpBody:
    model = service.registry.get(request.model)
    texts = service.registry.check_inputs(string_list(request.inputs, "inputs"))
    prefix = service.registry.prompt_text(model, "", request.prompt_name) if request.prompt_name else ""
    texts = [prefix + t for t in texts]
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    await service.registry.check_token_floor(model, texts)
    encodings = await model.tokenizer.tokenize(texts, add_special)
    service.registry.check_token_budget(0, sum(len(e.ids) for e in encodings))
    return json_body([_tokens(text, encoding) for text, encoding in zip(texts, encodings, strict=True)])


def _tokens(text: str, encoding) -> list[dict]:
    """TEI's SimpleToken list: special tokens carry their own text and no offsets."""
    out = []
    for token_id, token, (start, stop), special in zip(
        encoding.ids, encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True
    ):
        if special:
            out.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
        else:
            out.append({"id": token_id, "text": text[start:stop], "special": False, "start": start, "stop": stop})
    return out


def decode_ids(value, vocab: int) -> list[list[int]]:
    """TEI's /decode `ids`: a list of token ids or a list of such lists."""
    kind = value.WhichOneof("kind")
    items = list(value.list_value.values) if kind == "list_value" else []
    if items and all(v.WhichOneof("kind") == "number_value" for v in items):
        sequences = [[v.number_value for v in items]]
    elif items and all(v.WhichOneof("kind") == "list_value" for v in items):
        sequences = [
            [v.number_value if v.WhichOneof("kind") == "number_value" else -1.0 for v in item.list_value.values]
            for item in items
        ]
    else:
        raise InvalidInput("`ids` is required: a non-empty list of token ids, or a list of such lists")
    for i, seq in enumerate(sequences):
        values = np.asarray(seq, dtype=np.float64)
        if not ((values >= 0) & (values < vocab) & (values == np.floor(values))).all():
            raise InvalidInput(f"ids[{i}] holds a value that is not a token id: ids are integers in [0, {vocab})")
    return [[int(v) for v in seq] for seq in sequences]


async def decode(service, request) -> httpbody_pb2.HttpBody:
    model = service.registry.get(request.model)
    tokenizer = model.tokenizer.untruncated
    sequences = decode_ids(request.ids, tokenizer.get_vocab_size(with_added_tokens=True))
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return json_body(tokenizer.decode_batch(sequences, skip_special_tokens=skip))


# TEI's name for a pooling mode where it differs from sentence-transformers'.
TEI_POOLING = {"lasttoken": "last_token"}


def _model_type(model) -> dict:
    if model.spec.kind not in (ModelKind.CLASSIFIER, ModelKind.RERANKER):
        modes = [TEI_POOLING.get(mode.value, mode.value) for mode in model.spec.pooling]
        return {"embedding": {"pooling": "+".join(modes)}}  # several: concatenated, in this order
    labels = model.spec.labels or tuple(f"LABEL_{i}" for i in range(model.output_dim))
    return {
        model.spec.kind.value: {
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)},
        }
    }


async def info(service, request) -> httpbody_pb2.HttpBody:
    model = service.registry.get(request.model)
    config = service.registry.config
    limits = model.scheduler.limits[Priority.INTERACTIVE]
    return json_body(
        {
            "model_id": model.spec.name,
            "model_sha": None,
            "model_dtype": model.dtype,
            "served_model_name": model.spec.name,
            "model_type": _model_type(model),
            "max_concurrent_requests": model.scheduler.max_queued,
            "max_input_length": model.spec.max_length,
            "max_batch_tokens": limits.max_batch_tokens,
            "max_batch_requests": limits.max_batch_size,  # its own
            "max_client_batch_size": config.max_inputs_per_request,
            "auto_truncate": True,
            "tokenization_workers": config.tokenizer_threads,
            "version": _version(),
            "sha": None,
            "docker_label": None,
        }
    )


# POST /: per model kind, the route (its request message, handler and path) TEI would pick.
ROOT_ROUTES = {
    ModelKind.EMBEDDING: (cpb.TeiEmbedRequest, embed, "/embed"),
    ModelKind.CLIP: (cpb.TeiEmbedRequest, embed, "/embed"),
    ModelKind.CLAP: (cpb.TeiEmbedRequest, embed, "/embed"),
    ModelKind.CLASSIFIER: (cpb.TeiPredictRequest, predict, "/predict"),
    ModelKind.RERANKER: (cpb.RootRerankRequest, rerank, "/rerank"),
    ModelKind.SPARSE: (cpb.TeiEmbedRequest, embed_sparse, "/embed_sparse"),
    ModelKind.COLBERT: (cpb.TeiEmbedRequest, embed_all, "/embed_all"),
    ModelKind.COLPALI: (cpb.TeiEmbedRequest, embed_all, "/embed_all"),
    ModelKind.CLIP_PATCHES: (cpb.TeiEmbedRequest, embed_all, "/embed_all"),
}


def _root_route(kind: ModelKind, request: cpb.TeiRootRequest):
    """The kind's route; for an embedding model, /similarity when `inputs` is its object
    ({"source_sentence", "sentences"}, huggingface_hub's sentence_similarity), as TEI's root
    answers for a sentence-similarity model."""
    if kind in SIMILARITY_KINDS and request.inputs.WhichOneof("kind") == "struct_value":
        return cpb.TeiSimilarityRequest, similarity, "/similarity"
    return ROOT_ROUTES[kind]


async def root(service, request: cpb.TeiRootRequest) -> httpbody_pb2.HttpBody:
    """TEI's POST /: the request, narrowed to the message of the model's route (a field that
    route does not take is a 400), handled by that route."""
    if not request.model and len(service.registry.models) > 1:
        raise InvalidInput(
            f"POST / needs `model` when several models are served (here: "
            f"{', '.join(sorted(service.registry.models))}); or post to /embed, /predict, /rerank"
        )
    model = service.registry.get(request.model)
    message_class, handler, path = _root_route(model.spec.kind, request)
    fields = json_format.MessageToDict(request, preserving_proto_field_name=True)
    fields["model"] = model.spec.name
    try:
        narrowed = json_format.ParseDict(fields, message_class())
    except json_format.ParseError as exc:
        raise InvalidInput(
            f"POST / serves {model.spec.name!r} as TEI's {path}, which does not take this request: {exc}"
        ) from None
    return await handler(service, narrowed)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("encoderd")
    except PackageNotFoundError:
        return "unknown"
