"""The client keeps its word: a timeout bounds the whole call, ``aclose`` frees what it holds, a
write's outcome is exact, and a refusal reaches its own task only.

Against real ``pushtable serve`` processes (tests/conftest.py ``serve_process``), paused with
SIGSTOP where a server that reads nothing is the case. Each bound is a promise of the docs
(docs/network.md, "What a call's outcome says"): a call returns within its ``timeout`` plus
``MARGIN_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pushtable.errors import (
    PushTableError,
    ReaderGoneError,
    ResourceLimitError,
    SchemaMismatchError,
    ServerUnavailableError,
    SinkClosedError,
    WriteTimeoutError,
)
from pushtable.flight import connect
from pushtable.flight.client.aio import AsyncClient
from pushtable.flight.client.aio_threads import off_loop
from pushtable.flight.client.idempotent import IdempotentSink
from tests.conftest import WAIT, Background, aio_threads, no_aio_threads, serve_process

#: how far past its timeout a call may return (a thread's wake-up, a leave's round trip)
MARGIN_S = 1.5
#: rows of a batch of 8 MiB (one int64 column): past gRPC's flow-control window on its own
BIG_ROWS = 1 << 20

SCHEMA = pa.schema([pa.field("k", pa.int64(), nullable=False), ("v", pa.int64())])


def big(k: int) -> pa.RecordBatch:
    """8 MiB of rows, every one keyed ``k``."""
    return pa.record_batch(
        [pa.array([k] * BIG_ROWS, pa.int64()), pa.array(range(BIG_ROWS), pa.int64())],
        schema=SCHEMA,
    )


def rows(*keys: int | None) -> pa.RecordBatch:
    """One row per key (None: a NULL in the NOT NULL column, which the server refuses)."""
    return pa.record_batch(
        [pa.array(keys, pa.int64()), pa.array([7] * len(keys), pa.int64())],
        schema=SCHEMA.set(0, pa.field("k", pa.int64())),
    )


def counts(location: str, table: str) -> dict[int, int]:
    """Rows per key of ``table`` (a query that ends when the table does)."""
    with connect(location) as client:
        got = client.sql(f"SELECT k, count(*) AS n FROM {table} GROUP BY k").read_all()
    return dict(zip(got["k"].to_pylist(), got["n"].to_pylist(), strict=True))


def stream_threads() -> list[threading.Thread]:
    """A producer stream's threads (acknowledgements, sender) still running."""
    return [t for t in threading.enumerate() if t.name in ("pushtable-acks", "pushtable-send")]


@contextlib.contextmanager
def paused(proc: Any) -> Iterator[None]:
    """The server process stopped (SIGSTOP) for the block: it reads nothing, answers nothing."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed while stopped
            os.kill(proc.pid, signal.SIGCONT)


def timed(fn: Any) -> tuple[float, BaseException | None]:
    """How long ``fn()`` took and what it raised (a PushTableError), bounded by WAIT."""
    call = Background(fn)
    started = time.monotonic()
    assert call.done.wait(WAIT), "the call outlived every bound"
    return time.monotonic() - started, call.error


def test_a_sync_write_is_bounded_while_grpc_holds_its_batch_and_its_outcome_is_exact(
    tmp_path: Path,
) -> None:
    """A table of capacity 1 that nobody reads, 8 MiB batches: gRPC stops taking the stream's
    messages once its flow-control window is full, and a ``write(timeout=2)`` returns by its
    timeout, saying whether its batch is on its way (``kept``) or was never sent. Once read,
    the table holds each acknowledged and each kept batch once, and no batch a write said it
    did not send. (It blocked inside gRPC for over 40 s, under the sink's lock.)"""
    with serve_process({}, tmp_path) as (_, location):
        client = connect(location)
        client.create_table("t", SCHEMA, capacity=1)
        # a window wide enough that gRPC, not the window, is what stops taking batches
        sink = client.sink("t", window=64, window_bytes=1 << 31)
        outcomes: dict[int, str] = {}
        for k in range(48):
            if "not sent" in outcomes.values():
                break
            took, error = timed(lambda k=k: sink.write(big(k), timeout=2.0))
            assert took < 2.0 + MARGIN_S, (k, took)
            if error is None:
                outcomes[k] = "sent"
                continue
            assert isinstance(error, WriteTimeoutError), error
            outcomes[k] = "kept" if error.kept else "not sent"  # type: ignore[attr-defined]
            assert error.batches_written == (1 if error.kept else 0)  # type: ignore[attr-defined]
        assert "kept" in outcomes.values(), outcomes
        assert "not sent" in outcomes.values(), outcomes
        reading = Background(lambda: counts(location, "t"))
        sink.close(timeout=WAIT)
        assert reading.done.wait(WAIT)
        stored = reading.result
        for k, outcome in outcomes.items():
            assert stored.get(k, 0) == (0 if outcome == "not sent" else BIG_ROWS), (k, outcome)
        client.close()


def test_close_is_bounded_while_a_write_blocks_in_grpc(tmp_path: Path) -> None:
    """``Client.close()`` leaves its sinks' streams within its bound even when a write with no
    timeout blocks in gRPC or waits for room: that write raises ``SinkClosedError`` and the
    server's slot is free. (``close`` waited on the sink's lock behind the write, for good.)"""
    config = {"limits": {"max_streams_per_client": 2}}
    with serve_process(config, tmp_path) as (_, location):
        client = connect(location)
        client.create_table("t", SCHEMA, capacity=1)
        sink = client.sink("t")

        def write_all() -> None:
            for k in range(20):
                sink.write(big(k))

        writing = Background(write_all)
        assert not writing.done.wait(3.0)  # blocked: the table is full, nobody reads
        took, error = timed(client.close)
        assert error is None, error
        assert took < 5.0 + MARGIN_S, took
        assert writing.done.wait(WAIT)
        assert isinstance(writing.error, SinkClosedError), writing.error
        with connect(location) as other:  # the slots are free: two streams at once
            other.create_table("u", SCHEMA, capacity=4)
            sinks = [other.sink("u") for _ in range(2)]
            for i, s in enumerate(sinks):
                s.write(rows(i), timeout=WAIT)
                s.flush(timeout=WAIT)


def test_aclose_returns_within_its_timeout_and_frees_the_slot_and_threads(
    tmp_path: Path,
) -> None:
    """``aclose(timeout=3)`` on a sink whose writes gRPC holds (8 MiB batches into a full
    table) returns within 3 s plus the margin, its slot on the server and every thread of the
    sink gone: the next two sinks of a client allowed two streams write. (It took 6 s, its
    threads stayed, and the next sink was refused by ``max_streams_per_client``.)"""
    config = {"limits": {"max_streams_per_client": 2}}

    async def main(location: str) -> None:
        async with AsyncClient.connect(location) as client:
            await client.create_table("t", SCHEMA, capacity=1)
            await client.create_table("u", SCHEMA, capacity=4)
            stuck = await client.sink("t")
            outcomes = [await stuck.send(big(k)) for k in range(3)]
            pending = [asyncio.create_task(stuck.write(big(k))) for k in range(3, 6)]
            await asyncio.sleep(2.0)  # the server waits for room; gRPC holds the rest
            assert not all(task.done() for task in pending)
            started = time.monotonic()
            await stuck.aclose(timeout=3.0)
            assert time.monotonic() - started < 3.0 + MARGIN_S
            assert not aio_threads("pushtable-aio-write")
            assert not stream_threads(), stream_threads()
            for task in pending:
                with contextlib.suppress(PushTableError):
                    await asyncio.wait_for(task, WAIT)
            for outcome in outcomes:
                with contextlib.suppress(PushTableError):
                    await asyncio.wait_for(outcome, WAIT)
            sinks = [await client.sink("u") for _ in range(2)]
            for i, sink in enumerate(sinks):
                await sink.write(rows(i), timeout=WAIT)
            for sink in sinks:
                await sink.aclose(timeout=WAIT)
        await no_aio_threads()

    with serve_process(config, tmp_path) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))


def test_an_async_idempotent_write_timed_out_before_it_was_sent_is_never_stored(
    tmp_path: Path,
) -> None:
    """Window 1, the server paused: a write waiting for room times out, saying its batch was
    not sent (``kept`` False, ``batches_written`` 0); the producer writes it again, the server
    resumes: it is stored once. (The timed-out batch was sent anyway: stored [0, 1, 2, 2].)"""

    async def main(proc: Any, location: str) -> list[int]:
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ticks", SCHEMA, durable=True)
            sink = await client.sink("ticks", producer_id="p", window=1)
            await sink.write(rows(0), timeout=WAIT)
            with paused(proc):
                first = await sink.send(rows(1))  # in flight: the window is full
                with pytest.raises(WriteTimeoutError) as timed_out:
                    await sink.write(rows(2), timeout=1.0)
                assert timed_out.value.kept is False  # type: ignore[attr-defined]
                assert timed_out.value.batches_written == 0
                again = asyncio.create_task(sink.write(rows(2)))
                await asyncio.sleep(0.5)
            await asyncio.wait_for(first, WAIT)
            await asyncio.wait_for(again, WAIT)
            await sink.flush(timeout=WAIT)
            following = (await client.offsets("ticks"))["next"]
            got = await client.read("ticks", 0, following).read_all()
            return list(got["k"].to_pylist())

    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (proc, location):
        assert asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT)) == [0, 1, 2]


def test_a_batch_withdrawn_anywhere_in_the_window_is_never_sent(tmp_path: Path) -> None:
    """Window 1, the server paused: two numbered writes time out one after the other (the
    first is no longer the newest when the second is numbered), a third waits. Neither timed
    out batch is ever sent; the third is stored, numbered without a gap. (Only the newest
    could be taken back: an older one was sent as numbered.)"""

    async def main(proc: Any, location: str) -> tuple[list[int], int]:
        async with AsyncClient.connect(location) as client:
            await client.create_topic("ticks", SCHEMA, durable=True)
            sink = await client.sink("ticks", producer_id="p", window=1)
            await sink.write(rows(0), timeout=WAIT)
            with paused(proc):
                held = await sink.send(rows(1))  # in flight: the window is full
                late = []
                for k, timeout in ((2, 0.5), (3, 1.0)):
                    late.append(asyncio.create_task(sink.write(rows(k), timeout=timeout)))
                    await asyncio.sleep(0.1)
                waiting = asyncio.create_task(sink.write(rows(4)))
                for task in late:
                    with pytest.raises(WriteTimeoutError) as timed_out:
                        await asyncio.wait_for(task, WAIT)
                    assert timed_out.value.kept is False  # type: ignore[attr-defined]
            await asyncio.wait_for(held, WAIT)
            await asyncio.wait_for(waiting, WAIT)
            await sink.flush(timeout=WAIT)
            following = (await client.offsets("ticks"))["next"]
            got = await client.read("ticks", 0, following).read_all()
            return list(got["k"].to_pylist()), following

    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (proc, location):
        keys, following = asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT))
    assert keys == [0, 1, 4]
    assert following == 3


def test_a_refusal_reaches_only_the_task_whose_batch_was_refused(tmp_path: Path) -> None:
    """One idempotent async sink shared by two tasks: A's batch is refused (a NULL in a NOT
    NULL column) while B writes and flushes. A's write raises the refusal; B's flush and
    writes do not, in every round. (B's flush raised A's refusal, 5 of 5 rounds.)"""

    async def round_of(client: AsyncClient, topic: str) -> None:
        sink = await client.sink(topic, producer_id=f"p-{topic}")

        async def a() -> None:
            with pytest.raises(SchemaMismatchError):
                await sink.write(rows(None), timeout=WAIT)

        async def b() -> None:
            for k in range(5):
                await sink.send(rows(k))
            await sink.flush(timeout=WAIT)

        await asyncio.gather(a(), b())
        await sink.flush(timeout=WAIT)
        got = await client.read(topic, 0, (await client.offsets(topic))["next"]).read_all()
        assert sorted(got["k"].to_pylist()) == list(range(5))
        await sink.aclose(timeout=WAIT)

    async def main(location: str) -> None:
        async with AsyncClient.connect(location) as client:
            for i in range(5):
                await client.create_topic(f"t{i}", SCHEMA, durable=True)
                await round_of(client, f"t{i}")
        await no_aio_threads()

    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))


def test_the_sync_close_and_a_durable_flush_are_bounded_by_their_timeouts(
    tmp_path: Path,
) -> None:
    """Against a paused server, ``close(timeout=1)`` raises ``WriteTimeoutError`` within its
    bound (it waited for the stream's end without one) and the table stays open: ``close``
    again once the server is back closes it. Against a killed server, an idempotent
    ``flush(timeout=0.3)`` returns within its bound (its reconnect pause slept up to 1 s past
    the deadline)."""
    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (proc, location):
        client = connect(location)
        client.create_table("t", SCHEMA, capacity=4)
        sink = client.sink("t")
        sink.write(rows(1), timeout=WAIT)
        with paused(proc):
            took, error = timed(lambda: sink.close(timeout=1.0))
        assert isinstance(error, WriteTimeoutError), error
        assert took < 1.0 + MARGIN_S, took
        assert not sink.closed
        reading = Background(lambda: counts(location, "t"))
        sink.close(timeout=WAIT)
        assert reading.done.wait(WAIT)
        assert reading.result == {1: 1}

        client.create_topic("d", SCHEMA, durable=True)
        durable = client.sink("d", producer_id="p", retry=WAIT)
        durable.write(rows(1), timeout=WAIT)
        durable.flush(timeout=WAIT)
        proc.kill()
        proc.wait(WAIT)
        took, error = timed(lambda: durable.write(rows(2), timeout=0.3))
        assert took < 0.3 + MARGIN_S, took
        assert isinstance(error, (WriteTimeoutError, ServerUnavailableError)), error
        assert getattr(error, "kept", False), error  # the server is gone: the batch is kept
        for _ in range(3):
            took, error = timed(lambda: durable.flush(timeout=0.3))
            assert took < 0.3 + MARGIN_S, took
            assert isinstance(error, (WriteTimeoutError, ServerUnavailableError)), error
        client.close()


def test_aclose_of_a_result_while_its_query_opens_stops_the_query(tmp_path: Path) -> None:
    """A task opening a query when another leaves the result (``aclose``): the query stops as
    soon as it opens, freeing its slot (``max_queries`` 1: the next query runs). (The query
    went on reading the table for nobody, and the next was refused.)"""

    async def main(location: str) -> None:
        async with AsyncClient.connect(location) as client:
            await client.create_table("t", SCHEMA, capacity=4)
            await client.create_table("u", SCHEMA, capacity=4)
            result = client.sql("SELECT k FROM t")
            opening = asyncio.create_task(result.__anext__())
            await asyncio.sleep(0)  # the task runs to its open's await: the query is opening
            await result.aclose(timeout=WAIT)
            feeder = await client.sink("t")
            with contextlib.suppress(ReaderGoneError):  # the query, stopped, is gone
                await feeder.write(rows(1), timeout=WAIT)
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(opening, WAIT)
            await feeder.aclose(timeout=WAIT)
            sink = await client.sink("u")
            await sink.write(rows(3), timeout=WAIT)
            await sink.close(timeout=WAIT)
            deadline = time.monotonic() + WAIT
            while True:  # the server frees the slot once it sees the query cancelled
                try:
                    got = await client.sql("SELECT k FROM u").read_all()
                    break
                except ResourceLimitError:
                    assert time.monotonic() < deadline, "the left query kept its slot"
                    await asyncio.sleep(0.05)
            assert got["k"].to_pylist() == [3]
        await no_aio_threads()

    config = {"limits": {"max_queries": 1}}
    with serve_process(config, tmp_path) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))


def test_calls_on_a_sink_whose_client_left_say_so(tmp_path: Path) -> None:
    """After ``Client.close()``, a sink's ``flush`` raises ``SinkClosedError`` (it said all was
    acknowledged while a batch was never taken), and an idempotent write is refused with its
    batch not kept (it said ``kept=True`` for a batch it could never send)."""
    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (_, location):
        client = connect(location)
        client.create_table("t", SCHEMA, capacity=4)
        client.create_topic("d", SCHEMA, durable=True)
        plain = client.sink("t")
        durable = client.sink("d", producer_id="p")
        plain.write(rows(1), timeout=WAIT)
        durable.write(rows(1), timeout=WAIT)
        durable.flush(timeout=WAIT)
        client.close()
        with pytest.raises(SinkClosedError):
            plain.flush(timeout=WAIT)
        with pytest.raises(SinkClosedError) as refused:
            durable.write(rows(2), timeout=WAIT)
        assert not getattr(refused.value, "kept", False)
        assert refused.value.batches_written == 0
        assert isinstance(durable, IdempotentSink)
        assert durable.unacknowledged == 0


def test_an_async_idempotent_write_gives_up_after_retry(tmp_path: Path) -> None:
    """``retry=2``, the server killed: a write with no timeout raises ``ServerUnavailableError``
    within ``retry`` plus the margin, saying its batch is kept (it waited for good: the
    writer's 0.2 s steps each started a new outage)."""

    async def main(proc: Any, location: str) -> None:
        async with AsyncClient.connect(location) as client:
            await client.create_topic("d", SCHEMA, durable=True)
            sink = await client.sink("d", producer_id="p", retry=2.0)
            await sink.write(rows(0), timeout=WAIT)
            proc.kill()
            proc.wait(WAIT)
            started = time.monotonic()
            with pytest.raises(ServerUnavailableError) as gave_up:
                await asyncio.wait_for(sink.write(rows(1)), WAIT)
            assert time.monotonic() - started < 2.0 + MARGIN_S + 1.0  # a reconnect pause
            assert getattr(gave_up.value, "kept", False)
            with contextlib.suppress(PushTableError):
                await sink.aclose(timeout=WAIT)

    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (proc, location):
        asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT))


def test_a_kept_batchs_later_refusal_reaches_the_next_flush(tmp_path: Path) -> None:
    """An async write times out while its batch is on its way (``kept=True``): the server
    holds the batch before it (its table is full). Once a reader makes room the server
    refuses the kept batch (a NULL in a NOT NULL column): no task waits for it any more, so
    the sink's next ``flush`` raises the refusal. (That flush returned normally: the loss was
    told to nobody.)"""

    async def main(location: str) -> None:
        async with AsyncClient.connect(location) as client:
            await client.create_table("t", SCHEMA, capacity=1)
            sink = await client.sink("t")
            first = await sink.send(rows(0))  # queued in the table: full
            second = await sink.send(rows(1))  # the server waits for room for it
            with pytest.raises(WriteTimeoutError) as timed_out:
                await sink.write(rows(None), timeout=1.0)  # behind it, on its way
            assert timed_out.value.kept is True  # type: ignore[attr-defined]
            reading = asyncio.create_task(client.sql("SELECT k FROM t").read_all())
            await asyncio.wait_for(first, WAIT)
            await asyncio.wait_for(second, WAIT)
            with pytest.raises(SchemaMismatchError):
                await sink.flush(timeout=WAIT)
            await sink.close(timeout=WAIT)
            got = await asyncio.wait_for(reading, WAIT)
            assert sorted(got["k"].to_pylist()) == [0, 1], got  # partitions: any order
        await no_aio_threads()

    with serve_process({}, tmp_path) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))


def test_each_of_two_refused_batches_is_told_on_both_faces(tmp_path: Path) -> None:
    """Two batches refused (NULLs in a NOT NULL column): the plain sink kept one error slot,
    so the second refusal was dropped: the sync face raised once for two (writes, then two
    flushes and a close), the async face's two kept batches one error between two flushes
    and a close (3 of 3 runs each, review 8 of 85728d1). Each refusal is now raised by one
    call, oldest first, as an idempotent sink does."""
    with serve_process({}, tmp_path) as (_, location):
        with connect(location) as client:
            client.create_table("t", SCHEMA, capacity=16)
            sink = client.sink("t")
            refused = 0
            for batch in (rows(1), rows(None), rows(2), rows(None), rows(3)):
                try:
                    sink.write(batch, timeout=WAIT)
                except SchemaMismatchError:
                    refused += 1
            for call in (sink.flush, sink.flush):
                try:
                    call(timeout=WAIT)
                except SchemaMismatchError:
                    refused += 1
            sink.close(timeout=WAIT)  # nothing left to tell
            assert refused == 2
            client.create_table("u", SCHEMA, capacity=1)

        async def main() -> None:
            async with AsyncClient.connect(location) as aclient:
                asink = await aclient.sink("u")
                await asink.write(rows(1), timeout=WAIT)  # the table is full: nobody reads
                for batch in (rows(2), rows(None), rows(None), rows(3)):
                    with pytest.raises(WriteTimeoutError) as timed_out:
                        await asink.write(batch, timeout=0.5)
                    assert timed_out.value.kept is True  # type: ignore[attr-defined]
                reading = asyncio.create_task(aclient.sql("SELECT k FROM u").read_all())
                told = 0
                for _ in range(2):
                    with pytest.raises(SchemaMismatchError):
                        await asink.flush(timeout=WAIT)
                    told += 1
                await asink.close(timeout=WAIT)  # both were told: nothing more
                got = await asyncio.wait_for(reading, WAIT)
                assert sorted(got["k"].to_pylist()) == [1, 2, 3], got
                assert told == 2
            await no_aio_threads()

        asyncio.run(asyncio.wait_for(main(), 4 * WAIT))
        assert sorted(counts(location, "t")) == [1, 2, 3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_first_stream_to_a_restarted_paused_server_is_bounded(tmp_path: Path) -> None:
    """Sinks idle while their server restarts (same port) open their next stream on a
    connection gRPC makes again, and the new server is paused: a ``write(timeout=2)`` raised
    after 20 s (gRPC's connect timeout). Each returns by its timeout, on both sink kinds and
    both faces; once the server resumes, the stream its open got is taken by the next write
    (or let go when the client closes), and each table holds a batch once if its write said
    it was kept or written again, and never one a write said it did not send."""
    port, data = _free_port(), str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        client = connect(location)
        client.create_table("t", SCHEMA, capacity=4)
        client.create_topic("d", SCHEMA, durable=True)
        plain, durable = client.sink("t"), client.sink("d", producer_id="p", retry=WAIT)
        durable.write(rows(0), timeout=WAIT)
        durable.flush(timeout=WAIT)
        proc.kill()
        proc.wait(WAIT)

    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        with connect(location) as other:
            other.create_table("t", SCHEMA, capacity=4)
        outcomes: dict[str, str] = {}
        with paused(proc):
            for name, sink in (("t", plain), ("d", durable)):
                took, error = timed(lambda sink=sink: sink.write(rows(1), timeout=2.0))
                assert took < 2.0 + MARGIN_S, (name, took)
                if error is None:  # gRPC had reconnected in the background: it went at once
                    outcomes[name] = "sent"
                    continue
                assert isinstance(error, WriteTimeoutError | ServerUnavailableError), error
                outcomes[name] = "kept" if getattr(error, "kept", False) else "not sent"
        assert outcomes["t"] in ("not sent", "sent"), outcomes  # a plain sink keeps nothing
        for name, sink in (("t", plain), ("d", durable)):
            if outcomes[name] == "not sent":
                sink.write(rows(1), timeout=WAIT)  # the stream its open got, taken now
        reading = Background(lambda: counts(location, "t"))
        plain.close(timeout=WAIT)
        durable.flush(timeout=WAIT)
        assert reading.done.wait(WAIT)
        assert reading.result == {1: 1}
        assert client.read("d", 0, 2).read_all()["k"].to_pylist() == [0, 1]
        client.close()


@pytest.mark.asyncio
async def test_an_async_first_stream_to_a_restarted_paused_server_is_bounded(
    tmp_path: Path,
) -> None:
    """The asyncio face of the test above: ``await write(timeout=2)`` returns by its timeout
    with the batch not sent, and ``aclose`` frees what the open holds once the server is back."""
    port = _free_port()
    with serve_process({}, tmp_path, port=port) as (proc, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=4)
        sink = await client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    with serve_process({}, tmp_path, port=port) as (proc, location):
        with connect(location) as other:
            other.create_table("t", SCHEMA, capacity=4)
        with paused(proc):
            started = time.monotonic()
            # (gRPC may fail it at once with the last connect's error, in its backoff
            # after the restart: not sent either)
            with pytest.raises((WriteTimeoutError, ServerUnavailableError)) as raised:
                await asyncio.wait_for(sink.write(rows(1), timeout=2.0), WAIT)
            assert time.monotonic() - started < 2.0 + MARGIN_S
        # Under load gRPC may have reconnected in the background, so the open got a stream
        # at the paused server and the batch went on it, unacknowledged: kept, its outcome
        # reported by the close below (as the sync test above takes "sent"). Else not sent.
        kept = getattr(raised.value, "kept", False)
        if not kept:
            assert getattr(raised.value, "batches_written", 0) == 0
        deadline = time.monotonic() + WAIT
        while True:  # reached once gRPC's backoff is over
            try:
                await client.tables()
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        result = client.sql("SELECT k FROM t")
        await sink.write(rows(2), timeout=WAIT)
        await sink.close(timeout=WAIT)
        got = await asyncio.wait_for(result.read_all(), WAIT)
        assert got["k"].to_pylist() == ([1, 2] if kept else [2])
        await client.aclose(timeout=WAIT)
    await no_aio_threads()


def test_many_tasks_each_hear_their_own_refusal_on_a_durable_topic(tmp_path: Path) -> None:
    """60 tasks share an idempotent async sink (window 4), writing and sending while a task
    flushes; every 7th batch is refused (a NULL in a NOT NULL column). Each task hears its
    own outcome, no flush or close raises, and the topic holds every good batch once. (A
    review saw the batch after a refused one told the refusal and lost on 240b69f, 8 of 30
    runs: gRPC's write raised the refusal before the stream's reader saw its end, and the
    refusal was let go twice; not seen again there in 13 runs.)"""
    keys = 60
    bad = {k for k in range(keys) if k % 7 == 3}

    async def round_of(client: AsyncClient, topic: str) -> None:
        sink = await client.sink(topic, producer_id="p", window=4)
        outcomes: dict[int, str] = {}

        async def one(k: int) -> None:
            batch = rows(None if k in bad else k)
            try:
                if k % 2:
                    await asyncio.wait_for(await sink.send(batch, timeout=WAIT), WAIT)
                else:
                    await sink.write(batch, timeout=WAIT)
                outcomes[k] = "ok"
            except SchemaMismatchError:
                outcomes[k] = "refused"

        async def flushes() -> None:
            for _ in range(5):
                await asyncio.sleep(0.01)  # between the writes, not a wait for one
                await sink.flush(timeout=WAIT)

        tasks = [asyncio.create_task(one(k)) for k in range(keys)]
        await flushes()
        await asyncio.gather(*tasks)
        await sink.close(timeout=WAIT)
        assert outcomes == {k: "refused" if k in bad else "ok" for k in range(keys)}
        got = await client.read(topic, 0, (await client.offsets(topic))["next"]).read_all()
        assert sorted(got["k"].to_pylist()) == sorted(set(range(keys)) - bad)

    async def main(location: str) -> None:
        async with AsyncClient.connect(location) as client:
            for i in range(4):
                await client.create_topic(f"d{i}", SCHEMA, durable=True)
                await round_of(client, f"d{i}")
        await no_aio_threads()

    data = str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 8 * WAIT))


def test_a_batch_kept_past_retry_then_refused_reaches_the_next_flush(tmp_path: Path) -> None:
    """``retry=2``, the server killed: an async write of a batch the server will refuse
    gives up, ``kept=True`` with ``batches_written=1`` as the sync face says (it said 0).
    The server comes back (same port and data dir): the sink's next ``flush`` raises the
    refusal (it returned normally: the loss was told to nobody), and the topic holds the
    batches before and after it."""
    port, data = _free_port(), str(tmp_path / "data")

    async def before(location: str, proc: Any) -> tuple[AsyncClient, Any]:
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_topic("d", SCHEMA, durable=True)
        sink = await client.sink("d", producer_id="p", retry=2.0)
        await sink.write(rows(0), timeout=WAIT)
        proc.kill()
        proc.wait(WAIT)
        with pytest.raises(ServerUnavailableError) as gave_up:
            await asyncio.wait_for(sink.write(rows(None)), WAIT)
        assert getattr(gave_up.value, "kept", False)
        assert getattr(gave_up.value, "batches_written", None) == 1
        return client, sink

    async def after(client: AsyncClient, sink: Any) -> list[int]:
        deadline = time.monotonic() + WAIT
        while True:  # the sink sends its kept batch again as it reaches the new server
            try:
                await sink.flush(timeout=WAIT)
            except SchemaMismatchError:
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
                continue
            pytest.fail("the kept batch's refusal reached no flush")
        await sink.write(rows(2), timeout=WAIT)
        await sink.flush(timeout=WAIT)
        got = await client.read("d", 0, (await client.offsets("d"))["next"]).read_all()
        await sink.aclose(timeout=WAIT)
        await client.aclose(timeout=WAIT)
        return sorted(got["k"].to_pylist())

    async def main() -> None:
        with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
            client, sink = await before(location, proc)
        with serve_process({}, tmp_path, "--data-dir", data, port=port):
            assert await after(client, sink) == [0, 2]
        await no_aio_threads()

    asyncio.run(asyncio.wait_for(main(), 8 * WAIT))


def test_a_batch_given_up_before_it_was_sent_hears_its_later_refusal_at_a_flush(
    tmp_path: Path,
) -> None:
    """Window 2, ``retry=2``, the server killed: A's batch and B's (refused once sent: a
    NULL in a NOT NULL column) are kept, and given up before they are sent:
    ``ServerUnavailableError`` with ``kept=True`` and ``batches_written=1`` (it said 0). Once
    the server is back B is sent and refused: a ``flush`` raises it (nobody heard it), and
    the topic holds A's batch and the one after, not B's. (A batch that finds the window
    full is not kept at all: ``test_an_idempotent_sink_keeps_no_more_than_its_window``.)"""
    port, data = _free_port(), str(tmp_path / "data")

    async def outcome_of(future: Any) -> BaseException | None:
        try:
            await asyncio.wait_for(future, WAIT)
        except PushTableError as exc:
            return exc
        return None

    async def main() -> None:
        with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
            client = await AsyncClient.connect(location, timeout=WAIT)
            await client.create_topic("d", SCHEMA, durable=True)
            sink = await client.sink("d", producer_id="p", retry=2.0, window=2)
            await sink.write(rows(0), timeout=WAIT)
            proc.kill()
            proc.wait(WAIT)
            a = await sink.send(rows(1))
            b = await sink.send(rows(None))
            gave_up = await outcome_of(b)
        assert isinstance(gave_up, ServerUnavailableError), gave_up
        assert getattr(gave_up, "kept", False)
        assert getattr(gave_up, "batches_written", None) == 1
        with serve_process({}, tmp_path, "--data-dir", data, port=port):
            await outcome_of(a)
            deadline = time.monotonic() + WAIT
            refused = None
            while refused is None:  # B goes again as the sink reaches the new server
                try:
                    await sink.flush(timeout=WAIT)
                except SchemaMismatchError as exc:
                    refused = exc
                except ServerUnavailableError:
                    pass  # not reached yet: gRPC's backoff after the restart
                assert time.monotonic() < deadline, "B's refusal reached no flush"
                if refused is None:
                    await asyncio.sleep(0.05)
            await sink.write(rows(2), timeout=WAIT)
            await sink.flush(timeout=WAIT)
            got = await client.read("d", 0, (await client.offsets("d"))["next"]).read_all()
            assert sorted(got["k"].to_pylist()) == [0, 1, 2]
            await sink.aclose(timeout=WAIT)
            await client.aclose(timeout=WAIT)
        await no_aio_threads()

    asyncio.run(asyncio.wait_for(main(), 8 * WAIT))


def test_an_async_clients_aclose_names_the_sinks_it_could_not_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When a sink's ``aclose`` could not free its stream or thread by its timeout (a server
    that does not answer: whether gRPC's cancel ends the call at once depends on timing, so
    the sink's report is forced here), the client's ``aclose`` still lets everything else
    go (the other sink's stream ends, its slot is free) and then raises
    ``WriteTimeoutError`` naming the sink. It returned as if all were free. ``async with``
    whose body raised lets the body's error through and logs what was not freed."""
    from pushtable.flight.client.aio_sink import AsyncSink

    real = AsyncSink.aclose

    async def reporting(self: AsyncSink, *, timeout: float | None = 5.0) -> None:
        await real(self, timeout=timeout)
        if self.name.startswith("held"):
            raise WriteTimeoutError(f"aclose of '{self.name}' timed out with thread x still held")

    monkeypatch.setattr(AsyncSink, "aclose", reporting)

    async def main(location: str) -> None:
        client = await AsyncClient.connect(location, timeout=WAIT)
        kept = []  # a client closes the sinks it still has (it holds them weakly)
        for name in ("held_here", "free"):
            await client.create_table(name, SCHEMA, capacity=4)
            kept.append(await client.sink(name))
            await kept[-1].write(rows(1), timeout=WAIT)
        with pytest.raises(WriteTimeoutError, match=r"1 sink\(s\) not freed.*'held_here'"):
            await asyncio.wait_for(client.aclose(timeout=1.0), WAIT)
        with pytest.raises(ValueError, match="the body's"):
            async with await AsyncClient.connect(location, timeout=WAIT) as other:
                await other.create_table("held_too", SCHEMA, capacity=4)
                kept.append(await other.sink("held_too"))
                await kept[-1].write(rows(2), timeout=WAIT)
                raise ValueError("the body's error")
        assert "'held_too'" in caplog.text

    config = {"limits": {"max_streams_per_client": 2}}
    with serve_process(config, tmp_path) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))
        with connect(location) as after:  # every stream ended: both slots free
            sinks = [after.sink(name) for name in ("held_here", "free")]
            for sink in sinks:
                sink.write(rows(3), timeout=WAIT)
                sink.flush(timeout=WAIT)
            for sink in sinks:
                sink.close(timeout=WAIT)


def test_an_idempotent_write_with_no_timeout_gives_up_within_its_retry(tmp_path: Path) -> None:
    """A producer with ``retry=2`` and no timeout, its server restarted on the same port and
    paused: the write's open waited for gRPC's connection for 20 s, then said "unreachable
    for 2.0s". It gives up within ``retry`` (plus the margin), the batch kept; once the
    server resumes, the next flush stores it once."""
    port, data = _free_port(), str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        client = connect(location)
        client.create_topic("d", SCHEMA, durable=True)
        sink = client.sink("d", producer_id="p", retry=2.0)
        sink.write(rows(0))
        sink.flush(timeout=WAIT)
        proc.kill()
        proc.wait(WAIT)
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        with paused(proc):
            took, error = timed(lambda: sink.write(rows(1)))
            # (gRPC may have reconnected in the background: then the open went at once and
            # the write waits for nothing; either way it is bounded by ``retry``)
            assert took < 2.0 + MARGIN_S, took
            if error is not None:
                assert isinstance(error, ServerUnavailableError), error
                assert "unreachable for 2.0s" in str(error), error
                assert getattr(error, "kept", False), error
        sink.flush(timeout=WAIT)
        assert client.read("d", 0, 2).read_all()["k"].to_pylist() == [0, 1]
        client.close()


@pytest.mark.parametrize("leave", ["aclose", "fail", "client"])
def test_writes_waiting_for_room_in_the_writers_queue_hear_that_the_sink_was_left(
    tmp_path: Path, leave: str
) -> None:
    """Ten tasks write (no timeout) into a table nobody reads (capacity 1, window 1): the
    writer thread holds one, its queue the next four, and the rest wait for room in the
    queue. Left (``aclose``, ``fail``, the client's ``aclose``), the refusals of what was
    queued made room, and the waiting writes went into a queue nobody read: their tasks
    hung for good. Every task hears its outcome."""

    async def main(location: str) -> None:
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=1)
        sink = await client.sink("t", window=1)
        tasks = []
        for k in range(10):
            tasks.append(asyncio.create_task(sink.write(rows(k))))
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + WAIT
        while not sink._writer.queue.async_q.full():  # the writer's queue fills
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the last writes wait for room in the queue
        with contextlib.suppress(PushTableError):
            if leave == "aclose":
                await sink.aclose(timeout=3.0)
            elif leave == "fail":
                await sink.fail(ValueError("leaving"), timeout=3.0)
            else:
                await client.aclose(timeout=3.0)
        done, pending = await asyncio.wait(tasks, timeout=WAIT)
        assert not pending, f"{len(pending)} write(s) never heard their outcome"
        outcomes = [t.exception() for t in done]
        assert sum(isinstance(o, SinkClosedError) for o in outcomes) >= 5, outcomes
        with contextlib.suppress(PushTableError):
            await client.aclose(timeout=WAIT)

    with serve_process({}, tmp_path) as (_, location):
        asyncio.run(asyncio.wait_for(main(location), 4 * WAIT))


def held_by_a_blocked_write(location: str) -> tuple[Any, Any, Background]:
    """A sink whose thread A writes 8 MiB batches with no timeout into a table of capacity 1
    nobody reads: A holds the sink, waiting for room. (client, sink, A's call)."""
    client = connect(location)
    client.create_table("t", SCHEMA, capacity=1)
    sink = client.sink("t", window=2)

    def write_all() -> None:
        for k in range(20):
            sink.write(big(k))

    writing = Background(write_all)
    assert not writing.done.wait(3.0)  # A holds the sink, waiting for room
    return client, sink, writing


def test_a_sync_calls_timeout_bounds_its_wait_for_another_call_of_the_sink(
    tmp_path: Path,
) -> None:
    """Thread A writes with no timeout into a full table nobody reads and holds the sink:
    ``write``, ``flush`` and ``close`` with ``timeout=1`` from another thread waited for A
    for good (the sink's lock had no deadline). Each returns by its timeout; the write says
    its batch was not sent (``kept=False``)."""
    with serve_process({}, tmp_path) as (_, location):
        client, sink, writing = held_by_a_blocked_write(location)
        for call in (
            lambda: sink.write(rows(1), timeout=1.0),
            lambda: sink.flush(timeout=1.0),
            lambda: sink.close(timeout=1.0),
        ):
            took, error = timed(call)
            assert took < 1.0 + MARGIN_S, took
            assert isinstance(error, WriteTimeoutError), error
        assert getattr(error, "kept", None) is None  # close: no batch of its own
        took, error = timed(lambda: sink.write(rows(1), timeout=1.0))
        assert getattr(error, "kept", None) is False
        assert getattr(error, "batches_written", None) == 0
        client.close()
        assert writing.done.wait(WAIT)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_idempotent_sink_keeps_no_more_than_its_window(tmp_path: Path, face: str) -> None:
    """``window=2``, ``window_bytes=1 MiB``, ~0.4 MiB batches, the server killed: each write
    that timed out kept its batch, 20 batches and 7.6 MiB held. A batch that finds the
    window full is not kept (``kept=False``, never sent); once the server is back, the
    topic holds exactly the batches said kept, once."""
    port, data = _free_port(), str(tmp_path / "data")
    rows_each = 50_000  # ~0.4 MiB of two int64 columns
    said: dict[int, bool] = {}

    def sized(k: int) -> pa.RecordBatch:
        return pa.record_batch(
            [pa.array([k] * rows_each, pa.int64()), pa.array(range(rows_each), pa.int64())],
            schema=SCHEMA,
        )

    def reached(flush: Any) -> None:
        deadline = time.monotonic() + WAIT
        while True:  # once gRPC's backoff after the restart is over
            try:
                flush()
                return
            except ServerUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.1)

    async def writes(location: str, proc: Any) -> None:
        aclient = await AsyncClient.connect(location, timeout=WAIT)
        await aclient.create_topic("d", SCHEMA, durable=True)
        asink = await aclient.sink("d", producer_id="p", retry=WAIT, window=2, window_bytes=1 << 20)
        proc.kill()
        proc.wait(WAIT)
        for k in range(12):
            try:
                await asyncio.wait_for(asink.write(sized(k), timeout=0.3), WAIT)
                said[k] = True
            except PushTableError as exc:
                said[k] = bool(getattr(exc, "kept", False))
        assert asink.sync.unacknowledged <= 2  # type: ignore[attr-defined]
        with serve_process({}, tmp_path, "--data-dir", data, port=port):
            await off_loop(reached, lambda: asink.sync.flush(WAIT))
            await asink.aclose(timeout=WAIT)
        with contextlib.suppress(PushTableError):
            await aclient.aclose(timeout=WAIT)

    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        if face == "async":
            asyncio.run(asyncio.wait_for(writes(location, proc), 4 * WAIT))
        else:
            client = connect(location)
            client.create_topic("d", SCHEMA, durable=True)
            sink = client.sink("d", producer_id="p", retry=WAIT, window=2, window_bytes=1 << 20)
            proc.kill()
            proc.wait(WAIT)
            for k in range(12):
                took, error = timed(lambda k=k: sink.write(sized(k), timeout=0.3))
                assert took < 0.3 + MARGIN_S, took
                said[k] = error is None or bool(getattr(error, "kept", False))
            assert isinstance(sink, IdempotentSink)
            assert sink.unacknowledged <= 2
    kept = sorted(k for k, was in said.items() if was)
    assert len(kept) <= 2, said  # (async: a write withdrawn at its timeout is not kept)
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (_, location):
        if face == "sync":
            reached(lambda: sink.flush(timeout=WAIT))
            client.close()
        with connect(location) as reader:
            end = reader.offsets("d")["committed"]
            got = reader.read("d", 0, end).read_all()
    stored = sorted(set(got["k"].to_pylist()))
    assert stored == kept, (stored, said)
    assert got.num_rows == len(kept) * rows_each  # each once


def test_an_async_idempotent_write_with_no_timeout_gives_up_within_its_retry(
    tmp_path: Path,
) -> None:
    """The asyncio face of the test above: the writer thread steps its calls (0.2 s each),
    and each step's open timed out on the step's own deadline, so the outage clock never
    started: 22 s, then "unreachable for 2.0s". It gives up within ``retry``, kept."""
    port, data = _free_port(), str(tmp_path / "data")

    async def main() -> None:
        with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
            client = await AsyncClient.connect(location, timeout=WAIT)
            await client.create_topic("d", SCHEMA, durable=True)
            sink = await client.sink("d", producer_id="p", retry=2.0)
            proc.kill()
            proc.wait(WAIT)
        with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, _):
            with paused(proc):
                started = time.monotonic()
                outcome: BaseException | None = None
                try:
                    await asyncio.wait_for(sink.write(rows(1)), 2.0 + MARGIN_S)
                except (ServerUnavailableError, TimeoutError) as exc:
                    outcome = exc
                assert time.monotonic() - started < 2.0 + 2 * MARGIN_S
            if isinstance(outcome, TimeoutError):
                # Under load gRPC may have reconnected in the background: the stream opened
                # at the paused server, which holds it (no outage: waited for, as documented)
                assert sink.sync._put is not None, "neither an outage nor a held stream"
            else:
                assert isinstance(outcome, ServerUnavailableError), outcome
                assert "unreachable for 2.0s" in str(outcome)
                assert getattr(outcome, "kept", False)
            with contextlib.suppress(PushTableError):
                await sink.aclose(timeout=WAIT)
            with contextlib.suppress(PushTableError):
                await client.aclose(timeout=WAIT)

    asyncio.run(asyncio.wait_for(main(), 4 * WAIT))


def test_aclose_after_a_fail_that_timed_out_names_what_is_held(tmp_path: Path) -> None:
    """A ``fail(timeout=1)`` on a paused server raises by its timeout while its call goes on;
    the ``aclose`` after it returned at once, "free", with the stream and its threads held.
    It waits for the fail within its own timeout and names what is still held; once the
    server is back the stream ends. And a ``close`` after ``aclose`` raises
    ``SinkClosedError`` (it returned, the table left open, as if closed)."""

    async def main(proc: Any, location: str) -> None:
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=4)
        await client.create_table("u", SCHEMA, capacity=4)
        sink = await client.sink("t")
        await sink.write(rows(1), timeout=WAIT)
        with paused(proc):
            with pytest.raises(WriteTimeoutError):
                await sink.fail(ValueError("stop"), timeout=1.0)
            started = time.monotonic()
            with pytest.raises(WriteTimeoutError, match=r"fail\(\) has had no answer"):
                await sink.aclose(timeout=2.0)
            assert time.monotonic() - started < 2.0 + MARGIN_S
        other = await client.sink("u")
        await other.write(rows(2), timeout=WAIT)
        await other.aclose(timeout=WAIT)
        with pytest.raises(SinkClosedError, match="was left"):
            await other.close(timeout=WAIT)
        await client.aclose(timeout=WAIT)

    with serve_process({}, tmp_path) as (proc, location):
        asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT))
        with connect(location) as after:
            deadline = time.monotonic() + WAIT
            while not after.stats("t")["closed"]:  # the fail reached it once the server was back
                assert time.monotonic() < deadline, "the fail never reached the server"
                time.sleep(0.1)
            assert not after.stats("u")["closed"]


def test_an_outage_clock_left_by_an_earlier_write_does_not_fail_a_later_one(
    tmp_path: Path,
) -> None:
    """``retry=2``: a write times out on its own deadline during an outage (its open did not
    answer: the outage clock starts), the server comes back, and ``retry`` passes: the next
    write raised at once "unreachable for 2.0s" against the server that answers. Every open
    gets a moment past the window: the write goes, and each batch is stored once."""
    port, data = _free_port(), str(tmp_path / "data")
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (proc, location):
        client = connect(location, timeout=WAIT)
        client.create_topic("d", SCHEMA, durable=True)
        sink = client.sink("d", producer_id="p", retry=2.0)
        sink.write(rows(0), timeout=WAIT)
        sink.flush(timeout=WAIT)
        proc.kill()
        proc.wait(WAIT)
        with pytest.raises((WriteTimeoutError, ServerUnavailableError)) as first:
            sink.write(rows(1), timeout=0.5)
        assert getattr(first.value, "kept", False)
    with serve_process({}, tmp_path, "--data-dir", data, port=port) as (_, location):
        with connect(location, timeout=WAIT) as other:
            deadline = time.monotonic() + WAIT
            while True:  # the server answers (gRPC's backoff after the restart is over)
                try:
                    other.offsets("d")
                    break
                except ServerUnavailableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
        time.sleep(2.5)  # the retry window of the outage clock runs out (a later call)
        deadline = time.monotonic() + WAIT
        while True:  # its own connection may still be in gRPC's backoff: then a full retry
            took, error = timed(lambda: sink.write(rows(2), timeout=10.0))
            if error is None:
                break
            assert isinstance(error, ServerUnavailableError), error
            assert took >= 2.0 - 0.1, (took, error)  # never at once: a whole retry window
            assert time.monotonic() < deadline
        sink.flush(timeout=WAIT)
        got = client.read("d", 0, client.offsets("d")["committed"]).read_all()
        assert sorted(got["k"].to_pylist()) == [0, 1, 2]
        client.close()


def test_a_second_aclose_and_the_clients_name_a_stream_still_held(tmp_path: Path) -> None:
    """A batch in flight, the server paused: the sink's ``aclose(timeout=1)`` raises naming
    its stream; a second ``aclose``, and then the client's, returned "free" at once with the
    stream's threads alive. Each names it; and ``async with sink`` whose body raised lets the
    body's error through when the fail cannot reach the server (it raised the fail's
    timeout instead)."""

    async def main(proc: Any, location: str) -> None:
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=4)
        await client.create_table("u", SCHEMA, capacity=4)
        sink = await client.sink("t")
        await sink.write(rows(1), timeout=WAIT)
        with paused(proc):
            await sink.send(rows(2))
            for _ in range(2):
                with pytest.raises(WriteTimeoutError, match="still held"):
                    await sink.aclose(timeout=1.0)
            with pytest.raises(WriteTimeoutError, match="not freed"):
                await client.aclose(timeout=1.0)
        other = await AsyncClient.connect(location, timeout=WAIT)
        held = await other.sink("u")
        await held.write(rows(3), timeout=WAIT)
        with paused(proc), pytest.raises(ValueError, match="the body's"):
            async with held:
                raise ValueError("the body's error")
        with contextlib.suppress(PushTableError):
            await other.aclose(timeout=WAIT)

    with serve_process({}, tmp_path) as (proc, location):
        asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT))


def test_a_sync_fail_does_not_wait_behind_a_blocked_write(tmp_path: Path) -> None:
    """Thread A writes with no timeout into a full table nobody reads and holds the sink:
    ``fail()`` waited behind it for good. It leaves the stream under A (which raises) and
    fails the table at once."""
    with serve_process({}, tmp_path) as (_, location):
        client, sink, writing = held_by_a_blocked_write(location)
        took, error = timed(lambda: sink.fail(ValueError("stop")))
        assert error is None, error
        assert took < 5.0 + MARGIN_S, took
        assert writing.done.wait(WAIT)
        assert isinstance(writing.error, PushTableError), writing.error
        with connect(location) as other:
            assert other.stats("t")["closed"]
        client.close()


def test_an_async_clients_aclose_is_bounded_as_a_whole(tmp_path: Path) -> None:
    """A subscription held and a sink with a batch in flight, the server paused: the
    client's ``aclose(timeout=2)`` took 4 s (the subscriptions' wait, then the sinks' each
    had the whole timeout). One deadline bounds the call; it names the sink still held."""

    async def main(proc: Any, location: str) -> None:
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_topic("events", SCHEMA)
        await client.create_table("t", SCHEMA, capacity=4)
        await client.subscribe("events", "panel", capacity=4)
        sink = await client.sink("t")
        await sink.write(rows(1), timeout=WAIT)
        with paused(proc):
            await sink.send(rows(2))
            started = time.monotonic()
            with pytest.raises(WriteTimeoutError, match="not freed"):
                await client.aclose(timeout=2.0)
            assert time.monotonic() - started < 2.0 + MARGIN_S

    with serve_process({}, tmp_path) as (proc, location):
        asyncio.run(asyncio.wait_for(main(proc, location), 4 * WAIT))
