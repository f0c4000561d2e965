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

Issue 46: inside the frontend and the workers, the arrows only point down, and nothing goes round:

  * server/ is five layers, each importing only its own and those below it (SERVER_LAYERS):
    main (the composition root: the CLI, the gRPC app, the in-process API) > api (the services)
    > models (the registry, inputs, the compute path) > scheduling (queues, workers) > base
    (configuration, errors, metrics, tracing, TLS...);
  * workers/ likewise (WORKERS_LAYERS): the process and what drives it > the engines (backends/)
    > the pieces the engines share > the contract;
  * no two modules of the tree import each other, directly or round a loop (an import cycle): top
    level, deferred inside a function or under TYPE_CHECKING alike, unless listed with a reason.

A failure names each offending import as file:line, and where the code belongs.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections.abc import Collection, Mapping
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
    # `bench.attention`: the torch engine's packed attention kernel against its operators, in-process.
    ("bench/attention.py", "encoderd.workers.backends"),
    # `bench.small_linear`: the few-row bfloat16 GEMM kernel against oneDNN on the same layers, in-process.
    ("bench/small_linear.py", "encoderd.workers.backends"),
    # `bench.int8_linear`: the int8 VNNI GEMM kernel and the int8 forward, this build against a ref's, in-process.
    ("bench/int8_linear.py", "encoderd.workers.backends"),
    # `bench.gemm_rows`: the packed forward's row rounding (and the worker's primitive-cache bounds) on
    # oneDNN's GEMMs, in-process.
    ("bench/gemm_rows.py", "encoderd.workers.backends"),
    ("bench/gemm_rows.py", "encoderd.workers"),
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

# Inside the frontend and the workers, the layers top to bottom: (name, its members: modules or packages
# under the tree, as named below it). Each imports only its own layer and those below it.
LAYERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "encoderd.server": (  # server/__init__.py says what each holds
        ("main/", ("main",)),
        ("api/", ("api",)),
        ("models/", ("models",)),
        ("scheduling/", ("scheduling",)),
        ("base/", ("base",)),
    ),
    "encoderd.workers": (  # workers/__init__.py
        ("the worker process", ("process", "zygote", "fidelity", "bench_engines", "bench_oom", "bench_pacing")),
        ("backends/", ("backends",)),
        ("the engines' shared parts", ("calibration", "model_cache", "memory", "pacing", "pooling", "st_modules")),
        ("contract/", ("contract",)),
    ),
}
SERVER_LAYERS = tuple(name for name, _ in LAYERS["encoderd.server"])
WORKERS_LAYERS = tuple(name for name, _ in LAYERS["encoderd.workers"])

# (file, imported module) imports left out of the cycle search, each with its reason. None today: the
# workers' two cycles (the packed skeleton and its families; config / model_spec / st_config) are gone.
CYCLE_EXCEPTIONS: set[tuple[str, str]] = set()


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


def layer_of(module: str) -> tuple[str, int | None]:
    """(the layered tree holding `module`, the rank of its layer, 0 on top); ("", None) outside the
    layered trees or for a tree's own __init__, (tree, None) for a module of no layer."""
    for tree, layers in LAYERS.items():
        if _within(module, tree) and module != tree:
            ranks = [
                rank for rank, (_, members) in enumerate(layers) if any(_within(module, f"{tree}.{m}") for m in members)
            ]
            return tree, (ranks[0] if ranks else None)
    return "", None


def _order(tree: str) -> str:
    return f"{tree.rpartition('.')[2]}/: " + " > ".join(name for name, _ in LAYERS[tree])


def upward(importer: str, imported: str) -> str:
    """Why `importer` may not import `imported` inside a layered tree (an upward arrow); "" when it may."""
    tree, rank = layer_of(importer)
    target_tree, target_rank = layer_of(imported)
    if not tree or tree != target_tree or rank is None or target_rank is None or target_rank >= rank:
        return ""
    low, high = LAYERS[tree][rank][0], LAYERS[tree][target_rank][0]
    return (
        f"{low} is below {high} ({_order(tree)}): what it needs from {high} belongs in {low} or a layer below "
        f"it (or this code belongs up in {high})"
    )


def _modules(root: Path) -> dict[str, Path]:
    return {_module_of(path): path for folder in PACKAGES for path in sorted((root / folder).rglob("*.py"))}


def module_imports(path: Path, modules: Collection[str]) -> list[tuple[int, str]]:
    """(line, module of the tree) of every import in the file: `from p import m` is module p.m when
    there is one, else p; a package the file is inside is no import (Python loads it first anyway)."""
    module = _module_of(path)
    by_line: dict[int, list[str]] = {}
    for line, name in imports(path):
        by_line.setdefault(line, []).append(name)
    found = set()
    for line, names in by_line.items():
        for name in names:
            if name not in modules or _within(module, name):
                continue
            named = [n for n in names if n.startswith(name + ".")]
            if named and all(n in modules for n in named):  # `from p import m1, m2`: the modules, not p
                continue
            found.add((line, name))
    return sorted(found)


def unplaced(root: Path = ROOT) -> list[str]:
    """Modules of a layered tree that belong to no layer of it."""
    return [
        f"{path.relative_to(root)}: in no layer of {_order(layer_of(module)[0])}: add it to LAYERS where it belongs"
        for module, path in _modules(root).items()
        if layer_of(module)[0] and layer_of(module)[1] is None
    ]


def upward_imports(root: Path = ROOT) -> list[str]:
    modules = _modules(root)
    found = []
    for module, path in modules.items():
        name = str(path.relative_to(root))
        for line, imported in module_imports(path, modules):
            why = upward(module, imported)
            if why and (name, imported) not in EXCEPTIONS:
                found.append(f"{name}:{line}: imports {imported}: {why}")
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first such import}, over the whole tree."""
    modules = _modules(root)
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        name = str(path.relative_to(root))
        edges = graph.setdefault(module, {})
        for line, imported in module_imports(path, modules):
            if (name, imported) not in CYCLE_EXCEPTIONS:
                edges.setdefault(imported, f"{name}:{line}")
    return graph


def cycles(graph: Mapping[str, Mapping[str, str]]) -> list[str]:
    """One message per import cycle (a strongly connected group of modules), naming a loop through it
    import by import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_message(graph, group) for group in sorted(groups)]


def _cycle_message(graph: Mapping[str, Mapping[str, str]], group: list[str]) -> str:
    """A shortest loop from the group's first module back to it, each step as file:line imports module."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph.get(node, {})):
            if target == start:
                loop = [*paths[node], start]
                steps = [f"{graph[a][b]} imports {b}" for a, b in itertools.pairwise(loop)]
                return (
                    f"import cycle of {len(group)} modules ({', '.join(group)}): "
                    + "; ".join(steps)
                    + ": modules of a cycle cannot be understood apart; move what they share into a module "
                    "below them all (or pass it in), so each arrow points one way"
                )
            if target in members and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no loop through {group}")


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


def test_every_module_has_a_layer():
    """A new module of server/ or workers/ takes its place in the order: the author says where it belongs."""
    found = unplaced()
    assert not found, "modules in no layer:\n" + "\n".join(found)


def test_no_import_goes_up_a_layer():
    found = upward_imports()
    assert not found, "imports pointing up a layer:\n" + "\n".join(found)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_every_cycle_exception_is_still_needed():
    """An allowance stays only while the import it names would close a cycle (its module reaches back
    to the importer without it), so the list only ever shrinks."""
    graph, modules = import_graph(), _modules(ROOT)
    needed = set()
    for name, target in CYCLE_EXCEPTIONS:
        path = ROOT / name
        imported = path.exists() and target in {m for _, m in module_imports(path, modules)}
        if imported and _reaches(graph, target, _module_of(path)):
            needed.add((name, target))
    assert needed == CYCLE_EXCEPTIONS, f"cycle exceptions no longer needed: {sorted(CYCLE_EXCEPTIONS - needed)}"


def _reaches(graph: Mapping[str, Mapping[str, str]], start: str, goal: str) -> bool:
    seen, queue = {start}, [start]
    while queue:
        node = queue.pop()
        if node == goal:
            return True
        for target in graph.get(node, {}):
            if target not in seen:
                seen.add(target)
                queue.append(target)
    return False


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("encoderd.server.api.service", "encoderd.server.main.cli", "api/ is below main/"),
        ("encoderd.server.models.registry", "encoderd.server.api.service", "models/ is below api/"),
        ("encoderd.server.scheduling.scheduler", "encoderd.server.models.registry", "scheduling/ is below models/"),
        ("encoderd.server.base.metrics", "encoderd.server.scheduling.scheduler", "base/ is below scheduling/"),
        ("encoderd.server.base.errors", "encoderd.server.api", "base/ is below api/"),
        (
            "encoderd.workers.backends.torch_backend",
            "encoderd.workers.process",
            "backends/ is below the worker process",
        ),
        ("encoderd.workers.pooling", "encoderd.workers.backends.base", "shared parts is below backends/"),
        ("encoderd.workers.contract.model_spec", "encoderd.workers.pooling", "contract/ is below the engines'"),
        ("encoderd.workers.contract.config", "encoderd.workers.fidelity", "contract/ is below the worker process"),
    ],
)
def test_rules_catch_each_upward_import(importer, imported, rule):
    why = upward(importer, imported)
    assert rule in why
    assert "belongs in" in why  # the message says where the code goes


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("encoderd.server.main.app", "encoderd.server.api.compat"),
        ("encoderd.server.main.inprocess", "encoderd.server.models.registry"),
        ("encoderd.server.api.compat", "encoderd.server.api.tei"),  # within a layer: the cycle check judges
        ("encoderd.server.api.compat", "encoderd.server.models.registry"),
        ("encoderd.server.models.compute", "encoderd.server.scheduling.scheduler"),
        ("encoderd.server.scheduling.scheduler", "encoderd.server.base.metrics"),
        ("encoderd.workers.process", "encoderd.workers.backends"),
        ("encoderd.workers.backends.torch_backend", "encoderd.workers.calibration"),
        ("encoderd.workers.pooling", "encoderd.workers.contract.model_spec"),
        ("encoderd.bench.rest", "encoderd.server.api.rest"),  # across trees: the rules above judge
    ],
)
def test_order_allows_the_downward_imports(importer, imported):
    assert upward(importer, imported) == ""


def test_a_module_of_no_layer_is_found():
    assert layer_of("encoderd.server.ops.cli") == ("encoderd.server", None)
    assert layer_of("encoderd.workers.newthing") == ("encoderd.workers", None)
    assert layer_of("encoderd.server") == ("", None)  # the tree's own __init__: no layer to keep
    assert layer_of("encoderd.gateway.envoy") == ("", None)
    assert layer_of("encoderd.server.models.registry") == ("encoderd.server", SERVER_LAYERS.index("models/"))


def test_a_cycle_is_named_import_by_import():
    graph = {
        "a": {"b": "a.py:3"},
        "b": {"c": "b.py:5", "d": "b.py:6"},
        "c": {"a": "c.py:7"},
        "d": {},
        "e": {"a": "e.py:1"},  # imports into the cycle, not part of it
    }
    (found,) = cycles(graph)
    assert "import cycle of 3 modules (a, b, c)" in found
    assert "a.py:3 imports b; b.py:5 imports c; c.py:7 imports a" in found
    assert "below them all" in found
    assert cycles({"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {}}) == []


def test_module_imports_are_modules_not_the_packages_around_them():
    """`from . import tei` is an import of api/tei.py, not of api/__init__.py; a package the file is
    inside is no import; `from .rest import json_body` is rest.py."""
    modules = _modules(ROOT)
    compat = {m for _, m in module_imports(ROOT / "server/api/compat.py", modules)}
    assert {"encoderd.server.api.tei", "encoderd.server.api.rest"} <= compat
    assert "encoderd.server.api" not in compat
    torch_backend = {m for _, m in module_imports(ROOT / "workers/backends/torch_backend.py", modules)}
    assert "encoderd.workers.calibration" in torch_backend
    assert not {"encoderd.workers", "encoderd.workers.backends"} & torch_backend
