"""Run in a child process by ``tests/test_spark_cluster.py``: Spark on a standalone cluster.

``python tests/cluster_job.py SETTINGS.json`` with ``master``, ``server`` (a pushtable serve
location whose data dir is an S3 prefix), ``dataset`` (the topic's dataset on the store),
``storage_options``, ``src`` and ``checkpoints`` (folders). Prints one JSON line: what the
executors are, the worker check, and the rows the sink stored and the source read back.
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
    from pyspark.sql import DataFrame

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
    options = json.dumps(settings["storage_options"])
    out["sink_error"] = sink(
        spark, settings, settings["src"], str(Path(settings["checkpoints"]) / "sink")
    )
    seen: list[Any] = []

    def each(df: DataFrame, batch_id: int) -> None:
        seen.extend(tuple(r) for r in df.select("id", "level", "ts", "amount").collect())

    source = (
        spark.readStream.format("pushtable")
        .option("uri", settings["server"])
        .option("topic", "ticks")
        .option("partitions", "2")
        .option("dataset", settings["dataset"])
        .option("storage_options", options)
        .load()
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", str(Path(settings["checkpoints"]) / "source"))
        .trigger(availableNow=True)
        .start()
    )
    source.awaitTermination(300)
    out["source_error"] = None if source.exception() is None else str(source.exception())
    out["read_back"] = sorted(
        [int(i), str(level), ts.replace(tzinfo=timezone.utc).isoformat(), str(amount)]
        for i, level, ts, amount in seen
    )
    spark.stop()
    return out


if __name__ == "__main__":
    given = json.loads(Path(sys.argv[1]).read_text())
    result = sink_only(given) if given.get("mode") == "sink" else main(given)
    print("RESULT " + json.dumps(result), flush=True)
