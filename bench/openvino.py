"""OpenVINO as a bulk reference: sentence-transformers `backend="openvino"` in its own process and
virtualenv (optimum-intel pins transformers < 5.6, which cannot share our environment), no server.

Two variants: `openvino` at OpenVINO's own precision for this CPU (it picks bfloat16 where the CPU has
it natively), and `openvino-int8` (optimum-intel's static weight and activation quantization). Each is
first checked against float32 sentence-transformers on the bench corpus, with the project's own
fidelity floors (workers/fidelity.py: min cosine 0.999 for 16-bit, 0.99 for int8); a variant below
its floor is reported and skipped, never timed, as the server would refuse to serve it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..workers.fidelity import FLOORS
from .corpus import TokenCounter, Workload, make_corpus
from .modes import Row, _utilisation
from .options import log

OPENVINO_SPEC = (
    "optimum-intel==2.2.0",
    "optimum~=2.3.0",
    "nncf==3.4.0",
    "openvino==2026.4.1",
    "openvino-tokenizers==2026.4.1.0",
    "transformers>=4.51,<5.6",
    "huggingface-hub<1.22",
    "sentence-transformers==6.3.0",
)
RUNNER = Path(__file__).with_name("openvino_runner.py")
VARIANTS = {"openvino": ("auto", "half"), "openvino-int8": ("int8", "int8")}  # name: (runner variant, floor row)


def openvino_venv(cache: Path) -> Path:
    """~/.cache/encoderd-bench/venv-openvino, created once. It sees this interpreter's packages
    (--system-site-packages) for torch, so PyPI's CUDA build of torch (optimum-intel's dependency, via
    torchvision) is never fetched: optimum-intel goes in without its dependencies, which are listed."""
    venv = cache / "venv-openvino"
    ready = venv / ".encoderd-bench-ready"
    if ready.exists() and ready.read_text() == " ".join(OPENVINO_SPEC):
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    log(f"creating {venv} with {' '.join(OPENVINO_SPEC)} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *OPENVINO_SPEC[1:]], check=True, timeout=1800)
    subprocess.run([*pip, "--no-deps", OPENVINO_SPEC[0]], check=True, timeout=600)
    ready.write_text(" ".join(OPENVINO_SPEC))
    return venv


def reference_vectors(embed_dir: str, texts: list[str], threads: int) -> np.ndarray:
    """float32 sentence-transformers (this environment's) on the same texts: the fidelity reference."""
    import torch
    from sentence_transformers import SentenceTransformer

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = SentenceTransformer(embed_dir, device="cpu")
        return np.asarray(model.encode(texts, batch_size=32, show_progress_bar=False), dtype=np.float32)
    finally:
        torch.set_num_threads(before)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def windows(work: Workload, args) -> list[list[int]]:
    """The same slices run_bulk_in_process encodes: windows of C x B inputs over the shuffled corpus."""
    size, n = args.concurrency * args.batch, len(work.corpus)
    total = args.bulk_requests * args.batch if args.bulk_requests else 100 * n
    return [[(w * size + j) % n for j in range(min(size, total - w * size))] for w in range((total + size - 1) // size)]


def run_openvino(
    venv: Path, name: str, embed_dir: str, work: Workload, args, flops, peak: dict, threads: int, reference: np.ndarray
) -> Row:
    """One variant: its fidelity on the corpus first, then (above its floor) bulk, as one Row."""
    variant, floor_row = VARIANTS[name]
    floor = FLOORS[floor_row]["min_cosine"]
    job = {
        "model_dir": embed_dir,
        "variant": variant,
        "threads": threads,
        "texts": work.corpus,
        # Calibration: other texts of the same kind (another seed), never the measured ones.
        "calibration": make_corpus(TokenCounter(embed_dir), 128, args.seed + 7),
        "windows": windows(work, args),
        "batch": args.batch,
        "seconds": args.bulk_seconds,
        "cache_dir": str(args.cache_dir),
    }
    log(
        f"bulk {name}/in-process (own venv): fidelity vs float32 sentence-transformers, then windows of "
        f"{args.concurrency * args.batch} inputs, batch {args.batch}"
    )
    outcome = _run_job(venv, job)
    if isinstance(outcome, str):
        return Row("bulk", name, "in-process", errors=1, notes=outcome)
    result, vectors = outcome
    cosine = min_cosine(vectors, reference)
    note = (
        f"min cosine vs float32 sentence-transformers {cosine:.5f} (floor {floor}); "
        f"OpenVINO inference precision {result['precision']}"
    )
    if cosine < floor:
        log(f"  {name} skipped: {note}")
        return Row("bulk", name, "in-process", notes="skipped, below its fidelity floor: " + note)
    tokens, wall = int(work.real[np.array(result["indices_done"], dtype=np.int64)].sum()), result["wall_s"]
    row = Row(
        "bulk",
        name,
        "in-process",
        calls=result["windows"],
        wall_s=round(wall, 2),
        inputs_per_s=round(result["inputs"] / wall, 2),
        tokens_per_s=round(tokens / wall, 1),
        notes=note,
    )
    if variant == "auto":  # int8 has no measured peak
        dtype = "bfloat16" if any(s in result["precision"].lower() for s in ("bf16", "bfloat16")) else "float32"
        per_token = flops.flops(work.real) / float(work.real.sum())
        row.flop_utilisation = _utilisation(per_token * tokens / wall, peak.get(dtype))
    return row


def _run_job(venv: Path, job: dict) -> tuple[dict, np.ndarray] | str:
    """The runner in the virtualenv's interpreter: (its result, its vectors), or what went wrong."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(Path.home()),
    }
    with tempfile.TemporaryDirectory(prefix="encoderd-bench-openvino-") as tmp:
        job = {**job, "out": str(Path(tmp) / "result.json")}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        # -P: bench/ stays off sys.path (its modules would shadow the standard library's); cwd outside
        # the repository, so nothing of ours shadows its imports either.
        argv = [str(venv / "bin" / "python"), "-P", str(RUNNER), str(Path(tmp) / "job.json")]
        proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=3600, check=False)
        if proc.returncode != 0:
            return f"runner failed: {proc.stderr.strip()[-300:]}"
        return json.loads(Path(job["out"]).read_text()), np.load(job["out"] + ".npy")
