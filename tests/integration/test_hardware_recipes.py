"""Issue 15.1: the recipes each CPU gets are accurate there, and what a CPU cannot run is refused.

This host may have VNNI and native bfloat16; ENCODERD_CPU_FLAGS_MASK makes encoderd choose as an
AVX2-only host (AMD Zen 3) would. Where a library lets us lower the instruction set it really uses
(oneDNN's ONEDNN_MAX_CPU_ISA, under torch and CTranslate2), the check runs at AVX2 in a subprocess.
ONNX Runtime has no such switch, so its AVX2 int8 kernel is emulated in the graph: vpmaddubsw's
saturating int16 pair sums, as ONNX ops (emulate_avx2_int8).

Run as a script (`python test_hardware_recipes.py ENGINE DTYPE MODEL OUT.npy`) it computes the broad
corpus' outputs into OUT.npy: the subprocess half of the lowered-ISA checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support` when run as a script

from support.broad_corpus import broad_corpus

from encoderd.workers.backends import BackendOptions, create_backend
from encoderd.workers.contract import hardware
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.spec_reader import load_model_spec

AVX2_HOST = "avx512*,avx_vnni,amx*"  # the mask that leaves this host's flags as an AVX2-only CPU's
TEXTS = broad_corpus()


def _encode(spec, texts) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json"))
    tok.enable_truncation(spec.max_length)
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts)]


def length_sorted(spec, texts) -> list[str]:
    """The texts in the order the outputs below come in: by token count, as the frontend batches."""
    ids = _encode(spec, texts)
    return [texts[i] for i in sorted(range(len(texts)), key=lambda i: len(ids[i]))]


def tokenized(spec, texts):
    """Length-sorted batches of 16."""
    from encoderd.workers.contract.protocol import TokenBatch

    ids = _encode(spec, length_sorted(spec, texts))
    return [TokenBatch.from_sequences(k, ids[i : i + 16]) for k, i in enumerate(range(0, len(ids), 16))]


def outputs(backend, spec, texts=TEXTS) -> np.ndarray:
    """Outputs in length-sorted order (references are computed the same way)."""
    return np.concatenate([backend.forward(b) for b in tokenized(spec, texts)])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture
def cpu_mask(monkeypatch):
    """Set ENCODERD_CPU_FLAGS_MASK for this test (hardware.cpu() is re-read)."""

    def apply(mask: str) -> None:
        monkeypatch.setenv(hardware.MASK_ENV, mask)
        hardware.cpu.cache_clear()

    yield apply
    monkeypatch.delenv(hardware.MASK_ENV, raising=False)
    hardware.cpu.cache_clear()


@pytest.fixture(scope="module")
def minilm():
    return load_model_spec("minilm", default_model_path())


@pytest.fixture(scope="module")
def reference(minilm) -> np.ndarray:
    """torch float32 at this host's full instruction set."""
    backend = create_backend("torch", minilm, BackendOptions(threads=1))
    backend.load()
    return outputs(backend, minilm)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "engine,dtype,missing",
    [
        ("torch", "bfloat16", "avx512_bf16"),
        ("torch", "float16", "avx512_fp16"),
        ("ctranslate2", "int8", "avx512_vnni"),
        ("ctranslate2", "int8_float32", "avx_vnni"),
    ],
)
def test_avx2_host_refuses_what_it_would_emulate_or_saturate(engine, dtype, missing, minilm, cpu_mask, tmp_path):
    pytest.importorskip({"torch": "torch", "ctranslate2": "ctranslate2"}[engine])
    cpu_mask(AVX2_HOST)
    with pytest.raises(hardware.UnsupportedOnHardware, match=missing) as raised:
        create_backend(engine, minilm, BackendOptions(dtype=dtype, cache_dir=str(tmp_path))).load()
    assert "Use --dtype float32" in str(raised.value) or "--engine onnx --dtype int8" in str(raised.value)


def test_auto_engine_on_cpu_keeps_bfloat16_off_onnx(minilm, cpu_mask):
    """`--engine auto` hands onnxruntime only what it computes on CPU, so the verdict on bfloat16
    comes from the hardware policy, not from onnx's dtype list."""
    from encoderd.workers.backends import resolve_engine

    assert resolve_engine("auto", BackendOptions(dtype="bfloat16")) == "torch"
    assert resolve_engine("auto", BackendOptions(dtype="int8")) == "torch"  # 1.65x float32; onnx ~1.1x
    cpu_mask(AVX2_HOST)
    with pytest.raises(hardware.UnsupportedOnHardware, match="avx512_bf16"):
        create_backend("auto", minilm, BackendOptions(dtype="bfloat16"))


def test_server_refuses_with_one_line_and_a_nonzero_exit(tmp_path):
    """A real `encoderd serve --dtype bfloat16` as an AVX2-only host: it exits 2, and says why in one line."""
    pytest.importorskip("grpc")
    from support.server import ServerProcess

    server = ServerProcess(
        "--dtype",
        "bfloat16",
        "--cpu-threads",
        "1",
        "--model",
        f"mini={default_model_path()}",
        env={hardware.MASK_ENV: AVX2_HOST},
        log_path=tmp_path / "server.log",
    ).launch()
    try:
        code = server.proc.wait(120)
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    last = log.strip().splitlines()[-1]
    assert code == 2, log
    assert last.startswith("encoderd: cannot start mini@cpu[0]: UnsupportedOnHardware: --dtype bfloat16"), log
    assert "avx512_bf16" in last and "Use --dtype float32" in last
    assert "Traceback" not in log


# ------------------------------------------------------------------ onnx int8: both recipes
def choosing(recipe: str):
    """As a CPU whose features select `recipe` (a mask can only take VNNI away, and the host
    running these tests may have none to take)."""
    from unittest import mock

    return mock.patch.object(hardware, "onnx_int8_recipe", lambda info=None: recipe)


@pytest.fixture(scope="module")
def int8_graphs(minilm, tmp_path_factory) -> dict:
    """recipe -> {"path": the cached int8 graph, "cache": its cache directory}."""
    pytest.importorskip("onnxruntime")
    from encoderd.workers.backends.onnx_export import ensure_onnx_model

    cache = str(tmp_path_factory.mktemp("hardware-cache"))
    graphs = {}
    for recipe in (hardware.ONNX_INT8_SIGNED, hardware.ONNX_INT8_UNSIGNED):
        with choosing(recipe):
            graphs[recipe] = {"path": ensure_onnx_model(minilm, "int8", cache)[0], "cache": cache}
    return graphs


def test_int8_cache_entries_are_keyed_by_recipe(int8_graphs):
    assert set(int8_graphs) == {hardware.ONNX_INT8_SIGNED, hardware.ONNX_INT8_UNSIGNED}
    paths = {recipe: graph["path"].parent for recipe, graph in int8_graphs.items()}
    assert len(set(paths.values())) == 2  # one entry each: a VNNI graph is never reused on an AVX2 host
    for recipe, entry in paths.items():
        assert json.loads((entry / "encoderd-cache.json").read_text())["key"]["scheme"] == recipe


def _int8_weights(path: Path) -> list[np.ndarray]:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    weights = {init.name: init for init in graph.initializer}
    return [numpy_helper.to_array(weights[node.input[1]]) for node in graph.node if node.op_type == "MatMulInteger"]


def test_without_vnni_weights_are_unsigned(int8_graphs):
    """MLAS multiplies u8 x s8 with vpmaddubsw on AVX2 / AVX-512 without VNNI (adjacent products
    summed in a saturating int16: 2 x 255 x 127 = 64,770 > 32,767); for u8 x u8 it has no such
    kernel and widens both operands to int16 (vpmaddwd: pairs summed in int32)."""
    unsigned = _int8_weights(int8_graphs[hardware.ONNX_INT8_UNSIGNED]["path"])
    signed = _int8_weights(int8_graphs[hardware.ONNX_INT8_SIGNED]["path"])
    assert len(unsigned) == len(signed) == 30  # q, k, v, attention output and up-projection of 6 layers
    assert {w.dtype for w in unsigned} == {np.dtype(np.uint8)}
    assert {w.dtype for w in signed} == {np.dtype(np.int8)}
    assert np.iinfo(np.int16).max < 2 * 255 * 127 and np.iinfo(np.int32).max > 2 * 255 * 255


@pytest.mark.parametrize("recipe", [hardware.ONNX_INT8_SIGNED, hardware.ONNX_INT8_UNSIGNED])
def test_each_int8_recipe_is_accurate_on_a_broad_corpus(recipe, int8_graphs, minilm, reference):
    """Through the backend, as a host choosing that recipe loads it (its cache entry, not a rebuild).
    The unsigned recipe is exact on every x86 CPU, so what it computes here an AVX2 host computes.
    Measured here (Zen 5): signed min/mean cosine 0.9954/0.9984, unsigned 0.9951/0.9984 (7-bit signed
    weights, the other saturation-free recipe, 0.9891: below the floor)."""
    if recipe == hardware.ONNX_INT8_SIGNED and not hardware.cpu().int8_exact:
        pytest.skip("signed int8 weights saturate on this CPU (test_emulated_avx2_kernel_... shows how)")
    with choosing(recipe):
        backend = create_backend(
            "onnx", minilm, BackendOptions(dtype="int8", threads=1, cache_dir=int8_graphs[recipe]["cache"])
        )
        backend.load()
    assert backend.cache_hit
    cos = cosines(outputs(backend, minilm), reference)
    print(f"\nonnx int8 {recipe}: cosine min {cos.min():.4f} mean {cos.mean():.4f} ({len(cos)} texts)")
    assert cos.min() >= 0.99 and cos.mean() >= 0.995, (cos.min(), cos.mean())
    assert cos.min() < 0.9999  # it is int8: a graph left float32 would pass the bounds above


# ------------------------------------------------------------------ onnx int8 as an AVX2 CPU runs it
def emulate_avx2_int8(model):
    """Rewrite each MatMulInteger (u8 activations x s8 weights, symmetric) as ONNX ops computing what
    MLAS's AVX2 kernel does: each adjacent pair of products along k summed into a saturating int16
    (vpmaddubsw), then the pairs summed exactly; the activation zero point corrected exactly."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    nodes = []

    def const(name, value, dtype=np.int64):
        graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    for node in graph.node:
        if node.op_type != "MatMulInteger":
            nodes.append(node)
            continue
        a, b, a_zero, b_zero = node.input
        assert not numpy_helper.to_array(weights[b_zero]).any()  # symmetric weights
        w = numpy_helper.to_array(weights[b]).astype(np.int32)
        k, n = w.shape
        p = node.output[0]
        steps = [
            ("Shape", [a], "shape", {}),
            ("Reshape", [a, const(p + "/mk", [-1, k])], "a2", {}),
            ("Cast", [p + "/a2"], "a32", {"to": TensorProto.INT32}),
            ("Unsqueeze", [p + "/a32", const(p + "/last", [-1])], "a3", {}),
            ("Mul", [p + "/a3", const(p + "/w", w, np.int32)], "products", {}),  # (m, k, n)
            ("Reshape", [p + "/products", const(p + "/pairs_shape", [-1, k // 2, 2, n])], "pairs", {}),
            ("ReduceSum", [p + "/pairs", const(p + "/axis", [-2])], "pair_sums", {"keepdims": 0}),
            (
                "Clip",
                [p + "/pair_sums", const(p + "/lo", -32768, np.int32), const(p + "/hi", 32767, np.int32)],
                "saturated",
                {},
            ),
            ("ReduceSum", [p + "/saturated", p + "/axis"], "ab", {"keepdims": 0}),  # (m, n)
            ("Cast", [a_zero], "a_zero32", {"to": TensorProto.INT32}),
            ("Mul", [p + "/a_zero32", const(p + "/colsum", w.sum(0), np.int32)], "zero_term", {}),
            ("Sub", [p + "/ab", p + "/zero_term"], "c", {}),
            ("Slice", [p + "/shape", const(p + "/zero", [0]), const(p + "/minus1", [-1])], "lead", {}),
            ("Concat", [p + "/lead", const(p + "/n", [n])], "out_shape", {"axis": 0}),
        ]
        for op, inputs, out, attrs in steps:
            nodes.append(helper.make_node(op, inputs, [f"{p}/{out}"], **attrs))
        nodes.append(helper.make_node("Reshape", [p + "/c", p + "/out_shape"], [p]))
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _one_at_a_time(session, spec, texts) -> np.ndarray:
    from encoderd.workers.pooling import pool

    vectors = []
    for batch in tokenized(spec, texts):
        for lo, hi in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True):
            ids = batch.input_ids[lo:hi][None].astype(np.int64)
            mask = np.ones_like(ids)
            hidden = session.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
            vectors.append(pool(hidden[0], mask, spec.pooling)[0])
    return np.array(vectors)


def test_emulated_avx2_kernel_saturates_signed_weights(int8_graphs, minilm, tmp_path):
    """The issue's Zen 3 symptom, reproduced on any CPU: the signed-weight graph through the
    emulated AVX2 kernel gives cosines like the 0.19-0.79 measured there (here, 40 texts: min 0.097,
    median 0.36), while the same integers accumulated exactly (VNNI) give 0.998. An AVX2 host
    therefore gets the unsigned recipe (test_without_vnni_weights_are_unsigned)."""
    import onnx

    from encoderd.workers.backends.onnx_session import create_session

    texts = [t for t in TEXTS if len(t.split()) <= 12][:10]  # short: the emulation holds (tokens, k, n) int32
    torch_backend = create_backend("torch", minilm, BackendOptions(threads=1))
    torch_backend.load()
    want = outputs(torch_backend, minilm, texts)
    graph = int8_graphs[hardware.ONNX_INT8_SIGNED]["path"]
    emulated = tmp_path / "avx2.onnx"
    onnx.save(emulate_avx2_int8(onnx.load(str(graph))), str(emulated))
    native = cosines(_one_at_a_time(create_session(graph, ["CPUExecutionProvider"], 1), minilm, texts), want)
    at_avx2 = cosines(_one_at_a_time(create_session(emulated, ["CPUExecutionProvider"], 1), minilm, texts), want)
    print(
        f"\nsigned int8 weights: cosine min {native.min():.4f} exact, {at_avx2.min():.3f} "
        f"(median {np.median(at_avx2):.3f}) on the emulated AVX2 kernel"
    )
    assert np.median(at_avx2) < 0.9  # wrecked where pairs saturate
    if hardware.cpu().int8_exact:
        assert native.min() >= 0.99  # fine where products accumulate in int32


# ------------------------------------------------------------------ the AVX2 path of oneDNN (torch, ctranslate2)
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "CT2_USE_MKL": "0", "ONEDNN_VERBOSE": "1"}


def run_at_avx2(engine: str, dtype: str, model: str, out: Path) -> str:
    """This module as a script, oneDNN capped at AVX2 (CTranslate2 made to use oneDNN, not MKL); returns its log."""
    done = subprocess.run(
        [sys.executable, __file__, engine, dtype, model, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, **AVX2_ENV, hardware.MASK_ENV: ""},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "isa:Intel AVX2" in done.stdout, done.stdout[-2000:]  # oneDNN's own word that the cap took effect
    return done.stdout


def test_torch_float32_at_avx2_matches_full_isa(minilm, reference, tmp_path):
    log = run_at_avx2("torch", "float32", default_model_path(), tmp_path / "out.npy")
    assert "capability AVX2" in log  # ATen's own kernels too, not only oneDNN's
    assert cosines(np.load(tmp_path / "out.npy"), reference).min() >= 0.9999


def test_ctranslate2_int8_at_avx2_is_why_it_is_refused(minilm, reference, tmp_path):
    """CTranslate2 has no unsigned or 7-bit option. Its int8 through oneDNN's AVX2 kernel (what a
    Zen 3 runs) is worse than through VNNI and below the int8 floor. Measured here, embeddings:
    min/mean cosine 0.9859/0.9956 at AVX2, 0.9886/0.9970 with VNNI; the test classifier 0.968/0.9981
    vs 0.978/0.9985. (With VNNI it is below 0.99 on this corpus too, on short queries: see the notes.)"""
    pytest.importorskip("ctranslate2")
    from encoderd.workers.backends.ct2_backend import CT2Backend

    run_at_avx2("ctranslate2", "int8", default_model_path(), tmp_path / "avx2.npy")
    at_avx2 = cosines(np.load(tmp_path / "avx2.npy"), reference)
    print(f"\nctranslate2 int8 at AVX2: cosine min {at_avx2.min():.4f} mean {at_avx2.mean():.4f}")
    assert at_avx2.min() < 0.99
    if hardware.cpu().int8_exact:  # this host also has the int32-accumulating path: compare
        native = CT2Backend(minilm, BackendOptions(dtype="int8", threads=1, cache_dir=str(tmp_path / "cache")))
        native.load()  # the class directly: create_backend would apply the policy under test
        at_vnni = cosines(outputs(native, minilm), reference)
        print(f"ctranslate2 int8 with VNNI: cosine min {at_vnni.min():.4f} mean {at_vnni.mean():.4f}")
        assert at_avx2.mean() < at_vnni.mean()


def _script(engine: str, dtype: str, model: str, out: str) -> None:
    import torch

    print(f"capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    spec = load_model_spec("m", model)
    backend_class = {"torch": "torch_backend.TorchBackend", "ctranslate2": "ct2_backend.CT2Backend"}[engine]
    module, name = backend_class.split(".")
    backend = getattr(__import__(f"encoderd.workers.backends.{module}", fromlist=[name]), name)(
        spec, BackendOptions(dtype=dtype, threads=1, cache_dir=str(Path(out).parent / "cache"))
    )
    backend.load()  # the class directly: the policy would refuse ctranslate2 int8 where it is measured here
    np.save(out, outputs(backend, spec))


if __name__ == "__main__":
    _script(*sys.argv[1:5])
