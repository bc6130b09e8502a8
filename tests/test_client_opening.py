"""A producer's stream opened for a call with a deadline, on a thread of its own.

gRPC's open waits, unbounded, for its connection: to a restarted server that is paused, 20 s
whatever the call's timeout. A call with a deadline returns by then and the open goes on
(:mod:`pushtable.flight.client.opening`); these are the promises of the path it joins. Its
stream is the sink's next call's, or let go by ``close``, ``aclose`` and the client's close,
which return once it holds no slot on the server; a stream the server ended meanwhile, or an
open that failed with no call waiting for it, is not handed to the next call; and an asyncio
result whose task gave up while its query opened stops that query.

Against real ``pushtable serve`` processes restarted on one port and paused with SIGSTOP;
``max_streams_per_client=1`` (and ``max_queries=1``) make a leaked stream (query) visible as
the next one's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pushtable.errors import PushTableError as PushTableErrorType
from pushtable.errors import (
    ResourceLimitError,
    ServerUnavailableError,
    SinkClosedError,
    WriteTimeoutError,
)
from pushtable.flight import connect
from pushtable.flight.client import opening as opening_room
from pushtable.flight.client.aio import AsyncClient
from pushtable.flight.client.remote_sink import RemoteSink
from pushtable.flight.client.transport import Transport
from tests.conftest import WAIT, Background, no_aio_threads, serve_process, wait_until
from tests.test_client_word import SCHEMA, _free_port, counts, paused, rows, stream_threads

ONE_STREAM = {"limits": {"max_streams_per_client": 1}}


def _restarted(tmp_path: Path, config: dict[str, Any], port: int, *names: str) -> Any:
    """A server on ``port`` declaring ``names`` (a restart's: the old sinks' tables again)."""
    server = serve_process(config, tmp_path, port=port)
    proc, location = server.__enter__()
    with connect(location) as other:
        for name in names:
            other.create_table(name, SCHEMA, capacity=4)
    return server, proc, location


def _write_while_opening(sink: RemoteSink) -> None:
    """A write (to a paused server) whose stream's open outlives its timeout.

    gRPC may fail a call at once with the last connect's error while it waits to try again
    (its backoff after the restart): such a write is not sent either, and is made again.
    """
    deadline = time.monotonic() + WAIT
    while True:
        call = Background(lambda: sink.write(rows(1), timeout=1.0))
        assert call.done.wait(WAIT)
        error = call.error
        assert isinstance(error, WriteTimeoutError | ServerUnavailableError), error
        assert not getattr(error, "kept", False), error  # not sent, never will be
        if isinstance(error, WriteTimeoutError):
            return
        assert time.monotonic() < deadline, error


@contextlib.contextmanager
def _opens_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Streams open only once the block ends: held where gRPC holds an open while it
    reconnects to a restarted, paused server. (With the pause alone, whether gRPC had
    reconnected in the background first is a race: under load the write then went at once,
    and the open these tests are about never waited.)"""
    release = threading.Event()
    real = Transport.do_put

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        release.wait(WAIT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Transport, "do_put", held)
    try:
        yield
    finally:
        release.set()
        monkeypatch.setattr(Transport, "do_put", real)


def _timed_out_open(sink: RemoteSink, proc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write whose stream's open outlives its timeout: the server paused, then resumed."""
    with paused(proc), _opens_held(monkeypatch):
        _write_while_opening(sink)
    wait_until(lambda: sink._opening is not None and sink._opening.done, "the open to return")


def test_close_lets_a_stream_opened_for_a_timed_out_write_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream a timed-out write's open got is ended by the sink's ``close``: the
    client's one stream slot is free for its next sink (it stayed taken until the client
    closed)."""
    port = _free_port()
    with serve_process(ONE_STREAM, tmp_path, port=port) as (proc, location):
        client = connect(location, timeout=WAIT)
        client.create_table("t", SCHEMA, capacity=4)
        sink = client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    server, proc, location = _restarted(tmp_path, ONE_STREAM, port, "t", "u")
    try:
        _timed_out_open(sink, proc, monkeypatch)
        sink.close(timeout=WAIT)
        assert sink._opening is None
        assert not stream_threads(), stream_threads()
        _next_sink_writes(client, location)
        client.close()
    finally:
        server.__exit__(None, None, None)


def test_the_next_write_takes_only_a_stream_it_can_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed-out write's open returned a stream the server then ended for idleness
    (``idle_timeout`` 2 s): the next write failed on it. It opens another, and the table
    holds what the writes that returned said they wrote, once each."""
    port = _free_port()
    config = {"limits": {"idle_timeout": 2}}
    with serve_process(config, tmp_path, port=port) as (proc, location):
        client = connect(location, timeout=WAIT)
        client.create_table("t", SCHEMA, capacity=4)
        sink = client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    server, proc, location = _restarted(tmp_path, config, port, "t")
    try:
        _timed_out_open(sink, proc, monkeypatch)
        opened = sink._opening
        assert opened is not None
        assert opened._put is not None
        put = opened._put
        wait_until(lambda: put.idle or put.finished, "the server to end the idle stream")
        sink.write(rows(2), timeout=WAIT)
        sink.write(rows(3), timeout=WAIT)
        reading = _Reading(location, "t")
        sink.close(timeout=WAIT)
        assert reading.result(WAIT) == {2: 1, 3: 1}
        client.close()
    finally:
        server.__exit__(None, None, None)


def test_an_open_that_failed_with_no_call_waiting_is_not_the_next_calls_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paused server is killed while a timed-out write's stream opens (the open
    fails), and a server starts again on the port: the next write raised the dead server's
    ``ServerUnavailableError``. It opens anew and writes."""
    port = _free_port()
    with serve_process({}, tmp_path, port=port) as (proc, location):
        client = connect(location, timeout=WAIT)
        client.create_table("t", SCHEMA, capacity=4)
        sink = client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    server, proc, location = _restarted(tmp_path, {}, port, "t")
    with paused(proc), _opens_held(monkeypatch):
        _write_while_opening(sink)
        proc.kill()  # killed while stopped: the open in flight fails
        proc.wait(WAIT)
    server.__exit__(None, None, None)
    wait_until(lambda: sink._opening is not None and sink._opening.done, "the open to fail")
    server, proc, location = _restarted(tmp_path, {}, port, "t")
    try:
        wait_until(lambda: _reaches(client), "the connection to reach the new server")
        sink.write(rows(2), timeout=WAIT)
        reading = _Reading(location, "t")
        sink.close(timeout=WAIT)
        assert reading.result(WAIT) == {2: 1}
        client.close()
    finally:
        server.__exit__(None, None, None)


@pytest.mark.asyncio
async def test_aclose_frees_a_stream_that_starts_opening_as_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose`` runs while the writer thread is about to start a stream's open (held at
    that point by an event, as a loaded machine may hold it): the open, started after
    ``aclose`` looked, was nobody's and kept the client's one stream slot. It is let go:
    the write hears ``SinkClosedError`` and the client's next sink writes."""
    port = _free_port()
    with serve_process(ONE_STREAM, tmp_path, port=port) as (proc, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=4)
        sink = await client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    server, proc, location = _restarted(tmp_path, ONE_STREAM, port, "t", "u")
    starting, go = threading.Event(), threading.Event()
    real = opening_room.Opening.start

    def held_at_start(self: Any) -> bool:
        starting.set()
        go.wait(WAIT)
        return real(self)

    monkeypatch.setattr(opening_room.Opening, "start", held_at_start)
    try:
        # reached first: a connection gRPC starts to a paused server fails 20 s later,
        # resumed or not (the channel's, not this test's)
        await client.tables()
        with paused(proc):
            write = asyncio.create_task(sink.write(rows(1), timeout=WAIT))
            assert await asyncio.to_thread(starting.wait, WAIT)
            closing = asyncio.create_task(sink.aclose(timeout=WAIT))
            opening = sink.sync._opening  # the writer's, about to start
            assert opening is not None
            await asyncio.to_thread(wait_until, lambda: opening._let_go, "aclose to let it go")
            go.set()
            with pytest.raises(SinkClosedError):
                await asyncio.wait_for(write, WAIT)
            await asyncio.wait_for(closing, WAIT)  # the server still paused: nothing opened
        assert sink.sync._opening is None
        assert not stream_threads(), stream_threads()
        monkeypatch.undo()
        await _next_async_sink_writes(client)
        await client.aclose(timeout=WAIT)
    finally:
        server.__exit__(None, None, None)
    await no_aio_threads()


@pytest.mark.asyncio
async def test_aclose_returns_once_a_let_go_stream_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed-out write's open returned a stream once the server resumed; ``aclose``
    returned in 1 ms with that stream still open (its threads alive, the slot taken). It
    returns once the stream ended: no stream thread is left, and the next sink writes."""
    port = _free_port()
    with serve_process(ONE_STREAM, tmp_path, port=port) as (proc, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=4)
        sink = await client.sink("t")
        proc.kill()
        proc.wait(WAIT)
    server, proc, location = _restarted(tmp_path, ONE_STREAM, port, "t", "u")
    try:
        with paused(proc), _opens_held(monkeypatch), pytest.raises(WriteTimeoutError):
            await sink.write(rows(1), timeout=1.0)
        await asyncio.to_thread(
            wait_until,
            lambda: sink.sync._opening is not None and sink.sync._opening.done,
            "the open to return",
        )
        await sink.aclose(timeout=WAIT)
        assert not stream_threads(), stream_threads()
        await _next_async_sink_writes(client)
        await client.aclose(timeout=WAIT)
    finally:
        server.__exit__(None, None, None)
    await no_aio_threads()


@pytest.mark.asyncio
async def test_a_result_whose_task_gave_up_while_it_opened_stops_its_query(
    tmp_path: Path,
) -> None:
    """The task awaiting a result's first batch is cancelled while the query opens (the
    server paused); once the server resumes the query opened for nobody and held the one
    query slot (``max_queries=1``) after ``aclose``. It stops as it opens."""
    with serve_process({"limits": {"max_queries": 1}}, tmp_path) as (proc, location):
        async with AsyncClient.connect(location, timeout=WAIT) as client:
            await client.create_table("t", SCHEMA, capacity=4)
            await client.create_table("u", SCHEMA, capacity=4)
            sink = await client.sink("u")
            await sink.write(rows(3), timeout=WAIT)
            await sink.close(timeout=WAIT)
            result = client.sql("SELECT k FROM t")
            with paused(proc), pytest.raises(TimeoutError):
                await asyncio.wait_for(result.__anext__(), 1.0)
            opening = result._opening
            assert opening is not None
            await asyncio.wait_for(asyncio.shield(opening), WAIT)
            await result.aclose(timeout=WAIT)
            deadline = time.monotonic() + WAIT  # the server frees the slot as it hears
            while True:
                try:
                    got = await asyncio.wait_for(client.sql("SELECT k FROM u").read_all(), WAIT)
                    break
                except ResourceLimitError:
                    assert time.monotonic() < deadline, "the query's slot stayed taken"
                    await asyncio.sleep(0.05)
            assert got["k"].to_pylist() == [3]
    await no_aio_threads()


def _next_sink_writes(client: Any, location: str) -> None:
    """The client's next sink (of table ``u``) writes and is read: its slot was free."""
    other = client.sink("u")
    reading = _Reading(location, "u")
    other.write(rows(2), timeout=WAIT)
    other.close(timeout=WAIT)
    assert reading.result(WAIT) == {2: 1}


async def _next_async_sink_writes(client: Any) -> None:
    """The asyncio face of :func:`_next_sink_writes`."""
    other = await client.sink("u")
    result = client.sql("SELECT k FROM u")
    await other.write(rows(2), timeout=WAIT)
    await other.close(timeout=WAIT)
    assert (await asyncio.wait_for(result.read_all(), WAIT))["k"].to_pylist() == [2]


def _stat(location: str, table: str, key: str) -> Any:
    """One counter of ``table``, asked on a connection of its own."""
    with connect(location, timeout=WAIT) as other:
        return other.stats(table)[key]


def _reaches(client: Any) -> bool:
    """Whether a call of ``client`` reaches its server (gRPC fails calls at once, with the
    last connect's error, until its backoff after a restart is over)."""
    try:
        client.tables()
    except ServerUnavailableError:
        return False
    return True


class _Reading:
    """A query of a table's keys in the background (it ends when the table closes)."""

    def __init__(self, location: str, table: str) -> None:
        self._got: dict[int, int] | None = None
        self._thread = threading.Thread(target=self._run, args=(location, table), daemon=True)
        self._thread.start()

    def _run(self, location: str, table: str) -> None:
        self._got = counts(location, table)

    def result(self, timeout: float) -> dict[int, int] | None:
        self._thread.join(timeout)
        return self._got


@pytest.mark.asyncio
async def test_a_batch_queued_when_its_producer_leaves_is_acknowledged_not_told_lost(
    tmp_path: Path,
) -> None:
    """A table of capacity 1 nobody reads: A's batch is queued (its acknowledgement not yet
    sent), B's waits for room, and the producer leaves (``aclose``). A was told "may not be
    stored" and the table held it; the server now acknowledges what it queued before it
    gives up, so A's write succeeds and B's raises, and the table holds A only."""
    with serve_process({}, tmp_path) as (_, location):
        client = await AsyncClient.connect(location, timeout=WAIT)
        await client.create_table("t", SCHEMA, capacity=1)
        sink = await client.sink("t")
        first = await sink.send(rows(1), timeout=WAIT)
        second = await sink.send(rows(2), timeout=WAIT)
        await asyncio.to_thread(
            wait_until,
            lambda: _stat(location, "t", "queued_batches") == 1,
            "the first batch to be queued",
        )
        await sink.aclose(timeout=WAIT)
        await asyncio.wait_for(first, WAIT)
        with pytest.raises(SinkClosedError):
            await asyncio.wait_for(second, WAIT)
        with connect(location) as other:
            assert other.stats("t")["batches"] == 1
        await client.aclose(timeout=WAIT)
    await no_aio_threads()


def test_fail_frees_the_stream_even_when_its_action_fails(tmp_path: Path) -> None:
    """``fail()`` against a paused server: its action times out, and the sink's stream (and
    an open in flight) stayed open for good, taking the client's one stream slot. They end
    once the server is back; the client's next sink writes."""
    with serve_process(ONE_STREAM, tmp_path) as (proc, location):
        client = connect(location, timeout=2.0)
        client.create_table("t", SCHEMA, capacity=4)
        client.create_table("u", SCHEMA, capacity=4)
        sink = client.sink("t")
        sink.write(rows(1), timeout=WAIT)
        sink.flush(timeout=WAIT)
        with paused(proc), pytest.raises(WriteTimeoutError):
            sink.fail(RuntimeError("the producer broke"))
        wait_until(lambda: not stream_threads(), "the failed sink's stream to end")
        _next_sink_writes(client, location)
        client.close()


def test_an_idempotent_sink_closed_opens_no_stream_again(tmp_path: Path) -> None:
    """A second ``close()`` or a ``flush()`` after ``close()`` of an idempotent sink opened a
    fresh stream that held the client's one stream slot until the client closed."""
    data = str(tmp_path / "data")
    with serve_process(ONE_STREAM, tmp_path, "--data-dir", data) as (_, location):
        client = connect(location, timeout=WAIT)
        client.create_topic("d", SCHEMA, durable=True)
        client.create_table("u", SCHEMA, capacity=4)
        sink = client.sink("d", producer_id="p")
        sink.write(rows(1), timeout=WAIT)
        sink.close(timeout=WAIT)
        sink.close(timeout=WAIT)
        sink.flush(timeout=WAIT)
        assert sink._put is None
        assert not stream_threads(), stream_threads()
        _next_sink_writes(client, location)
        client.close()


def test_client_close_against_a_paused_server_frees_a_blocked_writer_and_the_slot(
    tmp_path: Path,
) -> None:
    """A write with no timeout waits for room in a full table; the server is paused and
    ``Client.close()`` leaves: the writer stayed blocked for good and the stream held the
    server's slot after it resumed (the repeated ``leave`` stopped as the connection
    closed). The writer hears ``SinkClosedError``; once the server resumes the stream ends
    (the connection stays open, in the background, until it has)."""
    with serve_process({}, tmp_path) as (proc, location):
        client = connect(location, timeout=WAIT)
        client.create_table("t", SCHEMA, capacity=1)
        sink = client.sink("t")
        errors: list[BaseException] = []

        def writer() -> None:
            for k in range(100):
                try:
                    sink.write(rows(k))
                except PushTableErrorType as exc:
                    errors.append(exc)
                    return

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        wait_until(lambda: _stat(location, "t", "waiting_writers") == 1, "a full table")
        with paused(proc):
            client.close()
            thread.join(WAIT)
            assert not thread.is_alive()
            assert isinstance(errors[0], SinkClosedError), errors
        wait_until(lambda: not stream_threads(), "the left stream to end once the server is back")
        with connect(location) as other:
            assert other.stats("t")["waiting_writers"] == 0
