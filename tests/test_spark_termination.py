"""Live sinks learn when the Spark query ends, without ``watch()``, from any session.

Real local Spark; no test here calls ``bridge.watch``. Every wait is bounded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from pushtable import SessionContext, StreamFailedError
from pushtable.spark import ForeachBatchBridge, StreamingQueryFailedError
from tests.conftest import query
from tests.spark_support import ARROW, QUERY_WAIT, crash_at, stream, write_epochs

pytestmark = pytest.mark.spark


def start(df: Any, bridge: ForeachBatchBridge, chk: Path) -> Any:
    """An availableNow query through ``bridge`` -- and deliberately no ``bridge.watch``."""
    return (
        df.writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )


def listeners(session: SparkSession) -> int:
    return len(session._jsparkSession.streams().listListeners())


def test_sinks_close_when_the_query_ends_without_watch(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM live")
    before = listeners(spark)
    q = start(stream(spark, tmp_path / "src"), ForeachBatchBridge(sinks=[live]), tmp_path / "chk")
    assert q.awaitTermination(QUERY_WAIT)
    assert reader.join(QUERY_WAIT) == {"n": [15]}  # closed, not left waiting
    # The bridge's listener is gone once its last watched query ended.
    deadline = time.monotonic() + QUERY_WAIT
    while listeners(spark) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listeners(spark) == before


def test_a_query_started_from_another_session(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 2)
    other = spark.newSession()
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM live")
    q = start(stream(other, tmp_path / "src"), ForeachBatchBridge(sinks=[live]), tmp_path / "chk")
    assert q.awaitTermination(QUERY_WAIT)
    assert reader.join(QUERY_WAIT) == {"n": [10]}


def test_sinks_fail_with_sparks_error_without_watch(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 3)
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM live")
    bridge = ForeachBatchBridge(sinks=[live], query_id="q")
    bridge.fault = crash_at("before_push", 1)
    q = start(stream(spark, tmp_path / "src"), bridge, tmp_path / "chk")
    with pytest.raises(StreamingQueryException, match="injected crash"):
        q.awaitTermination(QUERY_WAIT)
    error = reader.join_error(QUERY_WAIT)
    assert isinstance(error, StreamFailedError)
    assert isinstance(error.error, StreamingQueryFailedError)
    assert "injected crash" in str(error)


def test_sinks_close_only_when_the_last_query_of_the_bridge_ends() -> None:
    # The bookkeeping alone (our own logic): two watched queries, one listener key.
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW)
    bridge = ForeachBatchBridge(sinks=[live])
    bridge._watched.update({"q1": "session", "q2": "session"})
    bridge._on_terminated("q1", None)
    assert not live.closed
    bridge._on_terminated("q2", None)
    assert live.closed
    bridge._on_terminated("q2", "late duplicate event")  # an ended query is not watched
    assert not live.stats.failed


def test_a_bridge_of_two_real_queries_fails_its_sinks_when_one_fails(
    spark: SparkSession, tmp_path: Path
) -> None:
    """docs/spark.md: a bridge used by several queries closes its sinks only when the last
    ends, and fails them when one fails. Two real queries through one bridge at once: the
    first ends cleanly while the second runs (the sinks stay open); then a file that makes
    the second fail arrives, and the sinks fail with Spark's error."""
    from pyspark.sql.functions import udf

    write_epochs(tmp_path / "a", 2)
    write_epochs(tmp_path / "b", 1, start=10)  # ids 50..54: clean
    ctx = SessionContext()
    live = ctx.register_streaming_table("live", ARROW)
    reader = query(ctx, "SELECT count(*) AS n FROM live")
    bridge = ForeachBatchBridge(sinks=[live])

    @udf("long", useArrow=False)
    def boom_at_7(i: int) -> int:
        if i == 7:
            raise ValueError("query two fails at id 7")
        return i

    second = (  # runs until it fails: a file trigger, not availableNow
        stream(spark, tmp_path / "b")
        .withColumn("id", boom_at_7("id"))
        .writeStream.foreachBatch(bridge)
        .option("checkpointLocation", str(tmp_path / "chk-b"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    first = start(stream(spark, tmp_path / "a"), bridge, tmp_path / "chk-a")
    assert first.awaitTermination(QUERY_WAIT)
    assert first.exception() is None
    assert second.isActive
    assert not live.closed  # one query ended; the other still feeds the bridge
    write_epochs(tmp_path / "b", 1, start=1)  # ids 5..9: 7 fails the second query
    with pytest.raises(StreamingQueryException, match="query two fails at id 7"):
        second.awaitTermination(QUERY_WAIT)
    error = reader.join_error(QUERY_WAIT)
    assert isinstance(error, StreamFailedError)
    assert isinstance(error.error, StreamingQueryFailedError)
    assert "query two fails at id 7" in str(error)
