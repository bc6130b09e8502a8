"""Live-table throughput vs DuckDB scanning a lazy RecordBatchReader, side by side in one run.

Both engines read the same pre-built batches, pushed by the same producer threads through a
queue of the same capacity; only the consumer differs:

- pushtable: producers ``sink.write`` into a streaming table; DataFusion runs the query.
- DuckDB: producers ``put`` into a ``queue.Queue``; DuckDB scans a ``pa.RecordBatchReader``
  whose generator drains that queue (the hand-rolled blocking adapter pushtable replaces).

Run: ``python benchmarks/core.py [--quick] [--reps N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pushtable import SessionContext, TableSink

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])
QUERIES = {
    "agg": "SELECT count(*) AS n, sum(v) AS s FROM t",
    "filter": "SELECT count(*) AS n, sum(v) AS s FROM t WHERE v > 0.5",
}
CAPACITY = 8


@dataclass
class Result:
    engine: str
    query: str
    batch_rows: int
    producers: int
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


def _shares(batches: list[pa.RecordBatch], producers: int) -> list[list[pa.RecordBatch]]:
    return [batches[i::producers] for i in range(producers)]


def run_pushtable(batches: list[pa.RecordBatch], producers: int, sql: str) -> tuple[float, int]:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=CAPACITY)
    remaining = [producers]
    lock = threading.Lock()

    def produce(share: list[pa.RecordBatch]) -> None:
        for b in share:
            sink.write(b)
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                sink.close()

    threads = [threading.Thread(target=produce, args=(s,)) for s in _shares(batches, producers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    result = ctx.sql(sql).to_pydict()
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join(60)
    return elapsed, int(result["n"][0])


def run_duckdb(batches: list[pa.RecordBatch], producers: int, sql: str) -> tuple[float, int]:
    q: queue.Queue[pa.RecordBatch | None] = queue.Queue(maxsize=CAPACITY)

    def produce(share: list[pa.RecordBatch]) -> None:
        for b in share:
            q.put(b)
        q.put(None)

    def drain() -> Iterator[pa.RecordBatch]:
        done = 0
        while done < producers:
            b = q.get()
            if b is None:
                done += 1
            else:
                yield b

    con = duckdb.connect()
    threads = [threading.Thread(target=produce, args=(s,)) for s in _shares(batches, producers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    reader = pa.RecordBatchReader.from_batches(SCHEMA, drain())
    con.register("t", reader)
    row = con.execute(sql).fetchone()
    elapsed = time.perf_counter() - start
    for th in threads:
        th.join(60)
    assert row is not None
    return elapsed, int(row[0])


ENGINES: dict[str, Callable[[list[pa.RecordBatch], int, str], tuple[float, int]]] = {
    "pushtable": run_pushtable,
    "duckdb": run_duckdb,
}


def measure(
    total_rows: int, reps: int, batch_sizes: list[int], producer_counts: list[int]
) -> list[Result]:
    results = []
    for batch_rows in batch_sizes:
        batches = make_batches(total_rows, batch_rows)
        expected = {
            "agg": total_rows,
            "filter": int(sum(pc.sum(pc.greater(b["v"], 0.5)).as_py() for b in batches)),
        }
        for producers in producer_counts:
            for qname, sql in QUERIES.items():
                for engine, run in ENGINES.items():
                    rates = []
                    for _ in range(reps):
                        elapsed, n = run(batches, producers, sql)
                        assert n == expected[qname], f"{engine} {qname}: {n} != {expected[qname]}"
                        rates.append(total_rows / elapsed)
                    results.append(
                        Result(
                            engine,
                            qname,
                            batch_rows,
                            producers,
                            total_rows,
                            statistics.median(rates),
                            min(rates),
                            max(rates),
                        )
                    )
    return results


def reader_gone_latency(reps: int = 20) -> dict[str, float]:
    """Seconds from a query dropping its stream to a blocked writer's ReaderGoneError."""
    import gc

    from pushtable import ReaderGoneError

    samples = []
    for _ in range(reps):
        ctx = SessionContext()
        sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
        stream = ctx.sql("SELECT * FROM t").execute_stream()
        sink.write(make_batches(10, 10)[0])
        next(iter(stream))
        sink.write(make_batches(10, 10)[0])  # fills the queue
        raised_at: list[float] = []

        def blocked_writer(sink: TableSink, raised_at: list[float]) -> None:
            try:
                sink.write(make_batches(10, 10)[0], timeout=10)
            except ReaderGoneError:
                raised_at.append(time.perf_counter())

        writer = threading.Thread(target=blocked_writer, args=(sink, raised_at))
        writer.start()
        time.sleep(0.05)
        dropped_at = time.perf_counter()
        del stream
        gc.collect()
        writer.join(10)
        samples.append(raised_at[0] - dropped_at)
    return {"median_s": statistics.median(samples), "max_s": max(samples)}


def _rate(r: Result) -> str:
    """Median [min-max] in millions of rows per second."""
    m = 1e6
    return f"{r.median_rows_per_s / m:.0f} [{r.min_rows_per_s / m:.0f}-{r.max_rows_per_s / m:.0f}]"


def table(results: list[Result]) -> str:
    by_key = {(r.engine, r.query, r.batch_rows, r.producers): r for r in results}
    lines = [
        f"{'query':<7} {'batch rows':>10} {'producers':>9} {'pushtable Mrows/s':>18} "
        f"{'duckdb Mrows/s':>15} {'ratio':>6}"
    ]
    for r in results:
        if r.engine != "pushtable":
            continue
        d = by_key[("duckdb", r.query, r.batch_rows, r.producers)]
        lines.append(
            f"{r.query:<7} {r.batch_rows:>10,} {r.producers:>9} "
            f"{_rate(r):>18} {_rate(d):>15} {r.median_rows_per_s / d.median_rows_per_s:>5.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repetitions")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per figure (median)")
    parser.add_argument("--rows", type=int, default=1 << 24, help="rows per run")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    args = parser.parse_args()
    rows, reps = (1 << 19, 3) if args.quick else (args.rows, args.reps)
    print(
        f"{os.cpu_count()} cores, {rows:,} rows per run, "
        f"median of {reps} [min-max], capacity {CAPACITY}"
    )
    results = measure(rows, reps, [1024, 8192, 65536], [1, 4])
    print(table(results))
    gone = reader_gone_latency()
    print(
        f"reader gone -> blocked write raises: median {gone['median_s'] * 1e3:.2f} ms, "
        f"max {gone['max_s'] * 1e3:.2f} ms (20 runs)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"throughput": [asdict(r) for r in results], "reader_gone": gone}, f, indent=2
            )


if __name__ == "__main__":
    main()
