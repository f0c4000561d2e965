"""Issue 20: the layers do not cross. Every import in the tree is read from source (ast, nothing
imported) and held to these rules:

  * the frontend (server/, gateway/) imports from workers/ only its contract (workers/contract/);
  * the workers never import the frontend (server/, gateway/) nor the clients;
  * the contract imports nothing from workers/ outside itself: the frontend imports it without
    pulling in the worker code (launch.py's deferred entry point is the one exception: it runs in
    the worker process);
  * the clients import neither the frontend nor the workers (they ship alone as encoderd-client);
  * the benchmark (bench/) is a client: it imports the clients, the protos and the contract, and the
    server only where it starts one (the exceptions below); nothing imports the benchmark but the
    CLI's `encoderd bench`, lazily.

A failure names each offending import as file:line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Repository folder -> the package it installs as (pyproject.toml [tool.setuptools] package-dir).
PACKAGES = {
    "server": "encoderd.server",
    "bench": "encoderd.bench",
    "workers": "encoderd.workers",
    "gateway": "encoderd.gateway",
    "clients": "encoderd.clients",
    "encoderd": "encoderd",
}
CONTRACT = "encoderd.workers.contract"
FRONTEND = ("encoderd.server", "encoderd.gateway")
WORKERS = "encoderd.workers"
CLIENTS = "encoderd.clients"
BENCH = "encoderd.bench"
# What the benchmark imports as any user would: itself, the clients, the protos and the contract.
BENCH_MAY_IMPORT = (BENCH, CLIENTS, "encoderd.v1", CONTRACT)

# (file, imported module) pairs allowed across a layer, each with its reason.
EXCEPTIONS = {
    # The spawned worker's entry point, imported in the child process when it runs, never by the frontend.
    ("workers/contract/launch.py", "encoderd.workers.process"),
    # An in-process benchmark of the torch engine itself (padding-free vs padded forward): no server.
    ("bench/packed.py", "encoderd.workers.backends"),
    # `bench.breakdown`: a profile of the torch engine's own forward, in-process, no server.
    ("bench/breakdown.py", "encoderd.workers.backends"),
    # `bench --openvino`: a reference is judged by the server's own fidelity floors, kept in one place.
    ("bench/openvino.py", "encoderd.workers.fidelity"),
    # `bench.fidelity_holdout`: the worker's own self-check and engines, in-process, against a holdout corpus.
    ("bench/fidelity_holdout.py", "encoderd.workers"),
    ("bench/fidelity_holdout.py", "encoderd.workers.backends"),
    # `encoderd bench`: the CLI hands the rest of its command line to the benchmark (imported lazily:
    # test_the_frontend_loads_without_the_worker_code checks the CLI loads without it).
    ("server/main/cli.py", "encoderd.bench.runner"),
    # The FLOP peak is the matmul rate of the threads the started server will use: the server's own
    # layout rule for the same --serve-args (a copy would drift from it).
    ("bench/options.py", "encoderd.server.scheduling.placement"),
    # `bench.rest --stub`: a stand-in gRPC server behind a real Envoy gateway, to measure the gateway
    # alone; it answers with the server's own response envelope so the bytes are the real ones.
    ("bench/rest.py", "encoderd.server.api.rest"),
    ("bench/rest.py", "encoderd.gateway.envoy"),
    ("bench/rest.py", "encoderd.gateway.process"),
    # `bench.flood --front`: the shipped gRPC front (deploy/envoy/front.yaml) on the Envoy binary the gateway uses.
    ("bench/flood.py", "encoderd.gateway.envoy"),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_of(path: Path) -> str:
    relative = path.relative_to(ROOT)
    parts = [PACKAGES[relative.parts[0]], *relative.parts[1:-1]]
    if relative.stem != "__init__":
        parts.append(relative.stem)
    return ".".join(parts)


def imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file (or in `source`, read as that file), top
    level or deferred, `from x import y` counted as x.y too (y may be a module)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def crossing(importer: str, imported: str) -> str:
    """Why `importer` may not import `imported`; "" when it may."""
    if _within(imported, BENCH) and not _within(importer, BENCH):
        return "nothing imports the benchmark (the CLI's `encoderd bench` is the one exception)"
    if _within(importer, BENCH):
        if _within(imported, "encoderd") and not any(_within(imported, p) for p in BENCH_MAY_IMPORT):
            return "the benchmark is a client: it imports the clients, the protos and the contract"
    elif _within(importer, CONTRACT):
        if _within(imported, "encoderd") and not _within(imported, CONTRACT) and imported != WORKERS:
            return "the contract imports nothing outside itself"
    elif _within(importer, WORKERS):
        if any(_within(imported, p) for p in (*FRONTEND, CLIENTS)):
            return "the workers never import the frontend or the clients"
    elif any(_within(importer, p) for p in FRONTEND):
        if _within(imported, WORKERS) and imported != WORKERS and not _within(imported, CONTRACT):
            return "the frontend imports only the contract (workers/contract/) from the workers"
    elif _within(importer, CLIENTS) and any(_within(imported, p) for p in (*FRONTEND, WORKERS)):
        return "the clients import neither the frontend nor the workers"
    return ""


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            name = str(path.relative_to(root))
            importer = _module_of(path)
            reported: set[tuple[int, str]] = set()
            for line, imported in sorted(imports(path), key=lambda item: len(item[1])):
                why = crossing(importer, imported)
                allowed = any((name, m) in EXCEPTIONS for m in (imported, imported.rpartition(".")[0]))
                if why and not allowed and (line, imported.rpartition(".")[0]) not in reported:
                    reported.add((line, imported))  # `from x import a, b`: x once, not x.a and x.b too
                    found.append((name, line, f"{name}:{line}: imports {imported}: {why}"))
    return [message for *_, message in sorted(found)]


def test_no_import_crosses_a_layer():
    found = violations()
    assert not found, "imports crossing the layers:\n" + "\n".join(found)


def test_every_exception_is_still_needed():
    """An allowance nobody uses any more is removed, so the list only ever shrinks."""
    used = set()
    for name, target in EXCEPTIONS:
        path = ROOT / name
        if path.exists():
            used |= {(name, target) for _, imported in imports(path) if _within(imported, target)}
    assert used == EXCEPTIONS, f"unused exceptions: {sorted(EXCEPTIONS - used)}"


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("encoderd.workers.process", "encoderd.server.logs", "workers never import"),
        ("encoderd.server.models.registry", "encoderd.workers.process", "frontend imports only the contract"),
        ("encoderd.gateway.envoy", "encoderd.workers.backends.base", "frontend imports only the contract"),
        ("encoderd.clients.bulk", "encoderd.server.base.errors", "clients import neither"),
        ("encoderd.clients.bulk", "encoderd.workers.contract.protocol", "clients import neither"),
        ("encoderd.workers.contract.protocol", "encoderd.workers.backends", "contract imports nothing"),
        ("encoderd.bench.modes", "encoderd.server.scheduling.scheduler", "the benchmark is a client"),
        ("encoderd.bench.packed", "encoderd.workers.process", "the benchmark is a client"),
        ("encoderd.server.main.app", "encoderd.bench.runner", "nothing imports the benchmark"),
        ("encoderd.workers.process", "encoderd.bench.corpus", "nothing imports the benchmark"),
    ],
)
def test_rules_catch_each_kind_of_crossing(importer, imported, rule):
    assert rule in crossing(importer, imported)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("encoderd.server.models.registry", "encoderd.workers.contract.config"),
        ("encoderd.bench.mixed", "encoderd.clients.bulk"),
        ("encoderd.workers.process", "encoderd.workers.contract.protocol"),
        ("encoderd.workers.contract.config", "encoderd.workers.contract.model_spec"),
        ("encoderd.gateway.envoy", "encoderd.server.api.openapi"),
        ("encoderd.clients.bulk", "encoderd.v1.encoderd_pb2"),
    ],
)
def test_rules_allow_the_layered_imports(importer, imported):
    assert crossing(importer, imported) == ""


def test_relative_imports_resolve():
    """`from ..server.logs import x` in workers/process.py is encoderd.server.logs (and .x)."""
    source = "\n" * 30 + "from ..server.logs import configure_logging\n"
    assert (31, "encoderd.server.logs") in imports(ROOT / "workers/process.py", source)
    found = imports(ROOT / "server/scheduling/worker_client.py", "from ...workers.contract import protocol\n")
    assert (1, "encoderd.workers.contract.protocol") in found
    assert (1, "encoderd.gateway.process") in imports(ROOT / "gateway/__init__.py", "from . import process\n")


def test_engine_and_dtype_names_are_the_backends():
    """The contract names the engines and dtypes once (the frontend's --engine / --dtype choices):
    every engine module is one of them and every dtype an engine computes is one of them."""
    from encoderd.workers import backends
    from encoderd.workers.backends import ct2_backend, onnx_backend, tensorrt_backend, torch_backend
    from encoderd.workers.contract.config import DTYPES, ENGINES

    assert tuple(backends.ENGINES) == ENGINES
    computed = {
        *torch_backend.DTYPES,
        *torch_backend.QUANTIZED,
        *(d for device in onnx_backend.OnnxBackend.dtypes.values() for d in device),
        *(d for device in tensorrt_backend.TensorRTBackend.dtypes.values() for d in device),
        *(dtype for dtype, _ in ct2_backend.COMPUTE_TYPES),
    }
    assert computed == set(DTYPES)


def test_the_frontend_loads_without_the_worker_code():
    """What the rules are for: importing the frontend (the CLI, the gRPC app, the worker client) loads
    neither torch nor an engine nor the worker's own modules, nor the benchmark."""
    heavy = ("torch", "transformers", "onnxruntime", "ctranslate2")
    heavy += ("encoderd.workers.process", "encoderd.workers.backends", "encoderd.bench")
    script = (
        "import sys; import encoderd.server.main.cli, encoderd.server.main.app,"
        " encoderd.server.scheduling.worker_client;"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == ""
