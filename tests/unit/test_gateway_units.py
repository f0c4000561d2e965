"""The Envoy config encoderd renders (gateway/envoy.py), read back as data: what each listener
does with gRPC. Envoy itself runs in the integration tests; these pin what a run cannot show in
reasonable time."""

from __future__ import annotations

from pathlib import Path

import yaml

from encoderd.gateway.envoy import GatewaySettings, render

PUBLIC = ("encoderd_rest", "encoderd_grpc_public")


def _listeners(tmp_path, **settings) -> dict[str, dict]:
    config = yaml.safe_load(render(tmp_path, GatewaySettings(**settings)).read_text())
    return {listener["name"]: listener for listener in config["static_resources"]["listeners"]}


def _manager(listener: dict) -> dict:
    """A listener's (first) HTTP connection manager."""
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _route_config(listener: dict) -> dict:
    """The route config of a listener's (first) HTTP connection manager."""
    return _manager(listener)["route_config"]


def _routes(listener: dict) -> list[dict]:
    return [route for host in _route_config(listener)["virtual_hosts"] for route in host["routes"]]


def test_grpc_routes_have_neither_a_timeout_nor_a_stream_idle_timeout(tmp_path):
    """A gRPC call runs to its own deadline: Envoy's default stream idle timeout would cut a big
    unary call that computes silently for 5 minutes (UNAVAILABLE "stream timeout"; reproduced with
    the timeout set to 2 s and a 6 s call before the fix)."""
    listeners = _listeners(tmp_path, rest_port=7997, grpc_port=50051)
    grpc_routes = [
        route for name in PUBLIC for route in _routes(listeners[name]) if route["match"].get("grpc") is not None
    ]
    assert len(grpc_routes) == 4  # on each port: health probes (calls in flight of their own), the rest
    health = [r for r in grpc_routes if r["match"]["prefix"] == "/grpc.health.v1.Health/"]
    assert len(health) == 2 and all(r["route"]["priority"] == "HIGH" for r in health)
    for route in grpc_routes:
        assert route["route"]["cluster"] == "encoderd_grpc"
        assert route["route"]["timeout"] == "0s" and route["route"]["idle_timeout"] == "0s", route


def test_only_probes_and_scrapes_take_the_rest_ports_high_priority(tmp_path):
    """The REST route with the health probes' own calls in flight (priority HIGH, apart from
    --rest-max-in-flight) matches GET and HEAD of /health, /, /ping and /metrics only: TEI's POST /
    (embed, rerank, predict) matched it too, so a flood of it bypassed the limit and refused probes."""
    import re

    rest = [r for r in _routes(_listeners(tmp_path, rest_port=7997)["encoderd_rest"]) if "grpc" not in r["match"]]
    [high] = [r for r in rest if r.get("route", {}).get("priority") == "HIGH"]
    paths, [method] = high["match"]["safe_regex"]["regex"], high["match"]["headers"]
    assert [p for p in ("/", "/health", "/ping", "/metrics", "/embed") if re.fullmatch(paths, p)] == [
        "/",
        "/health",
        "/ping",
        "/metrics",
    ]
    verbs = method["string_match"]["safe_regex"]["regex"]
    assert method["name"] == ":method"
    assert [m for m in ("GET", "HEAD", "POST", "OPTIONS") if re.fullmatch(verbs, m)] == ["GET", "HEAD"]


def test_only_the_rest_port_bounds_the_time_to_send_a_request(tmp_path):
    """A body trickled to the REST port gets 408 (the integration test runs it); the gRPC port takes
    bulk streams that send for hours, so it has no request timeout. 0 turns it off."""
    from encoderd.gateway.envoy import ListenerLimits

    listeners = _listeners(tmp_path / "a", rest_port=7997, grpc_port=50051)
    assert _manager(listeners["encoderd_rest"])["request_timeout"] == "60s"
    assert "request_timeout" not in _manager(listeners["encoderd_grpc_public"])
    off = _listeners(tmp_path / "b", rest_port=7997, limits=ListenerLimits(request_timeout_s=0))
    assert _manager(off["encoderd_rest"])["request_timeout"] == "0s"  # Envoy: 0 = no timeout


def test_the_grpc_listener_is_there_only_when_asked_for(tmp_path):
    assert "encoderd_grpc_public" not in _listeners(tmp_path / "a", rest_port=7997)
    listener = _listeners(tmp_path / "b", rest_port=7997, grpc_host="0.0.0.0", grpc_port=50051)["encoderd_grpc_public"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 50051}
    assert not listener["enable_reuse_port"]  # a taken port fails Envoy's start
    # Anything but gRPC: a 415 that names the REST port.
    fallback = _routes(listener)[-1]
    assert fallback["direct_response"]["status"] == 415
    assert "REST is on port 7997" in fallback["direct_response"]["body"]["inline_string"]


def test_both_public_ports_and_the_front_return_the_request_id(tmp_path):
    """Every Envoy config marks the calls it forwards and adds the forwarded x-request-id to a
    response without one (server/api/service.py then leaves the id to it)."""
    listeners = _listeners(tmp_path, rest_port=7997, grpc_port=50051)
    front = yaml.safe_load((Path(__file__).parents[2] / "deploy/envoy/front.yaml").read_text())
    route_configs = [
        *(_route_config(listeners[name]) for name in PUBLIC),
        _route_config(front["static_resources"]["listeners"][0]),
    ]
    for config in route_configs:
        (marker,) = config["request_headers_to_add"]
        assert marker["header"] == {"key": "x-encoderd-proxy-returns-id", "value": "1"}
        (returned,) = config["response_headers_to_add"]
        assert returned == {
            "header": {"key": "x-request-id", "value": "%REQ(x-request-id)%"},
            "append_action": "ADD_IF_ABSENT",
        }


def test_the_rapid_reset_guard_is_relaxed_alike_in_every_envoy(tmp_path):
    """Envoy's default (500 streams) aborted connections of clients that cancel many young calls
    (tests/integration/test_rest.py reproduces it); the shipped front says the same as the render."""
    rendered = yaml.safe_load(render(tmp_path, GatewaySettings(rest_port=7997)).read_text())
    front = yaml.safe_load((Path(__file__).parents[2] / "deploy/envoy/front.yaml").read_text())
    for config in (rendered, front):
        (layer,) = config["layered_runtime"]["layers"]
        assert layer["static_layer"] == {"overload.premature_reset_total_stream_count": 10000}
