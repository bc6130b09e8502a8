"""The asyncio face as a service runs on it: each write's outcome to its own task, bounded and
cancel-safe shutdown, nothing leaked, the sync face's API, every error a ``PushTableError``.

Against real ``pushtable serve`` processes (tests/conftest.py ``serve_process``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pytest

from pushtable.errors import (
    ClientClosedError,
    PushTableError,
    ReaderGoneError,
    ResourceLimitError,
    SchemaMismatchError,
    ServerStoppedError,
    SinkClosedError,
    StreamFailedError,
    TableExistsError,
    UnknownTableError,
    WriteTimeoutError,
)
from pushtable.flight.client.aio import AsyncClient
from tests.conftest import WAIT, no_aio_threads, serve_process

pytestmark = pytest.mark.asyncio
T = TypeVar("T")

#: NOT NULL ``k``, a zoned timestamp, a decimal and a list with nulls: what services send
SCHEMA = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        ("ts", pa.timestamp("us", tz="Europe/Paris")),
        ("amount", pa.decimal128(12, 2)),
        ("tags", pa.list_(pa.string())),
    ]
)


def rows(*keys: int | None) -> pa.RecordBatch:
    """One row per key (None: a NULL in the NOT NULL column, which the server refuses)."""
    n = len(keys)
    return pa.record_batch(
        [
            pa.array(keys, pa.int64()),
            pa.array([1_700_000_000_000_000 + i for i in range(n)], SCHEMA.field("ts").type),
            pa.array([None if i % 2 else 10 * i for i in range(n)], pa.decimal128(12, 2)),
            pa.array([["a", None] if i % 2 else None for i in range(n)], pa.list_(pa.string())),
        ],
        schema=SCHEMA.set(0, pa.field("k", pa.int64())),
    )


@pytest.fixture
def served(tmp_path: Path) -> Any:
    with serve_process({}, tmp_path) as served:
        yield served


async def eventually(call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` once the server has room for it: a slot let go is free within the bound
    (the server sees a cancelled call end a moment after the client), one leaked never is."""
    for _ in range(int(WAIT / 0.05)):
        try:
            return await call()
        except ResourceLimitError:
            await asyncio.sleep(0.05)
    return await call()


async def keys_of(result: Any) -> list[int]:
    table = await result.read_all()
    return sorted(table["k"].to_pylist())


async def test_each_write_hears_its_own_outcome_and_a_refusal_costs_only_its_batch(
    served: tuple[Any, str],
) -> None:
    """A: wrong type, refused on the loop side; B: a NULL in NOT NULL, refused by the server,
    with C's batch sent after it on the same stream: B's write raises, C's (and D's) are
    stored. It used to hand A's error to B, C and D and store nothing."""
    _, location = served
    async with AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=64)
        result = client.sql("SELECT k, ts, amount, tags FROM t")
        sink = await client.sink("t")
        wrong = pa.record_batch({"k": pa.array(["x"])})
        with pytest.raises(SchemaMismatchError, match="'k'"):
            await sink.write(wrong)  # checked before it is queued
        b = await sink.send(rows(None))  # in flight together: C goes after B on the stream
        c = await sink.send(rows(1, 2))
        d = asyncio.create_task(sink.write(rows(3)))
        with pytest.raises(SchemaMismatchError, match="NOT NULL"):
            await asyncio.wait_for(b, WAIT)
        await asyncio.wait_for(c, WAIT)
        await asyncio.wait_for(d, WAIT)
        await sink.write(rows(4))  # the sink goes on
        await sink.flush(timeout=WAIT)
        stats = await sink.stats()
        await sink.close(timeout=WAIT)
        assert await asyncio.wait_for(keys_of(result), WAIT) == [1, 2, 3, 4]
        assert stats.table.rows == 4
    await no_aio_threads()


async def test_an_idempotent_producers_refused_batch_costs_only_its_write(
    tmp_path: Path,
) -> None:
    """The same into a durable topic through an idempotent sink: B (a NULL in NOT NULL) is
    refused to its own write; C, sent after it on the same stream, takes B's number and is
    stored; so is D. B used to stay in the sink, sent again and refused with every call,
    and nothing written after it was stored."""
    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (_, location):
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ticks", SCHEMA, durable=True)
            sink = await client.sink("ticks", producer_id="p", retry=WAIT)
            await sink.write(rows(1))
            b = await sink.send(rows(None))
            c = await sink.send(rows(2))
            with pytest.raises(SchemaMismatchError, match="NOT NULL"):
                await asyncio.wait_for(b, WAIT)
            await asyncio.wait_for(c, WAIT)
            await sink.write(rows(3))
            await sink.flush(timeout=WAIT)
            got = await client.read("ticks", 0, 3).read_all()
            assert got["k"].to_pylist() == [1, 2, 3]
            assert (await client.offsets("ticks"))["next"] == 3  # each once
    await no_aio_threads()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_sink_goes_on_after_the_server_restarts(tmp_path: Path) -> None:
    """After a restart (same port) the old sink writes again once its table is back; it
    used to raise ServerUnavailableError on every write for good."""
    port = _free_port()
    with serve_process({}, tmp_path, port=port) as (proc, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA)
        sink = await client.sink("t")
        await sink.write(rows(1))
        proc.send_signal(signal.SIGTERM)
        proc.wait(WAIT)
    with pytest.raises(PushTableError):  # stopped, or unreachable: said, by class
        await sink.write(rows(2), timeout=WAIT)
    with serve_process({}, tmp_path, port=port):
        await client.create_table("t", SCHEMA)
        result = client.sql("SELECT k FROM t")
        await sink.write(rows(3), timeout=WAIT)
        await sink.close(timeout=WAIT)
        assert await asyncio.wait_for(keys_of(result), WAIT) == [3]
        await client.aclose()
    await no_aio_threads()


async def test_an_idempotent_async_producer_rides_out_a_killed_server(tmp_path: Path) -> None:
    """A write made while the server is down waits (within ``retry``), and is stored once
    the server is back, every batch exactly once: the outage is not its error."""
    port, data = _free_port(), str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_topic("ticks", SCHEMA, durable=True)
        sink = await client.sink("ticks", producer_id="p", retry=WAIT)
        for i in range(3):
            await sink.write(rows(i))
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    during = asyncio.create_task(sink.write(rows(3), timeout=2 * WAIT))
    await asyncio.sleep(0.5)  # time for a write that took the outage for its error to say so
    assert not during.done()
    with serve_process({}, tmp_path, "--data-dir", data, port=port):
        await asyncio.wait_for(during, 2 * WAIT)
        await sink.write(rows(4))
        await sink.flush(timeout=WAIT)
        got = await client.read("ticks", 0, 5).read_all()
        assert got["k"].to_pylist() == [0, 1, 2, 3, 4]
        await client.aclose()
    await no_aio_threads()


async def test_shutdown_with_a_full_table_is_bounded_and_holds_no_executor(
    served: tuple[Any, str],
) -> None:
    """A table nobody reads, full: ``write``, ``flush`` and ``close`` give up at their
    ``timeout`` (or when cancelled) at once, the loop's default executor stays free, and
    ``aclose`` returns within its bound. ``close`` used to take 35 s, and stuck joins filled
    the default executor."""
    _, location = served
    client = await AsyncClient.connect(location)
    await client.create_table("full", SCHEMA, capacity=1)
    sinks = []
    for _ in range(8):  # more than a 2-core machine's default executor holds threads
        sink = await client.sink("full", window=1)
        sinks.append(sink)
        with pytest.raises(WriteTimeoutError):  # the table fills: the rest waits
            for i in range(4):
                await sink.write(rows(i), timeout=0.5)
        with pytest.raises(WriteTimeoutError):
            await sink.flush(timeout=0.2)
        with pytest.raises(WriteTimeoutError):
            await sink.close(timeout=0.2)
        with pytest.raises(asyncio.TimeoutError):  # cancelled from outside: the same
            await asyncio.wait_for(sink.close(), 0.2)
    # Nothing of that holds a worker of the loop's default executor.
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), WAIT) == 42
    await asyncio.wait_for(client.aclose(timeout=1.0), WAIT)
    with pytest.raises(ClientClosedError):
        await client.tables()
    with pytest.raises(SinkClosedError):
        await sinks[0].write(rows(9))
    await no_aio_threads()


async def test_aclose_frees_a_stream_whose_batch_waits_for_room(tmp_path: Path) -> None:
    """A sink left with ``aclose`` while the server waits for room for its batch in flight
    frees its stream slot before ``aclose`` returns, and that batch is not stored (it was
    never acknowledged). The stream used to stay the server's until the table had room:
    with 2 streams a client, the second sink after it was refused."""
    config = {"limits": {"max_streams_per_client": 2}}
    with serve_process(config, tmp_path) as (_, location):
        async with AsyncClient.connect(location) as client:
            await client.create_table("full", SCHEMA, capacity=1)
            await client.create_topic("other", SCHEMA)
            stuck = await client.sink("full", window=2)
            await stuck.write(rows(1))  # queued in the table: full
            pending = await stuck.send(rows(2))  # in flight: the server waits for room for it
            await asyncio.wait_for(stuck.aclose(timeout=2.0), WAIT)
            with pytest.raises(SinkClosedError):  # never acknowledged: left with its sink
                await asyncio.wait_for(pending, WAIT)
            sinks = [await client.sink("other") for _ in range(2)]
            for i, sink in enumerate(sinks):
                await sink.write(rows(10 + i), timeout=WAIT)  # both slots free
            for sink in sinks:
                await sink.aclose()  # a query's DoGet takes a slot too
            reading = asyncio.create_task(keys_of(client.sql("SELECT k FROM full")))
            closer = await client.sink("full")
            await closer.close(timeout=WAIT)
            assert await asyncio.wait_for(reading, WAIT) == [1]
    await no_aio_threads()


async def test_leaving_sinks_and_results_frees_their_streams_and_queries(tmp_path: Path) -> None:
    """With 2 streams a client and 1 query allowed, 6 sinks left with ``aclose`` and 6
    results left with ``break`` (then dropped) leave room for the next: they used to hold
    their stream and query for good (refused at the 17th sink and the 9th query)."""
    config = {"limits": {"max_streams_per_client": 2, "max_queries": 1}}
    with serve_process(config, tmp_path) as (_, location):
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ev", SCHEMA)
            for i in range(6):
                sink = await client.sink("ev")  # aclose ended the last one's stream
                await sink.write(rows(i))
                await sink.aclose()

            async def first(name: str) -> None:
                async for _ in client.sql(f"SELECT k FROM {name}"):
                    break  # the result is dropped here, its query still running

            for i in range(6):
                sink = await client.sink("ev")

                async def subscribe_write_read(name: str = f"s{i}", k: int = i) -> None:
                    # a query refused its slot drops its subscription: a retry starts anew
                    with contextlib.suppress(TableExistsError):  # a write was the one refused
                        await client.subscribe("ev", name)
                    await sink.write(rows(k))  # noqa: B023 (awaited here)
                    await first(name)

                await eventually(subscribe_write_read)
                gc.collect()
                await sink.aclose()
            # the room comes back for good: a 7th subscription's query answers
            await client.subscribe("ev", "last")
            async with await client.sink("ev") as sink:
                await eventually(lambda: sink.write(rows(7)))
            assert await eventually(lambda: keys_of(client.sql("SELECT k FROM last"))) == [7]
    await no_aio_threads()


async def test_subscriptions_are_let_go_when_their_query_ends_is_refused_or_they_are_left(
    tmp_path: Path,
) -> None:
    """A subscription's name is free once its query ended; one whose query was refused (no
    query slot) or that was left holds no producer. One refused used to hold every producer
    of the topic (blocked after 29 writes) and its name stayed taken."""
    with serve_process({"limits": {"max_queries": 1}}, tmp_path) as (_, location):
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ev", SCHEMA)
            await client.subscribe("ev", "viewer", capacity=2)
            busy = await client.subscribe("ev", "busy", capacity=2)
            async with client.sql("SELECT k FROM busy") as running:
                sink = await client.sink("ev")
                await sink.write(rows(0))
                assert (await asyncio.wait_for(running.__anext__(), WAIT)).num_rows == 1
                with pytest.raises(ResourceLimitError, match="max_queries"):
                    await client.sql("SELECT k FROM viewer").read_all()
                # refused: "viewer" is gone, and holds nobody (capacity 2, 10 writes)
                await busy.aclose()  # left: neither does "busy", though its query runs
                await running.aclose()
            for i in range(10):
                await sink.write(rows(i), timeout=WAIT)
            names = {t["name"] for t in await client.tables()}
            assert {"viewer", "busy"}.isdisjoint(names), names
            with pytest.raises(UnknownTableError):
                await client.unsubscribe("viewer")
            async with await client.subscribe("ev", "viewer") as again:  # the name is free
                assert again.name == "viewer"
            held = await client.subscribe("ev", "held")  # dropped when its client leaves
            await sink.aclose()
        async with AsyncClient.connect(location) as other:
            names = {t["name"] for t in await other.tables()}
            assert held.name not in names, names
    await no_aio_threads()


async def test_the_async_sink_has_the_sync_faces_api(served: tuple[Any, str]) -> None:
    """``fail`` (and ``async with`` whose body raises) fails the reader's query; ``advance``
    keeps its place after queued batches; ``stats`` and ``closed``."""
    _, location = served
    async with AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA)
        result = client.sql("SELECT k FROM t")
        with pytest.raises(ValueError, match="boom"):
            async with await client.sink("t") as sink:
                await sink.write(rows(1))
                raise ValueError("boom")
        assert sink.closed
        with pytest.raises(StreamFailedError, match="ValueError: boom"):
            await asyncio.wait_for(result.read_all(), WAIT)

        schema = pa.schema([("ts", pa.int64()), ("v", pa.float64())])
        await client.create_table("o", schema, order_by="ts")
        windows = client.sql("SELECT ts / 10 AS w, count(*) AS n FROM o GROUP BY ts / 10")
        sink = await client.sink("o", window=2)
        sent = [
            await sink.send(pa.record_batch({"ts": [t, t + 1], "v": [1.0, None]}))
            for t in range(0, 30, 2)
        ]
        await sink.advance(40)  # after the batches queued before it, never overtaking them
        await asyncio.wait_for(asyncio.gather(*sent), WAIT)
        stats = await sink.stats()
        assert (stats.sent_batches, stats.acknowledged_batches) == (16, 16)
        await sink.close()
        got = await asyncio.wait_for(windows.read_all(), WAIT)
        assert sorted(zip(got["w"].to_pylist(), got["n"].to_pylist(), strict=True)) == [
            (0, 10),
            (1, 10),
            (2, 10),
        ]
    await no_aio_threads()


async def test_a_stopped_server_is_named_and_calls_after_close_are_pushtable_errors(
    tmp_path: Path,
) -> None:
    with serve_process({}, tmp_path) as (proc, location):
        client = await AsyncClient.connect(location)
        await client.create_table("t", SCHEMA)
        result = client.sql("SELECT k FROM t")
        sink = await client.sink("t")
        await sink.write(rows(1))
        assert (await asyncio.wait_for(result.__anext__(), WAIT)).num_rows == 1
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(StreamFailedError) as failed:
            await asyncio.wait_for(result.__anext__(), WAIT)
        assert isinstance(failed.value.error, ServerStoppedError), failed.value.error
        await sink.aclose()
        with pytest.raises(SinkClosedError):
            await sink.write(rows(2))
        await client.aclose()
        with pytest.raises(ClientClosedError):
            client.sql("SELECT 1")
        with pytest.raises(ClientClosedError):
            await client.sink("t")
    await no_aio_threads()


async def test_a_cancelled_write_that_was_not_sent_is_never_sent(
    served: tuple[Any, str],
) -> None:
    """A write waiting for room when its task is cancelled is abandoned: never stored."""
    _, location = served
    async with AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=1)
        sink = await client.sink("t", window=1)
        await sink.write(rows(1))  # queued in the table: full
        await sink.send(rows(2))  # in flight: the server waits for room to queue it
        blocked = asyncio.create_task(sink.write(rows(3)))  # waits for the window
        await asyncio.sleep(0)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        reading = asyncio.create_task(keys_of(client.sql("SELECT k FROM t")))
        await sink.close(timeout=WAIT)
        assert await asyncio.wait_for(reading, WAIT) == [1, 2]
    await no_aio_threads()


async def test_a_batch_withdrawn_while_it_waits_for_room_is_not_sent_when_room_comes(
    served: tuple[Any, str],
) -> None:
    """The sink looks at a withdrawal once the window has room, right before sending: a write
    whose task stopped waiting is never sent, whenever in its wait it stopped. (It was looked
    at only between the writer's 0.2 s steps, so room that came within the step the task was
    cancelled in sent it: CI stored [1, 2, 3] for the test above.)"""
    _, location = served
    async with AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=1)
        sink = await client.sink("t", window=1)
        await sink.write(rows(1))  # queued in the table: full
        await sink.send(rows(2))  # in flight: the server waits for room to queue it
        third = sink._item(rows(3))
        third.withdrawn = True  # withdrawn before room comes, as a cancelled task does
        submitting = asyncio.create_task(
            asyncio.to_thread(sink.sync.submit, third, time.monotonic() + WAIT)
        )
        reading = asyncio.create_task(keys_of(client.sql("SELECT k FROM t")))
        await asyncio.wait_for(submitting, WAIT)  # returned once room came: not sent
        await sink.close(timeout=WAIT)
        assert await asyncio.wait_for(reading, WAIT) == [1, 2]
    await no_aio_threads()


async def test_an_idempotent_producer_takes_back_its_newest_batch_if_withdrawn(
    tmp_path: Path,
) -> None:
    """Withdrawn before it went, the newest numbered batch is taken back: the next write
    takes its number, and the topic holds no gap and nothing withdrawn."""
    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (_, location):
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ticks", SCHEMA, durable=True)
            sink = await client.sink("ticks", producer_id="p", window=1)
            await sink.write(rows(1))
            second = sink._item(rows(2))
            second.withdrawn = True
            await asyncio.to_thread(sink.sync.submit, second, time.monotonic() + WAIT)
            assert second.sequence is None  # taken back, its number free again
            await sink.write(rows(3))
            await sink.flush(timeout=WAIT)
            got = await client.read("ticks", 0, 2).read_all()
            assert got["k"].to_pylist() == [1, 3]
            assert (await client.offsets("ticks"))["next"] == 2
    await no_aio_threads()


async def test_a_dropped_reader_reaches_the_writing_task(served: tuple[Any, str]) -> None:
    _, location = served
    async with AsyncClient.connect(location) as client:
        await client.create_table("t", SCHEMA, capacity=4)
        result = client.sql("SELECT k FROM t")
        sink = await client.sink("t")
        await sink.write(rows(1))
        await asyncio.wait_for(result.__anext__(), WAIT)
        await result.aclose()
        with pytest.raises(ReaderGoneError):
            for i in range(100):
                await sink.write(rows(i), timeout=WAIT)
        await sink.aclose()
    await no_aio_threads()
