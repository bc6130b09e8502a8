"""Write -> result latency of live queries: how long after ``sink.write`` a row leaves the query.

Each case writes batches at a fixed rate into a fresh table while one query reads it; a
reader thread stamps when the first row of each batch comes out of the query. Reported: p50,
p99 and max in milliseconds. A query whose plan holds rows back (DataFusion 54's hash join
coalesces its output up to ``batch_size`` rows) shows it here as latencies of whole seconds.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import pyarrow as pa

from pushtable import SessionContext

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])
QUERIES = {
    "filter": "SELECT k FROM t WHERE v >= 0",
    "projection": "SELECT k, v * 2 AS w FROM t",
    "join": "SELECT t.k, d.name FROM t JOIN dim d ON t.k % 100 = d.id",
}
BATCH_ROWS = (1, 100, 8192)


def _case(query: str, rows: int, interval: float, samples: int) -> dict[str, Any]:
    ctx = SessionContext()
    ctx.register_record_batches(
        "dim", [[pa.record_batch({"id": list(range(100)), "name": [f"n{i}" for i in range(100)]})]]
    )
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=16)
    arrived: dict[int, float] = {}
    # Planned and started before the first write: a write that found the query still being
    # planned would time the planning, not the live path.
    stream = ctx.sql(QUERIES[query]).execute_stream()

    def read() -> None:
        for b in stream:
            now = time.perf_counter()
            ks = b.to_pyarrow().column("k").to_pylist()
            for batch_index in {k // rows for k in ks}:
                arrived.setdefault(batch_index, now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    written: list[float] = []
    start = time.perf_counter()
    for i in range(samples):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        b = pa.record_batch(
            [pa.array(range(i * rows, (i + 1) * rows), pa.int64()), pa.array([1.0] * rows)],
            schema=SCHEMA,
        )
        written.append(time.perf_counter())
        sink.write(b, timeout=30)
    time.sleep(interval)  # the last batch gets the same time to come out as the others
    sink.close()
    reader.join(60)
    ms = sorted((arrived[i] - written[i]) * 1e3 for i in range(samples) if i in arrived)
    return {
        "query": query,
        "sql": QUERIES[query],
        "batch_rows": rows,
        "batches_per_s": 1 / interval,
        "samples": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "max_ms": ms[-1],
    }


def run(quick: bool) -> dict[str, Any]:
    """The ``latency`` suite: every query at every batch size, at 100/s and (full) 1/s."""
    rates = [(0.01, 20 if quick else 300)] + ([] if quick else [(1.0, 10)])
    cases = [
        _case(q, rows, interval, samples)
        for interval, samples in rates
        for q in QUERIES
        for rows in BATCH_ROWS
    ]
    return {"cases": cases}


def table(suite: dict[str, Any]) -> str:
    """The latency cases as text."""
    lines = [f"{'query':11s} {'rows':>5s} {'rate/s':>7s} {'n':>4s} {'p50 ms':>8s} {'p99 ms':>8s}"]
    for c in suite["cases"]:
        lines.append(
            f"{c['query']:11s} {c['batch_rows']:5d} {c['batches_per_s']:7.0f} {c['samples']:4d} "
            f"{c['p50_ms']:8.2f} {c['p99_ms']:8.2f}"
        )
    return "\n".join(lines)
