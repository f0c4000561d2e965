"""Issue 19.3: `--engine torch --dtype int8` on CPU (workers/backends/int8_linear.py) against
sentence-transformers float32 on the same weights, on the broad corpus (prose, licences, code,
non-English, emoji, passages at the maximum length), and through the worker's own fidelity gate.

Speed is measured by tests/support/int8_recipes.py (ratios in hardware.py), never here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.broad_corpus import broad_corpus

from encoderd.workers import fidelity
from encoderd.workers.backends import BackendOptions, create_backend, packed_encoder
from encoderd.workers.backends.int8_linear import Int8Linear
from encoderd.workers.contract import hardware
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.contract.tokenizer import load_tokenizer

FLOOR = 0.99  # fidelity.FLOORS["int8"]["min_cosine"]
AVX2_ONLY = "avx512*,avx_vnni,amx*"


def embed_broad_corpus(dtype: str = "int8") -> tuple[np.ndarray, object]:
    """The broad corpus through an in-process torch backend, length-sorted batches of 16 as the
    scheduler cuts them; rows back in corpus order."""
    spec = load_model_spec("m", default_model_path())
    backend = create_backend("torch", spec, BackendOptions(dtype=dtype, threads=1))
    backend.load()
    tok = load_tokenizer(spec.path)
    tok.no_padding()
    tok.enable_truncation(spec.max_length)
    ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(broad_corpus())]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    rows = [order[i : i + 16] for i in range(0, len(order), 16)]
    batches = [TokenBatch.from_sequences(k, [ids[i] for i in r]) for k, r in enumerate(rows)]
    out = np.concatenate([backend.forward(batch) for batch in batches])
    return out[np.argsort(order)], backend


def min_cosine_to_sentence_transformers(got: np.ndarray) -> float:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(default_model_path(), device="cpu").encode(broad_corpus())
    return float(fidelity.min_cosine(got, want))


def test_int8_matches_sentence_transformers_and_passes_the_fidelity_gate():
    got, backend = embed_broad_corpus()
    quantized = [m for m in backend.model.modules() if isinstance(m, Int8Linear)]
    assert backend.packed is not None and len(quantized) >= 3 * backend.model.config.num_hidden_layers
    assert all(isinstance(qkv, Int8Linear) for qkv in backend.packed.pieces.qkv)
    cosine = min_cosine_to_sentence_transformers(got)
    print(f"\ntorch int8 ({hardware.torch_int8_recipe().name}) vs sentence-transformers: min cosine {cosine:.4f}")
    assert cosine >= FLOOR
    # the worker's own start-up check (calibration set, int8 floors) passes too
    assert fidelity.self_check(backend, backend.spec, allow_low=False).status == fidelity.PASSED


def test_without_vnni_7bit_weights_stay_accurate_on_the_saturating_kernel():
    """As an AVX2-only CPU: the recipe keeps weights to 7 bits, and oneDNN held to its AVX2 kernels
    (u8 x s8 pairs summed in a saturating int16) still gives min cosine >= 0.99. A subprocess: the
    ISA limit is read once, when oneDNN starts."""
    env = dict(
        os.environ,
        ONEDNN_MAX_CPU_ISA="AVX2",
        ATEN_CPU_CAPABILITY="avx2",
        **{hardware.MASK_ENV: AVX2_ONLY},
    )
    script = (
        "import json, sys; sys.path.insert(0, 'tests'); sys.path.insert(0, 'tests/integration');"
        "from test_torch_int8 import embed_broad_corpus, min_cosine_to_sentence_transformers;"
        "from encoderd.workers.backends.int8_linear import Int8Linear;"
        "got, b = embed_broad_corpus();"
        "peak = max(int(m.weight_t.abs().max()) for m in b.model.modules() if isinstance(m, Int8Linear));"
        "print(json.dumps({'peak': peak, 'cosine': min_cosine_to_sentence_transformers(got)}))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nAVX2 kernels, {hardware.TORCH_INT8_7BIT.name}: min cosine {result['cosine']:.4f}")
    assert result["peak"] <= 63  # 2 x 255 x 63 fits int16
    assert result["cosine"] >= FLOOR


def test_auto_serves_int8_where_vnni_but_no_native_bf16(tmp_path):
    """`encoderd serve` with default flags as a CPU with VNNI and without bf16 (Ice Lake, Alder
    Lake): it picks torch int8, says why, quantizes in the worker, passes the fidelity gate and
    serves vectors within the int8 floor of sentence-transformers."""
    pytest.importorskip("zmq")
    from sentence_transformers import SentenceTransformer
    from support.server import ServerProcess

    from encoderd.v1 import encoderd_pb2 as pb

    no_bf16 = "avx512_bf16,amx_bf16"
    info = hardware.read_cpu(mask=no_bf16)
    if hardware.choose_cpu_dtype("torch", info)[0] != "int8":
        pytest.skip(f"no VNNI on this CPU ({info.describe()}): auto keeps float32, as tested elsewhere")
    server = ServerProcess("--replicas", "1", env={hardware.MASK_ENV: no_bf16}, log_path=tmp_path / "log")
    server.env.pop("ENCODERD_DTYPE", None)  # tests/conftest.py pins float32
    texts = broad_corpus()[:12]
    with server:
        model = server.stub().ListModels(pb.ListModelsRequest()).models[0]
        reply = server.stub().Embed(pb.EmbedRequest(inputs=texts), timeout=60)
    got = np.array([e.values for e in reply.embeddings])
    assert (model.engine, model.dtype, model.fidelity_status) == ("torch", "int8", "passed")
    assert "int8 dot products" in server.log_text() and "linear layers quantized" in server.log_text()
    want = SentenceTransformer(default_model_path(), device="cpu").encode(texts)
    assert fidelity.min_cosine(got, want) >= FLOOR


def test_auto_int8_stays_off_kinds_the_fidelity_check_does_not_measure(monkeypatch):
    import msgspec

    from encoderd.workers.contract.model_spec import ModelKind

    monkeypatch.setattr(hardware, "choose_cpu_dtype", lambda engine, info=None: ("int8", "as a VNNI host"))
    spec = load_model_spec("m", default_model_path())
    assert create_backend("torch", spec, BackendOptions(dtype="auto")).options.dtype == "int8"
    colbert = msgspec.structs.replace(spec, kind=ModelKind.COLBERT)
    assert create_backend("torch", colbert, BackendOptions(dtype="auto")).options.dtype == "float32"


def test_torch_int8_is_cpu_only():
    spec = load_model_spec("m", default_model_path())
    with pytest.raises(ValueError, match="int8 on CPU only"):
        create_backend("torch", spec, BackendOptions(dtype="int8", device="cuda:0")).load()


def test_int8_calibration_sees_the_real_tokens_only(monkeypatch):
    """The SmoothQuant ranges come from the calibration set's own tokens: rounding the packed batches' rows
    differently (the filler) leaves every int8 linear's input scale unchanged."""
    spec = load_model_spec("embedding", default_model_path())

    def input_scales() -> list[torch.Tensor]:
        backend = create_backend("torch", spec, BackendOptions(dtype="int8", threads=1))
        backend.load()
        assert backend.packed is not None and backend.packed.round_rows
        lists = [value for value in vars(backend.packed.pieces).values() if isinstance(value, list)]
        fused = [m for value in lists for m in value if isinstance(m, Int8Linear)]  # the packed projections
        smoothed = [
            m for m in [*backend.model.modules(), *fused] if isinstance(m, Int8Linear) and m.input_scale is not None
        ]
        return [m.input_scale for m in smoothed]

    plain = input_scales()
    monkeypatch.setattr(packed_encoder, "GEMM_ROWS_MULTIPLE", 4 * packed_encoder.GEMM_ROWS_MULTIPLE)
    rounded_more = input_scales()
    assert len(plain) >= 6 * 3  # MiniLM: each layer's QKV, output and up projections are smoothed
    assert all(torch.equal(a, b) for a, b in zip(plain, rounded_more, strict=True))
