"""Issue 19.3: torch dynamic int8 recipes against float32 on the padding-free path, same threads,
on the broad corpus (tests/support/broad_corpus.py) plus 200 mixed-length sentences.

    .venv/bin/python tests/support/int8_recipes.py THREADS RECIPE[,RECIPE...] [MODEL_DIR]

MODEL_DIR: a BERT model other than the bundled MiniLM, e.g. the bge-base-sized one `encoderd bench`
builds (server/bench/models.py; random weights: its speed ratios mean something, its cosines not).

A recipe is '/'-separated: the quantized engine (x86, onednn, fbgemm), `pc` (per-channel weights),
`smooth` (SmoothQuant: per-input-channel scales from workers/calibration.py's texts, applied as a
Mul before each quantized linear), `aX` (its alpha), `dX` (the FFN down-projection's alpha),
`keepdown` (the FFN down-projection stays float32, oneDNN-packed), `pt` as the engine: every linear
an encoderd Int8Linear (workers/backends/int8_linear.py: one dynamic scale per token, int8 x int8 in
torch._int_mm), `ptdown` (only the FFN down-projection so), `rawdown` (no smoothing of the
down-projection), `w7` (7-bit weights: what a CPU without VNNI needs); `encoderd`: what the backend
`--engine torch --dtype int8` loads on this CPU (hardware.torch_int8_recipe); `bfloat16`: the
bfloat16 model, for comparison where the CPU computes it natively. Speed is CPU time of
this process (best of 4 interleaved rounds): on a machine shared with other work, wall time is not
comparable between recipes; use THREADS 1 so CPU time is compute time. The AVX2 estimate (emulated):

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    ENCODERD_CPU_FLAGS_MASK='avx512*,avx_vnni,amx*' .venv/bin/python tests/support/int8_recipes.py 1 encoderd
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import numpy as np
import torch

from encoderd.workers import memory
from encoderd.workers.backends import BackendOptions, int8_linear, packed_linear, torch_backend
from encoderd.workers.contract.model_files import default_model_path
from encoderd.workers.contract.protocol import TokenBatch
from encoderd.workers.contract.spec_reader import load_model_spec
from encoderd.workers.contract.tokenizer import load_tokenizer
from support.broad_corpus import broad_corpus
from support.corpus import sentences

memory.keep_freed_memory()  # for every recipe, float32 too: the same process
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
spec = load_model_spec("m", sys.argv[3] if len(sys.argv) > 3 else default_model_path())
tok = load_tokenizer(spec.path)
tok.no_padding()
tok.enable_truncation(spec.max_length)
texts = broad_corpus() + sentences(200, max_words=200, seed=9)
enc = sorted(tok.encode_batch(texts), key=lambda e: len(e.ids))
ids = [np.asarray(e.ids, dtype=np.int32) for e in enc]
batches = [TokenBatch.from_sequences(-1, ids[i : i + 16]) for i in range(0, len(ids), 16)]
ntok = sum(len(i) for i in ids)


def build(recipe):
    if recipe in ("encoderd", "bfloat16"):  # what `--engine torch --dtype int8` (or bfloat16) serves on this CPU
        dtype = "int8" if recipe == "encoderd" else recipe
        b = torch_backend.TorchBackend(spec, BackendOptions(dtype=dtype, threads=threads))
        b.load()
        return b
    real = packed_linear.available
    if recipe != "float32":
        packed_linear.available = lambda dtype: False
    b = torch_backend.TorchBackend(spec, BackendOptions(dtype="float32", threads=threads))
    b.load()
    packed_linear.available = real
    if recipe == "float32":
        return b
    parts = recipe.split("/")
    if parts[0] != "pt":
        torch.backends.quantized.engine = parts[0]
    from torch.ao.nn.quantized.dynamic import Linear as QLinear
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    qconfig = per_channel_dynamic_qconfig if "pc" in recipe else default_dynamic_qconfig
    keep_down = "keepdown" in recipe
    alpha = next((float(p[1:]) for p in recipe.split("/") if p.startswith("a")), 0.5)
    ranges = calibrate(b) if "smooth" in recipe else {}
    down_alpha = next((float(p[1:]) for p in recipe.split("/") if p.startswith("d")), alpha)
    downs = {layer.output.dense for layer in b.model.encoder.layer}

    bits = 7 if "w7" in parts else 8

    def q(lin):
        a = down_alpha if lin in downs else alpha
        smooth = lin in ranges and not (lin in downs and "rawdown" in parts)
        if parts[0] == "pt" or (lin in downs and "ptdown" in parts):
            return int8_linear.Int8Linear.from_linear(lin, bits, ranges[lin] if smooth else None, a)
        lin.qconfig = qconfig
        if smooth:
            w = lin.weight.detach()
            sc = ranges[lin].clamp(min=1e-5) ** a / w.abs().amax(0).clamp(min=1e-5) ** (1 - a)
            lin.weight.data = w * sc[None, :]
            return Smoothed(QLinear.from_float(lin), 1 / sc)
        return QLinear.from_float(lin)

    for layer in b.model.encoder.layer:
        layer.attention.output.dense = q(layer.attention.output.dense)
        layer.intermediate.dense = q(layer.intermediate.dense)
        if not keep_down:
            layer.output.dense = q(layer.output.dense)
        else:
            layer.output.dense = packed_linear.PackedLinear(layer.output.dense)
    b.packed.pieces.qkv = [q(lin) for lin in b.packed.pieces.qkv]
    return b


class Smoothed(torch.nn.Module):
    def __init__(self, inner, inv):
        super().__init__()
        self.inner, self.inv = inner, inv

    def forward(self, x):
        return self.inner(x * self.inv)


def calibrate(b):
    from encoderd.workers import calibration

    cal = calibration.texts(tok, spec.max_length)
    cenc = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(cal)]
    lins = list(list(b.packed.pieces.qkv) + [mod for mod in b.model.modules() if type(mod) is torch.nn.Linear])
    ranges = {}

    def hook(m, args):
        x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
        ranges[m] = torch.maximum(ranges[m], x) if m in ranges else x

    hs = [lin.register_forward_pre_hook(hook) for lin in lins]
    for i in range(0, len(cenc), 16):
        b.forward(TokenBatch.from_sequences(-1, cenc[i : i + 16]))
    for h in hs:
        h.remove()
    return ranges


def run(b):
    outs = [b.forward(x) for x in batches]
    return np.concatenate(outs)


recipes = ["float32", *sys.argv[2].split(",")]
backends = {r: build(r) for r in recipes}
ref = run(backends["float32"])
best = dict.fromkeys(recipes, 1000000000.0)
cos = {}
torch.set_num_threads(threads)
for _rnd in range(4):
    for r, b in backends.items():
        t = time.process_time()
        out = run(b)
        best[r] = min(best[r], time.process_time() - t)
        c = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
        cos[r] = (c.min(), c.mean())
for r in recipes:
    print(
        f"{r:28s} {ntok / best[r]:8.0f} tok/s  x{best['float32'] / best[r]:.2f}  "
        f"min cos {cos[r][0]:.4f} mean {cos[r][1]:.5f}",
        flush=True,
    )
