"""metrics.series: the labelled child prometheus_client's labels() returns, looked up once, so the
samples counted through it are the metric's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from encoderd.server.base import metrics


def test_series_is_the_labelled_child_and_counts_into_its_metric():
    registry = CollectorRegistry()
    counter = Counter("t_calls", "calls", ["model", "rpc"], registry=registry)
    histogram = Histogram("t_seconds", "seconds", ["model"], buckets=(0.1, 1), registry=registry)
    assert metrics.series(counter, "m", "Embed") is counter.labels("m", "Embed")
    assert metrics.series(counter, "m", "Embed") is metrics.series(counter, "m", "Embed")
    metrics.series(counter, "m", "Embed").inc()
    metrics.series(counter, "m", "Embed").inc(2)
    metrics.series(counter, "n", "Embed").inc()
    metrics.series(histogram, "m").observe(0.5)
    assert registry.get_sample_value("t_calls_total", {"model": "m", "rpc": "Embed"}) == 3
    assert registry.get_sample_value("t_calls_total", {"model": "n", "rpc": "Embed"}) == 1
    assert registry.get_sample_value("t_seconds_bucket", {"model": "m", "le": "1.0"}) == 1
    assert registry.get_sample_value("t_seconds_bucket", {"model": "m", "le": "0.1"}) == 0
