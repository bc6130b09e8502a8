"""Over the network: ``pushtable serve`` against the same work done in one process.

- **write**: producers push ``k int64, v float64`` batches (8,192 and 65,536 rows; 1 and 4
  producer threads) into a live table that a ``count(*), sum(v)`` query drains. *local*:
  ``TableSink.write`` in the query's process; *remote*: ``RemoteSink.write`` to a server in
  another process (``pushtable serve`` on loopback), the query running there.
- **sql**: ``SELECT k, v`` results streamed back to a remote client while a remote producer
  writes 65,536-row batches: rows/s received.
- **raw**: the wire alone, side by side: the same batches by bare pyarrow DoPut into a Flight
  server that drops them, and a bare DoGet (pyarrow's `RecordBatchStream`) of as many distinct
  batches held in the bare server's memory
  (:mod:`pushtable.bench.raw_flight`); ``remote/raw`` is pushtable's share of the wire.
- **latency**: a remote producer writes one-row batches at 100/s; a remote ``SELECT k`` stamps
  each row as it arrives: write -> result time p50 / p99 / max.
- **asyncio**: the same live ``SELECT`` while one producer writes, through the asyncio face
  (:mod:`pushtable.flight.client.aio`, one event loop) against the sync client, alternating; and
  write -> result latency through it.
- **spark**: 1,000,000-row epochs on ``local[2]``: :class:`~pushtable.spark.RemoteBridge`
  with ``push="executors"`` vs ``push="driver"`` into a server table drained by a query, without
  and with Lance; and Spark's floors for each path (``toArrow``, a no-op ``mapInArrow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
from datafusion import SessionConfig

from pushtable import SessionContext
from pushtable.bench.raw_flight import SCHEMA
from pushtable.bench.raw_flight import batches as _batches
from pushtable.flight import Client, connect

BYTES_PER_ROW = 16


@contextlib.contextmanager
def server_process(module: str = "pushtable", *args: str) -> Iterator[str]:
    """``pushtable serve`` (or ``module``) in a child process on a free loopback port.

    Yields its URI.
    """
    if not args and module == "pushtable":
        args = ("serve", "--port", "0")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
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
        s._end_stream()  # its stream ends (the table stays open): the server's per-client cap
    sinks[0].close()
    query.join(600)
    elapsed = time.perf_counter() - started
    assert counted["n"] == [rows * batches * producers], counted
    return elapsed


def write_raw(uri: str, rows: int, batches: int, producers: int) -> float:
    """The wire alone: the same batches by bare pyarrow DoPut into a server that drops them."""
    data = _batches(rows, batches, 0)
    client = flight.FlightClient(uri)
    streams = [
        client.do_put(flight.FlightDescriptor.for_path("raw"), SCHEMA) for _ in range(producers)
    ]
    started = time.perf_counter()
    _produce(lambda i, b: streams[i][0].write_batch(b), data, producers)
    for writer, _ in streams:
        writer.done_writing()
        writer.close()
    elapsed = time.perf_counter() - started
    client.close()
    return elapsed


def get_raw(uri: str, rows: int, batches: int) -> float:
    """The wire alone: a bare DoGet of as many distinct batches.

    They are held in the bare server's memory before the clock starts (as the table holds
    them for remote SQL).
    """
    client = flight.FlightClient(uri)
    ask = json.dumps({"rows": rows, "batches": batches}).encode()
    list(client.do_action(flight.Action("hold", ask)))
    started = time.perf_counter()
    received = sum(chunk.data.num_rows for chunk in client.do_get(flight.Ticket(ask)))
    elapsed = time.perf_counter() - started
    client.close()
    assert received == rows * batches, received
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


def sql_filled(client: Client, name: str, rows: int, batches: int) -> float:
    """Seconds for a remote ``SELECT k, v`` to stream back a table filled before the query.

    The table is written (and closed) before the query starts: the way out alone, to compare
    with a bare DoGet.
    """
    data = _batches(rows, batches, 1)
    client.create_table(name, SCHEMA, capacity=batches)
    with client.sink(name) as sink:
        for b in data:
            sink.write(b)
    result = client.sql(f"SELECT k, v FROM {name}")
    started = time.perf_counter()
    received = sum(batch.num_rows for batch in result)
    elapsed = time.perf_counter() - started
    assert received == rows * batches, received
    return elapsed


def latency(client: Client, name: str, samples: int, rate: float) -> dict[str, float]:
    """Remote write -> remote result time: one-row batches at ``rate``/s from a remote producer.

    A remote ``SELECT k`` stamps each row as it arrives (k = the write's clock).
    """
    client.create_table(name, SCHEMA, capacity=16)
    result = client.sql(f"SELECT k FROM {name}")
    delays: list[float] = []

    def read() -> None:
        for batch in result:
            now = time.perf_counter_ns()
            delays.extend((now - k) / 1e6 for k in batch.column(0).to_pylist())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with client.sink(name, window=1) as sink:
        for _ in range(samples):
            stamp = time.perf_counter_ns()
            sink.write(pa.record_batch([pa.array([stamp]), pa.array([0.0])], schema=SCHEMA))
            time.sleep(1 / rate)
    reader.join(60)
    return _percentiles(delays, samples)


def sql_stream_async(uri: str, name: str, rows: int, batches: int) -> float:
    """:func:`sql_stream` through the asyncio face.

    One event loop writes (an ``AsyncSink``) and reads (``async for`` over ``client.sql``).
    """
    from pushtable.flight.client.aio import AsyncClient

    data = _batches(rows, batches, 1)

    async def main() -> float:
        async with AsyncClient.connect(uri) as client:
            await client.create_table(name, SCHEMA, capacity=16)
            received = 0

            async def read() -> None:
                nonlocal received
                async for batch in client.sql(f"SELECT k, v FROM {name}"):
                    received += batch.num_rows

            async def write() -> None:
                # ``send`` returns once the batch is queued, as the sync ``write`` returns once
                # it is sent: one task pipelining its batches (``write`` waits for each
                # acknowledgement, for a task that wants its own batch's outcome).
                sink = await client.sink(name)
                outcomes = [await sink.send(b) for b in data]
                await sink.close()
                await asyncio.gather(*outcomes)

            started = time.perf_counter()
            await asyncio.gather(read(), write())
            elapsed = time.perf_counter() - started
            assert received == rows * batches, received
            return elapsed

    return asyncio.run(main())


def latency_async(uri: str, name: str, samples: int, rate: float) -> dict[str, float]:
    """:func:`latency` through the asyncio face.

    One loop writes one-row batches at ``rate``/s (``await sink.write``) and stamps each row
    as ``async for`` hands it over.
    """
    from pushtable.flight.client.aio import AsyncClient

    async def main() -> list[float]:
        async with AsyncClient.connect(uri) as client:
            await client.create_table(name, SCHEMA, capacity=16)
            delays: list[float] = []

            async def read() -> None:
                async for batch in client.sql(f"SELECT k FROM {name}"):
                    now = time.perf_counter_ns()
                    delays.extend((now - k) / 1e6 for k in batch.column(0).to_pylist())

            async def write() -> None:
                sink = await client.sink(name, window=1)
                for _ in range(samples):
                    stamp = time.perf_counter_ns()
                    one = pa.record_batch([pa.array([stamp]), pa.array([0.0])], schema=SCHEMA)
                    await sink.write(one)
                    await asyncio.sleep(1 / rate)
                await sink.close()

            await asyncio.wait_for(asyncio.gather(read(), write()), 120)
            return delays

    delays = asyncio.run(main())
    return _percentiles(delays, samples)


def _percentiles(delays: list[float], samples: int) -> dict[str, float]:
    """p50 / p99 / max of ``delays`` (ms), all ``samples`` of them."""
    assert len(delays) == samples, len(delays)
    ordered = sorted(delays)
    return {
        "samples": samples,
        "p50_ms": ordered[len(ordered) // 2],
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": ordered[-1],
    }


def _drain_into(result: Any, out: dict[str, Any]) -> None:
    out.update(result.read_all().to_pydict())


def _count_rows(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield pa.record_batch({"n": [sum(b.num_rows for b in batches)]})


def spark_epochs(uri: str, epochs: int, rows: int) -> dict[str, Any]:
    """RemoteBridge, executors vs driver, live table only and with Lance: rows/s per epoch.

    Each epoch has ``rows`` rows (the median is kept). Beside them, Spark's own floors:
    ``toArrow`` and a no-op ``mapInArrow`` over the same cached epoch (what each path pays
    before doing anything).
    """
    from pushtable.spark import RemoteBridge, local_spark
    from pushtable.spark.remote import Push

    spark = local_spark("pushtable-bench-flight")
    client = connect(uri)
    out: dict[str, Any] = {}
    floors: dict[str, list[float]] = {"to_arrow_s": [], "map_in_arrow_noop_s": []}
    pushes: tuple[Push, ...] = ("driver", "executors")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for lance in (False, True):
                for push in pushes:
                    key = f"{push}+lance" if lance else push
                    name = "spark_" + key.replace("+", "_")
                    client.create_table(name, pa.schema([("id", pa.int64()), ("v", pa.float64())]))
                    result = client.sql(f"SELECT count(*) AS n FROM {name}")
                    counted: dict[str, Any] = {}
                    query = threading.Thread(
                        target=_drain_into, args=(result, counted), daemon=True
                    )
                    query.start()
                    bridge = RemoteBridge(
                        uri,
                        name,
                        query_id=f"bench-{key}",
                        push=push,
                        lance_uri=f"{tmp}/{name}.lance" if lance else None,
                    )
                    seconds = []
                    for e in range(epochs + 1):  # epoch 0 warms up (JIT, Python workers)
                        df = spark.range(e * rows, (e + 1) * rows, numPartitions=2)
                        df = df.selectExpr("id", "rand() AS v").cache()
                        df.count()  # the epoch's data is ready, as a micro-batch's would be
                        if e and not lance and push == "driver":
                            started = time.perf_counter()
                            df.toArrow()
                            floors["to_arrow_s"].append(time.perf_counter() - started)
                            started = time.perf_counter()
                            df.mapInArrow(_count_rows, "n long").collect()
                            floors["map_in_arrow_noop_s"].append(time.perf_counter() - started)
                        started = time.perf_counter()
                        bridge(df, e)
                        if e:
                            seconds.append(time.perf_counter() - started)
                        df.unpersist()
                    bridge.close()
                    query.join(600)
                    assert counted["n"] == [rows * (epochs + 1)], counted
                    median = statistics.median(seconds)
                    out[key] = {"epoch_s_median": median, "rows_per_s": rows / median}
        out["executors_vs_driver"] = out["executors"]["rows_per_s"] / out["driver"]["rows_per_s"]
        out["executors_vs_driver_with_lance"] = (
            out["executors+lance"]["rows_per_s"] / out["driver+lance"]["rows_per_s"]
        )
        out["floors"] = {k: statistics.median(v) for k, v in floors.items()}
        out["rows"] = rows
        return out
    finally:
        client.close()
        spark.stop()


def _serve_config(folder: str) -> str:
    """The bench server's config file, written in ``folder``.

    SQL out of a filled table holds all 2,048 of the 8,192-row batches, above the default
    capacity cap.
    """
    config = Path(folder) / "serve.json"
    config.write_text(json.dumps({"limits": {"max_capacity": 4096}}))
    return str(config)


def run(quick: bool) -> dict[str, Any]:
    """The ``flight`` suite; each figure the median of the repeats."""
    repeats = 1 if quick else 3
    total_rows = 2_000_000 if quick else 16_777_216
    out: dict[str, Any] = {"write": [], "sql": [], "latency": {}, "spark": {}}
    with (
        tempfile.TemporaryDirectory(prefix="pushtable-bench-") as tmp,
        server_process("pushtable", "serve", "--port", "0", "--config", _serve_config(tmp)) as uri,
        server_process("pushtable.bench.raw_flight") as raw_uri,
        connect(uri) as client,
    ):
        n = 0
        for rows in (8_192, 65_536):
            for producers in (1, 4):
                batches = max(1, total_rows // rows // producers)
                local = [write_local(rows, batches, producers) for _ in range(repeats)]
                # Remote and raw runs alternate, so both see the machine in the same state.
                remote, raw = [], []
                for _ in range(repeats):
                    n += 1
                    remote.append(write_remote(client, f"w{n}", rows, batches, producers))
                    raw.append(write_raw(raw_uri, rows, batches, producers))
                moved = rows * batches * producers
                lo, re = statistics.median(local), statistics.median(remote)
                wire = statistics.median(raw)
                out["write"].append(
                    {
                        "batch_rows": rows,
                        "producers": producers,
                        "local_rows_per_s": moved / lo,
                        "remote_rows_per_s": moved / re,
                        "remote_gb_per_s": moved * BYTES_PER_ROW / re / 1e9,
                        "remote_vs_local": lo / re,
                        "raw_rows_per_s": moved / wire,
                        "remote_vs_raw": wire / re,
                    }
                )
        for rows in (8_192, 65_536):
            batches = max(1, total_rows // rows)
            # The three alternate, so that each sees the machine in the same state.
            live, filled, bare = [], [], []
            for _ in range(repeats):
                n += 1
                live.append(sql_stream(client, f"s{n}", rows, batches))
                filled.append(sql_filled(client, f"f{n}", rows, batches))
                bare.append(get_raw(raw_uri, rows, batches))
            moved = rows * batches
            secs, full, raw_secs = (statistics.median(x) for x in (live, filled, bare))
            out["sql"].append(
                {
                    "batch_rows": rows,
                    "rows_per_s": moved / secs,
                    "gb_per_s": moved * BYTES_PER_ROW / secs / 1e9,
                    "raw_rows_per_s": moved / raw_secs,
                    "remote_vs_raw": raw_secs / secs,
                    "filled_rows_per_s": moved / full,
                    "filled_vs_raw": raw_secs / full,
                }
            )
        # The asyncio face against the sync one: a live SELECT while one producer writes,
        # alternating, then write -> result latency at 100 batches/s.
        sync_s, async_s = [], []
        for _ in range(2 if quick else 7):  # half a second each: more rounds, a steadier median
            n += 1
            sync_s.append(sql_stream(client, f"ys{n}", 8_192, total_rows // 8_192))
            async_s.append(sql_stream_async(uri, f"ya{n}", 8_192, total_rows // 8_192))
        moved = 8_192 * (total_rows // 8_192)
        out["asyncio"] = {
            "batch_rows": 8_192,
            "sync_rows_per_s": moved / statistics.median(sync_s),
            "async_rows_per_s": moved / statistics.median(async_s),
            "async_vs_sync": statistics.median(sync_s) / statistics.median(async_s),
            "sync_runs_s": sync_s,
            "async_runs_s": async_s,
        }
        out["latency"] = latency(client, "lat", 50 if quick else 300, 100.0)
        out["asyncio"]["latency"] = latency_async(uri, "alat", 50 if quick else 300, 100.0)
        out["spark"] = spark_epochs(uri, 1 if quick else 3, 200_000 if quick else 1_000_000)
    return out


def table(results: dict[str, Any]) -> str:
    """The Flight suite's results as text."""
    lines = [
        "batch rows  producers  local M rows/s  remote M rows/s  remote GB/s  remote/local"
        "  raw DoPut M rows/s  remote/raw"
    ]
    for r in results["write"]:
        lines.append(
            f"{r['batch_rows']:>10}  {r['producers']:>9}  {r['local_rows_per_s'] / 1e6:14.1f}  "
            f"{r['remote_rows_per_s'] / 1e6:15.1f}  {r['remote_gb_per_s']:11.2f}  "
            f"{r['remote_vs_local']:12.2f}  {r['raw_rows_per_s'] / 1e6:18.1f}  "
            f"{r['remote_vs_raw']:10.2f}"
        )
    for s in results["sql"]:
        lines.append(
            f"remote SQL (SELECT k, v), {s['batch_rows']:,}-row batches: from a table written "
            f"before the query {s['filled_rows_per_s'] / 1e6:.1f} M rows/s (remote/raw DoGet "
            f"{s['filled_vs_raw']:.2f}); while a remote producer writes them "
            f"{s['rows_per_s'] / 1e6:.1f} M rows/s ({s['remote_vs_raw']:.2f}: the rows cross "
            f"the wire twice); bare DoGet {s['raw_rows_per_s'] / 1e6:.1f} M rows/s"
        )
    lat = results["latency"]
    lines.append(
        f"remote write -> remote result, 1-row batches at 100/s: p50 {lat['p50_ms']:.2f} ms, "
        f"p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms ({lat['samples']} samples)"
    )
    if "asyncio" in results:
        a = results["asyncio"]
        al = a["latency"]
        lines.append(
            f"asyncio face (pushtable.flight.client.aio), live SELECT while writing "
            f"{a['batch_rows']:,}-row batches: {a['async_rows_per_s'] / 1e6:.1f} M rows/s "
            f"against sync {a['sync_rows_per_s'] / 1e6:.1f} ({a['async_vs_sync']:.2f}x); "
            f"write -> result at 100/s: p50 {al['p50_ms']:.2f} ms, p99 {al['p99_ms']:.2f} ms, "
            f"max {al['max_ms']:.2f} ms"
        )
    sp = results["spark"]
    for suffix, label in (("", "live table"), ("+lance", "live table + Lance")):
        d, x = sp["driver" + suffix], sp["executors" + suffix]
        lines.append(
            f"Spark {sp['rows']:,}-row epochs, {label}: driver {d['rows_per_s'] / 1e6:.2f} M "
            f"rows/s, executors {x['rows_per_s'] / 1e6:.2f} M rows/s "
            f"({x['rows_per_s'] / d['rows_per_s']:.2f}x)"
        )
    f = sp["floors"]
    lines.append(
        f"Spark floors per epoch: toArrow {f['to_arrow_s']:.3f} s, no-op mapInArrow "
        f"{f['map_in_arrow_noop_s']:.3f} s"
    )
    return "\n".join(lines)
