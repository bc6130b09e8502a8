"""Topics: many live queries over one stream, taken at any time, with retention."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pytest
from datafusion import SessionConfig

from pushtable import (
    OrderViolationError,
    SchemaMismatchError,
    SessionContext,
    SinkClosedError,
    SlowSubscriberError,
    StreamFailedError,
    Topic,
    UnboundedQueryError,
    WriteTimeoutError,
)
from tests.conftest import SCHEMA, WAIT, Background, batch, query, wait_until


def ks(result: dict[str, list[int]]) -> list[int]:
    return list(result["k"])


def in_order() -> SessionContext:
    """A session whose scans read with one partition: results keep the arrival order
    (with more, each partition reads its batches in order, but partitions interleave)."""
    return SessionContext(SessionConfig().with_target_partitions(1))


def test_every_subscription_sees_every_later_batch_once_in_order() -> None:
    topic = Topic("events", SCHEMA)
    contexts = [in_order() for _ in range(3)]
    for i, c in enumerate(contexts):
        topic.subscribe(c, f"s{i}", capacity=2)
    readers = [query(c, f"SELECT k FROM s{i}") for i, c in enumerate(contexts)]
    for i in range(20):
        topic.write(batch(3, start=3 * i), timeout=WAIT)
    topic.close()
    for r in readers:
        assert ks(r.join()) == list(range(60))
    assert topic.stats.rows == 60
    assert topic.stats.queued_batches == 0


def test_a_finished_subscription_keeps_its_read_count() -> None:
    topic = Topic("events", SCHEMA)
    ctx = in_order()
    sub = topic.subscribe(ctx, "s", capacity=4)
    reader = query(ctx, "SELECT k FROM s")
    for i in range(5):
        topic.write(batch(2, start=2 * i), timeout=WAIT)
    wait_until(lambda: sub.stats.read_batches == 5, "the query to read 5 batches")
    topic.close()
    assert len(ks(reader.join())) == 10
    wait_until(lambda: sub.stats.state == "finished", "the subscription to finish")
    assert sub.stats.read_batches == 5  # what it read, not 0, once its query is done


def test_a_subscription_taken_midstream_starts_at_the_next_batch() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    topic.subscribe(ctx, "early", capacity=100)
    topic.write(batch(5, start=0))
    topic.subscribe(ctx, "late", capacity=100)
    topic.write(batch(5, start=5))
    topic.close()
    assert ks(ctx.sql("SELECT k FROM early").to_pydict()) == list(range(10))
    assert ks(ctx.sql("SELECT k FROM late").to_pydict()) == list(range(5, 10))


def test_writes_with_no_subscriber_never_block_and_hold_nothing() -> None:
    topic = Topic("t", SCHEMA)
    for i in range(100):
        topic.write(batch(10, start=i), timeout=0)
    s = topic.stats
    assert (s.rows, s.batches, s.queued_batches, s.subscribers) == (1000, 100, 0, 0)


def test_producer_errors_are_those_of_a_sink() -> None:
    topic = Topic("t", SCHEMA, order_by="k")
    ctx = in_order()
    topic.subscribe(ctx, "s")
    with pytest.raises(SchemaMismatchError, match="field 'k' has type int64"):
        topic.write(pa.table({"k": pa.array([1], pa.int64()), "v": [0.5]}))
    topic.write(batch(2, start=10))
    with pytest.raises(OrderViolationError, match="'k'"):
        topic.write(batch(2, start=0))
    topic.write(batch(2, start=12))  # still usable after both rejections
    topic.close()
    with pytest.raises(SinkClosedError):
        topic.write(batch(1))
    assert ks(ctx.sql("SELECT k FROM s").to_pydict()) == [10, 11, 12, 13]


def test_subscription_names_are_checked_like_tables() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    topic.subscribe(ctx, "s")
    with pytest.raises(ValueError, match="already registered"):
        topic.subscribe(ctx, "s")
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        topic.subscribe(ctx, "s2", capacity=0)
    with pytest.raises(ValueError, match="start must be 'now', 'latest' or 'earliest'"):
        topic.subscribe(ctx, "s3", start="tomorrow")
    with pytest.raises(ValueError, match="on_slow must be"):
        topic.subscribe(ctx, "s4", on_slow="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retain must be an integer"):
        Topic("u", SCHEMA, retain=-1)


# --- zero copy ------------------------------------------------------------------------------

_MEMORY_CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np, psutil, pyarrow as pa
    from pushtable import SessionContext, Topic

    subscribers, batches = int(sys.argv[1]), 16
    rows = 1_000_000  # 8 MB of float64 per batch
    data = [pa.record_batch({"v": np.random.default_rng(i).random(rows)}) for i in range(batches)]
    gc.collect()
    before = psutil.Process().memory_info().rss
    topic = Topic("t", pa.schema([("v", pa.float64())]))
    ctx = SessionContext()
    for i in range(subscribers):
        topic.subscribe(ctx, f"s{i}", capacity=batches)
    for b in data:
        topic.write(b, timeout=0)
    held = topic.stats.queued_bytes
    del data  # only the topic holds the batches now
    gc.collect()
    after = psutil.Process().memory_info().rss
    print(json.dumps({"held": held, "growth": after - before, "data": batches * rows * 8}))
    """
)


def test_subscribers_share_batches_memory_grows_with_batches_not_subscribers() -> None:
    import json

    figures = {}
    for n in (1, 16):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_CHILD, str(n)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        figures[n] = json.loads(out.stdout)
    data = figures[1]["data"]
    # The topic counts each batch once, whatever the number of subscribers...
    assert figures[1]["held"] == figures[16]["held"] == data
    # ...and holds it once: 16 subscribers cost what 1 costs (copies would add 15 x 128 MB).
    assert figures[16]["growth"] < figures[1]["growth"] + 0.1 * data


# --- independence -------------------------------------------------------------------------


def test_a_subscription_whose_query_stops_early_leaves_alone() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    topic.subscribe(ctx, "limited", capacity=1)
    topic.subscribe(ctx, "full", capacity=1)
    limited = query(ctx, "SELECT k FROM limited LIMIT 3")
    full = query(ctx, "SELECT k FROM full")
    for i in range(30):
        topic.write(batch(1, start=i), timeout=WAIT)  # would block for good on a stuck reader
    topic.close()
    assert len(ks(limited.join())) == 3
    assert ks(full.join()) == list(range(30))
    assert topic.stats.subscribers == 0  # both gone; the log is empty
    assert topic.stats.queued_batches == 0


def test_a_failing_subscriber_query_detaches_only_itself() -> None:
    topic = Topic("t", pa.schema([("s", pa.string())]))
    ctx = SessionContext()  # several partitions: the scan's default
    bad = topic.subscribe(ctx, "bad", capacity=1)
    topic.subscribe(ctx, "good", capacity=1)
    failing = Background(lambda: ctx.sql("SELECT CAST(s AS INT) AS i FROM bad").to_pydict())
    good = query(ctx, "SELECT s FROM good")
    topic.write(pa.record_batch({"s": ["1"]}), timeout=WAIT)
    topic.write(pa.record_batch({"s": ["not a number"]}), timeout=WAIT)
    assert "Cannot cast string 'not a number'" in str(failing.join_error())
    wait_until(lambda: bad.stats.state == "finished", "the failed query's subscription to go")
    for i in range(10):
        topic.write(pa.record_batch({"s": [str(i)]}), timeout=WAIT)
    topic.close()
    assert sorted(good.join()["s"]) == sorted(["1", "not a number"] + [str(i) for i in range(10)])


def test_a_cancelled_stream_detaches_its_subscription() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    sub = topic.subscribe(ctx, "s", capacity=1)
    stream = ctx.sql("SELECT k FROM s").execute_stream()
    topic.write(batch(1), timeout=WAIT)
    assert next(stream).to_pyarrow().num_rows == 1
    del stream
    wait_until(lambda: sub.stats.state == "finished", "the dropped stream's subscription to go")
    topic.write(batch(1), timeout=0)  # nobody to wait for
    assert topic.stats.subscribers == 0


# --- slow subscribers ---------------------------------------------------------------------


def test_block_mode_the_slowest_subscriber_paces_producers() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    slow = topic.subscribe(ctx, "slow", capacity=2)
    topic.write(batch(1, start=0))
    topic.write(batch(1, start=1))
    with pytest.raises(WriteTimeoutError):
        topic.write(batch(1, start=2), timeout=0.05)
    writer = Background(lambda: topic.write(batch(1, start=2), timeout=WAIT))
    wait_until(lambda: topic.stats.waiting_writers == 1, "the writer to block")
    stream = ctx.sql("SELECT k FROM slow").execute_stream()
    assert next(stream).to_pyarrow()["k"].to_pylist() == [0]
    writer.join()  # one batch read: room for the blocked write
    topic.close()
    rest = [b.to_pyarrow()["k"].to_pylist() for b in stream]
    assert rest == [[1], [2]]
    assert slow.stats.state == "finished"


def test_detach_mode_cuts_a_stuck_subscriber_loose_and_producers_go_on() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    stuck = topic.subscribe(ctx, "stuck", capacity=2, on_slow="detach", slow_timeout=0.1)
    topic.subscribe(ctx, "healthy", capacity=2)
    healthy = query(ctx, "SELECT k FROM healthy")
    for i in range(10):
        topic.write(batch(1, start=i), timeout=WAIT)
    topic.close()
    assert ks(healthy.join()) == list(range(10))
    s = stuck.stats
    assert s.state == "detached"
    assert s.detached_because is not None
    assert "fell behind" in s.detached_because
    assert topic.stats.detached == 1
    with pytest.raises(SlowSubscriberError, match=r"subscriber of 't' fell behind.*2 batch"):
        ctx.sql("SELECT k FROM stuck").to_pydict()


def test_a_reading_subscriber_within_its_timeout_is_not_detached() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    sub = topic.subscribe(ctx, "s", capacity=1, on_slow="detach", slow_timeout=WAIT)
    reader = query(ctx, "SELECT k FROM s")
    for i in range(50):
        topic.write(batch(1, start=i), timeout=WAIT)
    topic.close()
    assert ks(reader.join()) == list(range(50))
    assert topic.stats.detached == 0
    assert sub.stats.state == "finished"


# --- retention ----------------------------------------------------------------------------


def test_earliest_replays_the_retained_batches_then_goes_live() -> None:
    topic = Topic("t", SCHEMA, retain=3)
    for i in range(5):
        topic.write(batch(1, start=i))
    assert topic.stats.queued_batches == 3
    ctx = in_order()
    topic.subscribe(ctx, "all", start="earliest", capacity=1)
    topic.subscribe(ctx, "new", start="now", capacity=1)
    a, b = query(ctx, "SELECT k FROM all"), query(ctx, "SELECT k FROM new")
    for i in range(5, 8):
        topic.write(batch(1, start=i), timeout=WAIT)
    topic.close()
    assert ks(a.join()) == [2, 3, 4, 5, 6, 7]
    assert ks(b.join()) == [5, 6, 7]


def test_retain_bytes_keeps_the_newest_batches_that_fit() -> None:
    one = batch(100)
    size = _batch_bytes(one)
    topic = Topic("t", SCHEMA, retain_bytes=2 * size + size // 2)
    for i in range(6):
        topic.write(batch(100, start=100 * i))
    assert topic.stats.queued_batches == 2
    ctx = in_order()
    topic.subscribe(ctx, "s", start="earliest")
    topic.close()
    assert ks(ctx.sql("SELECT k FROM s").to_pydict()) == list(range(400, 600))


def test_both_retention_limits_apply() -> None:
    topic = Topic("t", SCHEMA, retain=5, retain_bytes=_batch_bytes(batch(10)) * 2)
    for i in range(8):
        topic.write(batch(10, start=10 * i))
    assert topic.stats.queued_batches == 2


def test_subscribing_after_close_gets_the_retained_batches_then_the_end() -> None:
    topic = Topic("t", SCHEMA, retain=2)
    for i in range(4):
        topic.write(batch(1, start=i))
    topic.close()
    ctx = in_order()
    topic.subscribe(ctx, "earliest", start="earliest")
    topic.subscribe(ctx, "now")
    assert ks(ctx.sql("SELECT k FROM earliest").to_pydict()) == [2, 3]
    assert ks(ctx.sql("SELECT k FROM now").to_pydict()) == []


def test_subscribing_after_fail_raises_the_failure() -> None:
    topic = Topic("t", SCHEMA, retain=2)
    topic.write(batch(1))
    boom = RuntimeError("upstream broke")
    topic.fail(boom)
    ctx = in_order()
    topic.subscribe(ctx, "s", start="earliest")
    with pytest.raises(StreamFailedError, match="upstream broke") as info:
        ctx.sql("SELECT k FROM s").to_pydict()
    assert info.value.error is boom


def test_fail_reaches_every_live_subscriber() -> None:
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    for i in range(3):
        topic.subscribe(ctx, f"s{i}")
    readers = [query(ctx, f"SELECT k FROM s{i}") for i in range(3)]
    topic.write(batch(1))
    topic.fail(ValueError("bad day"))
    for r in readers:
        assert isinstance(r.join_error(), StreamFailedError)


def _batch_bytes(b: pa.RecordBatch) -> int:
    from pushtable import _native

    return _native.batch_bytes(b)


# --- asyncio ------------------------------------------------------------------------------


def test_async_for_reads_results_without_blocking_the_event_loop() -> None:
    """Producer and consumer share one event loop: a blocking consumer would starve the
    producer (the watchdog then fails the topic, and the test with it)."""
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    topic.subscribe(ctx, "s", capacity=1)
    watchdog = threading.Timer(WAIT, lambda: topic.fail(TimeoutError("watchdog: loop blocked")))
    watchdog.start()

    async def produce() -> None:
        for i in range(20):
            await topic.awrite(batch(2, start=2 * i))
        await topic.aclose()

    async def consume() -> list[int]:
        seen: list[int] = []
        async for b in ctx.sql("SELECT k FROM s"):
            seen.extend(b.to_pyarrow()["k"].to_pylist())
        return seen

    async def main() -> list[int]:
        seen, _ = await asyncio.gather(consume(), produce())
        return seen

    try:
        assert asyncio.run(main()) == list(range(40))
    finally:
        watchdog.cancel()


def test_the_dashboard_example_runs() -> None:
    """examples/dashboard.py: five per-second panels, one joining late with the history; it
    asserts that every panel printed rows before the stream was closed."""
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "dashboard.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requests_seen_late" in done.stdout
    assert "     worst 00:00:00: {'worst_ms'" in done.stdout


def test_a_servers_listing_shows_subscriptions_with_their_topic() -> None:
    from pushtable.flight import Server, connect

    server = Server()
    try:
        client = connect(server.location)
        schema = pa.schema([("v", pa.int64())])
        client.create_topic("ticks", schema)
        client.subscribe("ticks", "ticks_live", capacity=4)
        listed = {t["name"]: t for t in client.tables()}
        assert listed["ticks"]["topic"]
        assert listed["ticks"].get("subscription_of") is None
        assert listed["ticks_live"]["subscription_of"] == "ticks"
        assert listed["ticks_live"]["bound_batches"] == 4
        assert client.schema("ticks_live") == schema
        client.close()
    finally:
        server.stop()


def test_a_query_refused_as_it_is_planned_lets_its_subscriptions_go() -> None:
    """A dashboard's panels, one subscription each: one panel's query refused at ``ctx.sql``
    (an unbounded top-n; a misspelled column) held its subscription, which filled and
    froze the topic's producer, and every other panel with it. The refused query's
    subscriptions leave the session; the producer and the other panel go on."""
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    top = topic.subscribe(ctx, "top", capacity=2, unbounded=True)
    typo = topic.subscribe(ctx, "typo", capacity=2)
    topic.subscribe(ctx, "panel", capacity=2)
    with pytest.raises(UnboundedQueryError):
        ctx.sql("SELECT k, count(*) AS n FROM top GROUP BY k ORDER BY n DESC LIMIT 5")
    with pytest.raises(Exception, match="nope"):
        ctx.sql("SELECT nope FROM typo")
    assert not ctx.table_exist("top")
    assert not ctx.table_exist("typo")
    reading = query(ctx, "SELECT k FROM panel")
    for i in range(10):
        topic.write(batch(1, start=i), timeout=WAIT)  # capacity 2: the refused ones held it
    topic.close()
    reading.join()
    assert ks(reading.result) == list(range(10))
    assert top.stats.state == typo.stats.state == "finished", (top.stats, typo.stats)


def test_deregistering_a_subscription_frees_its_topic_at_once() -> None:
    """``ctx.deregister_table`` of a subscription nobody reads: the topic's producer stops
    waiting for it at once, by the subscription's close, not by its provider being
    collected (a dashboard script saw it freed only by ``gc.collect()``, if at all)."""
    topic = Topic("t", SCHEMA)
    ctx = in_order()
    sub = topic.subscribe(ctx, "gone", capacity=1)
    ctx.deregister_table("gone")
    for i in range(5):
        topic.write(batch(1, start=i), timeout=WAIT)
    assert topic.stats.waiting_writers == 0
    assert sub.stats.state == "finished", sub.stats
    topic.close()
