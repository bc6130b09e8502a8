"""pushtable on an object store and a Spark cluster, each side by side with what a user would
hand-roll: ``python -m benchmarks.beyond_one_machine [--quick] [--json out.json]``.

The store is moto's S3 server in a process of its own on loopback (the tests' store: a real
store's requests take longer, so these figures show what each path adds to the store's own
cost, not a cloud's). Rows: ``id`` int64, ``level`` string, ``ts`` timestamp (UTC) and
``amount`` decimal(18,4). Every pair alternates within a round; medians are printed.

- ``ingest``: an idempotent producer over Flight into a durable topic of ``pushtable serve
  --data-dir s3://…``, timed to the last acknowledgement, against the hand-rolled Flight +
  Lance server (:mod:`pushtable.bench.lance_flight`) pointed at the same store.
- ``bridge``: one epoch of a cached DataFrame into Lance on the store: ``ForeachBatchBridge``
  (driver path, and ``executor_writes=True``) against ``lance.write_dataset(df.toArrow(),
  mode="append")``; on ``local[2]`` and on a standalone cluster of one and of two workers.
- ``first epoch``: a streaming query of ``foreachBatch(bridge)`` (executor writes) over
  parquet files, one a micro-batch: the start until the first epoch is stored, against the
  later epochs.
- ``source``: the pushtable source reading a durable topic on the store (from its dataset,
  and through the server) against ``readStream.parquet`` over the same rows on a local disk
  (the cluster's one machine is its shared file system; Spark here has no S3 connector), each
  ``availableNow`` into Spark's ``noop`` sink; one worker against two.

Not in CI: it needs ``moto[server]`` (a dev dependency) and about ten minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.moto_store import store

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("level", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("amount", pa.decimal128(18, 4)),
    ]
)
DDL = "id long, level string, ts timestamp, amount decimal(18,4)"


def rows_table(start: int, count: int) -> pa.Table:
    """``count`` rows from id ``start``: zoned timestamps a millisecond apart, decimals."""
    ids = np.arange(start, start + count, dtype=np.int64)
    levels = np.array(["debug", "info", "warn", "error"])[ids % 4]
    ts = pa.array(1_790_000_000_000_000 + ids * 1000, pa.timestamp("us", tz="UTC"))
    unscaled = np.zeros((count, 2), dtype=np.int64)  # decimal128: 16-byte little-endian
    unscaled[:, 0] = ids * 1250  # id / 8, at scale 4
    amount = pa.Array.from_buffers(
        pa.decimal128(18, 4), count, [None, pa.py_buffer(unscaled.tobytes())]
    )
    return pa.table([pa.array(ids), pa.array(levels), ts, amount], schema=SCHEMA)


# -- the store ---------------------------------------------------------------------------


@contextlib.contextmanager
def serve(options: dict[str, str], prefix: str, work: Path) -> Iterator[str]:
    """``pushtable serve --data-dir s3://bench/<prefix>`` in a child process; its location."""
    from pushtable.bench.flight import server_process

    config = work / f"serve-{prefix}.json"
    config.write_text(json.dumps({"storage_options": options}))
    data_dir = f"s3://bench/{prefix}"
    with server_process(
        "pushtable", "serve", "--port", "0", "--config", str(config), "--data-dir", data_dir
    ) as uri:
        yield uri


# -- ingest ------------------------------------------------------------------------------


def ingest_pushtable(options: dict[str, str], batches: list[pa.RecordBatch], work: Path) -> float:
    from pushtable.flight import connect

    with serve(options, f"pt{time.monotonic_ns()}", work) as uri, connect(uri) as client:
        client.create_topic("t", SCHEMA, durable=True)
        sink = client.sink("t", producer_id="bench")
        started = time.perf_counter()
        for b in batches:
            sink.write(b)
        sink.flush()
        elapsed = time.perf_counter() - started
        sink.close()
        return elapsed


def ingest_peer(options: dict[str, str], batches: list[pa.RecordBatch]) -> float:
    from pushtable.bench.flight import server_process
    from pushtable.bench.lance_flight import put_timed

    root = f"s3://bench/peer{time.monotonic_ns()}"
    args = ("--dir", root, "--storage-options", json.dumps(options))
    with server_process("pushtable.bench.lance_flight", *args) as uri:
        return put_timed(uri, SCHEMA, batches)


def ingest(options: dict[str, str], quick: bool, work: Path) -> list[dict[str, Any]]:
    total = 1_000_000 if quick else 4_000_000
    out = []
    for size in (8_192, 65_536):
        batches = rows_table(0, total).to_batches(max_chunksize=size)
        times: dict[str, list[float]] = {"pushtable": [], "peer": []}
        for _ in range(2 if quick else 3):
            times["pushtable"].append(ingest_pushtable(options, batches, work))
            times["peer"].append(ingest_peer(options, batches))
        rate = {k: total / statistics.median(v) / 1e6 for k, v in times.items()}
        out.append(
            {
                "batch_rows": size,
                "rows": total,
                "pushtable_m_rows_s": round(rate["pushtable"], 3),
                "peer_m_rows_s": round(rate["peer"], 3),
                "ratio": round(rate["pushtable"] / rate["peer"], 2),
                "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
            }
        )
    return out


# -- Spark (run in a child process per master: one SparkContext a process) ----------------


def spark_part(args: argparse.Namespace) -> dict[str, Any]:
    """Everything measured on one Spark master, in this (child) process."""
    from pushtable.spark import local_spark, register

    settings = json.loads(Path(args.spark).read_text())
    options: dict[str, str] = settings["options"]
    conf = {"spark.master": settings["master"], "spark.sql.session.timeZone": "UTC"}
    if settings["master"].startswith("spark://"):
        conf |= {
            "spark.executor.memory": "768m",
            "spark.executor.cores": "1",
            "spark.cores.max": str(settings["workers"]),
            "spark.pyspark.python": sys.executable,
        }
    spark = local_spark("pushtable-bench-beyond", **conf)
    register(spark)  # format("pushtable")
    out: dict[str, Any] = {"master": settings["master"], "workers": settings["workers"]}
    # The first epoch first: a new application, its executors' Python workers not started yet.
    out["first_epoch"] = first_epoch(spark, settings, options)
    if settings["first_epoch_only"]:
        spark.stop()
        return out
    out["bridge"] = bridge_epochs(spark, settings, options)
    out["source"] = source_reads(spark, settings, options)
    spark.stop()
    return out


def bridge_epochs(spark: Any, settings: dict[str, Any], options: dict[str, str]) -> Any:
    import lance

    from pushtable.lance_epochs import aligned
    from pushtable.spark import ForeachBatchBridge

    rows, rounds, tag = settings["epoch_rows"], settings["rounds"], settings["tag"]
    df = spark.read.parquet(settings["epochs"][0]).repartition(2).cache()
    assert df.count() == rows
    root = f"s3://bench/bridge-{tag}"
    driver = ForeachBatchBridge(
        lance_uri=f"{root}/driver.lance", storage_options=options, query_id="bench"
    )
    executors = ForeachBatchBridge(
        lance_uri=f"{root}/executors.lance",
        storage_options=options,
        query_id="bench",
        executor_writes=True,
    )
    hand_uri = f"{root}/hand.lance"

    def hand(epoch: int) -> None:
        # toArrow's decimal buffers can sit off their 16-byte alignment, and Lance 14's
        # writer panics on them ("Memory pointer ... is not aligned"): a hand-rolled writer
        # must copy those, as pushtable's does (the same helper, copying only what is off).
        lance.write_dataset(
            aligned(df.toArrow()),
            hand_uri,
            mode="create" if epoch == 0 else "append",
            storage_options=options,
        )

    sides: dict[str, Callable[[int], None]] = {
        "hand_rolled": hand,
        "bridge_driver": lambda e: driver(df, e),
        "bridge_executors": lambda e: executors(df, e),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for epoch in range(rounds + 1):  # epoch 0 creates each dataset: reported apart
        for name, fn in sides.items():
            started = time.perf_counter()
            fn(epoch)
            times[name].append(time.perf_counter() - started)
    for name in ("driver", "executors", "hand"):
        stored = lance.dataset(f"{root}/{name}.lance", storage_options=options).count_rows()
        assert stored == rows * (rounds + 1), (name, stored)
    driver.close()
    executors.close()
    return {
        "epoch_rows": rows,
        "first_s": {k: round(v[0], 3) for k, v in times.items()},
        "median_s": {k: round(statistics.median(v[1:]), 3) for k, v in times.items()},
        "vs_hand_rolled": {
            k: round(statistics.median(times["hand_rolled"][1:]) / statistics.median(v[1:]), 2)
            for k, v in times.items()
            if k != "hand_rolled"
        },
    }


def first_epoch(spark: Any, settings: dict[str, Any], options: dict[str, str]) -> Any:
    """A new streaming query's epochs through ``foreachBatch(bridge)`` (executor writes)."""
    from pushtable.spark import ForeachBatchBridge

    bridge = ForeachBatchBridge(
        lance_uri=f"s3://bench/stream-{settings['tag']}/e.lance",
        storage_options=options,
        executor_writes=True,
    )
    ends: list[float] = []
    begins: list[float] = []

    def each(df: Any, epoch: int) -> None:
        begins.append(time.perf_counter())
        bridge(df, epoch)
        ends.append(time.perf_counter())

    folder = str(Path(settings["epochs"][0]).parent)
    started = time.perf_counter()
    query = (
        spark.readStream.schema(DDL)
        .option("maxFilesPerTrigger", 1)
        .parquet(folder)
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", f"{settings['work']}/ckpt-first-{settings['tag']}")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(600)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    bridge.close()
    later = [e - b for b, e in zip(begins[1:], ends[1:], strict=True)]
    return {
        "epochs": len(ends),
        "start_to_first_stored_s": round(ends[0] - started, 2),
        "start_to_first_call_s": round(begins[0] - started, 2),
        "first_call_s": round(ends[0] - begins[0], 2),
        "later_epochs_median_s": round(statistics.median(later), 3) if later else None,
    }


def source_reads(spark: Any, settings: dict[str, Any], options: dict[str, str]) -> Any:
    """``availableNow`` over every row into ``noop``: pushtable's source vs parquet.

    Each side also drains a one-row topic (a one-row parquet folder): the cost of a query
    whatever its size (planning, the Python workers, opening the dataset). Beside them, the
    store's floor: Lance reading the topic's dataset in this one process, no Spark.
    """
    import lance

    def drain(name: str, reader: Any, expect: int) -> float:
        def each(df: Any, _epoch: int) -> None:
            df.write.format("noop").mode("overwrite").save()

        started = time.perf_counter()
        query = (
            reader.writeStream.foreachBatch(each)
            .option("checkpointLocation", f"{settings['work']}/ckpt-{name}-{time.time_ns()}")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(600)
        elapsed = time.perf_counter() - started
        if query.exception() is not None:
            raise RuntimeError(f"{name}: {query.exception()}")
        counted = sum(p["numInputRows"] for p in query.recentProgress)
        if counted != expect:
            raise RuntimeError(f"{name} read {counted} rows of {expect}")
        return elapsed

    def pushtable(topic: str, dataset: bool) -> Any:
        reader = (
            spark.readStream.format("pushtable")
            .option("uri", settings["server"])
            .option("topic", topic)
            .option("partitions", "2")
        )
        if dataset:
            reader = reader.option("dataset", f"{settings['data_dir']}/{topic}.lance").option(
                "storage_options", json.dumps(options)
            )
        return reader.load()

    def parquet(folder: str) -> Any:
        return spark.readStream.schema(DDL).parquet(folder)

    total = settings["topic_rows"]
    sides: dict[str, Callable[[bool], Any]] = {
        "parquet": lambda one: parquet(settings["parquet_one" if one else "parquet"]),
        "pushtable_dataset": lambda one: pushtable("one" if one else "src", True),
        "pushtable_server": lambda one: pushtable("one" if one else "src", False),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    fixed: dict[str, list[float]] = {k: [] for k in sides}
    floor: list[float] = []
    drain("warm-up", sides["parquet"](False), total)
    for _ in range(settings["rounds"]):
        for name, make in sides.items():
            times[name].append(drain(name, make(False), total))
            fixed[name].append(drain(name, make(True), 1))
        started = time.perf_counter()
        ds = lance.dataset(f"{settings['data_dir']}/src.lance", storage_options=options)
        assert ds.to_table(columns=list(SCHEMA.names)).num_rows == total
        floor.append(time.perf_counter() - started)
    rate = {k: total / statistics.median(v) / 1e6 for k, v in times.items()}
    return {
        "rows": total,
        "m_rows_s": {k: round(v, 3) for k, v in rate.items()},
        "vs_parquet": {k: round(v / rate["parquet"], 2) for k, v in rate.items()},
        "one_row_query_s": {k: round(statistics.median(v), 2) for k, v in fixed.items()},
        "store_floor_m_rows_s": round(total / statistics.median(floor) / 1e6, 3),
    }


def run_spark(settings: dict[str, Any], work: Path) -> dict[str, Any]:
    path = work / f"spark-{settings['tag']}.json"
    path.write_text(json.dumps(settings))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.beyond_one_machine", "--spark", str(path)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        check=False,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        python_lines = [x for x in done.stderr.splitlines() if not x.startswith(("\tat ", "\t..."))]
        tail = "\n".join(python_lines[-60:])
        raise RuntimeError(f"the Spark part failed ({done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=["ingest", "spark", "first-epoch"])
    parser.add_argument("--spark", help=argparse.SUPPRESS)  # the child's settings file
    args = parser.parse_args()
    if args.spark:
        print("RESULT " + json.dumps(spark_part(args)), flush=True)
        return
    from pushtable.flight import connect
    from tests.spark_cluster import standalone_cluster

    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "date": time.ctime()}
    with tempfile.TemporaryDirectory(prefix="pushtable-beyond-") as tmp, store() as options:
        work = Path(tmp)
        if args.only in (None, "ingest"):
            results["ingest"] = ingest(options, args.quick, work)
            print(json.dumps(results["ingest"], indent=1), flush=True)
        if args.only in (None, "spark", "first-epoch"):
            epoch_rows = 100_000 if args.quick else 400_000
            topic_rows = 500_000 if args.quick else 2_000_000
            epochs = work / "epochs"
            epochs.mkdir()
            files = []
            for e in range(6):
                path = epochs / f"part-{e:04d}.parquet"
                pq.write_table(rows_table(e * epoch_rows, epoch_rows), path)
                os.utime(path, (1_700_000_000 + e * 10, 1_700_000_000 + e * 10))
                files.append(str(path))
            parquet = work / "parquet"
            parquet.mkdir()
            whole = rows_table(0, topic_rows)
            for i, part in enumerate(whole.to_batches(max_chunksize=topic_rows // 4)):
                pq.write_table(pa.Table.from_batches([part]), parquet / f"p{i}.parquet")
            parquet_one = work / "parquet-one"
            parquet_one.mkdir()
            pq.write_table(rows_table(0, 1), parquet_one / "p0.parquet")
            with serve(options, "source", work) as location:
                with connect(location) as client:
                    client.create_topic("one", SCHEMA, durable=True)
                    with client.sink("one", producer_id="fill") as one:
                        one.write(rows_table(0, 1))
                    client.create_topic("src", SCHEMA, durable=True)
                    sink = client.sink("src", producer_id="fill")
                    for b in whole.to_batches(max_chunksize=65_536):
                        sink.write(b)
                    sink.flush()
                    sink.close()
                common = {
                    "options": options,
                    "epochs": files,
                    "epoch_rows": epoch_rows,
                    "topic_rows": topic_rows,
                    "rounds": 2 if args.quick else 3,
                    "first_epoch_only": args.only == "first-epoch",
                    "server": location,
                    "data_dir": "s3://bench/source",
                    "parquet": str(parquet),
                    "parquet_one": str(parquet_one),
                    "work": str(work),
                }
                spark: list[dict[str, Any]] = []
                results["spark"] = spark
                spark.append(
                    run_spark({**common, "master": "local[2]", "workers": 0, "tag": "local"}, work)
                )
                print(json.dumps(spark[-1], indent=1), flush=True)
                for workers in (1, 2):
                    with standalone_cluster(work / f"cluster{workers}", workers) as cluster:
                        settings = {
                            **common,
                            "master": cluster.url,
                            "workers": workers,
                            "tag": f"w{workers}",
                        }
                        spark.append(run_spark(settings, work))
                    print(json.dumps(spark[-1], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
