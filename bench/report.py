"""The results table and the encoderd-vs-others ratios, as printed at the end of a run."""

from __future__ import annotations

import sys

from .modes import Row


def print_table(rows: list[Row], out=sys.stdout) -> None:
    head = (
        f"{'mode':9} {'engine':22} {'proto':10} {'inputs/s':>9} {'tok/s':>9} {'p50 ms':>9} {'p95 ms':>9} "
        f"{'p99 ms':>9} {'pad':>5} {'FLOP%':>6} {'busy%':>6} {'calls':>6} {'err':>4}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)

    def fmt(value, width: int, decimals: int, scale: float = 1.0) -> str:
        return f"{value * scale:{width}.{decimals}f}" if value is not None else "-".rjust(width)

    for r in rows:
        print(
            f"{r.mode:9} {r.engine:22} {r.protocol:10} {r.inputs_per_s:9.1f} {r.tokens_per_s:9.0f} "
            f"{r.p50_ms:9.1f} {r.p95_ms:9.1f} {r.p99_ms:9.1f} {fmt(r.padding_ratio, 5, 2)} "
            f"{fmt(r.flop_utilisation, 6, 1, 100)} {fmt(r.worker_busy, 6, 0, 100)} {r.calls:6d} {r.errors:4d}",
            file=out,
        )
    cpu_rows = [r for r in rows if r.cpu_cores]
    if cpu_rows:
        print(
            "\nCPU cores used while measuring (client = this process; foreign = everyone else on the machine):",
            file=out,
        )
        for r in cpu_rows:
            used = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_cores.items() if v >= 0.005 or k == "foreign")
            print(f"  {r.mode:7} {r.engine}/{r.protocol}: {used}", file=out)
    for r in rows:
        if r.frontend_ms_per_input:
            print(
                f"  frontend CPU per input {r.mode} {r.engine}/{r.protocol}: {r.frontend_ms_per_input:.3f} ms "
                f"(one core feeds {1e3 / r.frontend_ms_per_input:,.0f} inputs/s)",
                file=out,
            )
        if r.mode in ("memory", "oom") and r.server:
            print(f"  {r.mode} {r.engine}: {r.server}", file=out)
    for r in rows:
        if r.notes:
            print(f"  note {r.mode} {r.engine}/{r.protocol}: {r.notes}", file=out)


def ratios(rows: list[Row]) -> list[dict]:
    """encoderd vs each other engine, per mode; > 1 means encoderd is better.
    bulk: tokens/s ratio; single and rerank: p50 latency of the other / encoderd's."""
    out = []
    for mine in (r for r in rows if r.engine == "encoderd"):
        for other in (r for r in rows if r.mode == mine.mode and r.engine != "encoderd"):
            if mine.mode == "bulk":
                value = mine.tokens_per_s / other.tokens_per_s if other.tokens_per_s else None
                metric = "tokens/s encoderd / other"
            else:
                value = other.p50_ms / mine.p50_ms if mine.p50_ms else None
                metric = "p50 other / encoderd"
            out.append(
                {
                    "mode": mine.mode,
                    "encoderd": mine.protocol,
                    "vs": f"{other.engine}/{other.protocol}",
                    "metric": metric,
                    "ratio": round(value, 3) if value else None,
                }
            )
    return out


def print_ratios(items: list[dict], out=sys.stdout) -> None:
    if not items:
        return
    print("\nRatios (> 1 = encoderd better):", file=out)
    for x in items:
        value = f"{x['ratio']:.2f}x" if x["ratio"] else "-"
        print(f"  {x['mode']:7} encoderd/{x['encoderd']:5} vs {x['vs']:34} {value:>8}   ({x['metric']})", file=out)


def floors(rows: list[Row], peak: dict) -> dict:
    """What no server can beat on this machine now: the matmul peak measured on the spot, and the
    in-process single-query time of the same model (sentence-transformers, no server); each
    encoderd single-query p50 as a multiple of the latter (1.0 = no serving overhead at all)."""
    floor = next((r.p50_ms for r in rows if r.mode == "single" and r.protocol == "in-process"), None)
    over = {
        r.protocol: round(r.p50_ms / floor, 3)
        for r in rows
        if floor and r.mode == "single" and r.engine == "encoderd" and r.p50_ms
    }
    return {
        "matmul_peak_gflops": {k: peak[k] for k in ("float32", "float16", "bfloat16") if k in peak},
        "single_in_process_p50_ms": floor,
        "encoderd_single_p50_over_floor": over,
    }


def print_floors(items: dict, out=sys.stdout) -> None:
    peak = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in items["matmul_peak_gflops"].items()) or "not measured"
    print(f"\nFloors: matmul peak {peak}", file=out)
    if items["single_in_process_p50_ms"]:
        over = ", ".join(f"{k} {v:.2f}x" for k, v in items["encoderd_single_p50_over_floor"].items())
        print(
            f"  single query in-process (same model, no server) p50 {items['single_in_process_p50_ms']:.1f} ms; "
            f"encoderd p50 / that: {over}",
            file=out,
        )


def print_served(models: list[dict], out=sys.stdout) -> None:
    """What encoderd actually served: `--dtype auto` resolves per host, and a model whose automatic
    bfloat16 fails its fidelity self-check is served float32, so a row's dtype is not the flag's."""
    if models:
        served = "; ".join(
            f"{m['id']} ({m['kind']}): {m['engine']} {m['dtype']} x{m['replicas']}, fidelity {m['fidelity_status']}"
            for m in models
        )
        print(f"encoderd served: {served}", file=out)
