"""Windows that emit as they close: throughput and window-close latency of the live engine.

The workload of docs/benchmarks.md's "windows" section: rows ``(ts, k, v)`` with event time
``ts``, a 1-second tumbling ``count(*)``/``sum(v)`` per window.

- throughput: 2,000,000 rows in 8,192-row batches pushed flat out; rows per second from the
  first write to the last window's row, results checked against the input;
- window-close latency: one batch every 20 ms, each batch a new second, so each write closes
  the previous window; the time from that write to the window's row in Python (p50/p99), at
  1, 100 and 8,192-row batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pushtable import SessionContext, Topic
from pushtable.bench.peer_workload import percentiles
from pushtable.engine import engine_threads

SCHEMA = pa.schema([("ts", pa.timestamp("ms", tz="UTC")), ("k", pa.int64()), ("v", pa.int64())])
SQL = "SELECT date_bin(INTERVAL '1 second', ts) AS w, count(*) AS n, sum(v) AS s FROM t GROUP BY 1"
BATCH_ROWS = (1, 100, 8192)


def _batch(first_ms: int, rows: int, span_ms: int) -> pa.RecordBatch:
    """``rows`` rows from ``first_ms`` spread over ``span_ms`` milliseconds, v = 1."""
    ts = first_ms + (np.arange(rows, dtype=np.int64) * span_ms) // max(rows, 1)
    return pa.record_batch(
        [
            pa.array(ts, pa.timestamp("ms", tz="UTC")),
            pa.array(np.arange(rows)),
            pa.array(np.ones(rows, np.int64)),
        ],
        schema=SCHEMA,
    )


@dataclass(frozen=True)
class Workload:
    """What a run writes and asks: the table's schema, the query, the batches."""

    schema: pa.Schema
    sql: str
    #: (rows, batch_rows) -> the throughput run's batches
    batches: Callable[[int, int], list[pa.RecordBatch]]
    #: (i, rows) -> batch i of the latency run (writing it closes window i - 1)
    latency_batch: Callable[[int, int], pa.RecordBatch]
    #: a result's window column -> the window's number
    window_of: Callable[[pa.Array], list[int]]
    #: how many windows each row is counted in (a sliding window's size / slide)
    copies: int = 1


def _throughput_batches(rows: int, batch_rows: int, per_window: int = 100_000) -> list[Any]:
    batches = []
    for first in range(0, rows, batch_rows):
        n = min(batch_rows, rows - first)
        # per_window rows per second of event time
        ts0 = (first * 1000) // per_window
        batches.append(_batch(ts0, n, (n * 1000) // per_window))
    return batches


TIMESTAMPS = Workload(
    schema=SCHEMA,
    sql=SQL,
    batches=_throughput_batches,
    latency_batch=lambda i, rows: _batch(i * 1000, rows, 500),
    window_of=lambda w: [v // 1_000_000_000 for v in w.cast(pa.int64()).to_pylist()],  # ns
)


def _ms(values: pa.Array) -> list[int]:
    return [v // 1000 for v in values.cast(pa.int64()).to_pylist()]  # timestamp[ms] -> seconds


#: The tumbling window closing every 1,000 rows (``ts`` = the row's number in ms): about 8
#: windows close in each 8,192-row batch, so what it measures is the cost of a window emitted.
DENSE = Workload(
    schema=SCHEMA,
    sql=SQL,
    batches=lambda rows, batch_rows: _throughput_batches(rows, batch_rows, per_window=1_000),
    latency_batch=TIMESTAMPS.latency_batch,
    window_of=TIMESTAMPS.window_of,
)

#: Spark's sliding window, 10 seconds every second: each row is in 10 windows; the window
#: ending at second e closes with batch e (its number: e - 1, as a tumbling window's).
SLIDING = Workload(
    schema=SCHEMA,
    sql="SELECT window(ts, '10 seconds', '1 second') AS w, count(*) AS n, sum(v) AS s "
    "FROM t GROUP BY 1",
    batches=_throughput_batches,
    latency_batch=lambda i, rows: _batch(i * 1000, rows, 500),
    window_of=lambda w: [e - 1 for e in _ms(pc.struct_field(w, "end"))],
    copies=10,
)

#: Spark's session window with a 300 ms gap over bursts: each batch is 500 ms of one second
#: (a session), closed by the next burst; throughput over 8,192-row bursts.
SESSIONS = Workload(
    schema=SCHEMA,
    sql="SELECT session_window(ts, '300 milliseconds') AS w, count(*) AS n, sum(v) AS s "
    "FROM t GROUP BY 1",
    batches=lambda rows, batch_rows: [
        _batch(i * 1000, batch_rows, 500) for i in range(rows // batch_rows)
    ],
    latency_batch=lambda i, rows: _batch(i * 1000, rows, 500),
    window_of=lambda w: _ms(pc.struct_field(w, "start")),
)

#: The shapes measured beside the tumbling one.
SHAPES = {
    "sliding 10 s every 1 s": SLIDING,
    "session, 300 ms gap": SESSIONS,
    "tumbling 1 s, a window every 1,000 rows": DENSE,
}


def throughput(
    rows: int = 2_000_000, batch_rows: int = 8192, workload: Workload = TIMESTAMPS
) -> dict[str, Any]:
    """Rows per second through a 1-second tumbling window, flat out; results verified."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table(
        "t", workload.schema, capacity=64, order_by="ts", unbounded=True
    )
    batches = workload.batches(rows, batch_rows)
    got: list[pa.RecordBatch] = []
    stream = ctx.sql(workload.sql).execute_stream()

    def produce() -> None:
        with sink:
            for b in batches:
                sink.write(b)

    start = time.perf_counter()
    producer = threading.Thread(target=produce)
    producer.start()
    for b in stream:
        got.append(b.to_pyarrow())
    seconds = time.perf_counter() - start
    producer.join()
    result = pa.Table.from_batches(got) if got else pa.table({"n": [], "s": []})
    rows = sum(b.num_rows for b in batches)
    counted = rows * workload.copies
    ok = sum(result["n"].to_pylist()) == counted and sum(result["s"].to_pylist()) == counted
    return {
        "rows": rows,
        "batch_rows": batch_rows,
        "windows": result.num_rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "verified": ok,
    }


def close_latency(
    batch_rows: int, samples: int = 200, interval: float = 0.02, workload: Workload = TIMESTAMPS
) -> dict[str, Any]:
    """Write -> window row: each batch opens a new second, closing the one before."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table(
        "t", workload.schema, capacity=16, order_by="ts", unbounded=True
    )
    arrived: dict[int, float] = {}
    stream = ctx.sql(workload.sql).execute_stream()

    def read() -> None:
        for b in stream:
            now = time.perf_counter()
            for w in workload.window_of(b.to_pyarrow().column("w")):
                arrived.setdefault(w, now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    written: list[float] = []
    start = time.perf_counter()
    for i in range(samples + 1):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        b = workload.latency_batch(i, batch_rows)
        written.append(time.perf_counter())
        sink.write(b, timeout=30)
    time.sleep(interval)
    sink.close()
    reader.join(60)
    # Window i closes when batch i + 1 is written.
    ms = sorted((arrived[i] - written[i + 1]) * 1e3 for i in range(samples) if i in arrived)
    return percentiles(batch_rows, ms)


#: Live window queries run at once over one topic in the ``concurrent`` part of the suite.
CONCURRENT = (1, 4, 16, 64)


def concurrent(
    queries: int, rows: int = 1_000_000, samples: int = 100, interval: float = 0.02
) -> dict[str, Any]:
    """``queries`` live window queries over one ordered :class:`~pushtable.Topic`.

    Throughput: ``rows`` rows in 8,192-row batches written flat out (the slowest query paces
    the producer); rows/s is every query's rows over the time to the last query's last window
    (all results verified). Window close: one batch every ``interval`` seconds, each closing
    the previous second, and the time from that write to the window's row in each query
    (p50/p99 over every query's windows). Peak RSS over the process's RSS before the topic.
    """
    import gc

    import psutil

    proc = psutil.Process()
    gc.collect()
    baseline = proc.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        seconds, verified = _concurrent_throughput(queries, rows)
        ms = _concurrent_close(queries, samples, interval)
    finally:
        stop.set()
        sampler.join()
    latency = percentiles(1, ms)
    return {
        "queries": queries,
        "rows": rows,
        "rows_per_s_total": queries * rows / seconds,
        "verified": verified,
        "close_p50_ms": latency.get("p50_ms", float("nan")),
        "close_p99_ms": latency.get("p99_ms", float("nan")),
        "close_samples": latency["samples"],
        "baseline_rss_mb": baseline / 2**20,
        "peak_rss_growth_mb": (peak[0] - baseline) / 2**20,
    }


def _subscribed(queries: int) -> tuple[Topic, list[Any]]:
    """A topic ordered by ``ts`` and ``queries`` live window queries over it, planned."""
    topic = Topic("events", SCHEMA, order_by="ts")
    ctx = SessionContext()
    for i in range(queries):
        topic.subscribe(ctx, f"t{i}", capacity=16, unbounded=True)
    streams = [
        ctx.sql(SQL.replace("FROM t ", f"FROM t{i} ")).execute_stream() for i in range(queries)
    ]
    return topic, streams


def _concurrent_throughput(queries: int, rows: int) -> tuple[float, bool]:
    topic, streams = _subscribed(queries)
    batches = _throughput_batches(rows, 8192)
    totals = [0] * queries

    def read(i: int) -> None:
        for b in streams[i]:
            totals[i] += sum(b.to_pyarrow().column("n").to_pylist())

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(queries)]
    start = time.perf_counter()
    for r in readers:
        r.start()
    with topic:
        for b in batches:
            topic.write(b)
    for r in readers:
        r.join(600)
    seconds = time.perf_counter() - start
    return seconds, all(t == rows for t in totals)


def _concurrent_close(queries: int, samples: int, interval: float) -> list[float]:
    topic, streams = _subscribed(queries)
    arrived: list[dict[int, float]] = [{} for _ in range(queries)]

    def read(i: int) -> None:
        for b in streams[i]:
            now = time.perf_counter()
            for w in TIMESTAMPS.window_of(b.to_pyarrow().column("w")):
                arrived[i].setdefault(w, now)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(queries)]
    for r in readers:
        r.start()
    written: list[float] = []
    start = time.perf_counter()
    for i in range(samples + 1):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        b = TIMESTAMPS.latency_batch(i, 1)
        written.append(time.perf_counter())
        topic.write(b, timeout=30)
    time.sleep(interval)
    topic.close()
    for r in readers:
        r.join(60)
    return sorted(
        (got[i] - written[i + 1]) * 1e3 for got in arrived for i in range(samples) if i in got
    )


def run(quick: bool) -> dict[str, Any]:
    """The ``windows`` suite (pushtable's figures)."""
    rows = 200_000 if quick else 2_000_000
    if not quick:
        throughput(rows)  # unmeasured warm-up, as in the side-by-side run
    runs = [throughput(rows) for _ in range(1 if quick else 5)]
    best = sorted(runs, key=lambda r: r["rows_per_s"])[len(runs) // 2]
    latency = [close_latency(rows, 20 if quick else 200) for rows in BATCH_ROWS]
    counts = CONCURRENT[:2] if quick else CONCURRENT
    many = [concurrent(n, 100_000 if quick else 1_000_000, 20 if quick else 100) for n in counts]
    shapes = {}
    for name, workload in SHAPES.items():
        tries = [throughput(rows, workload=workload) for _ in range(1 if quick else 3)]
        shapes[name] = {
            "throughput": sorted(tries, key=lambda r: r["rows_per_s"])[len(tries) // 2],
            "close_latency": close_latency(8192, 20 if quick else 200, workload=workload),
        }
    return {
        "shapes": shapes,
        "throughput": best,
        "throughput_runs": runs,
        "close_latency": latency,
        "engine_threads": engine_threads(),
        "concurrent": many,
    }


def table(suite: dict[str, Any]) -> str:
    """The windows suite's results as text."""
    t = suite["throughput"]
    lines = [
        f"windows throughput: {t['rows']:,} rows in {t['batch_rows']:,}-row batches, "
        f"{t['windows']} windows: {t['rows_per_s'] / 1e6:.1f} M rows/s (median of "
        f"{len(suite['throughput_runs'])}, verified={t['verified']})",
        f"{'batch rows':>10s} {'n':>4s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}",
    ]
    for c in suite["close_latency"]:
        lines.append(
            f"{c['batch_rows']:10d} {c['samples']:4d} {c['p50_ms']:8.2f} {c['p99_ms']:8.2f} "
            f"{c['max_ms']:8.2f}"
        )
    for name, shape in suite.get("shapes", {}).items():
        t, c = shape["throughput"], shape["close_latency"]
        lines.append(
            f"{name}: {t['rows_per_s'] / 1e6:.1f} M rows/s ({t['windows']} windows, "
            f"verified={t['verified']}); close p50 {c['p50_ms']:.2f} / p99 {c['p99_ms']:.2f} ms "
            f"at {c['batch_rows']:,}-row batches"
        )
    if suite.get("concurrent"):
        lines.append(
            f"concurrent live window queries over one topic ({suite['engine_threads']} engine "
            "threads):"
        )
        lines.append(
            f"{'queries':>8s} {'M rows/s total':>15s} {'close p50 ms':>13s} {'close p99 ms':>13s} "
            f"{'RSS growth MB':>14s}"
        )
        for c in suite["concurrent"]:
            lines.append(
                f"{c['queries']:8d} {c['rows_per_s_total'] / 1e6:15.1f} {c['close_p50_ms']:13.2f} "
                f"{c['close_p99_ms']:13.2f} {c['peak_rss_growth_mb']:14.1f}"
            )
    return "\n".join(lines)
