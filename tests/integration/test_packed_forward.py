"""Issues 5 and 19: the padding-free torch forward (workers/backends/packed_encoder.py, packed_pieces.py and its
family pieces) equals the padded transformers forward on the same weights, for every kind,
pooling and packed family.

In-process, CPU, float32: batches mix 3- to 256-token inputs in corpus order, so the
padded forward pads heavily and the packed one must agree where attention masks differ
most. The end-to-end comparisons with sentence-transformers (test_core.py) run through
this path as well, since the served MiniLM is a BERT. `--torch-compile` is served end to end here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.corpus import sentences
from support.families import build as build_family
from support.models import build_classifier, build_reranker
from torch.utils._python_dispatch import TorchDispatchMode

from encoderd.workers.backends import BackendOptions, create_backend, host_kernels, packed_encoder, packed_pieces
from encoderd.workers.backends.torch_backend import pool
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.model_spec import ModelKind, Pooling
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec

TEXTS = sentences(40, max_words=300, seed=11)  # 3 to 256+ tokens: some are truncated
QUERY = "which engine serves encoders fastest"


# Module fixtures: this file needs nothing of tests/conftest.py (tests/gpu/device_check.sh runs it on a GPU).
@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory) -> str:
    return str(build_reranker(tmp_path_factory.mktemp("packed") / "reranker"))


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory) -> str:
    return str(build_classifier(tmp_path_factory.mktemp("packed") / "classifier"))


def batches(spec, query: str | None = None, size: int = 16) -> list[TokenBatch]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tok.enable_truncation(spec.max_length)
    tok.no_padding()
    encodings = tok.encode_batch([(query, t) for t in TEXTS] if query else TEXTS)
    chunks = [encodings[start : start + size] for start in range(0, len(encodings), size)]
    return [
        TokenBatch.from_sequences(k, [e.ids for e in chunk], [e.type_ids for e in chunk] if query else None)
        for k, chunk in enumerate(chunks)
    ]


def load_backend(spec, options: BackendOptions, packed: bool = True):
    """A loaded torch backend; packed=False: as if the model were not a BERT (the padded forward)."""
    backend = create_backend("torch", spec, options)
    with mock.patch.object(packed_encoder, "usable", return_value=False) if not packed else contextlib.nullcontext():
        backend.load()
    return backend


def packed_and_padded(spec):
    """Two loads of one model: the packed forward, and the padded one."""
    backends = [load_backend(spec, BackendOptions(threads=1), packed) for packed in (True, False)]
    assert backends[0].packed is not None and backends[0].is_padded is False
    assert backends[1].packed is None and backends[1].is_padded
    return backends


@pytest.mark.parametrize("kind", ["embedding", "reranker", "classifier"])
def test_packed_forward_equals_padded(kind, reranker_path, classifier_path):
    path = {"embedding": default_model_path(), "reranker": reranker_path, "classifier": classifier_path}[kind]
    spec = load_model_spec(kind, path, ModelKind(kind))
    packed, padded = packed_and_padded(spec)
    work = batches(spec, QUERY if kind == "reranker" else None)
    assert any(b.lengths.max() > 4 * b.lengths.min() for b in work)  # the padded forward really pads
    for batch in work:
        got, want = packed.forward(batch), padded.forward(batch)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", list(Pooling))
def test_every_pooling_matches_the_padded_pooling(pooling):
    spec = msgspec.structs.replace(load_model_spec("e", default_model_path(), ModelKind.EMBEDDING), pooling=pooling)
    packed, _ = packed_and_padded(spec)
    batch = batches(spec)[0]
    lengths = torch.from_numpy(batch.lengths.astype(np.int64))
    hidden = torch.randn(int(lengths.sum()), 8, generator=torch.Generator().manual_seed(3))
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    dense = torch.zeros(*mask.shape, 8)
    dense[mask] = hidden
    got = packed.packed.pool(hidden, torch.from_numpy(batch.cu_seqlens), pooling)
    torch.testing.assert_close(got, pool(dense, mask.long(), pooling), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.MEAN_SQRT_LEN, Pooling.WEIGHTED_MEAN])
def test_pooling_bfloat16_states_sums_in_float32(pooling):
    """256 alike token states (repetitive text: a markdown rule, "word word ..."): pooled from
    bfloat16 as precisely as their float32 copy. A bfloat16 running sum had drifted to cosine 0.9977
    against float32 on the served 600-dash rule, under the 0.999 bfloat16 floor."""
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(384, generator=generator)
    hidden = (base + 0.05 * torch.randn(256, 384, generator=generator)).bfloat16()
    cu_seqlens = torch.tensor([0, 256], dtype=torch.int32)
    exact = packed_encoder.PackedEncoder.pool(hidden.float(), cu_seqlens, pooling)  # the same values in float32
    for got in (
        packed_encoder.PackedEncoder.pool(hidden, cu_seqlens, pooling),
        pool(hidden[None], torch.ones(1, 256, dtype=torch.long), pooling),
    ):
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)


# Families with packed pieces beyond BERT: (family, kind) checked packed vs padded on the same weights.
FAMILY_CASES = [
    (family, kind)
    for family in ("xlm-roberta", "roberta", "camembert", "distilbert", "modernbert", "qwen3")
    for kind in ("embedding", "reranker")
] + [("modernbert", "classifier"), ("qwen3", "classifier")]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-families")
    return lambda family, kind: str(build_family(family, kind, root / f"{family}-{kind}"))


@pytest.mark.parametrize("family,kind", FAMILY_CASES, ids=["-".join(c) for c in FAMILY_CASES])
def test_packed_family_forward_equals_padded(family, kind, family_models):
    """Each family's packed pieces (positions, layers, head) against transformers' padded float32
    forward of the same weights, with BERT's tolerance; the mixed lengths pad heavily."""
    spec = load_model_spec(kind, family_models(family, kind), ModelKind(kind))
    packed, padded = packed_and_padded(spec)
    for batch in batches(spec, QUERY if kind == "reranker" else None):
        np.testing.assert_allclose(packed.forward(batch), padded.forward(batch), atol=2e-5, rtol=1e-4)


def test_roberta_positions_skip_pad_tokens_inside_a_text(family_models):
    """RoBERTa-style positions count only tokens that are not the pad id (a literal "<pad>" in a text
    keeps position padding_idx and does not advance the count): the packed forward counts the same."""
    spec = load_model_spec("x", family_models("xlm-roberta", "embedding"), ModelKind.EMBEDDING)
    packed, padded = packed_and_padded(spec)
    pad = spec.pad_token_id
    batch = TokenBatch.from_sequences(0, [[0, 17, pad, 23, pad, 40, 2], [0, 9, 2], [0, pad, 2]])
    np.testing.assert_allclose(packed.forward(batch), padded.forward(batch), atol=2e-5, rtol=1e-4)


def test_families_without_packed_pieces_keep_the_padded_forward(family_models):
    for family in ("deberta-v2", "mpnet"):  # MPNet: relative position buckets; DeBERTa: relative attention
        backend = create_backend(
            "torch",
            load_model_spec(family, family_models(family, "embedding"), ModelKind.EMBEDDING),
            BackendOptions(threads=1),
        )
        backend.load()
        assert backend.packed is None and backend.is_padded, family


def _check_varlen_against_padded(spec, kind: str, dtype: str, relative: bool = False) -> None:
    """The packed (varlen FlashAttention) forward vs the padded SDPA one, same dtype and GPU:
    embeddings by cosine, logits within 0.05 (bfloat16) / 0.01, also relatively if `relative`."""
    options = BackendOptions(device="cuda", dtype=dtype)
    backends = [load_backend(spec, options, packed) for packed in (True, False)]
    if backends[0].packed is None:
        pytest.skip("no varlen attention kernel in this torch (and no flash-attn)")
    tolerance = 0.05 if dtype == "bfloat16" else 0.01
    for batch in batches(spec, QUERY if kind == "reranker" else None):
        got, want = backends[0].forward(batch), backends[1].forward(batch)
        if kind == "embedding":
            cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            assert cos.min() >= 0.999, cos.min()
        elif relative:
            np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
        else:
            np.testing.assert_allclose(got, want, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_attention_on_cuda_matches_padded(dtype, reranker_path):
    """One varlen FlashAttention call per layer vs the padded SDPA forward, same dtype and GPU."""
    for kind, path in (("embedding", default_model_path()), ("reranker", reranker_path)):
        spec = load_model_spec(kind, path, ModelKind(kind))
        _check_varlen_against_padded(spec, kind, dtype)


# Where the CUDA path differs per family: XLM-R's positions and head, ModernBERT's sliding window
# (window_size in the varlen kernel), Qwen3's causal grouped-query attention and scored token.
GPU_FAMILY_CASES = [
    ("xlm-roberta", "reranker"),
    ("modernbert", "embedding"),
    ("modernbert", "reranker"),
    ("qwen3", "embedding"),
    ("qwen3", "reranker"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("family,kind", GPU_FAMILY_CASES, ids=["-".join(c) for c in GPU_FAMILY_CASES])
def test_varlen_attention_on_cuda_matches_padded_per_family(family, kind, dtype, family_models):
    """Each family's packed pieces through one varlen FlashAttention call per layer (window and causal
    flags included) vs its padded SDPA forward, same dtype and GPU."""
    spec = load_model_spec(kind, family_models(family, kind), ModelKind(kind))
    # These random heads spread logits over several units: a relative bound as well.
    _check_varlen_against_padded(spec, kind, dtype, relative=True)


def test_torch_compile_option_matches_the_eager_forward():
    """--torch-compile: the padded forward compiled with inductor (dynamic shapes) gives the eager numbers."""
    spec = load_model_spec("e", default_model_path(), ModelKind.EMBEDDING)
    eager = create_backend("torch", spec, BackendOptions(threads=2))
    compiled = create_backend("torch", spec, BackendOptions(threads=2, compile=True))
    for backend in (eager, compiled):
        backend.load()
    assert compiled.packed is None and compiled.is_padded
    for batch in batches(spec)[:2]:  # two shapes: the second call must not need a new graph per length
        np.testing.assert_allclose(compiled.forward(batch), eager.forward(batch), atol=2e-5, rtol=1e-4)


def test_served_with_torch_compile_equals_sentence_transformers(tmp_path):
    """`encoderd serve --torch-compile` end to end: the flag reaches the worker, which compiles during
    warm-up, and served embeddings equal sentence-transformers on the same weights."""
    pytest.importorskip("zmq")
    from sentence_transformers import SentenceTransformer
    from support.server import ServerProcess

    from encoderd.v1 import encoderd_pb2 as pb

    texts = TEXTS[:16]
    log = tmp_path / "server.log"
    with ServerProcess("--torch-compile", "--model", f"mini={default_model_path()}", log_path=log) as server:
        reply = server.stub().Embed(pb.EmbedRequest(model="mini", inputs=texts))
    got = np.array([e.values for e in reply.embeddings])
    want = SentenceTransformer(default_model_path(), device="cpu").encode(texts)
    assert "torch.compile (dynamic shapes)" in log.read_text()
    np.testing.assert_allclose(got, want, atol=1e-5)


# ------------------------------------------------------------------ CPU attention in bfloat16
# In bfloat16/float16 on CPU, sequences longer than FLASH_UP_TO go through attention's three products
# (_attend_by_products), shorter ones through SDPA; float32 keeps SDPA throughout.
ATTENTION_LENGTHS = [3, 40, 40, 33, 32, 100, 7, 257, 40]  # both sides of FLASH_UP_TO; equal lengths


def _reference_attention(q, k, v, cu_seqlens, window):
    """Float32 SDPA on each sequence alone, key/value heads repeated for grouped-query attention."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        keys, values = (t[a:b].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        mask = packed_pieces._band(b - a, window, q.device)
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask).transpose(0, 1)
    return out


@contextlib.contextmanager
def attention_kernel_served():
    """A list that gets, for each attend() call, whether host_kernels' packed attention kernel served it."""
    served: list[bool] = []
    real = host_kernels.attend_full

    def recording(*args):
        context = real(*args)
        served.append(context is not None)
        return context

    with mock.patch.object(host_kernels, "attend_full", recording):
        yield served


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [packed_pieces.FULL, packed_pieces.CAUSAL, (4, 4)], ids=["full", "causal", "band"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 12, 32), (8, 2, 64)], ids=["mha", "gqa"])
def test_cpu_attention_equals_sdpa_per_sequence(dtype, window, heads, kv_heads, dim, threads):
    """attend() on CPU, over packed sequences of mixed and equal lengths, against float32 SDPA on each
    sequence: within float32's rounding in float32, within bfloat16's (inputs rounded, scores and
    probabilities in bfloat16) otherwise. The windows are BERT's (full), Qwen3's (causal, grouped-query)
    and ModernBERT's local layers (band). On one thread in bfloat16, BERT's full window over equal
    heads is host_kernels' packed attention kernel (where a C compiler built it); everything else is
    per sequence, by three products past FLASH_UP_TO tokens in bfloat16."""
    generator = torch.Generator().manual_seed(5)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(ATTENTION_LENGTHS)]), dtype=torch.int32)
    tokens = int(cu_seqlens[-1])
    q, k, v = (torch.randn(tokens, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    reduced = getattr(torch, dtype)
    q, k, v = (t.to(reduced).float() for t in (q, k, v))  # the reference sees the same rounded inputs
    want = _reference_attention(q, k, v, cu_seqlens, window)
    batch = packed_pieces.PackedBatch.of(torch.zeros(tokens, dtype=torch.long), cu_seqlens)
    products = mock.patch.object(packed_pieces, "_attend_by_products", wraps=packed_pieces._attend_by_products)
    with products as by_products, attention_kernel_served() as served:
        got = packed_pieces.attend(q.to(reduced), k.to(reduced), v.to(reduced), batch, window).float()
    one_call = dtype == "bfloat16" and heads == kv_heads and threads == 1 and host_kernels.kernels() is not None
    assert served == ([one_call] if window == packed_pieces.FULL else [])
    longer = sum(n > packed_pieces.FLASH_UP_TO for n in ATTENTION_LENGTHS)
    assert by_products.call_count == (longer if dtype == "bfloat16" and not any(served) else 0)
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
        assert (got - want).abs().mean() < 5e-3


def _worst_error(backend, reference, work, kind: str) -> float:
    """1 - the worst cosine (embeddings) or the largest score difference, over the batches."""
    if kind == "embedding":
        cosines = [
            (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            for got, want in ((backend.forward(b), reference.forward(b)) for b in work)
        ]
        return float(1 - min(c.min() for c in cosines))
    return float(max(np.abs(backend.forward(b) - reference.forward(b)).max() for b in work))


def _bert_or_family(family: str, kind: str, family_models, reranker_path: str) -> str:
    """The model of a (family, kind) case: BERT's are the bundled MiniLM (embedding) and the built reranker."""
    if family == "bert":
        return default_model_path() if kind == "embedding" else reranker_path
    return family_models(family, kind)


BFLOAT16_CASES = [("bert", "embedding"), ("bert", "reranker"), *FAMILY_CASES]


@pytest.mark.parametrize("family,kind", BFLOAT16_CASES, ids=["-".join(c) for c in BFLOAT16_CASES])
def test_packed_bfloat16_on_cpu_as_close_to_float32_as_transformers(family, kind, family_models, reranker_path):
    """Each packed family in bfloat16 on CPU (BERT's attention by host_kernels' packed kernel; the other
    windows by products past FLASH_UP_TO tokens, SDPA below) against transformers' padded float32
    forward of the same weights: no further from it than twice transformers' own padded bfloat16
    forward is. (These seeded models' random heads put logits in the
    tens, where bfloat16's own step is 0.125: an absolute bound would measure the head, not attention.
    A wrong mask, window or head grouping lands far outside twice.)"""
    path = _bert_or_family(family, kind, family_models, reranker_path)
    spec = load_model_spec(kind, path, ModelKind(kind))
    reduced = BackendOptions(dtype="bfloat16", threads=1)
    reference = load_backend(spec, BackendOptions(threads=1), packed=False)
    padded, packed = load_backend(spec, reduced, packed=False), load_backend(spec, reduced)
    assert packed.packed is not None and packed.options.dtype == "bfloat16"
    work = batches(spec, QUERY if kind == "reranker" else None)
    products = mock.patch.object(packed_pieces, "_attend_by_products", wraps=packed_pieces._attend_by_products)
    with products as by_products, attention_kernel_served() as served:
        error = _worst_error(packed, reference, work, kind)
    assert by_products.called or any(served)
    if family == "bert" and host_kernels.kernels() is not None:
        assert all(served) and served, "BERT's layers: the packed attention kernel serves every one"
    assert error <= 2 * _worst_error(padded, reference, work, kind), error


WHOLE_LAYER_CASES = [
    ("bert", "embedding", "bfloat16"),
    ("bert", "reranker", "bfloat16"),
    ("xlm-roberta", "reranker", "bfloat16"),
    ("distilbert", "embedding", "bfloat16"),
    ("bert", "embedding", "int8"),
    ("xlm-roberta", "reranker", "int8"),
]


@pytest.mark.parametrize("family,kind,dtype", WHOLE_LAYER_CASES, ids=["-".join(c) for c in WHOLE_LAYER_CASES])
def test_whole_bert_layers_equal_the_layers_operator_by_operator(family, kind, dtype, family_models, reranker_path):
    """Where the host kernels compute a short query's BERT layers one call each (host_kernels.bert_layer:
    one thread; bfloat16 with the few-row GEMM built here, or int8 with the VNNI GEMM and a bfloat16
    residual stream), the forward equals the same layers computed operator by operator bit for bit: single
    queries of 1 to limit + 8 tokens (few_row_limit(), INT8_WHOLE_LAYER_ROWS), batches of several short
    sequences, the corpus batches (past the limit: operator by operator either way); every layer of a query
    within the limit runs whole. BERT (MiniLM and a reranker), XLM-RoBERTa's positions, DistilBERT's names
    and scale."""
    if host_kernels.few_row_limit() == 0:
        pytest.skip("no few-row bfloat16 GEMM on this CPU (it needs avx512_bf16): every layer runs by operators")
    if dtype == "int8" and not host_kernels.kernels().int8_gemm:
        pytest.skip("no int8 GEMM kernel on this CPU (it needs avx512_vnni): int8 layers run by operators")
    path = _bert_or_family(family, kind, family_models, reranker_path)
    spec = load_model_spec(kind, path, ModelKind(kind))
    backend = load_backend(spec, BackendOptions(dtype=dtype, threads=1))
    pieces = backend.packed.pieces
    assert len(pieces.whole_layers) == pieces.layer_count
    query = QUERY if kind == "reranker" else None
    limit = host_kernels.INT8_WHOLE_LAYER_ROWS if dtype == "int8" else host_kernels.few_row_limit()
    singles = [[list(range(5, 5 + n))] for n in (*range(1, 17), 31, 32, 33, limit - 1, limit, limit + 1, limit + 8)]
    several = [[list(range(7, 7 + n)) for n in lengths] for lengths in ([1, 1], [3, 9, 2], [20, 21, 22])]
    work = batches(spec, query) + [
        TokenBatch.from_sequences(100 + i, seqs, [[0] * len(s) for s in seqs] if query else None)
        for i, seqs in enumerate(singles + several)
    ]
    calls = []
    real = host_kernels.bert_layer

    def counted(x, *args):
        calls.append((x.shape[0], (out := real(x, *args)) is not None))
        return out

    with mock.patch.object(host_kernels, "bert_layer", counted):
        whole = [backend.forward(batch) for batch in work]
    served_rows = {rows for rows, served in calls if served}
    assert set(range(1, 17)) <= served_rows and max(served_rows) <= limit
    assert all(served == (rows <= limit) for rows, served in calls), calls
    pieces.whole_layers = []
    for batch, got in zip(work, whole, strict=True):
        want = backend.forward(batch)
        assert np.array_equal(got, want), (batch.lengths, np.abs(got - want).max())


class _GemmRows(TorchDispatchMode):
    """The row counts (M) of the matrix products run under it: packed oneDNN linears, int8's, torch's
    (the host kernels' GEMMs, few-row bfloat16 and int8, are counted where they are called, in kernel_rows)."""

    PRODUCTS = ("_linear_pointwise", "_int_mm", "addmm", "mm", "linear")

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []
        self.kernel_rows: list[int] = []  # the host kernels' (the few-row bfloat16 GEMM's of the layers alone)
        self.in_layer = False  # set while a layer runs: the host kernels' GEMMs are counted only there

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.PRODUCTS:
            self.rows.append(args[1].shape[0] if func.__name__.startswith("addmm") else args[0].shape[0])
        return func(*args, **(kwargs or {}))


ROWS_CASES = [
    *(("bert", "embedding", dtype) for dtype in ("bfloat16", "float32", "int8")),
    *((family, kind, "bfloat16") for family, kind in (("xlm-roberta", "reranker"), ("modernbert", "classifier"))),
    ("qwen3", "embedding", "bfloat16"),
]


@pytest.mark.parametrize("family,kind,dtype", ROWS_CASES, ids=["-".join(c) for c in ROWS_CASES])
def test_gemm_rows_rounded_up_leave_real_rows_bit_identical(family, kind, dtype, family_models, monkeypatch):
    """On CPU every oneDNN GEMM of the packed forward runs on a multiple of gemm_rows_multiple's rows (oneDNN
    builds a primitive per row count: live queries of many lengths, and bigger batches, rebuilt them); where
    host kernels compute every layer GEMM (rows_multiple: the few-row bfloat16 GEMM, the int8 GEMM), on the
    batch's own rows. The filler sequences change no real row's bits, and never reach pooling or the head:
    single queries of 2-40 tokens and the corpus batches equal the forward with fillers to twice the multiple
    everywhere exactly (the lengths that are multiples of 8: no filler against one; the kernels': none
    against a filler). Not oneDNN's rows against no filler at all: with AMX, oneDNN computes a last block of
    under 8 rows with another kernel (packed_encoder's comment)."""
    path = default_model_path() if family == "bert" else family_models(family, kind)
    spec = load_model_spec(kind, path, ModelKind(kind))
    backend = load_backend(spec, BackendOptions(dtype=dtype, threads=1))
    assert backend.packed is not None
    query = QUERY if kind == "reranker" else None
    work = batches(spec, query) + [
        TokenBatch.from_sequences(100 + n, [list(range(5, 5 + n))], [[0] * n] if query else None) for n in range(2, 41)
    ]
    products, layer = _GemmRows(), backend.packed.pieces.layer

    def counted_layer(*args):
        with products:
            products.in_layer = True
            try:
                return layer(*args)
            finally:
                products.in_layer = False

    monkeypatch.setattr(backend.packed.pieces, "layer", counted_layer)  # the layers' GEMMs, not the head's
    int8_gemm = host_kernels.int8_linear  # int8's VNNI GEMM is a host kernel, not a torch operator

    def counted_int8_gemm(quantized, *args):
        products.kernel_rows.append(quantized.shape[0])
        return int8_gemm(quantized, *args)

    monkeypatch.setattr(host_kernels, "int8_linear", counted_int8_gemm)
    few_rows_gemm = host_kernels.bf16_linear  # so is the few-row bfloat16 GEMM, where it serves

    def counted_few_rows_gemm(x, *args):
        if (out := few_rows_gemm(x, *args)) is not None and products.in_layer:  # not the head's
            products.kernel_rows.append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr(host_kernels, "bf16_linear", counted_few_rows_gemm)
    whole_layer = host_kernels.bert_layer  # and a BERT layer's GEMMs in one call, where it serves

    def counted_whole_layer(x, *args):
        if (out := whole_layer(x, *args)) is not None:
            products.kernel_rows.append(x.shape[0])
        return out

    monkeypatch.setattr(host_kernels, "bert_layer", counted_whole_layer)
    rounded = [backend.forward(batch) for batch in work]
    onednn, kernels, rows_multiple = products.rows, products.kernel_rows, backend.packed.rows_multiple
    assert all(m % packed_encoder.gemm_rows_multiple(m) == 0 for m in onednn), onednn
    assert all(m % rows_multiple(m) == 0 for m in kernels), kernels
    assert max(onednn + kernels) >= 512  # the corpus batches ran; past the least multiple's range, if rounded
    assert {n for n in range(2, 41) if rows_multiple(n) == 1} <= set(kernels)  # those queries' own token counts
    if backend.packed.few_row_weights or backend.packed.int8_gemms:  # bfloat16 or int8 where the kernels serve
        assert rows_multiple(9) == 1, "MiniLM-sized layers of 9 rows run on host kernels wherever they serve"
    monkeypatch.setattr(packed_encoder, "GEMM_ROWS_MULTIPLE", 2 * packed_encoder.GEMM_ROWS_MULTIPLE)
    monkeypatch.setattr(backend.packed, "rows_multiple", packed_encoder.gemm_rows_multiple)  # fillers everywhere
    for batch, got in zip(work, rounded, strict=True):
        want = backend.forward(batch)
        assert got.shape == want.shape and np.array_equal(got, want), (batch.lengths, np.abs(got - want).max())
