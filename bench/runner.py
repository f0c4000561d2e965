"""The run, top to bottom: workload, matmul peak, the targets (started or given), every mode on every
target, the report; `main` is `encoderd bench` and `python -m encoderd.bench`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ..workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path
from .corpus import Workload, make_workload
from .device import device_peak, is_cuda, run_memory, run_oom
from .flops import FlopModel, matmul_peak
from .models import build_base_embedder, build_xlmr_reranker
from .modes import Row, run_bulk, run_bulk_in_process, run_rerank, run_single
from .openvino import VARIANTS, openvino_venv, reference_vectors, run_openvino
from .options import build_parser, log, resolve_options, serving_threads, worker_threads
from .processes import CpuProbe, Managed, grpc_serving, http_ok, process_tree, wait_until
from .recovery import run_recovery
from .report import floors, print_floors, print_ratios, print_served, print_table, ratios
from .servers import (
    RERANKER_NAME,
    build_reranker,
    encoderd_probe_groups,
    infinity_venv,
    list_models,
    start_encoderd,
    start_infinity,
)
from .targets import GrpcTarget, RestTarget, SentenceTransformersTarget


def bench_models(args) -> tuple[str, str | None]:
    """(embedder directory, cross-encoder directory or None) for --models."""
    wants_reranker = "rerank" in args.modes
    if args.models in ("base", "tiny"):
        tiny = args.models == "tiny"
        embed_dir = build_base_embedder(args.cache_dir, tiny)
        rerank_dir = (args.reranker or build_xlmr_reranker(args.cache_dir, tiny)) if wants_reranker else None
        return embed_dir, rerank_dir
    return default_model_path(), build_reranker(args) if wants_reranker else None


class Bench:
    """Owns everything it starts; close() stops it all, whatever happened."""

    def __init__(self, args):
        self.args = args
        self.stack = contextlib.ExitStack()
        self.rows: list[Row] = []
        self.info: dict = {}

    def run(self) -> dict:
        args = self.args
        started = time.monotonic()
        if "recovery" in args.modes:  # first, its servers alone on the machine; it starts and stops its own
            venv = infinity_venv(args.cache_dir) if args.infinity else None
            self.rows += run_recovery(args, default_model_path(), self.log_dir(), venv)
            if args.modes == ["recovery"]:
                self.info["elapsed_s"] = round(time.monotonic() - started, 1)
                return self.report()
        embed_dir, rerank_dir = bench_models(args)
        self.embed_dir = embed_dir
        work, self.info = make_workload(args, embed_dir, rerank_dir)
        log(
            f"corpus: {len(work.corpus)} inputs, tokens p50 {self.info['corpus']['p50']:.0f} "
            f"mean {self.info['corpus']['mean']:.0f} max {self.info['corpus']['max']}"
        )
        threads = serving_threads(args)
        self.info["peak_gflops"] = peak = self.measure_peak(threads)
        log(
            f"matmul peak with {threads} threads: fp32 {peak['float32']:.0f} GFLOP/s, "
            f"bf16 {peak['bfloat16']:.0f} GFLOP/s (others used {peak['foreign_cores']:.2f} cores meanwhile)"
        )
        targets = self.start_targets(embed_dir, rerank_dir)
        flops = FlopModel.from_dir(embed_dir)
        self.info["flop_model"] = {
            **asdict(flops),
            "matmul_params": flops.matmul_params,
            "formula": "FLOPs(n) = n * (2*P + 4*L*H*n), P = L*(4H^2 + 2HI)",
        }
        self.run_modes(targets, work, flops, threads)
        self.run_device_modes(targets, work, embed_dir)
        self.info["elapsed_s"] = round(time.monotonic() - started, 1)
        return self.report()

    def start_targets(self, embed_dir: str, rerank_dir: str | None) -> list[dict]:
        args = self.args
        logs = self.log_dir()
        rest = args.rest and self._rest_available()
        venv = infinity_venv(args.cache_dir) if args.infinity or args.infinity_bf16 else None
        server = ports = None
        infinities = []  # (name, dtype, server, port)
        if not args.target_grpc:
            server, ports = start_encoderd(args, embed_dir, rerank_dir, logs, rest)
            self.stack.callback(server.stop)
        # Started together with encoderd: all load at once, saving a minute.
        for wanted, dtype in ((args.infinity, "float32"), (args.infinity_bf16, "bfloat16")):
            if wanted and venv:
                infinity, inf_port = start_infinity(
                    venv, embed_dir, rerank_dir, logs, not args.infinity_no_warmup, dtype
                )
                self.stack.callback(infinity.stop)
                infinities.append((infinity.name, dtype, infinity, inf_port))
        targets = self._encoderd_targets(server, ports, rest)
        for name, dtype, infinity, inf_port in infinities:
            targets.append(self._infinity_target(name, dtype, infinity, inf_port, rerank_dir))
        if not args.no_st:
            log("loading sentence-transformers in this process")
            # As many threads as all the server's workers together compute on.
            st = SentenceTransformersTarget(embed_dir, rerank_dir, serving_threads(args), args.device)
            targets.append(
                {"name": "sentence-transformers", "client": st, "probe": None, "metrics": None, "dtype": st.dtype}
            )
        self._add_foreign_reference(targets)
        return targets

    def log_dir(self) -> Path:
        if "log_dir" not in self.info:
            logs = self.args.log_dir or Path(tempfile.mkdtemp(prefix="encoderd-bench-"))
            logs.mkdir(parents=True, exist_ok=True)
            self.info["log_dir"] = str(logs)
        return Path(self.info["log_dir"])

    def _rest_available(self) -> bool:
        """Our own server always serves REST; a --target-grpc server only with --target-rest."""
        return bool(self.args.target_rest) if self.args.target_grpc else True

    def _encoderd_targets(self, server: Managed | None, ports: dict | None, rest: bool) -> list[dict]:
        args, ports = self.args, ports or {}  # no ports: every address is a --target-* flag
        address = args.target_grpc or f"127.0.0.1:{ports['grpc']}"
        metrics = args.target_metrics or (f"http://127.0.0.1:{ports['metrics']}/metrics" if ports else None)
        if server:
            wait_until(lambda: grpc_serving(address), "encoderd gRPC", server, 900)
        base = (args.target_rest or f"http://127.0.0.1:{ports['rest']}") if rest else ""
        if server and rest:  # before the process tree is read: Envoy is one of its children
            wait_until(lambda: http_ok(base + "/health"), "encoderd REST", server, 300)
        models = list_models(address)
        embed = next(m for m in models if m.kind == "embedding")
        reranker = next((m for m in models if m.kind == "reranker"), None)
        rerank = reranker.id if reranker else None
        self.info["encoderd_models"] = [
            {
                "id": m.id,
                "kind": m.kind,
                "engine": m.engine,
                "device": m.device,
                "dtype": m.dtype,
                "replicas": len(m.replicas),
                "fidelity_status": m.fidelity_status,
            }
            for m in models
        ]
        probe = CpuProbe(encoderd_probe_groups(server, models, embed.id, rerank))
        self.info["pids"] = {"encoderd": sorted({p for pids in probe.groups.values() for p in pids})}
        grpc_client = GrpcTarget(address, embed.id, rerank, args.bulk_priority)
        self.stack.callback(grpc_client.close)
        targets = [
            {
                "name": "encoderd",
                "client": grpc_client,
                "probe": probe,
                "metrics": metrics,
                "dtype": embed.dtype,
                # An automatic bfloat16 that fails a model's fidelity check is served float32: the
                # reranker's utilisation is measured against the peak of its own dtype.
                "rerank_dtype": reranker.dtype if reranker else embed.dtype,
                "model": embed.id,
            }
        ]
        if rest:
            rest_client = RestTarget(base.rstrip("/") + "/v1", embed.id, rerank)
            self.stack.callback(rest_client.close)
            targets.append({**targets[0], "client": rest_client})
        log(f"encoderd ready: {', '.join(m.id for m in models)}")
        return targets

    def _infinity_target(self, name: str, dtype: str, infinity: Managed, port: int, rerank_dir: str | None) -> dict:
        # Infinity times batches of up to 512 tokens per model before it answers: minutes for 12-layer
        # models on 2 busy cores.
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), name, infinity, 1800)
        client = RestTarget(f"http://127.0.0.1:{port}", DEFAULT_MODEL_NAME, rerank_dir and RERANKER_NAME)
        self.stack.callback(client.close)
        tree = process_tree(infinity.pid)
        self.info.setdefault("pids", {})[name] = tree
        log(f"{name} ready")
        return {"name": name, "client": client, "probe": CpuProbe({"server": tree}), "metrics": None, "dtype": dtype}

    def _add_foreign_reference(self, targets: list[dict]) -> None:
        # Every group knows all our processes, so "foreign" excludes the other idle server too.
        ours = {name: pids for t in targets if t["probe"] for name, pids in t["probe"].groups.items()}
        all_pids = sorted({p for pids in ours.values() for p in pids})
        for t in targets:
            if t["probe"]:
                mine = {p for pids in t["probe"].groups.values() for p in pids}
                t["probe"].groups["idle_servers"] = [p for p in all_pids if p not in mine]

    def run_modes(self, targets: list[dict], work: Workload, flops: FlopModel, threads: int) -> None:
        args, peak = self.args, self.info["peak_gflops"]
        # Mode by mode, every target side by side: the conditions of the machine stay comparable.
        if "single" in args.modes:
            for t in targets:
                self.quiet()
                self.rows.append(run_single(t["name"], t["client"], work, args, t["probe"], threads))
        if "rerank" in args.modes and work.rerank_sets:
            for t in targets:
                self.quiet()
                dtype = t.get("rerank_dtype", t["dtype"])
                self.rows.append(
                    run_rerank(t["name"], t["client"], work, args, t["probe"], flops, peak.get(dtype), threads)
                )
        if "bulk" in args.modes:
            for t in targets:
                self.quiet()
                if t["name"] == "sentence-transformers":
                    in_process = functools.partial(
                        run_bulk_in_process, t["client"], work, args, flops, peak.get(t["dtype"]), threads
                    )
                    in_process()  # the warm pass (below)
                    self.rows.append(in_process())
                    continue
                bulk = functools.partial(
                    run_bulk,
                    t["name"],
                    t["client"],
                    work,
                    args,
                    t["probe"],
                    t["metrics"],
                    t.get("model", ""),
                    flops,
                    peak.get(t["dtype"]),
                    threads,
                )
                # Every target's bulk is timed warm: one untimed pass of the same workload first (its
                # batch shapes, a server's drain rates), as OpenVINO's fidelity pass over the corpus
                # warms it before its timed windows; timed cold, the 4 s run of a fresh server read
                # ~10 % under the same server's later runs (bench.bulk_compare, which also warms).
                log(f"bulk {t['name']}/{t['client'].protocol}: an untimed pass first")
                bulk()
                self.quiet()
                self.rows.append(bulk())
                if args.stream and t["name"] == "encoderd" and t["client"].protocol == "grpc":
                    self.quiet()
                    self.rows.append(bulk(stream=True))
            if args.openvino:
                self.run_openvino(work, flops, threads)

    def run_openvino(self, work: Workload, flops: FlopModel, threads: int) -> None:
        """Both OpenVINO variants, each checked against float32 sentence-transformers first."""
        args = self.args
        venv = openvino_venv(args.cache_dir)
        embed_dir = self.embed_dir
        log("fidelity reference: float32 sentence-transformers on the corpus")
        reference = reference_vectors(embed_dir, work.corpus, threads)
        for name in VARIANTS:
            self.quiet()
            self.rows.append(
                run_openvino(venv, name, embed_dir, work, args, flops, self.info["peak_gflops"], threads, reference)
            )

    def run_device_modes(self, targets: list[dict], work: Workload, embed_dir: str) -> None:
        """memory and oom (bench/device.py): encoderd alone, the workers on --device."""
        args = self.args
        ours = next(t for t in targets if t["name"] == "encoderd")
        if "memory" in args.modes:
            self.quiet()
            workers = ours["probe"].groups.get("worker", []) if ours["probe"] else []
            self.rows.append(run_memory(ours["client"], work, args, args.device, workers))
        if "oom" in args.modes:
            batch, length = (64, 512) if is_cuda(args.device) else (8, 64)
            self.rows.append(run_oom(embed_dir, args.device, batch, length))

    def measure_peak(self, threads: int) -> dict:
        """The best of up to three tries: a peak measured while others load the machine is too low (and
        every utilisation too high), so it retries unless the machine was quiet, and says how busy it was.
        On a GPU: once, there (nothing else shares it)."""
        if is_cuda(self.args.device):
            return {**device_peak(self.args.device, self.args.peak_sizes), "foreign_cores": 0.0}
        best: dict = {}
        for _ in range(1 if self.args.quick else 3):
            self.quiet()
            before = CpuProbe({}).snapshot()
            peak = matmul_peak(threads, self.args.peak_sizes)
            peak["foreign_cores"] = CpuProbe.cores(before, CpuProbe({}).snapshot())["foreign"]
            if not best or peak["float32"] > best["float32"]:
                best = peak
            if peak["foreign_cores"] < 0.2:
                break
        return best

    def quiet(self) -> None:
        """On a shared machine, wait (up to --quiet-wait s) until the others use < 0.3 cores; our servers
        are idle between measurements, so what is busy now is someone else."""
        deadline = time.monotonic() + self.args.quiet_wait
        while True:
            a = CpuProbe({}).snapshot()
            time.sleep(1.0)
            load = CpuProbe.cores(a, CpuProbe({}).snapshot())["foreign"]
            if load < 0.3 or time.monotonic() >= deadline:
                break
        if self.args.quiet_wait:
            log(f"  machine load before measuring: {load:.2f} cores used by others")

    def report(self) -> dict:
        args = self.args
        result = {
            "conditions": {
                "quick": args.quick,
                "serve_args": args.serve_args,
                "concurrency": args.concurrency,
                "batch": args.batch,
                "bulk_seconds": args.bulk_seconds,
                "bulk_warmup": args.bulk_warmup,
                "single_calls": args.single_calls,
                "rerank_calls": args.rerank_calls,
                "rerank_docs": args.rerank_docs,
                "models": args.models,
                "device": args.device,
                "cpus": len(os.sched_getaffinity(0)),
                "worker_threads": worker_threads(args),
                "python": sys.version.split()[0],
            },
            **self.info,
            "results": [asdict(r) for r in self.rows],
            "ratios": ratios(self.rows),
            "floors": floors(self.rows, self.info.get("peak_gflops", {})),
        }
        print()
        print_table(self.rows)
        print_ratios(result["ratios"])
        print_floors(result["floors"])
        print_served(self.info.get("encoderd_models", []))
        print(f"\nconditions: {json.dumps(result['conditions'])}")
        if "corpus" in self.info:  # a recovery-only run has none
            print(f"corpus tokens: {json.dumps(self.info['corpus'])}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
            log(f"wrote {args.json}")
        return result

    def close(self) -> None:
        self.stack.close()


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through `finally`, so the servers are stopped


def main(argv: list[str] | None = None, prog: str = "python -m encoderd.bench") -> int:
    args = resolve_options(build_parser(prog).parse_args(argv))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    bench = Bench(args)
    try:
        bench.run()
    except KeyboardInterrupt:
        log("interrupted; stopping what was started")
        return 130
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
