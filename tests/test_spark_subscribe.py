"""Spark subscriptions: the Lance history, then the live tail, with no gap and no duplicate."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

from pushtable import SessionContext
from pushtable.spark import ForeachBatchBridge
from tests.conftest import Background
from tests.spark_support import ARROW, ids, run, stream, write_epochs

ROWS = 20  # rows per hand-fed epoch


def epoch_df(spark: SparkSession, epoch: int) -> DataFrame:
    """Epoch ``epoch``: ids epoch*ROWS .. epoch*ROWS + ROWS - 1."""
    start = epoch * ROWS
    return spark.range(start, start + ROWS).selectExpr("id", "cast(id % 2 AS string) AS level")


def feed(bridge: ForeachBatchBridge, spark: SparkSession, epochs: range) -> None:
    for e in epochs:
        bridge(epoch_df(spark, e), e)


def expected(epochs: range) -> list[int]:
    return [i for e in epochs for i in range(e * ROWS, e * ROWS + ROWS)]


def read_ids(ctx: SessionContext, name: str) -> Background:
    return Background(lambda: sorted(ctx.sql(f"SELECT id FROM {name}").to_pydict()["id"]))


def test_history_then_the_live_tail(spark: SparkSession, tmp_path: Path) -> None:
    bridge = ForeachBatchBridge(lance_uri=tmp_path / "out.lance", query_id="q")
    feed(bridge, spark, range(3))
    ctx = SessionContext()
    bridge.subscribe(ctx, "with_history")
    bridge.subscribe(ctx, "tail_only", history=False)
    full, tail = read_ids(ctx, "with_history"), read_ids(ctx, "tail_only")
    feed(bridge, spark, range(3, 5))
    bridge.close()
    assert full.join() == expected(range(5))
    assert tail.join() == expected(range(3, 5))


def test_subscribing_after_the_end_reads_the_history_then_ends(
    spark: SparkSession, tmp_path: Path
) -> None:
    bridge = ForeachBatchBridge(lance_uri=tmp_path / "out.lance", query_id="q")
    feed(bridge, spark, range(2))
    bridge.close()
    ctx = SessionContext()
    bridge.subscribe(ctx, "late")
    assert sorted(ctx.sql("SELECT id FROM late").to_pydict()["id"]) == expected(range(2))


def test_a_real_query_closes_its_subscriptions(spark: SparkSession, tmp_path: Path) -> None:
    src, uri = tmp_path / "src", tmp_path / "out.lance"
    write_epochs(src, 3)
    bridge = ForeachBatchBridge(lance_uri=uri)
    ctx = SessionContext()
    bridge.subscribe(ctx, "live", schema=ARROW)  # before any epoch: the schema is given
    reader = read_ids(ctx, "live")
    run(stream(spark, src), bridge, tmp_path / "chk")
    assert reader.join() == ids(uri) == list(range(15))
    ctx2 = SessionContext()
    bridge.subscribe(ctx2, "after")  # the query ended: history, then end of stream
    assert sorted(ctx2.sql("SELECT id FROM after").to_pydict()["id"]) == list(range(15))


def test_an_epoch_retried_after_its_commit_reaches_every_subscriber_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The commit landed, then the epoch failed (a crash between commit and publish). A
    subscription taken before and one taken in between both see the epoch exactly once."""
    bridge = ForeachBatchBridge(lance_uri=tmp_path / "out.lance", query_id="q")
    feed(bridge, spark, range(2))
    ctx = SessionContext()
    bridge.subscribe(ctx, "before")
    before = read_ids(ctx, "before")

    def crash_after_commit(step: str, epoch: int) -> None:
        if step == "after_commit" and epoch == 2:
            raise RuntimeError("crash after the commit")

    bridge.fault = crash_after_commit
    with pytest.raises(RuntimeError, match="crash after the commit"):
        bridge(epoch_df(spark, 2), 2)
    bridge.fault = None
    bridge.subscribe(ctx, "between")
    between = read_ids(ctx, "between")
    bridge(epoch_df(spark, 2), 2)  # Spark's retry: a replay, committed once
    feed(bridge, spark, range(3, 4))
    bridge(epoch_df(spark, 3), 3)  # a plain replay
    bridge.close()
    assert before.join() == expected(range(4))
    assert between.join() == expected(range(4))
    assert ids(tmp_path / "out.lance") == expected(range(4))


def test_fifty_subscriptions_at_random_moments_see_each_row_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Epochs commit in a loop while 50 subscriptions are taken at random moments; every
    subscriber's query sees history + live tail = every row, exactly once."""
    bridge = ForeachBatchBridge(lance_uri=tmp_path / "out.lance", query_id="q")
    feed(bridge, spark, range(1))  # a dataset (and its schema) exists
    epochs = range(1, 31)
    rng = random.Random(7)
    readers: list[Background] = []
    started = threading.Event()

    def subscribe_at_random() -> None:
        started.wait(30)
        for i in range(50):
            ctx = SessionContext()
            bridge.subscribe(ctx, f"s{i}")
            readers.append(read_ids(ctx, f"s{i}"))
            threading.Event().wait(rng.uniform(0, 0.15))

    subscriber = Background(subscribe_at_random)

    def commit_loop() -> None:
        started.set()
        feed(bridge, spark, epochs)

    Background(commit_loop).join(timeout=300)
    subscriber.join(timeout=300)
    bridge.close()
    everything = expected(range(31))
    for i, r in enumerate(readers):
        assert r.join(timeout=120) == everything, f"subscription s{i}"
    assert ids(tmp_path / "out.lance") == everything


def test_subscribe_refuses_what_cannot_work(tmp_path: Path) -> None:
    ctx = SessionContext()
    with pytest.raises(ValueError, match="history=True reads the Lance dataset"):
        ForeachBatchBridge(sinks=[ctx.register_streaming_table("x", ARROW)]).subscribe(ctx, "s")
    with pytest.raises(ValueError, match="subscriptions need mode='append'"):
        ForeachBatchBridge(lance_uri=tmp_path / "o.lance", mode="complete").subscribe(ctx, "s")
    with pytest.raises(ValueError, match="no schema yet"):
        ForeachBatchBridge(lance_uri=tmp_path / "o.lance").subscribe(ctx, "s")
