"""Producers for tables on ``pushtable serve``: :class:`RemoteSink` and :class:`Stager`.

:class:`Stager` is the Spark bridge's: it sends one task attempt's share of an epoch.

A :class:`RemoteSink` has the methods and exceptions of a local :class:`~pushtable.TableSink`.
``write`` returns once the batch is on its way with at most ``window`` batches not yet
acknowledged (queued in the server's table); beyond that it waits, so a full table blocks the
client's producer. ``flush`` waits for every acknowledgement; ``close`` flushes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import (
    PushTableError,
    ServerStoppedError,
    ServerUnavailableError,
    SinkClosedError,
    StreamEndedError,
    WriteTimeoutError,
)
from pushtable.flight import protocol
from pushtable.flight.transport import Transport
from pushtable.producer import ProducerScope, SinkStats, TopicStats, arrow_batches, check_timeout

__all__ = ["RemoteSink", "RemoteSinkStats", "Stager"]

_LATER = pa.py_buffer(protocol.LATER)
_SYNC = pa.py_buffer(protocol.SYNC)


@dataclass(frozen=True)
class RemoteSinkStats:
    """What this client sent and the server acknowledged, and the server table's counters."""

    sent_batches: int
    acknowledged_batches: int
    table: SinkStats | TopicStats


class _Put:
    """One DoPut stream and the thread that reads its acknowledgements."""

    def __init__(self, transport: Transport, descriptor: Any, schema: pa.Schema) -> None:
        self.writer, self._reader = transport.do_put(descriptor, schema)
        self.schema = schema
        self.sent = 0
        self.acked = 0
        self.requested = 0  # the count the newest acknowledgement asked for covers
        self.error: BaseException | None = None
        self.finished = False
        self.idle = False  # the server ended the stream for idleness: the next write reopens
        self.changed = threading.Condition()
        self.io = threading.Lock()  # one call on the writer at a time
        self._ack_reader = threading.Thread(
            target=self._read_acks, name="pushtable-acks", daemon=True
        )
        self._ack_reader.start()

    def send(
        self, batch: pa.RecordBatch, metadata: bytes | None = None, ack_every: int = 1
    ) -> None:
        """Write one batch (already in the stream's wire schema), with ``metadata`` if any.

        The server acknowledges it at once only when ``ack_every`` batches went unasked:
        ``wait`` asks (``SYNC``) for what it needs beyond that.
        """
        later = metadata is None and self.sent + 1 - self.requested < ack_every
        with self.io:
            if later:
                protocol.call(self.writer.write_with_metadata, batch, _LATER)
            elif metadata is None:
                protocol.call(self.writer.write_batch, batch)
            else:
                protocol.call(self.writer.write_with_metadata, batch, pa.py_buffer(metadata))
        self.sent += 1
        if not later:
            self.requested = self.sent

    def _sync(self) -> None:
        """Ask the server to acknowledge every batch sent so far.

        If the stream has ended, the acknowledgement reader has the verdict.
        """
        with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException):
            self.writer.write_metadata(_SYNC)
        self.requested = self.sent

    def _read_acks(self) -> None:
        try:
            while True:
                buf = self._reader.read()
                if buf is None:
                    break
                if buf.equals(protocol.STOPPING):
                    # The server is stopping: end our side, so it need not wait for a write.
                    with self.changed:
                        self.error = ServerStoppedError("the pushtable server stopped")
                    with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException):
                        self.writer.done_writing()
                    continue
                if buf.equals(protocol.FAILED):
                    # A commit failed: end our side; the call's error names it.
                    with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException):
                        self.writer.done_writing()
                    continue
                if buf.equals(protocol.IDLE):
                    # Idle too long: end our side cleanly; the next write opens a new stream.
                    with self.changed:
                        self.idle = True
                    with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException):
                        self.writer.done_writing()
                    continue
                with self.changed:
                    self.acked = protocol.acked(buf)
                    self.changed.notify_all()
        except (flight.FlightError, pa.ArrowException) as exc:
            with self.changed:
                self.error = protocol.client_error(exc)
        finally:
            with self.changed:
                self.finished = True
                self.changed.notify_all()

    def wait(self, most_unacked: int, deadline: float | None) -> bool:
        """Wait until at most ``most_unacked`` batches are unacknowledged (False: timed out)."""
        if self.sent - self.requested > most_unacked:
            self._sync()
        with self.changed:
            while self.sent - self.acked > most_unacked and not self.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(left)
            if self.error is None and self.sent - self.acked > most_unacked:
                self.error = self._verdict()
            if self.error is not None:
                raise self.error
            return True

    def _verdict(self) -> BaseException:
        """Why the server ended the stream early (its error arrives when the stream closes)."""
        try:
            with self.io:
                self.writer.close()
        except (flight.FlightError, pa.ArrowException) as exc:
            return protocol.client_error(exc)
        return StreamEndedError("the server ended the stream before acknowledging every batch")

    def abandon(self, timeout: float = 5.0) -> None:
        """Let go of a stream whose error was raised.

        The writer is closed only once the acknowledgement reader is done: closing it under a
        pending read would crash.
        """
        with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            self.writer.done_writing()
        with self.changed:
            self.changed.wait_for(lambda: self.finished, timeout)
            if not self.finished:
                return  # the server never ended it: leak it rather than crash
        self._ack_reader.join(timeout)  # it set ``finished`` last: it is ending
        with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            self.writer.close()

    def finish(self, timeout: float | None = None) -> None:
        """End the stream: every acknowledgement read, the server's verdict raised."""
        with self.io, contextlib.suppress(PushTableError):  # the ack reader has the verdict
            protocol.call(self.writer.done_writing)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while not self.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WriteTimeoutError("the server did not finish the stream in time")
                self.changed.wait(left)
        self._ack_reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        error = self.error
        try:
            with self.io:
                protocol.call(self.writer.close)
        except PushTableError as exc:
            error = error or exc
        if error is not None:
            raise error


class Stager:
    """One Spark task attempt's share of an epoch, sent to the server's stage area."""

    def __init__(self, transport: Transport, path: list[str], schema: pa.Schema) -> None:
        self._table = path[0]
        self._schema = schema
        self._wire_schema = protocol.wire_schema(schema)
        self._put = _Put(transport, flight.FlightDescriptor.for_path(*path), self._wire_schema)

    def write(self, batch: pa.RecordBatch) -> None:
        """Send ``batch`` to the stage area, checked against the share's schema first."""
        batch = protocol.to_wire(self._table, self._schema, self._wire_schema, batch)
        try:
            self._put.send(batch)
        except PushTableError:
            self._put.finish(timeout=30.0)  # the server's reason, if it gave one
            raise

    def finish(self) -> None:
        """End the share; returns once the server holds all of it (raises its error)."""
        self._put.finish()


class RemoteSink(ProducerScope):
    """A producer for a table on a ``pushtable serve`` server, used like a local ``TableSink``.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable.flight import Server, connect
        >>> server = Server()
        >>> client = connect(server.location)
        >>> client.create_table("t", pa.schema([("v", pa.int64())]), capacity=2)
        >>> sink = client.sink("t")
        >>> sink.write(pa.record_batch({"v": [1]}))
        >>> sink.flush()
        >>> sink.stats.acknowledged_batches
        1
        >>> server.stop()
        0
    """

    def __init__(
        self, transport: Transport, name: str, schema: pa.Schema, *, window: int = 8
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self._transport = transport
        self.name = name
        self.schema = schema
        self.window = window
        self._wire_schema = protocol.wire_schema(schema)
        self._put: _Put | None = None
        self._sent = 0
        self._acked = 0
        self._closed = False
        self._stopped = False  # a stream of it heard the server say it stops
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteSink(name={self.name!r}, server={self._transport.uri!r})"

    def _stream(self) -> _Put:
        if self._put is not None and self._put.idle:  # the server ended it: start anew
            self._end_stream_locked()
        if self._put is None:
            descriptor = flight.FlightDescriptor.for_path(self.name)
            self._put = _Put(self._transport, descriptor, self._wire_schema)
        return self._put

    def _drop_stream(self) -> None:
        """Forget a stream the server ended (after an error): the next write opens another."""
        put, self._put = self._put, None
        if put is not None:
            self._acked += put.acked
            self._sent += put.sent
            self._stopped |= isinstance(put.error, ServerStoppedError)
            put.abandon()  # its error was raised already

    def _end_stream(self) -> None:
        """End the open stream, if any (the client is closing); the table stays open."""
        with self._lock:
            self._end_stream_locked()

    def _end_stream_locked(self) -> None:
        put, self._put = self._put, None
        if put is not None:
            with contextlib.suppress(PushTableError):
                put.finish(timeout=5.0)
            self._sent += put.sent
            self._acked += put.acked

    def write(self, data: Any, timeout: float | None = None) -> None:
        """Send a batch (or every batch of a table / stream), at most ``window`` unacknowledged.

        It waits while ``window`` batches are unacknowledged; ``timeout`` bounds that wait (the
        batch is then not sent).

        Raises the same errors as ``TableSink.write``: ``SchemaMismatchError`` (checked before
        sending; NOT NULL violations come from the server), ``SinkClosedError``,
        ``ReaderGoneError``, ``WriteTimeoutError``; an error of an earlier batch in flight is
        raised by the next call. ``batches_written`` counts what this call sent.
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        written = 0
        with self._lock:
            if self._closed:
                raise SinkClosedError(f"remote sink for '{self.name}' is closed")
            try:
                for data_batch in arrow_batches(data):
                    batch = protocol.to_wire(self.name, self.schema, self._wire_schema, data_batch)
                    put = self._stream()
                    if not put.wait(self.window - 1, deadline):
                        raise WriteTimeoutError(
                            f"write to remote table '{self.name}' timed out after {timeout}s "
                            f"with {self.window} batch(es) unacknowledged"
                        )
                    put.send(batch, ack_every=max(1, self.window // 2))
                    written += 1
            except PushTableError as exc:
                if self._put is not None and self._put.error is not None:
                    self._drop_stream()
                exc.batches_written = written
                raise

    async def awrite(self, data: Any, timeout: float | None = None) -> None:
        """Asyncio form of :meth:`write` (runs it on a worker thread; the loop never blocks)."""
        await asyncio.to_thread(self.write, data, timeout)

    def advance(self, ts: Any, timeout: float | None = None) -> None:
        """``TableSink.advance`` on the server's table, in order with this sink's batches.

        It keeps its place among the batches written before and after it on this sink. ``ts``
        is an ``int``, or a ``datetime`` for a timestamp column. Errors (no ``order_by``, a
        closed table) come back like a write's.
        """
        metadata = protocol.advance_metadata(ts)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closed:
                raise SinkClosedError(f"remote sink for '{self.name}' is closed")
            put = self._stream()
            if not put.wait(self.window - 1, deadline):
                raise WriteTimeoutError(
                    f"advance on remote table '{self.name}' timed out after {timeout}s "
                    f"with {self.window} batch(es) unacknowledged"
                )
            put.send(pa.RecordBatch.from_pylist([], schema=self._wire_schema), metadata)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server acknowledged every batch sent (queued in its table)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                if self._put is not None and not self._put.wait(0, deadline):
                    raise WriteTimeoutError(f"flush of remote table '{self.name}' timed out")
            except PushTableError:
                if self._put is not None and self._put.error is not None:
                    self._drop_stream()
                raise

    def close(self) -> None:
        """Flush, end this producer's stream, and close the table (end of stream)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            put, self._put = self._put, None
            if put is not None:
                self._stopped |= isinstance(put.error, ServerStoppedError)
                put.finish()
                self._sent += put.sent
                self._acked += put.acked
        try:
            self._transport.action("close", {"name": self.name})
        except ServerUnavailableError as exc:
            if self._stopped:  # the server said it stopped: that, not "unreachable"
                raise ServerStoppedError(
                    f"the pushtable server stopped before the close of '{self.name}' reached "
                    "it: the table was failed with the stop, not closed"
                ) from exc
            raise

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close`, run in a worker thread."""
        await asyncio.to_thread(self.close)

    def fail(self, exc: BaseException) -> None:
        """Make the table's reading query raise (``StreamFailedError`` naming ``exc``)."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(exc).__name__}")
        with self._lock:
            self._closed = True
            put, self._put = self._put, None
        self._transport.action(
            "fail", {"name": self.name, "type": type(exc).__name__, "message": str(exc)}
        )
        if put is not None:
            with contextlib.suppress(PushTableError):
                put.finish(timeout=5.0)

    @property
    def stats(self) -> RemoteSinkStats:
        """The batches this producer sent and had acknowledged, and the server table's counters."""
        table = self._transport.action("stats", {"name": self.name})
        cls = TopicStats if "subscribers" in table else SinkStats
        put = self._put
        sent = self._sent + (put.sent if put else 0)
        acked = self._acked + (put.acked if put else 0)
        return RemoteSinkStats(sent, acked, cls.known(table))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`fail` was called."""
        return self._closed
