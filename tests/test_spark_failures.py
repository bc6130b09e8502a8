"""Spark failure paths: a bad record, a killed executor task, stop() with an epoch in flight.

Live readers must raise (not hang), and Lance must hold only whole epochs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf

from pushtable import SessionContext
from pushtable.spark import ForeachBatchBridge
from tests.conftest import Background, query
from tests.spark_support import ARROW, DDL, QUERY_WAIT, age, ids, run, stream, write_epochs

pytestmark = pytest.mark.spark


def _start(spark: SparkSession, df: object, bridge: ForeachBatchBridge, chk: Path) -> object:
    q = (
        df.writeStream.foreachBatch(bridge)  # type: ignore[attr-defined]
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )
    bridge.watch(q, spark)
    return q


def test_a_bad_record_fails_the_query_and_the_live_reader(
    spark: SparkSession, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    write_epochs(src, 2)
    (src / "part-0002.json").write_text('{"id": 10, "level": "a"}\n{"id": oops\n')
    age(src / "part-0002.json", 2)
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW)
    reader = query(ctx, "SELECT count(*) FROM events")
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "out.lance")
    df = spark.readStream.schema(DDL).option("maxFilesPerTrigger", 1).option("mode", "FAILFAST")
    q = _start(spark, df.json(str(src)), bridge, tmp_path / "chk")
    with pytest.raises(StreamingQueryException, match=r"(?i)malformed"):
        q.awaitTermination(QUERY_WAIT)  # type: ignore[attr-defined]
    failed_at = time.monotonic()
    err = reader.join_error(timeout=QUERY_WAIT)
    print(f"live reader raised {time.monotonic() - failed_at:.3f}s after the query failed")
    assert "StreamingQueryFailedError" in str(err)
    assert ids(tmp_path / "out.lance") == list(range(10))  # epochs 0 and 1, whole


def test_a_killed_executor_task_fails_the_query_and_the_live_reader(
    spark: SparkSession, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    write_epochs(src, 3)

    @udf("long", useArrow=False)  # plain Python UDF: nothing to infer from the hints
    def die_on_12(i: int) -> int:
        if i == 12:
            os._exit(1)  # the Python worker process dies mid-task
        return i

    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW)
    reader = query(ctx, "SELECT count(*) FROM events")
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=tmp_path / "out.lance")
    df = stream(spark, src).withColumn("id", die_on_12("id"))
    q = _start(spark, df, bridge, tmp_path / "chk")
    # Spark's own words for a Python worker that died (every PySpark error says "worker").
    with pytest.raises(StreamingQueryException, match=r"Python worker exited unexpectedly"):
        q.awaitTermination(QUERY_WAIT)  # type: ignore[attr-defined]
    assert "StreamingQueryFailedError" in str(reader.join_error(timeout=QUERY_WAIT))
    assert ids(tmp_path / "out.lance") == list(range(10))


def test_stop_with_an_epoch_in_flight_leaves_lance_consistent(
    spark: SparkSession, tmp_path: Path
) -> None:
    src, uri, chk = tmp_path / "src", tmp_path / "out.lance", tmp_path / "chk"
    write_epochs(src, 3)
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM events")
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=uri)
    in_flight, stopping, stopped, finished = (threading.Event() for _ in range(4))
    held_through_stop: list[bool] = []

    def hold(step: str, epoch: int) -> None:
        if step == "before_commit" and epoch == 1:
            in_flight.set()
            # Spark is told to stop while this epoch is mid-way: its stop() is called (and
            # cannot return: Spark waits for the batch) before the epoch goes on.
            held_through_stop.append(stopping.wait(QUERY_WAIT) and not stopped.is_set())
        if step == "after_push" and epoch == 1:
            finished.set()

    bridge.fault = hold
    q = _start(spark, stream(spark, src), bridge, chk)
    assert in_flight.wait(QUERY_WAIT)

    def stop() -> None:
        stopping.set()
        q.stop()  # type: ignore[attr-defined]
        stopped.set()

    stopper = Background(stop)
    stopper.join(timeout=QUERY_WAIT)
    assert held_through_stop == [True]  # the interleaving the test is about happened
    n = reader.join(timeout=QUERY_WAIT)["n"][0]  # stop() is a normal end: the reader finishes
    # Spark abandons the callback; let it run to its end before looking and restarting.
    assert finished.wait(QUERY_WAIT)
    got = ids(uri)
    assert len(got) % 5 == 0
    assert len(set(got)) == len(got)
    assert n <= len(got)  # the live table never saw data that is not durable
    restarted = ForeachBatchBridge(lance_uri=uri)
    run(stream(spark, src), restarted, chk)
    assert ids(uri) == list(range(15))
