"""A 30-second soak: steady producer, slow reader; RSS stays within the queue's bound."""

from __future__ import annotations

from pushtable.bench.memory import measure

MARGIN_MB = 64  # allocator slack, DataFusion's own buffers, the batch being built


def test_rss_stays_bounded_with_a_slow_reader() -> None:
    result = measure(30.0, 65_536, capacity=1024, max_bytes=8 << 20)
    assert result["rows_read"] > 0
    bound = result["baseline_rss_mb"] + result["queue_bound_mb"] + MARGIN_MB
    assert result["max_rss_mb"] <= bound, result
    assert abs(result["growth_mb"]) < 16, result  # no trend between the two halves
