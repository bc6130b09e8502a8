"""Over the network: ``pushtable serve`` against the same work done in one process.

- **write**: producers push ``k int64, v float64`` batches (8,192 and 65,536 rows; 1 and 4
  producer threads) into a live table that a ``count(*), sum(v)`` query drains. *local*:
  ``TableSink.write`` in the query's process; *remote*: ``RemoteSink.write`` to a server in
  another process (``pushtable serve`` on loopback), the query running there.
- **sql**: ``SELECT k, v`` results streamed back to a remote client while a local producer on
  the server... (here: a remote producer) writes, rows/s received.
- **spark**: 1,000,000-row epochs on ``local[2]``: :class:`~pushtable.spark.RemoteBridge`
  with ``push="executors"`` vs ``push="driver"`` into a server table drained by a query.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from datafusion import SessionConfig

from pushtable import SessionContext
from pushtable.flight import Client, connect

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])
BYTES_PER_ROW = 16


@contextlib.contextmanager
def server_process() -> Iterator[str]:
    """``pushtable serve`` in a child process on a free loopback port; yields its URI."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pushtable", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        uri = line.split("listening on ", 1)[1].split()[0]
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _batches(rows: int, count: int, seed: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    k = pa.array(np.arange(rows, dtype=np.int64))
    return [pa.record_batch([k, pa.array(rng.random(rows))], schema=SCHEMA) for _ in range(count)]


def _produce(write: Any, batches: list[pa.RecordBatch], producers: int) -> None:
    def one(i: int) -> None:
        for b in batches:
            write(i, b)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)


def write_local(rows: int, batches: int, producers: int) -> float:
    """Seconds to push and aggregate ``producers * batches`` batches in one process."""
    data = _batches(rows, batches, 0)
    ctx = SessionContext(SessionConfig().with_target_partitions(os.cpu_count() or 1))
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=16)
    result: dict[str, Any] = {}
    query = threading.Thread(
        target=lambda: result.update(ctx.sql("SELECT count(*) AS n FROM t").to_pydict()),
        daemon=True,
    )
    started = time.perf_counter()
    query.start()
    _produce(lambda _i, b: sink.write(b), data, producers)
    sink.close()
    query.join(600)
    elapsed = time.perf_counter() - started
    assert result["n"] == [rows * batches * producers], result
    return elapsed


def write_remote(client: Client, name: str, rows: int, batches: int, producers: int) -> float:
    """The same through a server: remote producers, the query on the server."""
    data = _batches(rows, batches, 0)
    client.create_table(name, SCHEMA, capacity=16)
    result = client.sql(f"SELECT count(*) AS n FROM {name}")
    counted: dict[str, Any] = {}
    query = threading.Thread(
        target=lambda: counted.update(result.read_all().to_pydict()), daemon=True
    )
    sinks = [client.sink(name) for _ in range(producers)]
    started = time.perf_counter()
    query.start()
    _produce(lambda i, b: sinks[i].write(b), data, producers)
    for s in sinks[1:]:
        s.flush()
    sinks[0].close()
    query.join(600)
    elapsed = time.perf_counter() - started
    assert counted["n"] == [rows * batches * producers], counted
    return elapsed


def sql_stream(client: Client, name: str, rows: int, batches: int) -> float:
    """Seconds for a remote ``SELECT k, v`` to stream every row back while it is written."""
    data = _batches(rows, batches, 1)
    client.create_table(name, SCHEMA, capacity=16)
    result = client.sql(f"SELECT k, v FROM {name}")
    received = 0

    def read() -> None:
        nonlocal received
        for batch in result:
            received += batch.num_rows

    reader = threading.Thread(target=read, daemon=True)
    started = time.perf_counter()
    reader.start()
    with client.sink(name) as sink:
        for b in data:
            sink.write(b)
    reader.join(600)
    elapsed = time.perf_counter() - started
    assert received == rows * batches, received
    return elapsed


def _drain_into(result: Any, out: dict[str, Any]) -> None:
    out.update(result.read_all().to_pydict())


def spark_epochs(uri: str, epochs: int, rows: int) -> dict[str, Any]:
    """RemoteBridge, executors vs driver: rows/s per epoch of ``rows`` rows (median)."""
    from pushtable.spark import RemoteBridge, local_spark
    from pushtable.spark.remote import Push

    spark = local_spark("pushtable-bench-flight")
    client = connect(uri)
    out: dict[str, Any] = {}
    try:
        pushes: tuple[Push, ...] = ("driver", "executors")
        for push in pushes:
            name = f"spark_{push}"
            client.create_table(name, pa.schema([("id", pa.int64()), ("v", pa.float64())]))
            result = client.sql(f"SELECT count(*) AS n FROM {name}")
            counted: dict[str, Any] = {}
            query = threading.Thread(target=_drain_into, args=(result, counted), daemon=True)
            query.start()
            bridge = RemoteBridge(uri, name, query_id=f"bench-{push}", push=push)
            seconds = []
            for e in range(epochs + 1):  # epoch 0 warms up (JIT, Python workers)
                df = spark.range(e * rows, (e + 1) * rows, numPartitions=2).selectExpr(
                    "id", "rand() AS v"
                )
                df = df.cache()
                df.count()  # the epoch's data is ready, as a micro-batch's would be
                started = time.perf_counter()
                bridge(df, e)
                if e:
                    seconds.append(time.perf_counter() - started)
                df.unpersist()
            bridge.close()
            query.join(600)
            assert counted["n"] == [rows * (epochs + 1)], counted
            median = statistics.median(seconds)
            out[push] = {"epoch_s_median": median, "rows_per_s": rows / median}
        out["executors_vs_driver"] = out["executors"]["rows_per_s"] / out["driver"]["rows_per_s"]
        return out
    finally:
        client.close()
        spark.stop()


def run(quick: bool) -> dict[str, Any]:
    """The ``flight`` suite; each figure the median of the repeats."""
    repeats = 1 if quick else 3
    total_rows = 2_000_000 if quick else 16_777_216
    out: dict[str, Any] = {"write": [], "sql": {}, "spark": {}}
    with server_process() as uri, connect(uri) as client:
        n = 0
        for rows in (8_192, 65_536):
            for producers in (1, 4):
                batches = max(1, total_rows // rows // producers)
                local = [write_local(rows, batches, producers) for _ in range(repeats)]
                remote = []
                for _ in range(repeats):
                    n += 1
                    remote.append(write_remote(client, f"w{n}", rows, batches, producers))
                moved = rows * batches * producers
                lo, re = statistics.median(local), statistics.median(remote)
                out["write"].append(
                    {
                        "batch_rows": rows,
                        "producers": producers,
                        "local_rows_per_s": moved / lo,
                        "remote_rows_per_s": moved / re,
                        "remote_gb_per_s": moved * BYTES_PER_ROW / re / 1e9,
                        "remote_vs_local": lo / re,
                    }
                )
        batches = max(1, total_rows // 65_536)
        secs = statistics.median(
            sql_stream(client, f"s{i}", 65_536, batches) for i in range(repeats)
        )
        moved = 65_536 * batches
        out["sql"] = {
            "batch_rows": 65_536,
            "rows_per_s": moved / secs,
            "gb_per_s": moved * BYTES_PER_ROW / secs / 1e9,
        }
        out["spark"] = spark_epochs(uri, 1 if quick else 3, 200_000 if quick else 1_000_000)
    return out


def table(results: dict[str, Any]) -> str:
    lines = ["batch rows  producers  local M rows/s  remote M rows/s  remote GB/s  remote/local"]
    for r in results["write"]:
        lines.append(
            f"{r['batch_rows']:>10}  {r['producers']:>9}  {r['local_rows_per_s'] / 1e6:14.1f}  "
            f"{r['remote_rows_per_s'] / 1e6:15.1f}  {r['remote_gb_per_s']:11.2f}  "
            f"{r['remote_vs_local']:12.2f}"
        )
    s = results["sql"]
    lines.append(
        f"remote SQL streaming (SELECT k, v): {s['rows_per_s'] / 1e6:.1f} M rows/s "
        f"({s['gb_per_s']:.2f} GB/s)"
    )
    sp = results["spark"]
    lines.append(
        f"Spark epochs: driver {sp['driver']['rows_per_s'] / 1e6:.2f} M rows/s, executors "
        f"{sp['executors']['rows_per_s'] / 1e6:.2f} M rows/s ({sp['executors_vs_driver']:.2f}x)"
    )
    return "\n".join(lines)
