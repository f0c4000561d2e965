"""Issue 15, item 3: every sentence-transformers module users ship, in the config formats of older
and current releases, served as sentence-transformers / transformers compute it on the same weights;
what encoderd cannot reproduce is refused at start with a message naming the module and the file.

Models are MiniLM under rewritten module configs (tests/support/st_models.py). The engine checks
run the worker's path in-process: the frontend's tokenizer, a backend's pooled output, the
worker's Dense modules (workers/st_modules.py) and the frontend's normalization. One real server
checks the same end to end, with a multi-label classifier beside it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.corpus import sentences
from support.server import ServerProcess
from support.st_models import NORMALIZE, Dense, build_head_model, build_st_model

from encoderd.server.models import postprocess
from encoderd.server.models.tokenization import ModelTokenizer
from encoderd.v1 import encoderd_pb2 as pb
from encoderd.workers.backends import BackendOptions, create_backend, packed_encoder
from encoderd.workers.contract.model_spec import ModelKind, ModelLoadError, Pooling, ScoreActivation, check_prompts
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.contract.tokenizer import load_tokenizer
from encoderd.workers.st_modules import SentenceModules

CASED = ["Hello World from PARIS and Berlin", "The EU's GDP Grew in Q3", "iPhone USB-C CamelCaseIdentifier HTTPServer"]
# 6 to 200+ tokens: the long ones are cut at the models' max_seq_length of 128
TEXTS = sentences(11, max_words=160, seed=23) + sentences(2, min_words=140, max_words=200, seed=5) + CASED
EMBEDDERS = {
    # LaBSE-style: CLS, Dense layers, Normalize; as sentence-transformers 6.2 writes it
    "cls-dense-new": {
        "fmt": "new",
        "pooling": ("cls",),
        "modules": (Dense(128, "Tanh"), Dense(64, "Identity"), NORMALIZE),
    },
    "mean-dense-old": {
        "fmt": "old",
        "pooling": ("mean",),
        "modules": (Dense(128, "Tanh"), Dense(64, "Identity"), NORMALIZE),
    },
    # Three modes concatenated (legacy booleans), lower-casing over a cased tokenizer, no Normalize
    "concat-old-lowercase": {
        "fmt": "old",
        "pooling": ("cls", "max", "mean"),
        "modules": (Dense(96, "GELU"),),
        "lowercase": True,
        "cased_tokenizer": True,
        "include_prompt": False,
    },
    # The other modes, a Normalize before a residual Dense, and one after
    "concat-new-residual": {
        "fmt": "new",
        "pooling": ("weightedmean", "mean_sqrt_len_tokens", "lasttoken"),
        "modules": (NORMALIZE, Dense(64, "Sigmoid", residual=True), NORMALIZE),
    },
    "max-new-plain": {"fmt": "new", "pooling": ("max",)},
}
# (model, engine, variant): the torch padding-free forward on every model; the padded one, and the
# numpy pooling of the other engines, on models that together hold every pooling mode and Dense shape.
ENGINE_CASES = (
    [(name, "torch", "packed") for name in EMBEDDERS]
    + [(name, "torch", "padded") for name in ("concat-old-lowercase", "concat-new-residual", "max-new-plain")]
    + [
        ("concat-new-residual", "onnx", ""),
        ("cls-dense-new", "ctranslate2", ""),
        ("concat-new-residual", "ctranslate2", ""),
    ]
)


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("st-models")


@pytest.fixture(scope="module")
def embedders(st_dir) -> dict[str, str]:
    return {name: str(build_st_model(st_dir / name, **options)) for name, options in EMBEDDERS.items()}


@pytest.fixture(scope="module")
def references(embedders) -> dict[str, np.ndarray]:
    """sentence-transformers' own output for each model (its modules, its normalization)."""
    from sentence_transformers import SentenceTransformer

    out = {}
    for name, path in embedders.items():
        model = SentenceTransformer(path, device="cpu")
        out[name] = model.encode(TEXTS, batch_size=8, convert_to_numpy=True)
    return out


def frontend_tokens(spec, texts: list[str], pairs_with: str | None = None):
    """Token ids as the frontend makes them (server/models/tokenization.py, lower-casing included)."""
    with ThreadPoolExecutor(1) as pool:
        tokenizer = ModelTokenizer(load_tokenizer(spec.path, spec.lowercase), spec.max_length, pool)
        return asyncio.run(tokenizer.encode(texts, pairs_with=pairs_with))


def batches(spec, texts: list[str]) -> list[TokenBatch]:
    """Unsorted batches of 8, so each one pads."""
    ids = frontend_tokens(spec, texts).ids
    return [TokenBatch.from_sequences(k, ids[i : i + 8]) for k, i in enumerate(range(0, len(ids), 8))]


def load_backend(engine: str, spec, cache_dir: str, monkeypatch, variant: str = ""):
    if variant == "padded":  # the padded transformers forward, as for architectures the packed path skips
        monkeypatch.setattr(packed_encoder, "usable", lambda *args: False)
    backend = create_backend(engine, spec, BackendOptions(threads=2, cache_dir=cache_dir))
    backend.load()
    if engine == "torch":
        assert (backend.packed is None) == (variant == "padded")
    return backend


def served_vectors(backend, spec) -> tuple[np.ndarray, int]:
    """What Embed returns: pooled -> the worker's Dense modules -> the frontend's normalization;
    and the width the worker reports."""
    modules = SentenceModules(spec)
    pooled = np.concatenate([modules(backend.forward(b)) for b in batches(spec, TEXTS)])
    return postprocess.finish_embeddings(pooled, normalize=spec.normalize), modules.output_dim(backend.output_dim)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize(
    "name,engine,variant", ENGINE_CASES, ids=[f"{n}-{e}{'-' + v if v else ''}" for n, e, v in ENGINE_CASES]
)
def test_engine_output_equals_sentence_transformers(
    name, engine, variant, embedders, references, tmp_path_factory, monkeypatch
):
    pytest.importorskip({"onnx": "onnxruntime", "ctranslate2": "ctranslate2"}.get(engine, "torch"))
    spec = load_model_spec(name, embedders[name])
    want = references[name]
    backend = load_backend(engine, spec, str(tmp_path_factory.getbasetemp() / "st-cache"), monkeypatch, variant)
    got, width = served_vectors(backend, spec)
    assert got.shape == want.shape and width == want.shape[1] == spec.hidden_size
    assert cosines(got, want).min() >= 0.9999
    # Unnormalized pipelines: the length is part of the vector.
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)


def test_specs_read_both_formats(embedders):
    old, new = load_model_spec("old", embedders["mean-dense-old"]), load_model_spec("new", embedders["cls-dense-new"])
    assert old.pooling == (Pooling.MEAN,) and new.pooling == (Pooling.CLS,)
    for spec in (old, new):
        assert [(d.in_features, d.out_features, d.activation) for d in spec.dense] == [
            (384, 128, "Tanh"),
            (128, 64, "Identity"),
        ]
        assert spec.normalize and spec.hidden_size == 64 and spec.max_length == 128
    concat = load_model_spec("concat", embedders["concat-old-lowercase"])
    assert concat.pooling == (Pooling.CLS, Pooling.MAX, Pooling.MEAN) and concat.lowercase and not concat.normalize
    residual = load_model_spec("residual", embedders["concat-new-residual"])
    assert residual.dense[0].normalize_input and residual.dense[0].residual and residual.normalize
    assert load_model_spec("plain", embedders["max-new-plain"]).dense == ()


def test_lower_casing_matters_for_the_cased_model(embedders):
    """The lower-casing check above can fail: this tokenizer keeps case, so without do_lower_case
    the frontend would send other token ids for the cased texts."""
    spec = load_model_spec("concat", embedders["concat-old-lowercase"])
    plain, lowered = load_tokenizer(spec.path), load_tokenizer(spec.path, lowercase=True)
    assert all(plain.encode(t).ids != lowered.encode(t).ids for t in CASED)
    assert lowered.encode(CASED[0]).ids == plain.encode(CASED[0].lower()).ids
    # and sentence-transformers lower-cases too: its vectors for a text and its lower-cased twin agree
    from sentence_transformers import SentenceTransformer

    vectors = SentenceTransformer(spec.path, device="cpu").encode([CASED[0], CASED[0].lower()])
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-6)


POOLINGS = [(mode,) for mode in Pooling] + [
    (Pooling.CLS, Pooling.MAX, Pooling.MEAN, Pooling.MEAN_SQRT_LEN, Pooling.WEIGHTED_MEAN, Pooling.LAST_TOKEN)
]


@pytest.mark.parametrize("modes", POOLINGS, ids=["+".join(m.value for m in modes) for modes in POOLINGS])
def test_every_pooling_implementation_equals_sentence_transformers_pooling(modes):
    """Each mode alone, and all concatenated, in all three places encoderd pools (numpy, padded
    torch, packed torch), against sentence-transformers' Pooling module on the same hidden states.
    Alone, because inside a model a small error in one mode can hide behind the others."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Pooling as StPooling

    from encoderd.workers.backends.packed_encoder import PackedEncoder
    from encoderd.workers.backends.torch_backend import pool as torch_pool
    from encoderd.workers.pooling import pool as numpy_pool

    lengths = torch.tensor([1, 7, 40, 3, 23])
    hidden = torch.randn(len(lengths), int(lengths.max()), 16, generator=torch.Generator().manual_seed(5))
    mask = (torch.arange(hidden.shape[1])[None] < lengths[:, None]).long()
    reference = StPooling(16, pooling_mode=tuple(m.value for m in modes))(
        {"token_embeddings": hidden, "attention_mask": mask}
    )["sentence_embedding"]
    packed = hidden[mask.bool()]  # row-major: the sequences back to back
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    for got in (
        torch.from_numpy(numpy_pool(hidden.numpy(), mask.numpy(), modes)),
        torch_pool(hidden, mask, modes),
        PackedEncoder.pool(packed, cu_seqlens, modes),
    ):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ classifier heads
HEADS = {  # name -> (labels, problem_type, expected activation)
    "multi-label": (("sports", "politics", "science", "arts"), "multi_label_classification", ScoreActivation.SIGMOID),
    "regression": (("valence", "arousal"), "regression", ScoreActivation.IDENTITY),
    "single-label": (("negative", "neutral", "positive"), "single_label_classification", ScoreActivation.SOFTMAX),
}
TORCH_ACTIVATIONS = {
    ScoreActivation.SIGMOID: lambda x: x.sigmoid(),
    ScoreActivation.IDENTITY: lambda x: x,
    ScoreActivation.SOFTMAX: lambda x: x.softmax(-1),
}


@pytest.fixture(scope="module")
def heads(st_dir) -> dict[str, str]:
    return {
        name: str(build_head_model(st_dir / name, labels, problem_type=problem))
        for name, (labels, problem, _) in HEADS.items()
    }


def transformers_logits(path: str, texts: list[str], pairs_with: str | None = None):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    args = ([pairs_with] * len(texts), texts) if pairs_with else (texts,)
    with torch.no_grad():
        return model(**tokenizer(*args, padding=True, truncation=True, max_length=512, return_tensors="pt")).logits


@pytest.mark.parametrize("name", HEADS)
def test_classifier_scores_follow_problem_type(name, heads, monkeypatch, tmp_path):
    spec = load_model_spec(name, heads[name])
    assert spec.kind == ModelKind.CLASSIFIER and spec.score_activation == HEADS[name][2]
    backend = load_backend("torch", spec, str(tmp_path), monkeypatch)
    logits = np.concatenate([backend.forward(b) for b in batches(spec, TEXTS)])
    got = postprocess.scores(logits, spec.score_activation)
    reference = transformers_logits(spec.path, TEXTS)
    np.testing.assert_allclose(got, TORCH_ACTIVATIONS[spec.score_activation](reference).numpy(), atol=1e-4)
    # The head's logits spread enough that any other activation would be caught.
    for other in set(ScoreActivation) - {spec.score_activation}:
        assert np.abs(postprocess.scores(logits, other) - got).max() > 0.05


CROSS_ENCODERS = [  # (labels, activation the CrossEncoder config names, where)
    (1, "Identity", "current"),
    (1, "Identity", "legacy"),
    (1, "Sigmoid", "v4"),
    (3, "Sigmoid", "current"),
]


@pytest.mark.parametrize("labels,activation,where", CROSS_ENCODERS, ids=[f"{n}-{a}-{w}" for n, a, w in CROSS_ENCODERS])
def test_cross_encoder_activation_is_honoured(labels, activation, where, st_dir, monkeypatch, tmp_path):
    from sentence_transformers import CrossEncoder

    path = str(
        build_head_model(
            st_dir / f"ce-{labels}-{activation}-{where}",
            tuple(f"L{i}" for i in range(labels)),
            cross_encoder_activation=activation,
            where=where,
        )
    )
    spec = load_model_spec("ce", path)
    assert spec.kind == (ModelKind.RERANKER if labels == 1 else ModelKind.CLASSIFIER)
    assert spec.score_activation == ScoreActivation(activation.lower())
    query = "how do search engines rank documents"
    tokens = frontend_tokens(spec, TEXTS, pairs_with=query)
    batch = TokenBatch.from_sequences(0, tokens.ids, tokens.type_ids)
    logits = load_backend("torch", spec, str(tmp_path), monkeypatch).forward(batch)
    got = postprocess.scores(logits[:, 0] if labels == 1 else logits, spec.score_activation)
    want = CrossEncoder(path, device="cpu").predict([(query, t) for t in TEXTS])
    np.testing.assert_allclose(got, want, atol=1e-4)


# ------------------------------------------------------------------ refusals
def variant(base: str, out: Path, edit) -> str:
    """A copy of a built model (weights linked) with `edit(dir)` applied to its files."""
    shutil.copytree(base, out, symlinks=True)
    edit(out)
    return str(out)


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data) or data))


def insert_module(module: dict):
    return lambda d: edit_json(d / "modules.json", lambda m: [*m[:2], module, *m[2:]])


REFUSALS = {
    "layer-norm": (
        "cls-dense-new",
        insert_module({"idx": 9, "name": "9", "path": "9_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}),
        r"modules.json: module 9 \('sentence_transformers.models.LayerNorm', in .*9_LayerNorm\)",
    ),
    "custom-class": (
        "cls-dense-new",
        insert_module({"idx": 9, "name": "9", "path": "9_Custom", "type": "my_package.modules.WhiteningLayer"}),
        "WhiteningLayer",
    ),
    "static-embedding": (
        "max-new-plain",
        lambda d: edit_json(
            d / "modules.json",
            lambda m: [{**m[0], "type": "sentence_transformers.sentence_transformer.modules.StaticEmbedding"}, *m[1:]],
        ),
        "StaticEmbedding",
    ),
    "pooling-mode": (
        "cls-dense-new",
        lambda d: edit_json(d / "1_Pooling" / "config.json", lambda c: {**c, "pooling_mode": "median"}),
        r"1_Pooling/config.json: pooling mode 'median'",
    ),
    "legacy-pooling-key": (
        "mean-dense-old",
        lambda d: edit_json(d / "1_Pooling" / "config.json", lambda c: {**c, "pooling_mode_median_tokens": True}),
        "pooling_mode_median_tokens",
    ),
    "activation": (
        "cls-dense-new",
        lambda d: edit_json(
            d / "2_Dense" / "config.json", lambda c: {**c, "activation_function": "my_package.activations.Swish"}
        ),
        r"2_Dense/config.json: activation .*Swish",
    ),
    "torch-activation": (
        "mean-dense-old",
        lambda d: edit_json(
            d / "2_Dense" / "config.json", lambda c: {**c, "activation_function": "torch.nn.modules.activation.Softmax"}
        ),
        "Softmax",
    ),
    "dense-width": (
        "cls-dense-new",
        lambda d: edit_json(d / "3_Dense" / "config.json", lambda c: {**c, "in_features": 100}),
        "3_Dense.*takes 100",
    ),
    "dense-weights": ("cls-dense-new", lambda d: (d / "2_Dense" / "model.safetensors").unlink(), "2_Dense.*no weights"),
    "no-pooling": ("max-new-plain", lambda d: edit_json(d / "modules.json", lambda m: m[:1]), "Pooling"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_unreproducible_models_are_refused(case, embedders, tmp_path):
    base, edit, message = REFUSALS[case]
    path = variant(embedders[base], tmp_path / case, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_model_spec(case, path)


def test_unknown_heads_are_refused(heads, st_dir, tmp_path):
    path = variant(
        heads["regression"],
        tmp_path / "problem",
        lambda d: edit_json(d / "config.json", lambda c: {**c, "problem_type": "ordinal_regression"}),
    )
    with pytest.raises(ModelLoadError, match="problem_type 'ordinal_regression'"):
        load_model_spec("problem", path)
    path = str(build_head_model(st_dir / "ce-tanh", ("score",), cross_encoder_activation="Tanh"))
    with pytest.raises(ModelLoadError, match=r"activation 'torch\.nn\.modules\.activation\.Tanh'"):
        load_model_spec("ce", path)
    # Several labels: a CrossEncoder's Identity (its default there) leaves Classify's softmax.
    path = str(build_head_model(st_dir / "ce-3-identity", ("a", "b", "c"), cross_encoder_activation="Identity"))
    assert load_model_spec("ce", path).score_activation == ScoreActivation.SOFTMAX


def test_prompts_refused_where_pooling_excludes_them(embedders, tmp_path):
    spec = load_model_spec("noprompt", embedders["concat-old-lowercase"])
    assert not spec.include_prompt
    check_prompts(spec, {"query": ""})  # empty prompts change nothing
    with pytest.raises(ModelLoadError, match="include_prompt"):
        check_prompts(spec, {"query": "query: "})  # e.g. --prompt query=query:
    path = variant(
        spec.path,
        tmp_path / "prompted",
        lambda d: edit_json(d / "config_sentence_transformers.json", lambda c: {**c, "prompts": {"query": "query: "}}),
    )
    with pytest.raises(ModelLoadError, match="include_prompt"):
        load_model_spec("prompted", path)


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def st_server(embedders, heads, tmp_path_factory):
    log = tmp_path_factory.mktemp("st-logs") / "server.log"
    with ServerProcess(
        "--model",
        f"dense={embedders['cls-dense-new']}",
        "--model",
        f"lowercase={embedders['concat-old-lowercase']}",
        "--model",
        f"multilabel={heads['multi-label']}",
        log_path=log,
    ) as server:
        yield server


def test_served_through_grpc(st_server, references, heads):
    stub = st_server.stub()
    for name, model in (("cls-dense-new", "dense"), ("concat-old-lowercase", "lowercase")):
        response = stub.Embed(pb.EmbedRequest(model=model, inputs=TEXTS))
        got = np.array([e.values for e in response.embeddings], dtype=np.float32)
        assert got.shape == references[name].shape
        np.testing.assert_allclose(got, references[name], rtol=1e-4, atol=1e-5)
    dims = {m.id: m.dimensions for m in stub.ListModels(pb.ListModelsRequest()).models}
    assert dims == {"dense": 64, "lowercase": 96, "multilabel": 4}
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(pb.EmbedRequest(model="lowercase", inputs=TEXTS[:2], prompt="query: "))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "include_prompt" in error.value.details()

    response = stub.Classify(pb.ClassifyRequest(model="multilabel", inputs=TEXTS))
    labels = HEADS["multi-label"][0]
    got = np.array([[{s.label: s.score for s in r.labels}[label] for label in labels] for r in response.results])
    want = transformers_logits(heads["multi-label"], TEXTS).sigmoid().numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_serve_refuses_at_start(embedders, tmp_path):
    """`encoderd serve` with a model it cannot reproduce exits non-zero, the reason in its log."""
    path = variant(embedders["cls-dense-new"], tmp_path / "layer-norm", REFUSALS["layer-norm"][1])
    server = ServerProcess("--model", f"bad={path}", log_path=tmp_path / "server.log").launch()
    try:
        assert server.proc.wait(120) != 0
    finally:
        server.stop()
    text = server.log_text()
    # One line naming the module and the reason (start-up errors carry no traceback).
    [line] = [ln for ln in text.splitlines() if "'sentence_transformers.models.LayerNorm'" in ln]
    assert line.startswith("encoderd: ") and "encoderd serves only what it reproduces exactly" in line, text
    assert "Traceback" not in text
