"""The ONNX graphs the onnx engine (onnx_backend.py) and the tensorrt engine run, built once and cached.

The transformers model is exported once with `torch.onnx.export(dynamo=True)`
with dynamic batch and sequence axes, then derived graphs are made from that
export: int8 by smoothing activation outliers into the weights, then per-channel
dynamic quantization of every MatMul but the feed-forward down-projections
(see quantize_int8), float16 by converting initializers and ops
while keeping float32 inputs/outputs. Each graph is a model_cache entry, so a
restart loads it from disk without torch doing any work.

The graph ends at the encoder's hidden states (embeddings) or the logits
(rerankers, classifiers); pooling happens in numpy (workers.pooling), so one
export serves every pooling mode.

Why dynamo: on transformers 5 the legacy TorchScript exporter traces the
"mask is all ones" shortcut of the attention-mask code and silently drops the
mask for padded batches; torch.export keeps the data-dependent mask.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..contract import hardware
from ..contract.config import default_cache_dir
from ..contract.model_spec import ModelKind, ModelSpec
from ..model_cache import cached_build, fingerprint_model, library_versions
from .base import from_pretrained
from .onnx_session import ORT_DISTRIBUTIONS, create_session

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
OPSET = 18
# Above this many bytes of weights a graph no longer fits one protobuf (2 GiB): use external data.
_EXTERNAL_DATA_BYTES = 1_500_000_000
# Bump when quantize_int8 changes what it writes, so cached int8 graphs of an older recipe are rebuilt.
INT8_RECIPE = 2
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: 0.5 and 0.8 measure alike


# ------------------------------------------------------------------------ export
def _export_inputs(model) -> list[str]:
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        names.append("token_type_ids")
    return names


def export_onnx(
    model_dir: str, kind: ModelKind, max_length: int, out_dir: Path, trust_remote_code: bool = False
) -> None:
    """Write out_dir/model.onnx: float32, dynamic (batch, sequence) axes."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    model_class = AutoModel if kind == ModelKind.EMBEDDING else AutoModelForSequenceClassification
    try:
        model = from_pretrained(
            model_class, model_dir, trust_remote_code, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
    except ValueError:  # no SDPA path (DeBERTa-v2): the model's own attention
        model = from_pretrained(model_class, model_dir, trust_remote_code, dtype=torch.float32).eval()
    names = _export_inputs(model)
    output = "last_hidden_state" if kind == ModelKind.EMBEDDING else "logits"

    class GraphOutput(torch.nn.Module):
        """Returns one tensor, so the graph has one named output and no tuples."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            return getattr(self.model(**{name: inputs[name] for name in names}), output)

    # A padded example (row 1 half masked) so nothing specializes on an all-ones mask.
    ids = torch.full((2, 16), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    example = (ids, mask, torch.zeros_like(ids))[: len(names)]
    batch = torch.export.Dim("batch")
    # Bounded by the position table; torch.export rejects an unbounded axis that indexes it. > 16: the example.
    seq = torch.export.Dim("sequence", max=max(max_length, 17))
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > _EXTERNAL_DATA_BYTES
    with torch.no_grad():
        torch.onnx.export(
            GraphOutput().eval(),
            example,
            str(out_dir / MODEL_FILE),
            input_names=names,
            output_names=[output],
            dynamo=True,
            opset_version=OPSET,
            verbose=False,
            # The exporter's optimizer folds weight transposes into constant initializers;
            # without it quantize_dynamic finds no constant MatMul weight and quantizes nothing.
            optimize=True,
            dynamic_shapes={name: {0: batch, 1: seq} for name in names},
            external_data=big,
        )


def _matrix_shapes(graph) -> dict[str, tuple[int, int]]:
    return {init.name: tuple(init.dims) for init in graph.initializer if len(init.dims) == 2}


def int8_plan(graph) -> tuple[list[str], dict[str, list]]:
    """Which MatMuls (those with a constant weight [in, out]) stay float32, and which get
    quantized, grouped by the activation they read (q, k and v share theirs).

    Float32: the feed-forward down-projections (in > out): their input is the GELU output,
    whose outliers no random calibration predicts (see quantize_int8). A weight any other
    node also reads is left alone rather than smoothed for one of its readers.
    """
    shapes = _matrix_shapes(graph)
    constants = {init.name for init in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    keep_float: list[str] = []
    groups: dict[str, list] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in shapes:
            continue
        if shapes[node.input[1]][0] > shapes[node.input[1]][1]:
            keep_float.append(node.name)
        elif readers[node.input[1]] == 1 and node.input[0] not in constants:
            groups.setdefault(node.input[0], []).append(node)
    return keep_float, groups


def calibration_feed(graph, length: int, rows: int = 8) -> dict[str, np.ndarray]:
    """Seeded random tokens over the whole vocabulary. Enough for smoothing: the channels
    whose outliers matter are the same for any input (they come with every token)."""
    shapes = _matrix_shapes(graph)
    vocab = next(
        (
            shapes[node.input[0]][0]
            for node in graph.node
            if node.op_type == "Gather" and node.input[1] == "input_ids" and node.input[0] in shapes
        ),
        1000,
    )
    ids = np.random.default_rng(0).integers(0, vocab, (rows, length), dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {i.name: feed[i.name] for i in graph.input}


def activation_ranges(source: Path, names: list[str], length: int, work: Path) -> dict[str, np.ndarray]:
    """Per-channel max |x| of the named tensors of the float32 graph on calibration_feed."""
    import onnx

    model = onnx.load(str(source))
    model.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    onnx.save(model, str(work / "calibrate.onnx"), save_as_external_data=_is_big(source))
    session = create_session(work / "calibrate.onnx", ["CPUExecutionProvider"], 0)
    values = session.run(names, calibration_feed(model.graph, length))
    return {name: np.abs(x).reshape(-1, x.shape[-1]).max(0) for name, x in zip(names, values, strict=True)}


def smooth(model, groups: dict[str, list], ranges: dict[str, np.ndarray]) -> None:
    """SmoothQuant (Xiao et al., 2023), in place: x @ W == (x / s) @ (s * W) with per-input-channel
    s = max|x|^a / max|W|^(1-a), so a few outlier channels no longer set the one activation scale
    dynamic quantization uses for the whole tensor. A Mul node computes x / s before each group."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    for index, (activation, nodes) in enumerate(groups.items()):
        arrays = [numpy_helper.to_array(weights[node.input[1]]) for node in nodes]
        w_max = np.max([np.abs(w).max(1) for w in arrays], axis=0)
        s = np.maximum(ranges[activation], 1e-5) ** SMOOTH_ALPHA / np.maximum(w_max, 1e-5) ** (1 - SMOOTH_ALPHA)
        for node, w in zip(nodes, arrays, strict=True):
            weights[node.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), node.input[1]))
            node.input[0] = f"{activation}/smoothed"
        graph.initializer.append(numpy_helper.from_array((1 / s).astype(np.float32), f"{activation}/smooth"))
        first = min(list(graph.node).index(node) for node in nodes)  # before its readers: topological order
        graph.node.insert(
            first,
            onnx.helper.make_node(
                "Mul", [activation, f"{activation}/smooth"], [f"{activation}/smoothed"], name=f"smooth_{index}"
            ),
        )


def _is_big(source: Path) -> bool:
    return sum(f.stat().st_size for f in source.parent.iterdir()) > _EXTERNAL_DATA_BYTES


def quantize_int8(source: Path, out_dir: Path, max_length: int, recipe: str) -> None:
    """Dynamic int8, weights per output channel (per-tensor costs ~0.05 cosine on MiniLM), after
    smoothing; the feed-forward down-projections stay float32. `recipe` (hardware.onnx_int8_recipe):
    signed weights, or unsigned ones where the CPU has no VNNI and u8 x s8 products would saturate
    its int16 pair sums.

    Measured on all-MiniLM-L6-v2 (test_engines' 40 mixed-length texts in batches of 16), worst /
    mean embedding cosine to float32 and tokens/s relative to float32 (1 and 2 threads alike):
      every MatMul int8                                  0.986 / 0.992   2.0x
      down-projections float32                           0.991 / 0.995   1.5x
      down-projections float32, the rest smoothed        0.997 / 0.998   1.5x   <- this
      also up-projections float32 (no smoothing)         0.997 / 0.998   1.2x
    Smoothing the down-projections too needs real text to calibrate (random tokens give 0.985).
    The activation scale covers the whole input tensor, so the backend runs int8 one sequence at a
    time (OnnxBackend.forward): batched, a sequence's error would depend on its neighbours.
    """
    import tempfile

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    big = _is_big(source)
    model = onnx.load(str(source))
    keep_float, groups = int8_plan(model.graph)
    with tempfile.TemporaryDirectory(dir=out_dir) as work_dir:
        work = Path(work_dir)
        smooth(model, groups, activation_ranges(source, list(groups), min(128, max_length), work))
        onnx.save(model, str(work / MODEL_FILE), save_as_external_data=big)
        # Quantize an export, never an onnxruntime-optimized (fused) graph: quantize_dynamic fails on those.
        # MatMul only: also quantizing the embedding Gathers costs accuracy (min cosine 0.976 vs 0.980) for no speed.
        weights = QuantType.QUInt8 if recipe == hardware.ONNX_INT8_UNSIGNED else QuantType.QInt8
        quantize_dynamic(
            work / MODEL_FILE,
            out_dir / MODEL_FILE,
            per_channel=True,
            weight_type=weights,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=keep_float,
            use_external_data_format=big,
        )
    # quantize_dynamic skips MatMuls whose weight is not a constant initializer without failing;
    # a graph it left in float32 must not be served (and cached) as int8.
    graph = onnx.load(str(out_dir / MODEL_FILE), load_external_data=False).graph
    if not any(node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for node in graph.node):
        raise RuntimeError(f"int8 quantization of {source} quantized no MatMul; the export is not quantizable")


def convert_float16(source: Path, out_dir: Path) -> None:
    """float16 weights and compute, float32 inputs/outputs (so callers never see half)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # Needs the exporter-optimized graph: with the shape arithmetic unfolded the converter retypes a
    # float32 Expand input and onnxruntime rejects the graph ("Type (tensor(float16)) ... does not match").
    model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
    big = model.ByteSize() > _EXTERNAL_DATA_BYTES
    onnx.save(model, str(out_dir / MODEL_FILE), save_as_external_data=big)


@contextlib.contextmanager
def _quiet_libraries():
    """Mute the exporter's and quantizer's per-tensor INFO logs and advisory warnings
    (some go to the root logger, so a named logger's level cannot); failures still raise."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _timed(what: str, step, *args) -> None:
    log.info("%s ...", what)
    started = time.perf_counter()
    with _quiet_libraries():
        step(*args)
    log.info("%s done in %.1fs", what, time.perf_counter() - started)


def ensure_onnx_model(
    spec: ModelSpec, dtype: str, cache_dir: str, trust_remote_code: bool = False
) -> tuple[Path, bool]:
    """The cached graph for (model, dtype), exporting and converting on a miss.

    Returns (model.onnx path, whether it came from the cache untouched).
    """
    root = cache_dir or default_cache_dir()
    versions = library_versions("torch", "transformers", "onnx", "onnxscript", *ORT_DISTRIBUTIONS)
    key = {
        "model": fingerprint_model(spec.path),
        "kind": spec.kind.value,
        "max_length": spec.max_length,
        "versions": versions,
    }
    base = cached_build(
        root,
        "onnx",
        f"{spec.name}-float32",
        {**key, "dtype": "float32"},
        lambda out: _timed(
            f"exporting {spec.name} to ONNX", export_onnx, spec.path, spec.kind, spec.max_length, out, trust_remote_code
        ),
    )
    if dtype == "float32":
        return base.path / MODEL_FILE, base.hit
    scheme = hardware.onnx_int8_recipe()
    # (what it does, for the progress line; the conversion; its arguments after source and destination)
    steps: dict[str, tuple[str, Callable[..., None], tuple]] = {
        "int8": (
            f"quantizing {{}} to int8 ({scheme}: smoothed, dynamic, per-channel)",
            quantize_int8,
            (spec.max_length, scheme),
        ),
        "float16": ("converting {} to float16", convert_float16, ()),
    }
    what, convert, extra = steps[dtype]
    # The scheme is in the key: a graph quantized for a VNNI CPU is never reused on one it would saturate.
    recipe = {"recipe": INT8_RECIPE, "scheme": scheme} if dtype == "int8" else {}
    entry = cached_build(
        root,
        "onnx",
        f"{spec.name}-{dtype}",
        {**key, "dtype": dtype, **recipe},
        lambda out: _timed(what.format(spec.name), convert, base.path / MODEL_FILE, out, *extra),
    )
    return entry.path / MODEL_FILE, base.hit and entry.hit
