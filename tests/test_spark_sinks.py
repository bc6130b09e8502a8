"""Live sinks that cannot keep up or cannot take an epoch never stall or wedge the query.

Real local Spark and real Lance; every wait is bounded.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from pushtable import SessionContext, StreamFailedError
from pushtable.spark import ForeachBatchBridge, IncompatibleSinkError, SlowReaderError
from tests.conftest import Background, query
from tests.spark_support import ARROW, QUERY_WAIT, age, ids, run, stamped, stream, write_epochs

pytestmark = pytest.mark.spark


def test_a_sink_nobody_reads_is_detached_and_the_query_persists_everything(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    unread = ctx.register_streaming_table("unread", ARROW, capacity=1)
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(sinks=[unread], lance_uri=uri, push_timeout=0.5)
    run(stream(spark, tmp_path / "src"), bridge, tmp_path / "chk")
    assert [e for _, e in stamped(uri)] == [0, 1, 2]
    assert ids(uri) == list(range(15))
    assert unread.stats.failed
    with pytest.raises(StreamFailedError, match="missed epoch 1") as info:
        ctx.sql("SELECT count(*) FROM unread").collect()
    assert isinstance(info.value.error, SlowReaderError)


def test_stop_returns_with_a_full_sink_and_no_reader(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 2)
    ctx = SessionContext()  # kept: a dropped session would drop the table (reader gone)
    unread = ctx.register_streaming_table("unread", ARROW, capacity=1)
    bridge = ForeachBatchBridge(sinks=[unread], push_timeout=1.0, query_id="q")
    # Epoch 0 fills the table; epoch 1's push then waits for room for up to push_timeout.
    # Seen waiting (the sink counts its blocked writer), not assumed to be.
    blocked = threading.Event()
    deadline = time.monotonic() + QUERY_WAIT / 2  # inside the test's own timeout

    def watch() -> None:
        while unread.stats.waiting_writers == 0 and time.monotonic() < deadline:
            blocked.wait(0.001)
        if unread.stats.waiting_writers:
            blocked.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    q = (
        stream(spark, tmp_path / "src")
        .writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    watcher.join(QUERY_WAIT / 2 + 1)
    assert blocked.is_set(), "epoch 1 never blocked on the full sink"
    stopping = Background(q.stop)  # epoch 1 was seen blocked on the full sink
    stopping.join(QUERY_WAIT)
    assert not q.isActive
    assert unread.stats.failed


def test_block_keeps_spark_paced_by_the_reader(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW, capacity=1)
    bridge = ForeachBatchBridge(sinks=[live], on_slow_reader="block", push_timeout=0.01)
    # The reader starts late, long after push_timeout: with "block" nothing is detached.
    q = (
        stream(spark, tmp_path / "src")
        .writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    bridge.watch(q)
    first_blocked = threading.Event()

    def watch_blocked() -> None:
        while live.stats.waiting_writers == 0 and q.isActive:
            first_blocked.wait(0.01)
        first_blocked.set()

    threading.Thread(target=watch_blocked, daemon=True).start()
    assert first_blocked.wait(QUERY_WAIT)
    reader = query(ctx, "SELECT count(*) AS n FROM live")
    assert q.awaitTermination(QUERY_WAIT)
    assert reader.join() == {"n": [15]}
    assert not live.stats.failed


def test_a_sink_with_other_columns_is_detached_before_the_commit(
    spark: SparkSession, tmp_path: Path
) -> None:
    write_epochs(tmp_path / "src", 2)
    ctx = SessionContext()
    other = ctx.register_streaming_table("other", pa.schema([("id", pa.string())]))
    good = ctx.register_streaming_table("good", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM good")
    uri = tmp_path / "out.lance"
    run(
        stream(spark, tmp_path / "src"),
        ForeachBatchBridge(sinks=[other, good], lance_uri=uri),
        tmp_path / "chk",
    )
    assert [e for _, e in stamped(uri)] == [0, 1]
    assert reader.join() == {"n": [10]}  # the compatible sink got everything
    with pytest.raises(StreamFailedError, match="cannot take epoch 0") as info:
        ctx.sql("SELECT * FROM other").collect()
    assert isinstance(info.value.error, IncompatibleSinkError)


def test_a_not_null_sink_and_a_null_in_an_epoch(spark: SparkSession, tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_epochs(src, 1)
    with open(src / "part-0001.json", "w") as f:  # epoch 1 holds a null id
        f.write(json.dumps({"id": None, "level": "a"}) + "\n")
        f.write(json.dumps({"id": 99, "level": "b"}) + "\n")
    age(src / "part-0001.json", 1)
    write_epochs(src, 1, start=2)
    ctx = SessionContext()
    strict = pa.schema([pa.field("id", pa.int64(), nullable=False), ("level", pa.string())])
    live = ctx.register_streaming_table("strict", strict)
    reader = query(ctx, "SELECT count(*) AS n FROM strict")
    uri = tmp_path / "out.lance"
    run(stream(spark, src), ForeachBatchBridge(sinks=[live], lance_uri=uri), tmp_path / "chk")
    assert [e for _, e in stamped(uri)] == [0, 1, 2]  # Lance has every epoch, once
    error = reader.join_error()  # the query finished; the reader learned why it stopped
    assert isinstance(error, StreamFailedError)
    assert isinstance(error.error, IncompatibleSinkError)
    assert "rejected epoch 1" in str(error)
    assert "NOT NULL" in str(error)


def test_push_options_are_checked(tmp_path: Path) -> None:
    live = SessionContext().register_streaming_table("t", ARROW)
    with pytest.raises(ValueError, match="push_timeout"):
        ForeachBatchBridge(sinks=[live], push_timeout=0)
    with pytest.raises(ValueError, match="push_timeout"):
        ForeachBatchBridge(sinks=[live], push_timeout=float("inf"))
    with pytest.raises(ValueError, match="on_slow_reader"):
        ForeachBatchBridge(sinks=[live], on_slow_reader="drop")  # type: ignore[arg-type]


def test_executor_writes_with_sinks_read_one_computation(
    spark: SparkSession, tmp_path: Path
) -> None:
    from pyspark.sql import functions as F

    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    schema = pa.schema([("id", pa.int64()), ("level", pa.string()), ("r", pa.float64())])
    live = ctx.register_streaming_table("live", schema)
    reader = query(ctx, "SELECT id, r FROM live ORDER BY id")
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=uri, executor_writes=True)
    # A Python UDF draws anew on every computation (Spark's rand() would repeat its seed).
    draw = F.udf(lambda: random.random(), "double").asNondeterministic()
    df = stream(spark, tmp_path / "src").withColumn("r", draw())
    run(df, bridge, tmp_path / "chk")
    persisted = lance.dataset(str(uri)).to_table(columns=["id", "r"]).sort_by("id").to_pydict()
    assert reader.join() == persisted
    assert len(persisted["id"]) == 15
