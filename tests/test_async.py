"""Asyncio producers: awrite / aclose / ``async with``, backpressure and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pushtable import ReaderGoneError, SchemaMismatchError, SessionContext, WriteTimeoutError
from tests.conftest import SCHEMA, batch, query

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


async def test_awrite_suspends_instead_of_blocking_the_loop(ctx: SessionContext) -> None:
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    await sink.awrite(batch(1))
    pending = asyncio.create_task(sink.awrite(batch(1, 1), timeout=30))
    ticks = 0
    for _ in range(20):  # the loop keeps running while the write waits for room
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 20
    assert not pending.done()
    reader = query(ctx, "SELECT count(*) AS n FROM t")
    await asyncio.wait_for(pending, 30)
    await sink.aclose()
    assert reader.join() == {"n": [2]}


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
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)  # longer than the writer thread's slice
    reader = query(ctx, "SELECT k FROM t")
    await sink.aclose()
    assert reader.join() == {"k": [0]}


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
    with pytest.raises(Exception, match="ZeroDivisionError"):
        ctx.sql("SELECT * FROM bad").collect()
