"""``format("pushtable")`` in a running streaming query, beside what a user could write instead.

All run on the same local[2] Spark and the same stream.

- **sink**: one file per micro-batch (``rows`` rows each, parquet, ``maxFilesPerTrigger=1``)
  into (a) ``writeStream.format("pushtable")`` with Lance, (b) ``foreachBatch`` with
  :class:`~pushtable.spark.RemoteBridge` (``push="executors"``) with Lance, (c) ``foreachBatch``
  calling ``toArrow()`` and dropping the result (the floor: what any Arrow consumer of a
  micro-batch pays). Each micro-batch's ``addBatch`` time (Spark's own progress figure: the
  sink's whole work) gives rows/s, median over the batches after the first. (a) and (b) feed
  a live table on a loopback ``pushtable serve`` server that a query drains.
- **source**: a durable topic of ``rows * batches`` rows in 64 Ki-row batches read by
  ``readStream.format("pushtable")`` into ``format("noop")`` (all of it in one run,
  ``Trigger.AvailableNow``), beside the same rows as parquet files read into ``noop``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession

from pushtable.flight import Server, connect
from pushtable.spark import RemoteBridge, local_spark, register

SCHEMA = pa.schema([("id", pa.int64()), ("level", pa.string()), ("value", pa.float64())])
DDL = "id long, level string, value double"
SOURCE_BATCH = 65_536


def _epoch(first: int, rows: int) -> pa.Table:
    ids = pa.array(range(first, first + rows), pa.int64())
    levels = pa.array([str(i % 7) for i in range(first, first + rows)], pa.string())
    return pa.table([ids, levels, pa.compute.divide(ids.cast(pa.float64()), 3.0)], schema=SCHEMA)


def _stream(spark: SparkSession, src: Path) -> DataFrame:
    return spark.readStream.schema(DDL).option("maxFilesPerTrigger", 1).parquet(str(src))


def _batch_seconds(query: Any) -> list[float]:
    """Each micro-batch's ``addBatch`` seconds, the first (warm-up) left out."""
    progress = sorted(query.recentProgress, key=lambda p: int(p["batchId"]))
    times = [p["durationMs"]["addBatch"] / 1e3 for p in progress if p["numInputRows"]]
    return times[1:]


def _run(query: Any) -> list[float]:
    if not query.awaitTermination(1800):
        query.stop()
        raise TimeoutError("the benchmark's streaming query did not finish in 30 minutes")
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return _batch_seconds(query)


def measure(rows: int, batches: int) -> dict[str, Any]:
    """Every figure of the run: the sinks, then the sources.

    The sinks run on ``batches`` micro-batches of ``rows`` rows, after a warm-up one.
    """
    spark = local_spark("pushtable-bench-format")
    register(spark)
    work = Path(tempfile.mkdtemp(prefix="pushtable-bench-format-"))
    server = Server(data_dir=work / "data")
    client = connect(server.location)
    out: dict[str, Any] = {"rows_per_batch": rows, "batches": batches}
    try:
        src = work / "src"
        src.mkdir()
        for b in range(batches + 1):  # the first is a warm-up
            pq.write_table(_epoch(b * rows, rows), src / f"part-{b:04d}.parquet")

        def drained(table: str) -> Callable[[], int]:
            client.create_table(table, SCHEMA)
            result = client.sql(f"SELECT count(*) AS n FROM {table}")
            counted: list[int] = []
            thread = threading.Thread(
                target=lambda: counted.append(result.read_all()["n"][0].as_py()), daemon=True
            )
            thread.start()

            def finish() -> int:
                client.sink(table).close()
                thread.join(600)
                return counted[0]

            return finish

        sinks: dict[str, Callable[[Any], Any]] = {
            "format_sink": lambda w: (
                w.format("pushtable")
                .option("uri", server.location)
                .option("table", "format_sink")
                .option("lance_uri", str(work / "format.lance"))
            ),
            "remote_bridge_executors": lambda w: w.foreachBatch(
                RemoteBridge(
                    server.location,
                    "remote_bridge_executors",
                    lance_uri=work / "bridge.lance",
                    query_id="bench-bridge",
                )
            ),
            "to_arrow": lambda w: w.foreachBatch(lambda df, _: df.toArrow()),
        }
        for name, sink in sinks.items():
            finish = drained(name) if name != "to_arrow" else None
            query = sink(_stream(spark, src).writeStream)
            seconds = _run(
                query.option("checkpointLocation", str(work / f"chk-{name}"))
                .trigger(availableNow=True)
                .start()
            )
            median = statistics.median(seconds)
            out[name] = {"batch_s_median": median, "rows_per_s": rows / median}
            if finish is not None:
                landed = finish()
                assert landed == rows * (batches + 1), (name, landed)
        floor = out["to_arrow"]["batch_s_median"]
        for name in ("format_sink", "remote_bridge_executors"):
            out[name]["over_to_arrow_pct"] = 100 * (out[name]["batch_s_median"] - floor) / floor
        out["format_vs_bridge"] = (
            out["format_sink"]["rows_per_s"] / out["remote_bridge_executors"]["rows_per_s"]
        )
        out["source"] = _source(spark, work, rows * batches)
    finally:
        client.close()
        server.stop()
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def _source(spark: SparkSession, work: Path, total: int) -> dict[str, Any]:
    """The source against parquet files of the same rows, the server in a process of its own.

    ``pushtable serve`` runs as deployed; the source reads through it, and with the ``dataset``
    option (the executors read the topic's Lance dataset directly). Each reader runs twice,
    alternating; the faster run counts.
    """
    from pushtable.bench.flight import server_process

    data = work / "source-data"
    with server_process("pushtable", "serve", "--port", "0", "--data-dir", str(data)) as uri:
        client = connect(uri)
        client.create_topic("ticks", SCHEMA, durable=True)
        sink = client.sink("ticks", producer_id="bench")
        files = work / "ticks-parquet"
        files.mkdir()
        for n, first in enumerate(range(0, total, SOURCE_BATCH)):
            table = _epoch(first, min(SOURCE_BATCH, total - first))
            sink.write(table)
            pq.write_table(table, files / f"part-{n:05d}.parquet")
        sink.flush()
        out: dict[str, Any] = {"rows": total, "offsets": client.offsets("ticks")["committed"]}

        def pushtable_source(**options: str) -> DataFrame:
            reader = (
                spark.readStream.format("pushtable").option("uri", uri).option("topic", "ticks")
            )
            for key, value in options.items():
                reader = reader.option(key, value)
            return reader.load()

        readers: dict[str, Callable[[], DataFrame]] = {
            "parquet_files": lambda: spark.readStream.schema(DDL).parquet(str(files)),
            "format_source": pushtable_source,
            "format_source_dataset": lambda: pushtable_source(dataset=str(data / "ticks.lance")),
        }
        for run in range(2):
            for name, reader in readers.items():
                started = time.perf_counter()
                query = (
                    reader()
                    .writeStream.format("noop")
                    .option("checkpointLocation", str(work / f"chk-src-{name}-{run}"))
                    .trigger(availableNow=True)
                    .start()
                )
                _run(query)
                seconds = time.perf_counter() - started
                read = sum(int(p["numInputRows"]) for p in query.recentProgress)
                assert read == total, (name, read)
                best = out.get(name, {}).get("seconds", float("inf"))
                out[name] = {
                    "seconds": min(best, seconds),
                    "rows_per_s": total / min(best, seconds),
                }
        client.close()
    parquet = out["parquet_files"]["rows_per_s"]
    for name in ("format_source", "format_source_dataset"):
        out[name]["vs_parquet"] = out[name]["rows_per_s"] / parquet
    return out


def report(r: dict[str, Any]) -> str:
    """The run's figures as text."""
    lines = [
        f"streaming sink, micro-batches of {r['rows_per_batch']:,} rows, median of "
        f"{r['batches']} (addBatch)",
    ]
    for name in ("to_arrow", "remote_bridge_executors", "format_sink"):
        x = r[name]
        extra = (
            f"  (+{x['over_to_arrow_pct']:.0f}% over toArrow)" if "over_to_arrow_pct" in x else ""
        )
        ms, mrows = x["batch_s_median"] * 1e3, x["rows_per_s"] / 1e6
        lines.append(f"  {name:<26}{ms:8.1f} ms  {mrows:6.2f} M rows/s{extra}")
    s = r["source"]
    lines.append(f"streaming source, {s['rows']:,} rows ({s['offsets']} offsets) into noop")
    lines.append(f"  {'parquet_files':<26}{s['parquet_files']['rows_per_s'] / 1e6:6.2f} M rows/s")
    for name in ("format_source", "format_source_dataset"):
        lines.append(
            f"  {name:<26}{s[name]['rows_per_s'] / 1e6:6.2f} M rows/s  "
            f"({s[name]['vs_parquet']:.2f}x parquet)"
        )
    return "\n".join(lines)


def run(quick: bool) -> dict[str, Any]:
    """Quick: 100,000-row micro-batches, 3 of them; full: 1,000,000 rows, 8."""
    return measure(100_000, 3) if quick else measure(1_000_000, 8)
