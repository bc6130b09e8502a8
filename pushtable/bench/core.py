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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pushtable import ReaderGoneError, SessionContext, TableSink

BATCH_ROWS = (1024, 8192, 65536)
PRODUCERS = (1, 4)
CAPACITIES = (64,)
#: Distinct batches per configuration, cycled to the run's rows (as a live source repeats
#: shapes, and so memory stays bounded however many rows a run pushes).
DISTINCT = 16


@dataclass(frozen=True)
class Workload:
    """A schema users have, its batch maker, and the numeric column the queries read."""

    name: str
    schema: pa.Schema
    make: Callable[[int, int, np.random.Generator], list[pa.Array]]
    value: str
    threshold: float

    @property
    def queries(self) -> dict[str, str]:
        """The two queries over the workload's value column, ``agg`` and ``filter``, by name."""
        v = self.value
        return {
            "agg": f"SELECT count(*) AS n, sum({v}) AS s FROM t",
            "filter": f"SELECT count(*) AS n, sum({v}) AS s FROM t WHERE {v} > {self.threshold}",
        }

    def batches(self, batch_rows: int) -> list[pa.RecordBatch]:
        """``DISTINCT`` distinct batches of ``batch_rows`` rows, from a fixed seed."""
        rng = np.random.default_rng(42)
        return [
            pa.record_batch(self.make(i * batch_rows, batch_rows, rng), schema=self.schema)
            for i in range(DISTINCT)
        ]


def _numbers(start: int, n: int, rng: np.random.Generator) -> list[pa.Array]:
    return [pa.array(np.arange(start, start + n, dtype=np.int64)), pa.array(rng.random(n))]


def _strings(start: int, n: int, rng: np.random.Generator) -> list[pa.Array]:
    users = np.char.add("user-", rng.integers(0, 100_000, n).astype(str))
    return [*_numbers(start, n, rng), pa.array(users)]


LEVELS = np.array(["debug", "info", "warn", "error", "fatal"])
SERVICES = pa.array([f"svc-{name}" for name in ("api", "auth", "billing", "search", "cart")])
WORDS = np.array(["request", "served", "from", "cache", "miss", "upstream", "slow", "retry"])


def _events(start: int, n: int, rng: np.random.Generator) -> list[pa.Array]:
    ts = (np.int64(1_767_225_600_000_000) + np.arange(start, start + n) * 1000).astype(
        "datetime64[us]"
    )
    words = WORDS[rng.integers(0, len(WORDS), (n, 6))]
    ids = rng.integers(10**11, 10**12, n).astype(str)
    message = np.char.add(np.char.add(ids, " "), [" ".join(w) for w in words])
    service = pa.DictionaryArray.from_arrays(
        pa.array(rng.integers(0, len(SERVICES), n), pa.int32()), SERVICES
    )
    return [
        pa.array(ts, pa.timestamp("us", tz="UTC")),
        service,
        pa.array(LEVELS[rng.integers(0, len(LEVELS), n)]),
        pa.array(rng.gamma(2.0, 15.0, n)),
        pa.array(message),
    ]


def _wide(start: int, n: int, rng: np.random.Generator) -> list[pa.Array]:
    cols: list[pa.Array] = [pa.array(rng.random(n)) for _ in range(6)]
    cols += [pa.array(rng.integers(0, 1 << 40, n)) for _ in range(6)]
    cols += [pa.array(np.char.add("tag-", rng.integers(0, 5000, n).astype(str))) for _ in range(4)]
    cols += [pa.array(rng.random(n) > 0.5) for _ in range(2)]
    ts = (np.int64(1_767_225_600_000_000) + np.arange(start, start + n)).astype("datetime64[us]")
    cols.append(pa.array(ts, pa.timestamp("us", tz="UTC")))
    cols.append(
        pa.DictionaryArray.from_arrays(
            pa.array(rng.integers(0, len(SERVICES), n), pa.int32()), SERVICES
        )
    )
    return cols


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "numbers", pa.schema([("k", pa.int64()), ("v", pa.float64())]), _numbers, "v", 0.5
        ),
        Workload(
            "strings",
            pa.schema([("k", pa.int64()), ("v", pa.float64()), ("s", pa.string())]),
            _strings,
            "v",
            0.5,
        ),
        Workload(
            "events",
            pa.schema(
                [
                    ("ts", pa.timestamp("us", tz="UTC")),
                    ("service", pa.dictionary(pa.int32(), pa.string())),
                    ("level", pa.string()),
                    ("latency_ms", pa.float64()),
                    ("message", pa.string()),
                ]
            ),
            _events,
            "latency_ms",
            25.0,
        ),
        Workload(
            "wide",
            pa.schema(
                [(f"f{i}", pa.float64()) for i in range(6)]
                + [(f"i{i}", pa.int64()) for i in range(6)]
                + [(f"s{i}", pa.string()) for i in range(4)]
                + [(f"b{i}", pa.bool_()) for i in range(2)]
                + [("ts", pa.timestamp("us", tz="UTC"))]
                + [("service", pa.dictionary(pa.int32(), pa.string()))]
            ),
            _wide,
            "f0",
            0.5,
        ),
    )
}
#: The two-column workload: what ``reader_gone_latency`` and older figures use.
SCHEMA = WORKLOADS["numbers"].schema


@dataclass(frozen=True)
class Result:
    """One engine's rows per second on one configuration: median, min and max of its runs."""

    engine: str
    workload: str
    query: str
    batch_rows: int
    producers: int
    capacity: int
    rows: int
    median_rows_per_s: float
    min_rows_per_s: float
    max_rows_per_s: float


def make_batches(total_rows: int, batch_rows: int) -> list[pa.RecordBatch]:
    """``total_rows`` of the ``numbers`` workload (distinct batches, for one-off uses)."""
    rng = np.random.default_rng(42)
    return [
        pa.record_batch(_numbers(s, min(batch_rows, total_rows - s), rng), schema=SCHEMA)
        for s in range(0, total_rows, batch_rows)
    ]


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
    work: Workload, batches: list[pa.RecordBatch], producers: int, capacity: int, query: str
) -> tuple[float, int]:
    """The query over a pushtable streaming table fed by ``producers`` threads: (seconds, rows)."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", work.schema, capacity=capacity)
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
    n = int(ctx.sql(work.queries[query]).to_pydict()["n"][0])
    return time.perf_counter() - start, n


def run_duckdb(
    work: Workload, batches: list[pa.RecordBatch], producers: int, capacity: int, query: str
) -> tuple[float, int]:
    """The query in DuckDB over a reader of the producers' bounded queue: (seconds, rows)."""
    con = duckdb.connect()
    threads, drained = _queue_source(batches, producers, capacity)
    t = pa.RecordBatchReader.from_batches(work.schema, drained)  # noqa: F841 - found by name
    start = time.perf_counter()
    for th in threads:
        th.start()
    row = con.execute(work.queries[query]).fetchone()
    assert row is not None
    return time.perf_counter() - start, int(row[0])


def run_python(
    work: Workload, batches: list[pa.RecordBatch], producers: int, capacity: int, query: str
) -> tuple[float, int]:
    """The query in Python (pyarrow compute) over the producers' queue: (seconds, rows)."""
    threads, drained = _queue_source(batches, producers, capacity)
    start = time.perf_counter()
    for t in threads:
        t.start()
    n, total = 0, 0.0
    for b in drained:
        v = b.column(work.value)
        if query == "filter":
            v = pc.filter(v, pc.greater(v, work.threshold))
        n += len(v)
        total += pc.sum(v).as_py() or 0.0
    return time.perf_counter() - start, n


# Each returns (seconds from the producers' start to the answer, row count); setup such as
# creating a context or connection is excluded for every engine alike.
Engine = Callable[[Workload, list[pa.RecordBatch], int, int, str], tuple[float, int]]
ENGINES: dict[str, Engine] = {
    "pushtable": run_pushtable,
    "duckdb": run_duckdb,
    "python": run_python,
}


def measure(
    total_rows: int,
    reps: int,
    workloads: Sequence[str] = tuple(WORKLOADS),
    batch_sizes: tuple[int, ...] = BATCH_ROWS,
    producer_counts: tuple[int, ...] = PRODUCERS,
    capacities: tuple[int, ...] = CAPACITIES,
) -> list[Result]:
    """Every engine on every configuration; each figure the median of ``reps`` runs.

    The engines' runs alternate (one of each per round) so that drift hits them alike.
    """
    results: list[Result] = []
    for name in workloads:
        work = WORKLOADS[name]
        for batch_rows in batch_sizes:
            distinct = work.batches(batch_rows)
            count = max(1, total_rows // batch_rows)
            batches = [distinct[i % DISTINCT] for i in range(count)]
            rows = count * batch_rows
            expected = {
                "agg": rows,
                "filter": sum(
                    int(pc.sum(pc.greater(b[work.value], work.threshold)).as_py()) for b in batches
                ),
            }
            for producers in producer_counts:
                for capacity in capacities:
                    for query in work.queries:
                        rates: dict[str, list[float]] = {e: [] for e in ENGINES}
                        for _ in range(reps):
                            for engine, run_one in ENGINES.items():
                                elapsed, n = run_one(work, batches, producers, capacity, query)
                                assert n == expected[query], f"{engine} {name} {query}: {n}"
                                rates[engine].append(rows / elapsed)
                        results.extend(
                            Result(
                                engine,
                                name,
                                query,
                                batch_rows,
                                producers,
                                capacity,
                                rows,
                                statistics.median(r),
                                min(r),
                                max(r),
                            )
                            for engine, r in rates.items()
                        )
    return results


def _key(r: Result | dict[str, Any]) -> tuple[Any, ...]:
    d = asdict(r) if isinstance(r, Result) else r
    return (d["workload"], d["query"], d["batch_rows"], d["producers"], d["capacity"])


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """The ratio pushtable / other engine, per configuration, from the same run."""
    by_key = {(r.engine,) + _key(r): r for r in results}
    out = []
    for r in results:
        if r.engine != "pushtable":
            continue
        key = _key(r)
        row: dict[str, Any] = dict(
            zip(("workload", "query", "batch_rows", "producers", "capacity"), key, strict=True)
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
    results = measure(rows, 3 if quick else reps)
    return {
        "rows_per_run": rows,
        "reps": 3 if quick else reps,
        "duckdb_version": duckdb.__version__,
        "pyarrow_version": pa.__version__,
        "schemas": {name: str(w.schema) for name, w in WORKLOADS.items()},
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
        "reader_gone": reader_gone_latency(5 if quick else 20),
    }


def table(suite: dict[str, Any]) -> str:
    """The ratio table as text."""
    by_key = {(r["engine"],) + _key(r): r for r in suite["results"]}
    lines = [
        f"DuckDB {suite.get('duckdb_version', '?')}; M rows/s, median of {suite['reps']} "
        "alternating runs",
        f"{'workload':<9}{'query':<7}{'batch':>7}{'prod':>5}  {'pushtable':>10}{'duckdb':>9}"
        f"{'python':>9}  {'vs duckdb':>9}{'vs python':>10}",
    ]
    for r in suite["ratios"]:
        key = _key(r)
        rates = [by_key[(e,) + key]["median_rows_per_s"] / 1e6 for e in ENGINES]
        lines.append(
            f"{r['workload']:<9}{r['query']:<7}{r['batch_rows']:>7}{r['producers']:>5}  "
            f"{rates[0]:>10.0f}{rates[1]:>9.0f}{rates[2]:>9.0f}  "
            f"{r['vs_duckdb']:>8.2f}x{r['vs_python']:>9.2f}x"
        )
    return "\n".join(lines)
