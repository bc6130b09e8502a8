"""Fan-out: one producer, 1 / 4 / 16 live queries over one :class:`~pushtable.Topic`.

Each subscriber runs ``SELECT count(*), sum(v)`` while the producer writes fresh batches as
fast as the slowest subscriber lets it (``on_slow="block"``). Reported: rows/s per subscriber
and in total, the producer's blocked time, and peak RSS growth against the bound on what the
topic may hold (``capacity`` queued batches, plus one each scan partition is working on).
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
from datafusion import SessionConfig

from pushtable import SessionContext, Topic

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])


def measure(subscribers: int, batches: int, batch_rows: int, capacity: int) -> dict[str, Any]:
    """One run: ``batches`` batches of ``batch_rows`` rows to ``subscribers`` queries."""
    proc = psutil.Process()
    topic = Topic("events", SCHEMA)
    partitions = os.cpu_count() or 1  # scan partitions per query (DataFusion's default)
    ctx = SessionContext(SessionConfig().with_target_partitions(partitions))
    results: list[Any] = [None] * subscribers

    def run_query(i: int) -> None:
        results[i] = ctx.sql(f"SELECT count(*) AS n, sum(v) AS s FROM s{i}").to_pydict()

    subs = [topic.subscribe(ctx, f"s{i}", capacity=capacity) for i in range(subscribers)]
    rng = np.random.default_rng(0)
    queries = [
        threading.Thread(target=run_query, args=(i,), daemon=True) for i in range(subscribers)
    ]
    started = time.perf_counter()
    for q in queries:
        q.start()
    # The baseline includes the running (idle) queries: what grows from here is data.
    while any(s.stats.state != "reading" for s in subs):
        time.sleep(0.001)
    gc.collect()
    baseline = proc.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    expected_sum = 0.0
    k = np.arange(batch_rows, dtype=np.int64)
    for _ in range(batches):
        v = rng.random(batch_rows)
        expected_sum += float(v.sum())
        topic.write(pa.record_batch([pa.array(k), pa.array(v)], schema=SCHEMA))
    topic.close()
    for q in queries:
        q.join(600)
    elapsed = time.perf_counter() - started
    done.set()
    sampler.join()
    rows = batches * batch_rows
    for r in results:  # every subscriber saw every row (the last change is the total)
        assert r is not None, "a subscriber's query did not finish"
        assert r["n"][-1] == rows, r
        assert abs(r["s"][-1] - expected_sum) < 1e-6 * rows, r
    batch_bytes = batch_rows * 16
    bound = (capacity + partitions) * batch_bytes
    stats = topic.stats
    return {
        "subscribers": subscribers,
        "batches": batches,
        "batch_rows": batch_rows,
        "capacity": capacity,
        "seconds": elapsed,
        "rows_per_s_per_subscriber": rows / elapsed,
        "rows_per_s_total": subscribers * rows / elapsed,
        "producer_blocked_s": stats.blocked_seconds,
        "baseline_rss_mb": baseline / 2**20,
        "peak_rss_growth_mb": (peak - baseline) / 2**20,
        "bound_mb": bound / 2**20,
    }


def run(quick: bool) -> dict[str, Any]:
    """The ``fanout`` suite: 1, 4 and 16 subscribers; each figure the median of the repeats."""
    batches = 100 if quick else 400
    repeats = 1 if quick else 3
    out: dict[str, Any] = {}
    measure(1, 10, 65_536, 16)  # warm-up: thread pools, allocator arenas
    for n in (1, 4, 16):
        runs = [measure(n, batches, 65_536, 16) for _ in range(repeats)]
        best = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        out[str(n)] = best
    one = out["1"]["rows_per_s_total"]
    for key in ("4", "16"):
        out[key]["total_vs_1"] = out[key]["rows_per_s_total"] / one
    return out


def table(results: dict[str, Any]) -> str:
    """The fan-out results as text."""
    lines = [
        "subscribers  M rows/s each  M rows/s total  x vs 1  producer blocked s  "
        "RSS growth MB  bound MB"
    ]
    for n, r in results.items():
        lines.append(
            f"{n:>11}  {r['rows_per_s_per_subscriber'] / 1e6:13.1f}  "
            f"{r['rows_per_s_total'] / 1e6:14.1f}  {r.get('total_vs_1', 1.0):6.2f}  "
            f"{r['producer_blocked_s']:18.2f}  {r['peak_rss_growth_mb']:13.1f}  "
            f"{r['bound_mb']:8.1f}"
        )
    return "\n".join(lines)
