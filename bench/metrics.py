"""encoderd's own Prometheus counters, scraped around a measurement: padding and batch sizes."""

from __future__ import annotations


def scrape(url: str | None) -> dict[str, float]:
    """encoderd counters summed over their labels, per metric sample name and model."""
    if not url:
        return {}
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in family.samples:
            if s.name.startswith("encoderd_") and "model" in s.labels and "le" not in s.labels:
                key = f"{s.name}|{s.labels['model']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def server_counters(before: dict, after: dict, model: str) -> dict:
    def delta(name: str) -> float:
        key = f"{name}|{model}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    real, computed, batches = (
        delta("encoderd_real_tokens_total"),
        delta("encoderd_computed_tokens_total"),
        delta("encoderd_batches_total"),
    )
    if not real:
        return {}
    return {
        "padding_ratio": computed / real,
        "batches": int(batches),
        "mean_batch_size": delta("encoderd_batch_size_sum") / max(batches, 1),
        "mean_batch_seconds": delta("encoderd_batch_duration_seconds_sum") / max(batches, 1),
        "server_real_tokens": int(real),
        "server_computed_tokens": int(computed),
    }
