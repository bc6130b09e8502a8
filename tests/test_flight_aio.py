"""The asyncio face of the remote client against real ``pushtable serve`` processes.

Many tasks reading and writing at once, a query cancelled mid-stream (its server-side query
stops: the table's producer is told), a slow consumer (the queue between the reader thread
and the loop stays bounded), a server killed mid-stream (the waiting task raises), errors by
class, and no thread left after ``aclose()``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pushtable import (
    PermissionDeniedError,
    PushTableError,
    ReaderGoneError,
    ServerStoppedError,
    ServerUnavailableError,
    StreamFailedError,
    TableExistsError,
    UnknownTableError,
)
from pushtable.flight.client.aio import AsyncClient, AsyncSink
from tests.conftest import WAIT, no_aio_threads, serve_process

pytestmark = pytest.mark.asyncio

SCHEMA = pa.schema(
    [
        pa.field("k", pa.int64()),
        pa.field("at", pa.timestamp("us", tz="Europe/Paris")),
        pa.field("amount", pa.decimal128(12, 2)),
        pa.field("tags", pa.list_(pa.string())),
    ]
)


def batch(first: int, rows: int = 100) -> pa.RecordBatch:
    """Keys ``first..``, zoned times, decimals, nested lists and nulls."""
    ks = list(range(first, first + rows))
    return pa.record_batch(
        {
            "k": ks,
            "at": [None if k % 7 == 0 else k * 1_000_000 for k in ks],
            "amount": [None if k % 5 == 0 else Decimal(k * 101) / 100 for k in ks],
            "tags": [None if k % 3 == 0 else [str(k)] for k in ks],
        },
        schema=SCHEMA,
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, str]]:
    """``pushtable serve`` in a child process (a data dir for durable topics)."""
    with serve_process({}, tmp_path, "--data-dir", str(tmp_path / "data")) as served:
        yield served


async def write_on(sink: AsyncSink) -> None:
    """Write and flush until the sink raises (the caller bounds the wait)."""
    while True:
        await sink.write(batch(100))
        await sink.flush()


async def test_many_tasks_read_and_write_at_once_every_row_once(
    served: tuple[Any, str],
) -> None:
    _, location = served
    async with await AsyncClient.connect(location) as client:
        for name in ("a", "b", "c"):
            await client.create_table(name, SCHEMA, capacity=4)
        results = {n: client.sql(f"SELECT k, at, amount, tags FROM {n}") for n in "abc"}

        async def produce(name: str, producers: int) -> None:
            sinks = [await client.sink(name) for _ in range(producers)]

            async def one(i: int) -> None:
                for j in range(10):
                    await sinks[i].write(batch((i * 10 + j) * 100))

            await asyncio.gather(*(one(i) for i in range(producers)))
            for s in sinks:
                await s.flush()
            await sinks[0].close()  # the table's end: its query ends

        async def consume(name: str) -> pa.Table:
            return await results[name].read_all()

        got = await asyncio.wait_for(
            asyncio.gather(
                *(produce(n, p) for n, p in zip("abc", (1, 2, 3), strict=True)),
                *(consume(n) for n in "abc"),
            ),
            WAIT,
        )
    for producers, table in zip((1, 2, 3), got[3:], strict=True):
        want = pa.Table.from_batches([batch(b * 100) for b in range(producers * 10)])
        assert table.sort_by("k").equals(want)  # every row once, types and nulls exact
    await no_aio_threads()


async def test_a_task_cancelled_mid_stream_stops_the_servers_query(
    served: tuple[Any, str],
) -> None:
    _, location = served
    async with await AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=2)
        rows = client.sql("SELECT k FROM t")
        sink = await client.sink("t")
        await sink.write(batch(0))
        first = asyncio.Event()

        async def read() -> None:
            async for _ in rows:
                first.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), WAIT)
        reader.cancel()  # while it waits for the next batch
        with pytest.raises(asyncio.CancelledError):
            await reader
        # The server's query is gone: the table's producer learns it, within the bound.
        with pytest.raises(ReaderGoneError):
            await asyncio.wait_for(write_on(sink), WAIT)
        await sink.aclose()
    await no_aio_threads()


async def test_leaving_the_loop_early_stops_the_query_and_its_thread(
    served: tuple[Any, str],
) -> None:
    _, location = served
    async with await AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA)
        sink = await client.sink("t")
        async with client.sql("SELECT k FROM t") as rows:
            await sink.write(batch(0))
            async for got in rows:
                assert got.num_rows == 100
                break
        await no_aio_threads("pushtable-aio-read")  # its reader ended with it
        with pytest.raises(ReaderGoneError):
            await asyncio.wait_for(write_on(sink), WAIT)
        await sink.aclose()


async def test_a_slow_consumer_holds_the_stream_within_its_queue(
    served: tuple[Any, str],
) -> None:
    """The reader thread holds at most ``max_queued`` batches ahead of the loop; the rest waits
    in Flight and the server."""
    _, location = served
    async with await AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=64)
        sink = await client.sink("t")
        for i in range(40):
            await sink.write(batch(i * 100))
        await sink.close()  # all 40 wait on the server: only the queue limits the thread
        rows = client.sql("SELECT k FROM t", max_queued=2)
        first = await asyncio.wait_for(rows.__anext__(), WAIT)
        assert rows._queue is not None
        queue = rows._queue

        async def filled() -> None:
            while queue.async_q.qsize() < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(filled(), WAIT)  # the thread fills the queue, then waits
        seen, deepest = first.num_rows, 0
        async for got in rows:
            deepest = max(deepest, rows._queue.async_q.qsize())
            seen += got.num_rows
    assert seen == 4000
    assert deepest <= 2


@pytest.mark.parametrize(
    ("sig", "error", "says"),
    [
        (signal.SIGKILL, ServerUnavailableError, "unavailable|reach"),
        # A stopping server fails its tables: the query says so, naming the stop.
        (signal.SIGTERM, StreamFailedError, "ServerStoppedError: the pushtable server stopped"),
    ],
    ids=["killed", "stopped"],
)
async def test_a_server_killed_or_stopped_mid_stream_makes_the_waiting_task_raise(
    tmp_path: Path, sig: signal.Signals, error: type[Exception], says: str
) -> None:
    with serve_process({}, tmp_path) as (proc, location):
        client = await AsyncClient.connect(location)
        try:
            await client.create_table("t", SCHEMA)
            rows = client.sql("SELECT k FROM t")
            sink = await client.sink("t")
            await sink.write(batch(0))
            got = await asyncio.wait_for(rows.__anext__(), WAIT)
            assert got.num_rows == 100
            waiting = asyncio.create_task(rows.__anext__())
            proc.send_signal(sig)
            with pytest.raises(error, match=says):
                await asyncio.wait_for(waiting, WAIT)
            with pytest.raises((ServerStoppedError, ServerUnavailableError)):  # the sink's too
                await asyncio.wait_for(write_on(sink), WAIT)
        finally:
            await client.aclose()
    await no_aio_threads()


async def test_errors_cross_by_class(tmp_path: Path) -> None:
    config = {
        "tokens": [
            {"name": "ops", "secret": "ops-secret", "role": "admin"},
            {"name": "dash", "secret": "reader", "role": "read", "tables": ["t"]},
        ]
    }
    with serve_process(config, tmp_path) as (_, location):
        async with await AsyncClient.connect(location, token="ops-secret") as client:
            await client.create_table("t", SCHEMA)
            with pytest.raises(TableExistsError):
                await client.create_table("t", SCHEMA)
            with pytest.raises(UnknownTableError):
                await client.schema("nope")
            with pytest.raises(PushTableError) as sync_error:
                await asyncio.to_thread(lambda: client.sync.sql("SELECT * FROM nope").read_all())
            # The async face raises what the sync one does, class and message.
            with pytest.raises(type(sync_error.value), match=r"public\.nope' not found"):
                await client.sql("SELECT * FROM nope").read_all()
        async with await AsyncClient.connect(location, token="reader") as reader:
            sink = await reader.sink("t")
            with pytest.raises(PermissionDeniedError):  # a read token cannot push
                await sink.write(batch(0))
                await sink.flush()
            await sink.aclose()
    await no_aio_threads()


async def test_a_durable_producer_awaits_its_commits(served: tuple[Any, str]) -> None:
    _, location = served
    async with await AsyncClient.connect(location) as client:
        await client.create_topic("ticks", SCHEMA, durable=True)
        sink = await client.sink("ticks", producer_id="p")
        for i in range(5):
            await sink.write(batch(i * 100))
        await sink.flush()
        assert (await client.offsets("ticks"))["committed"] == 5
        got = await client.read("ticks", 0, 5).read_all()
        assert got.equals(pa.Table.from_batches([batch(i * 100) for i in range(5)]))
        await sink.aclose()


async def test_a_subscription_to_a_topic_streams_to_the_loop(served: tuple[Any, str]) -> None:
    _, location = served
    async with await AsyncClient.connect(location) as client:
        await client.create_topic("ticks", SCHEMA)
        await client.subscribe("ticks", "mine")
        async with client.sql("SELECT k, amount, tags FROM mine") as rows:
            sink = await client.sink("ticks")
            await sink.write(batch(0))
            first = await asyncio.wait_for(rows.__anext__(), WAIT)
            await sink.write(batch(100))
            await sink.close()  # the topic ends: so does the subscription's query
            rest = [b async for b in rows]
    got = pa.Table.from_batches([first, *rest])
    want = pa.Table.from_batches([batch(0), batch(100)]).select(["k", "amount", "tags"])
    assert got.equals(want)
