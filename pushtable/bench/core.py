"""Live-table throughput against the strongest alternatives, side by side in one run.

All engines read the same pre-built batches, pushed by the same producer threads through a
bounded queue of the same capacity; only the consumer differs:

- ``pushtable``: producers ``sink.write`` into a streaming table; DataFusion runs the SQL.
- ``duckdb``: producers ``put`` into a ``queue.Queue``; DuckDB scans a lazy
  ``pa.RecordBatchReader`` draining it (the hand-rolled blocking adapter pushtable replaces).
- ``python``: the same queue drained by a plain Python loop with pyarrow.compute kernels.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pushtable import ReaderGoneError, SessionContext, TableSink

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])
QUERIES = {
    "agg": "SELECT count(*) AS n, sum(v) AS s FROM t",
    "filter": "SELECT count(*) AS n, sum(v) AS s FROM t WHERE v > 0.5",
}
BATCH_ROWS = (1024, 8192, 65536)
PRODUCERS = (1, 4)
CAPACITIES = (4, 64)


@dataclass(frozen=True)
class Result:
    engine: str
    query: str
    batch_rows: int
    producers: int
    capacity: int
    rows: int
    median_rows_per_s: float
    min_rows_per_s: float
    max_rows_per_s: float


def make_batches(total_rows: int, batch_rows: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(42)
    out = []
    for start in range(0, total_rows, batch_rows):
        n = min(batch_rows, total_rows - start)
        k = np.arange(start, start + n, dtype=np.int64)
        out.append(pa.record_batch([pa.array(k), pa.array(rng.random(n))], schema=SCHEMA))
    return out


def _producers(
    batches: list[pa.RecordBatch],
    producers: int,
    put: Callable[[pa.RecordBatch], None],
    done: Callable[[], None],
) -> list[threading.Thread]:
    """Threads that each push every ``producers``-th batch, then call ``done``."""

    def produce(share: list[pa.RecordBatch]) -> None:
        for b in share:
            put(b)
        done()

    return [
        threading.Thread(target=produce, args=(batches[i::producers],), daemon=True)
        for i in range(producers)
    ]


def _queue_source(
    batches: list[pa.RecordBatch], producers: int, capacity: int
) -> tuple[list[threading.Thread], Iterator[pa.RecordBatch]]:
    """Producer threads feeding a bounded queue, and the generator that drains it."""
    q: queue.Queue[pa.RecordBatch | None] = queue.Queue(maxsize=capacity)
    threads = _producers(batches, producers, q.put, lambda: q.put(None))

    def drain() -> Iterator[pa.RecordBatch]:
        finished = 0
        while finished < producers:
            b = q.get()
            if b is None:
                finished += 1
            else:
                yield b

    return threads, drain()


def run_pushtable(
    batches: list[pa.RecordBatch], producers: int, capacity: int, sql: str
) -> tuple[float, int]:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=capacity)
    remaining = [producers]
    lock = threading.Lock()

    def done() -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                sink.close()

    threads = _producers(batches, producers, sink.write, done)
    start = time.perf_counter()
    for t in threads:
        t.start()
    n = int(ctx.sql(sql).to_pydict()["n"][0])
    return time.perf_counter() - start, n


def run_duckdb(
    batches: list[pa.RecordBatch], producers: int, capacity: int, sql: str
) -> tuple[float, int]:
    con = duckdb.connect()
    threads, drained = _queue_source(batches, producers, capacity)
    t = pa.RecordBatchReader.from_batches(SCHEMA, drained)  # noqa: F841 - found by name
    start = time.perf_counter()
    for th in threads:
        th.start()
    row = con.execute(sql).fetchone()
    assert row is not None
    return time.perf_counter() - start, int(row[0])


def run_python(
    batches: list[pa.RecordBatch], producers: int, capacity: int, sql: str
) -> tuple[float, int]:
    threads, drained = _queue_source(batches, producers, capacity)
    start = time.perf_counter()
    for t in threads:
        t.start()
    n, total = 0, 0.0
    filtered = "WHERE" in sql
    for b in drained:
        v = b.column(1)
        if filtered:
            v = pc.filter(v, pc.greater(v, 0.5))
        n += len(v)
        total += pc.sum(v).as_py() or 0.0
    return time.perf_counter() - start, n


# Each returns (seconds from the producers' start to the answer, row count); setup such as
# creating a context or connection is excluded for every engine alike.
ENGINES: dict[str, Callable[[list[pa.RecordBatch], int, int, str], tuple[float, int]]] = {
    "pushtable": run_pushtable,
    "duckdb": run_duckdb,
    "python": run_python,
}


def measure(
    total_rows: int,
    reps: int,
    batch_sizes: tuple[int, ...] = BATCH_ROWS,
    producer_counts: tuple[int, ...] = PRODUCERS,
    capacities: tuple[int, ...] = CAPACITIES,
) -> list[Result]:
    """Every engine on every configuration; each figure the median of ``reps`` runs."""
    results = []
    for batch_rows in batch_sizes:
        batches = make_batches(total_rows, batch_rows)
        expected = {
            "agg": total_rows,
            "filter": sum(int(pc.sum(pc.greater(b["v"], 0.5)).as_py()) for b in batches),
        }
        for producers in producer_counts:
            for capacity in capacities:
                for qname, sql in QUERIES.items():
                    for engine, run in ENGINES.items():
                        rates = []
                        for _ in range(reps):
                            elapsed, n = run(batches, producers, capacity, sql)
                            rates.append(total_rows / elapsed)
                            assert n == expected[qname], f"{engine} {qname}: {n}"
                        results.append(
                            Result(
                                engine,
                                qname,
                                batch_rows,
                                producers,
                                capacity,
                                total_rows,
                                statistics.median(rates),
                                min(rates),
                                max(rates),
                            )
                        )
    return results


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """pushtable / other engine, per configuration, from the same run."""
    by_key = {(r.engine, r.query, r.batch_rows, r.producers, r.capacity): r for r in results}
    out = []
    for r in results:
        if r.engine != "pushtable":
            continue
        key = (r.query, r.batch_rows, r.producers, r.capacity)
        row: dict[str, Any] = dict(
            zip(("query", "batch_rows", "producers", "capacity"), key, strict=True)
        )
        for other in ("duckdb", "python"):
            row[f"vs_{other}"] = r.median_rows_per_s / by_key[(other,) + key].median_rows_per_s
        out.append(row)
    return out


def reader_gone_latency(reps: int = 20) -> dict[str, float]:
    """Seconds from a query dropping its stream to a blocked writer's ReaderGoneError."""
    one = make_batches(10, 10)[0]
    samples = []
    for _ in range(reps):
        ctx = SessionContext()
        sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
        stream = ctx.sql("SELECT * FROM t").execute_stream()
        sink.write(one)
        next(iter(stream))
        raised_at: list[float] = []
        writer = threading.Thread(target=_write_expecting_gone, args=(sink, one, raised_at))
        writer.start()
        # The scan's partitions may take a few batches ahead: wait until the writer blocks.
        blocked_by = time.monotonic() + 10
        while sink.stats.waiting_writers == 0 and time.monotonic() < blocked_by:
            time.sleep(0.001)
        dropped_at = time.perf_counter()
        del stream  # the last reference: CPython drops the native stream right here
        writer.join(10)
        if not raised_at:
            raise RuntimeError("the blocked writer was not released within 10 s")
        samples.append(raised_at[0] - dropped_at)
    return {"median_s": statistics.median(samples), "max_s": max(samples)}


def _write_expecting_gone(sink: TableSink, b: pa.RecordBatch, raised_at: list[float]) -> None:
    """Write until the queue is full and the write blocks; record when it raises."""
    try:
        while True:
            sink.write(b, timeout=10)
    except ReaderGoneError:
        raised_at.append(time.perf_counter())


def run(quick: bool, reps: int = 5) -> dict[str, Any]:
    """The ``core`` suite as a JSON-ready dict."""
    rows = 1 << 18 if quick else 1 << 24
    results = measure(rows, reps)
    return {
        "rows_per_run": rows,
        "reps": reps,
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
        "reader_gone": reader_gone_latency(5 if quick else 20),
    }


def table(suite: dict[str, Any]) -> str:
    """The ratio table as text."""
    by_key = {
        (r["engine"], r["query"], r["batch_rows"], r["producers"], r["capacity"]): r
        for r in suite["results"]
    }
    lines = [
        f"{'query':<7}{'batch':>7}{'prod':>5}{'cap':>4}  {'pushtable':>10}{'duckdb':>9}"
        f"{'python':>9}  {'vs duckdb':>9}{'vs python':>10}   (Mrows/s, median)"
    ]
    for r in suite["ratios"]:
        key = (r["query"], r["batch_rows"], r["producers"], r["capacity"])
        rates = [by_key[(e,) + key]["median_rows_per_s"] / 1e6 for e in ENGINES]
        lines.append(
            f"{r['query']:<7}{r['batch_rows']:>7}{r['producers']:>5}{r['capacity']:>4}  "
            f"{rates[0]:>10.0f}{rates[1]:>9.0f}{rates[2]:>9.0f}  "
            f"{r['vs_duckdb']:>8.2f}x{r['vs_python']:>9.2f}x"
        )
    return "\n".join(lines)
