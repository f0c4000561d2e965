"""Starting the servers under test: encoderd (this checkout's `encoderd serve`) and Infinity (its own
virtualenv); the reranker they serve; and which of encoderd's processes is which."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from ..workers.contract.model_files import DEFAULT_MODEL_NAME
from .options import log
from .processes import Managed, free_port, process_tree, serve_command

RERANKER_NAME = "reranker"
INFINITY_SPEC = ("infinity-emb[server,torch]==0.0.78", "torch==2.13.0")
REPO_ROOT = Path(__file__).resolve().parents[1]


def start_encoderd(args, embed_dir: str, rerank_dir: str | None, logs: Path, rest: bool) -> tuple[Managed, dict]:
    import shlex

    ports = {"grpc": free_port(), "metrics": free_port(), "rest": free_port() if rest else 0}
    argv = [
        *serve_command(),
        "--host",
        "127.0.0.1",
        "--grpc-port",
        str(ports["grpc"]),
        "--metrics-port",
        str(ports["metrics"]),
        "--model",
        f"{DEFAULT_MODEL_NAME}={embed_dir}",
    ]
    if rerank_dir:
        argv += ["--model", f"{RERANKER_NAME}={rerank_dir}"]
    if rest:
        argv += ["--rest-port", str(ports["rest"])]
    else:  # its REST default port may be taken (or in use by another run)
        argv += ["--no-rest"]
    argv += shlex.split(args.serve_args)
    log("starting " + " ".join(argv[2:]))
    return Managed("encoderd", argv, logs / "encoderd.log").start(), ports


def infinity_venv(cache: Path) -> Path:
    """~/.cache/encoderd-bench/venv-infinity, created once: Infinity pins sentence-transformers < 4 and
    transformers 4.57, which cannot share our environment."""
    venv = cache / "venv-infinity"
    ready = venv / ".encoderd-bench-ready"
    if ready.exists() and ready.read_text() == " ".join(INFINITY_SPEC):
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    log(f"creating {venv} with {' '.join(INFINITY_SPEC)} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *INFINITY_SPEC], check=True, timeout=1800
    )
    ready.write_text(" ".join(INFINITY_SPEC))
    return venv


def start_infinity(
    venv: Path, embed_dir: str, rerank_dir: str | None, logs: Path, warmup: bool = True, dtype: str = "float32"
) -> tuple[Managed, int]:
    """Infinity's torch engine on CPU at `dtype`: float32 (its CPU default) or bfloat16, which 0.0.78
    accepts on CPU (its loading strategy loads the weights in bfloat16; only `auto` means float32 there)."""
    port = free_port()
    models = [("--model-id", embed_dir, DEFAULT_MODEL_NAME)] + (
        [("--model-id", rerank_dir, RERANKER_NAME)] if rerank_dir else []
    )
    argv = [
        str(venv / "bin" / "infinity_emb"),
        "v2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--no-vector-disk-cache",
    ]  # its default caches results by request hash: repeated inputs would be free
    for flag, path, name in models:
        argv += [flag, path, "--served-model-name", name] + ([] if warmup else ["--no-model-warmup"])
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": "",
    }
    name = "infinity" if dtype == "float32" else f"infinity-{dtype}"
    log(f"starting {name}: infinity_emb " + " ".join(argv[2:]))
    # cwd outside the repository, so nothing of ours shadows its imports
    return Managed(name, argv, logs / f"{name}.log", env=env, cwd=str(logs)).start(), port


def build_reranker(args) -> str:
    """A one-label cross-encoder: MiniLM body + seeded head (tests/support/models.py), built once."""
    if args.reranker:
        return args.reranker
    import importlib

    tests = REPO_ROOT / "tests"
    if not (tests / "support" / "models.py").exists():
        raise SystemExit("encoderd bench: rerank needs --reranker DIR (no repository checkout to build one from)")
    sys.path.insert(0, str(tests))  # the tests' `support` package, as their conftest imports it
    try:
        module = importlib.import_module("support.models")
    finally:
        sys.path.remove(str(tests))
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    return str(module.build_reranker(args.cache_dir / "reranker-minilm"))


def list_models(address: str) -> list:
    import grpc

    from ..v1 import encoderd_pb2, encoderd_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return list(
            encoderd_pb2_grpc.EncoderStub(channel).ListModels(encoderd_pb2.ListModelsRequest(), timeout=10).models
        )


def encoderd_probe_groups(
    server: Managed | None, models: list, embed_model: str, rerank_model: str | None
) -> dict[str, list[int]]:
    """The workers of the benchmarked models, the others, and the rest of the server's tree (frontend, Envoy)."""

    def pids(model_ids) -> list[int]:
        return [r.pid for m in models if m.id in model_ids for r in m.replicas if r.pid]

    groups = {"worker": pids({embed_model}), "rerank_worker": pids({rerank_model})}
    if server:
        named = {p for g in groups.values() for p in g}
        groups["other_workers"] = [p for p in pids({m.id for m in models}) if p not in named]
        groups["frontend"] = [server.pid]
        skip = named | set(groups["other_workers"]) | {server.pid}
        groups["gateway"] = [p for p in process_tree(server.pid) if p not in skip]
    return groups
