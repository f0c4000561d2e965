"""The shipped gRPC front (deploy/envoy/front.yaml) on loopback, for benchmarks and tests.

Only its addresses change (and, where asked, its limit of calls in flight): every policy
stays as shipped, so what is measured or tested is what operators deploy.
"""

from __future__ import annotations

from pathlib import Path

import yaml

FRONT_YAML = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "front.yaml"  # in a checkout


def front_config(grpc_ports: list[int], listen_port: int, admin_port: int, max_requests: int | None = None) -> dict:
    """front.yaml listening on 127.0.0.1:listen_port, balancing over 127.0.0.1:grpc_ports."""
    config = yaml.safe_load(FRONT_YAML.read_text())
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    (cluster,) = config["static_resources"]["clusters"]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        for port in grpc_ports
    ]
    if max_requests is not None:
        (calls,) = [t for t in cluster["circuit_breakers"]["thresholds"] if t["priority"] == "DEFAULT"]
        calls.update(max_requests=max_requests, max_pending_requests=max_requests)  # health probes keep theirs
    return config


def front_command(envoy: str, config_path: Path, workers: int | None = None) -> list[str]:
    """Envoy on that config; `workers` worker threads (Envoy's --concurrency; default: one per core)."""
    threads = ["--concurrency", str(workers)] if workers else []
    return [envoy, "--config-path", str(config_path), "--disable-hot-restart", "--log-level", "warn", *threads]
