"""Asyncio producers: awrite / aclose / ``async with``, backpressure and cancellation."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pytest

from pushtable import (
    ReaderGoneError,
    SchemaMismatchError,
    SessionContext,
    StreamFailedError,
    WriteTimeoutError,
)
from tests.conftest import SCHEMA, WAIT, batch, query

pytestmark = pytest.mark.asyncio


async def test_many_async_producers_every_row_once(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    reader = query(ctx, "SELECT count(*) AS n, count(DISTINCT k) AS d FROM t")

    async def produce(i: int) -> None:
        for j in range(20):
            await sink.awrite(batch(5, (i * 20 + j) * 5), timeout=30)

    await asyncio.wait_for(asyncio.gather(*(produce(i) for i in range(16))), 60)
    await sink.aclose()
    assert reader.join() == {"n": [1600], "d": [1600]}


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` on the loop (the caller bounds the wait)."""
    while not condition():
        await asyncio.sleep(0.001)


async def test_awrite_suspends_instead_of_blocking_the_loop(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    await sink.awrite(batch(1))
    # If awrite blocked the loop, nothing below would run until this watchdog closed the sink.
    watchdog = threading.Timer(WAIT, sink.close)
    watchdog.start()
    try:
        pending = asyncio.create_task(sink.awrite(batch(1, 1), timeout=WAIT))
        # The loop keeps running (this poll is on it) until the write is seen waiting for
        # room: the event that shows the writer blocked, not a sleep that hopes it is.
        await asyncio.wait_for(until(lambda: sink.stats.waiting_writers == 1), WAIT)
        assert not sink.stats.closed, "the loop was blocked until the watchdog fired"
        assert not pending.done()
        reader = query(ctx, "SELECT count(*) AS n FROM t")
        await asyncio.wait_for(pending, WAIT)
        await sink.aclose()
        assert reader.join() == {"n": [2]}
    finally:
        watchdog.cancel()


async def test_awrite_timeout(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    await sink.awrite(batch(1))
    with pytest.raises(WriteTimeoutError):
        await sink.awrite(batch(1), timeout=0.2)
    assert sink.stats.batches == 1


async def test_cancelled_awrite_leaves_its_batch_unwritten(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    await sink.awrite(batch(1))
    task = asyncio.create_task(sink.awrite(batch(1, 1)))
    await _until(lambda: sink.stats.waiting_writers == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: sink.stats.waiting_writers == 0)  # the thread let go of it
    reader = query(ctx, "SELECT k FROM t")
    await sink.aclose()
    assert reader.join() == {"k": [0]}


async def test_a_timeout_is_honoured_behind_a_write_without_one(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    await sink.awrite(batch(1))
    forever = asyncio.create_task(sink.awrite(batch(1, 1)))  # no timeout: waits for a reader
    await _until(lambda: sink.stats.waiting_writers == 1)
    with pytest.raises(WriteTimeoutError):
        await asyncio.wait_for(sink.awrite(batch(1, 2), timeout=0.2), WAIT)
    forever.cancel()
    with pytest.raises(asyncio.CancelledError):
        await forever
    assert sink.stats.batches == 1


async def test_a_stream_is_read_lazily_off_the_loop_with_backpressure(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    pulled = 0

    def produce() -> Iterator[pa.RecordBatch]:
        nonlocal pulled
        for i in range(20):
            pulled += 1
            yield batch(1, i)

    stream = pa.RecordBatchReader.from_batches(SCHEMA, produce())
    task = asyncio.create_task(sink.awrite(stream, timeout=WAIT))
    await _until(lambda: sink.stats.waiting_writers == 1)
    # 2 queued + 1 waiting for room: the rest of the stream has not been read.
    assert pulled == 3
    reader = query(ctx, "SELECT count(*) AS n FROM t")
    await asyncio.wait_for(task, WAIT)
    await sink.aclose()
    assert reader.join() == {"n": [20]}
    assert pulled == 20


async def test_cancelling_a_stream_write_keeps_only_what_was_queued(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    table = pa.Table.from_batches([batch(1, i) for i in range(5)])
    task = asyncio.create_task(sink.awrite(table))
    await _until(lambda: sink.stats.waiting_writers == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: sink.stats.waiting_writers == 0)
    reader = query(ctx, "SELECT k FROM t")
    await sink.aclose()
    assert sorted(reader.join()["k"]) == [0, 1]  # batches 2-4 were never enqueued


async def test_awrite_timeout_on_a_stream_reports_what_it_queued(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=2)
    with pytest.raises(WriteTimeoutError) as info:
        await sink.awrite(pa.Table.from_batches([batch(1, i) for i in range(4)]), timeout=0.1)
    assert info.value.batches_written == 2
    assert sink.stats.batches == 2


async def _until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition()``; fail after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.001)


async def test_awrite_raises_the_same_errors_as_write(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    with pytest.raises(SchemaMismatchError):
        await sink.awrite(batch(1).select(["k"]))
    ctx.deregister_table("t")
    with pytest.raises(ReaderGoneError):
        await sink.awrite(batch(1))


async def test_async_with_closes_or_fails(ctx: SessionContext) -> None:
    good = ctx.register_streaming_table("good", SCHEMA)
    async with good:
        await good.awrite(batch(2))
    assert good.closed
    assert good.error is None
    bad = ctx.register_streaming_table("bad", SCHEMA)
    with pytest.raises(ZeroDivisionError):
        async with bad:
            await bad.awrite(batch(1))
            _ = 1 / 0
    assert isinstance(bad.error, ZeroDivisionError)
    with pytest.raises(StreamFailedError, match="ZeroDivisionError") as info:
        ctx.sql("SELECT * FROM bad").collect()
    assert info.value.error is bad.error
