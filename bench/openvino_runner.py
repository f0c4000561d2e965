"""Run inside the OpenVINO virtualenv (bench/openvino.py makes it): sentence-transformers with
`backend="openvino"`, in this process, no server. Imports nothing of encoderd: that environment has
its own transformers.

    <venv>/bin/python -P openvino_runner.py JOB.json   (-P: bench/ stays off sys.path)

JOB.json: {"model_dir", "variant" ("auto" | "int8"), "threads", "texts", "calibration", "windows",
"batch", "seconds", "cache_dir", "out"}. It encodes `texts` once (the vectors, for the fidelity check,
written to out + ".npy"; this pass also warms up), then times `windows` (lists of indices into texts,
each encoded with encode(batch_size=batch)) until they are done or `seconds` have passed, and writes
{"inputs", "windows", "indices_done", "wall_s", "cpu_s", "precision"} to out.

auto: OpenVINO's own default precision for this CPU (bfloat16 where the CPU has it natively).
int8: optimum-intel's static quantization (weights and activations, OVQuantizationConfig) calibrated
on `calibration` texts, exported once under cache_dir.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path


def _ov_config(threads: int) -> dict:
    return {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY"}


def load(job: dict):
    from sentence_transformers import SentenceTransformer

    kwargs = {"ov_config": _ov_config(job["threads"])}
    if job["variant"] == "auto":
        return SentenceTransformer(job["model_dir"], backend="openvino", device="cpu", model_kwargs=kwargs)
    quantized = quantize_once(job)
    return SentenceTransformer(str(quantized), backend="openvino", device="cpu", model_kwargs=kwargs)


def quantize_once(job: dict) -> Path:
    """The model exported to OpenVINO and quantized to int8 (weights and activations), written once
    under cache_dir, keyed by the model directory and the calibration texts."""
    import shutil

    key = hashlib.sha256((job["model_dir"] + "\n" + "\n".join(job["calibration"])).encode()).hexdigest()[:12]
    out = Path(job["cache_dir"]) / f"openvino-int8-{Path(job['model_dir']).name}-{key}"
    if (out / ".done").exists():
        return out
    import nncf
    from optimum.intel import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers import SentenceTransformer

    float_model = SentenceTransformer(job["model_dir"], backend="openvino", device="cpu")
    ov_model = float_model.transformers_model
    tokenizer = float_model.tokenizer
    samples = [dict(tokenizer(t, return_tensors="np")) for t in job["calibration"]]
    quantizer = OVQuantizer.from_pretrained(ov_model)
    config = OVConfig(quantization_config=OVQuantizationConfig(num_samples=len(samples)))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # It writes config.json and openvino/openvino_model.{xml,bin}: where backend="openvino" looks.
    quantizer.quantize(nncf.Dataset(samples), save_directory=str(tmp), ov_config=config)
    # A sentence-transformers directory around it: the source's modules, tokenizer and config.
    for item in Path(job["model_dir"]).iterdir():
        if item.name.startswith(".") or item.suffix in (".safetensors", ".bin", ".onnx") or (tmp / item.name).exists():
            continue
        (shutil.copytree if item.is_dir() else shutil.copy)(item, tmp / item.name)
    (tmp / ".done").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def precision(model) -> str:
    try:
        return str(model.transformers_model.request.get_property("INFERENCE_PRECISION_HINT"))
    except Exception as exc:  # noqa: BLE001 - reported, not needed for the measurement
        return f"unknown ({type(exc).__name__})"


def main(job_path: str) -> int:
    import numpy as np

    job = json.loads(Path(job_path).read_text())
    model = load(job)
    texts, batch = job["texts"], job["batch"]
    vectors = model.encode(texts, batch_size=batch, show_progress_bar=False)
    np.save(job["out"] + ".npy", np.asarray(vectors, dtype=np.float32))
    done, inputs, count = [], 0, 0
    t0, c0 = time.monotonic(), time.process_time()
    for window in job["windows"]:
        model.encode([texts[i] for i in window], batch_size=batch, show_progress_bar=False)
        done.extend(window)
        inputs, count = inputs + len(window), count + 1
        if time.monotonic() - t0 >= job["seconds"]:
            break
    result = {
        "inputs": inputs,
        "windows": count,
        "indices_done": done,
        "wall_s": time.monotonic() - t0,
        "cpu_s": time.process_time() - c0,
        "precision": precision(model),
    }
    Path(job["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
