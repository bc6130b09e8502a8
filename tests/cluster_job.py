"""Run in a child process by ``tests/test_spark_cluster.py``: Spark on a standalone cluster.

``python tests/cluster_job.py SETTINGS.json`` with ``master``, ``server`` (a pushtable serve
location whose data dir is an S3 prefix), ``dataset`` (the topic's dataset on the store),
``storage_options``, ``lance`` (an S3 prefix for the bridges' datasets), ``src`` and
``checkpoints`` (folders). Prints one JSON line: what the executors are, the worker check, the
errors of each query, the rows the source read back (from the dataset and through the server)
and the rows the in-process bridge's live table answered.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timezone
from pathlib import Path
from typing import Any

DDL = "id long, level string, ts timestamp, amount decimal(18,4)"


def session(settings: dict[str, Any]) -> Any:
    from pushtable.spark import local_spark

    return local_spark(
        "pushtable-cluster-test",
        **{
            "spark.master": settings["master"],
            "spark.executor.memory": "512m",
            "spark.executor.cores": "1",
            "spark.cores.max": "2",
            "spark.pyspark.python": sys.executable,
            "spark.sql.session.timeZone": "UTC",  # collected timestamps: naive, in UTC
        },
    )


def sink(spark: Any, settings: dict[str, Any], src: str, checkpoint: str) -> str | None:
    """``format("pushtable")`` over the JSON files of ``src`` into topic ``ticks``; its error."""
    query = (
        spark.readStream.schema(DDL)
        .option("maxFilesPerTrigger", 1)
        .json(src)
        .writeStream.format("pushtable")
        .option("uri", settings["server"])
        .option("table", "ticks")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(600)
    return None if query.exception() is None else str(query.exception())


def source(spark: Any, settings: dict[str, Any], via: str) -> tuple[list[Any], str | None]:
    """Topic ``ticks`` read back by the source on the executors: from its dataset on the store
    (``via="dataset"``) or through the server (``via="server"``). The rows and the error."""
    from pyspark.sql import DataFrame

    seen: list[Any] = []

    def each(df: DataFrame, batch_id: int) -> None:
        seen.extend(tuple(r) for r in df.select("id", "level", "ts", "amount").collect())

    reader = (
        spark.readStream.format("pushtable")
        .option("uri", settings["server"])
        .option("topic", "ticks")
        .option("partitions", "2")
    )
    if via == "dataset":
        reader = reader.option("dataset", settings["dataset"]).option(
            "storage_options", json.dumps(settings["storage_options"])
        )
    query = (
        reader.load()
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", str(Path(settings["checkpoints"]) / f"source-{via}"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    error = None if query.exception() is None else str(query.exception())
    return sorted(row(*r) for r in seen), error


def row(i: Any, level: Any, ts: Any, amount: Any) -> list[Any]:
    """One row as the test writes it: ``[id, level, ts ISO (UTC), amount]``."""
    return [int(i), str(level), ts.replace(tzinfo=timezone.utc).isoformat(), str(amount)]


def bridges(spark: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Both foreachBatch bridges over the same micro-batches, each to Lance on the store.

    ``RemoteBridge(push="executors")``: the executors send their partitions to the server's
    durable topic ``bridged`` and write Lance fragments; ``ForeachBatchBridge(executor_writes=
    True)``: the executors write fragments, the driver commits them and feeds a live table
    in this process, read by a live query while the epochs arrive.
    """
    import threading

    from pushtable import SessionContext
    from pushtable.spark import ForeachBatchBridge, RemoteBridge
    from pushtable.spark.arrow import arrow_schema

    options = settings["storage_options"]
    out: dict[str, Any] = {}
    remote = RemoteBridge(
        settings["server"],
        "bridged",
        lance_uri=settings["lance"] + "/remote.lance",
        storage_options=options,
        query_id="cluster-remote",
        push="executors",
    )
    out["remote_bridge_error"] = run_bridge(spark, settings, remote, "remote")
    remote.close()
    ctx = SessionContext()
    frame = spark.readStream.schema(DDL).json(settings["src"])
    live = ctx.register_streaming_table("live", arrow_schema(frame.schema), capacity=4)
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: got.extend(ctx.sql("SELECT * FROM live").to_arrow_table().to_pylist())
    )
    reader.start()
    local = ForeachBatchBridge(
        sinks=[live],
        lance_uri=settings["lance"] + "/local.lance",
        storage_options=options,
        executor_writes=True,
    )
    out["local_bridge_error"] = run_bridge(spark, settings, local, "local")
    local.close()
    reader.join(60)
    out["live"] = sorted(row(r["id"], r["level"], r["ts"], r["amount"]) for r in got)
    return out


def run_bridge(spark: Any, settings: dict[str, Any], bridge: Any, name: str) -> str | None:
    """The micro-batches of ``src`` through ``foreachBatch(bridge)``; the query's error."""
    query = (
        spark.readStream.schema(DDL)
        .option("maxFilesPerTrigger", 1)
        .json(settings["src"])
        .writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(Path(settings["checkpoints"]) / f"bridge-{name}"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(600)
    return None if query.exception() is None else str(query.exception())


def sink_only(settings: dict[str, Any]) -> dict[str, Any]:
    """Only the sink, over ``settings["src"]`` (a test kills an executor or this driver)."""
    from pushtable.spark import register

    spark = session(settings)
    register(spark)
    print("STARTED", flush=True)
    error = sink(spark, settings, settings["src"], settings["checkpoint"])
    spark.stop()
    return {"sink_error": error}


def main(settings: dict[str, Any]) -> dict[str, Any]:
    from pushtable.errors import WorkerPythonError
    from pushtable.spark import register
    from pushtable.spark.session import ensure_worker_python

    spark = session(settings)
    out: dict[str, Any] = {"driver_pid": os.getpid()}
    # Where the Python work runs: a process per executor, not this one.
    pids = spark.range(4, numPartitions=4).rdd.map(lambda _: os.getpid()).distinct().collect()
    out["worker_pids"] = sorted(pids)
    out["executors"] = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
    # The worker check asks the executors: a worker Python that cannot import pushtable is
    # named (the interpreter below has no pyarrow), and nothing is patched over.
    context = spark.sparkContext
    good = context.pythonExec
    context.pythonExec = "/usr/bin/python3"
    try:
        ensure_worker_python(spark)
        out["bad_worker_python"] = None
    except WorkerPythonError as exc:
        out["bad_worker_python"] = str(exc)
    finally:
        context.pythonExec = good
    ensure_worker_python(spark)  # the good one passes
    register(spark)
    out["sink_error"] = sink(
        spark, settings, settings["src"], str(Path(settings["checkpoints"]) / "sink")
    )
    for via in ("dataset", "server"):
        rows, error = source(spark, settings, via)
        out[f"source_{via}_error"] = error
        out[f"read_back_{via}"] = rows
    out.update(bridges(spark, settings))
    spark.stop()
    return out


if __name__ == "__main__":
    given = json.loads(Path(sys.argv[1]).read_text())
    result = sink_only(given) if given.get("mode") == "sink" else main(given)
    print("RESULT " + json.dumps(result), flush=True)
