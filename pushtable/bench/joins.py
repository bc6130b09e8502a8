"""Interval joins of two live tables: throughput and memory of the engine's stream join.

The workload of docs/benchmarks.md's "joins" section: two ordered unbounded tables ``a`` and
``b`` of rows ``(k, ts, v)``, 10 ms of event time between rows, ``b``'s row 5 ms after ``a``'s
of the same key (1,000 keys), joined by
``a.k = b.k AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'`` (each ``a`` row meets
exactly one ``b`` row), one producer thread per side writing 8,192-row batches flat out, the
query counting the matches. Throughput is rows written on both sides per second, first write
to the answer; the process's RSS is sampled every 10 ms, so a state that grew with the stream
(instead of with the bound) would show.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from pushtable import SessionContext

SCHEMA = pa.schema([("k", pa.int64()), ("ts", pa.timestamp("ms", tz="UTC")), ("v", pa.int64())])
SQL = (
    "SELECT count(*) AS n FROM a JOIN b ON a.k = b.k "
    "AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'"
)
KEYS = 1_000


def _side(i: int, rows: int, offset_ms: int) -> pa.RecordBatch:
    """Batch ``i`` of a side: rows ``i * rows ..``, 10 ms apart, key ``r % KEYS``."""
    r = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
    return pa.record_batch(
        [
            pa.array(r % KEYS),
            pa.array(r * 10 + offset_ms, pa.timestamp("ms", tz="UTC")),
            pa.array(r),
        ],
        schema=SCHEMA,
    )


def interval_join(rows_per_side: int, batch_rows: int = 8192) -> dict[str, Any]:
    """Both sides written flat out by two threads; rows/s and RSS over the run."""
    import psutil

    proc = psutil.Process()
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", SCHEMA, 8, order_by="ts", unbounded=True)
    b = ctx.register_streaming_table("b", SCHEMA, 8, order_by="ts", unbounded=True)
    query = ctx.sql(SQL)
    batches = rows_per_side // batch_rows
    baseline = proc.memory_info().rss
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            samples.append(proc.memory_info().rss)

    def produce(sink: Any, offset_ms: int) -> None:
        with sink:
            for i in range(batches):
                sink.write(_side(i, batch_rows, offset_ms))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    producers = [
        threading.Thread(target=produce, args=(a, 0), daemon=True),
        threading.Thread(target=produce, args=(b, 5), daemon=True),
    ]
    for p in producers:
        p.start()
    # An unbounded table's aggregate answers with changes: the last one is the count.
    counts = [r["n"] for batch in query.execute_stream() for r in batch.to_pyarrow().to_pylist()]
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    written = batches * batch_rows
    half = len(samples) // 2
    first, second = samples[:half] or [baseline], samples[half:] or [baseline]
    return {
        "rows_per_side": written,
        "rows_per_s": 2 * written / seconds,
        "verified": bool(counts) and counts[-1] == written,
        "rss_baseline_mb": baseline / 2**20,
        "rss_peak_first_half_mb": max(first) / 2**20,
        "rss_peak_second_half_mb": max(second) / 2**20,
    }


#: Pathway's interval join takes rows one per call: its run has this many rows a side.
PATHWAY_ROWS = 98_304


def run(quick: bool, peers: bool = False) -> dict[str, Any]:
    """2,000,000 rows a side for throughput (median of 3), then 10,000,000 a side for memory.

    Fewer rows with ``quick``. With ``peers``, the same join on LaminarDB and Pathway from the
    peers venv, after pushtable's (Pathway on fewer rows).
    """
    rows, long = (200_000, 400_000) if quick else (2_000_000, 10_000_000)
    runs = [interval_join(rows) for _ in range(1 if quick else 3)]
    out: dict[str, Any] = {
        "throughput": sorted(runs, key=lambda r: r["rows_per_s"])[len(runs) // 2],
        "long": interval_join(long),
    }
    if peers:
        from pushtable.bench.peers import PEERS, peer

        params = {"shape": "join", "rows": rows, "batch_rows": 8192}
        params["pathway_max_rows"] = PATHWAY_ROWS // (10 if quick else 1)
        out["peers"] = {name: peer(name, params) for name in PEERS}
    return out


def table(suite: dict[str, Any]) -> str:
    """The join suite's results as text."""
    t, long = suite["throughput"], suite["long"]
    return "\n".join(
        [
            f"interval join of two live tables: {t['rows_per_side']:,} rows a side, "
            f"{t['rows_per_s'] / 1e6:.2f} M rows/s both sides (verified={t['verified']})",
            f"  {long['rows_per_side']:,} rows a side: RSS baseline {long['rss_baseline_mb']:.0f} "
            f"MB, peak {long['rss_peak_first_half_mb']:.0f} MB in the first half, "
            f"{long['rss_peak_second_half_mb']:.0f} MB in the second "
            f"(verified={long['verified']}, {long['rows_per_s'] / 1e6:.2f} M rows/s)",
            *_peer_lines(suite.get("peers", {}), t["rows_per_s"]),
        ]
    )


def _peer_lines(peers: dict[str, Any], ours: float) -> list[str]:
    lines = []
    for name, result in peers.items():
        if "skipped" in result:
            lines.append(f"  {name}: skipped: {result['skipped']}")
            continue
        t = result["throughput"][0]
        rate = t["rows_per_s"]
        done = (
            f"{rate / 1e6:.3f} M rows/s (pushtable {ours / rate:.0f}x)"
            if rate and t["verified"]
            else "no rate: not every match came"
        )
        lines.append(
            f"  {result['engine']}: {t['rows_per_side']:,} rows a side, {t['matches']:,} of "
            f"{t['rows_per_side']:,} matches, {done}"
        )
    return lines
