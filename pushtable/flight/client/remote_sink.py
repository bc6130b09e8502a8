"""A producer for a table on ``pushtable serve``: :class:`RemoteSink`.

A :class:`RemoteSink` has the methods and exceptions of a local :class:`~pushtable.TableSink`.
``write`` returns once the batch is on its way with at most ``window`` batches not yet
acknowledged (queued in the server's table); beyond that it waits, so a full table blocks the
client's producer. ``flush`` waits for every acknowledgement; ``close`` flushes first.

A batch the server refuses (NOT NULL, order, invalid Arrow) costs only itself: the batches
sent after it, which the server did not take, are sent again on a new stream, and the refusal
is raised by the producer's next call (a refused batch leaves the sink usable; nothing else
is lost). A stream refused as it opened for a count that frees by itself (its token's other
calls still opening: a burst of producers) took nothing: its batches go again on another,
opened a moment later (see :class:`~pushtable.flight.client.transport.Reopening`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
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
from pushtable.flight.client.opening import Opening, end_unused
from pushtable.flight.client.outcome import Item, Sent, timed_out
from pushtable.flight.client.put_stream import LEAVE_WAIT_S, PutStream
from pushtable.flight.client.transport import Reopening, Transport
from pushtable.producer import ProducerScope, SinkStats, TopicStats, arrow_batches, check_timeout

__all__ = ["WINDOW_BYTES", "RemoteSink", "RemoteSinkStats"]

#: how long a producer leaving (its client closing) waits for its stream to end before it
#: leaves it (see :meth:`PutStream.finish`)
END_WAIT_S = 5.0
#: The bytes a producer's batches in flight may reference (with ``window`` batches, whichever
#: bound comes first): what the client holds for the server and what gRPC buffers for it.
WINDOW_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class RemoteSinkStats:
    """What this client sent and the server acknowledged, and the server table's counters."""

    sent_batches: int
    acknowledged_batches: int
    table: SinkStats | TopicStats


def _left(deadline: float) -> float:
    """The seconds left until ``deadline`` (a little more than none: a call's timeout)."""
    return max(0.001, deadline - time.monotonic())


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
        self,
        transport: Transport,
        name: str,
        schema: pa.Schema,
        *,
        window: int = 8,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 1:
            raise ValueError(f"window_bytes must be an integer >= 1, got {window_bytes!r}")
        self._transport = transport
        self.name = name
        self.schema = schema
        self.window = window
        self.window_bytes = window_bytes
        self._wire_schema = protocol.wire_schema(schema)
        self._put: PutStream | None = None
        self._sent = 0
        self._acked = 0
        self._closed = False
        self._left = False  # its client left it (closing): no call sends on it again
        #: streams left and not yet ended on the server (a second leave waits for them too)
        self._leaving: list[PutStream] = []
        #: earlier batches' refusals, oldest first: each raised by one later call
        self._unreported: collections.deque[BaseException] = collections.deque()
        #: the errors of batches no task waits for any more (see :meth:`orphan`), oldest first
        self._orphan_errors: collections.deque[BaseException] = collections.deque()
        #: items to send before anything new: those sent after a refused one, which the
        #: server never took
        self._pending: collections.deque[Item] = collections.deque()
        #: called when a stream of this sink ends (on its reader thread): an asyncio
        #: producer's writer settles what was in flight then, not at its next write
        self.on_stream_end: Callable[[], None] | None = None
        self._stopped = False  # a stream of it heard the server say it stops
        #: the pauses between streams refused as they opened, and when to stop opening more
        self._reopening = Reopening(f"remote table '{name}'")
        #: a stream being opened for a call with a deadline that passed first
        self._opening: Opening | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteSink(name={self.name!r}, server={self._transport.uri!r})"

    def _stream(self, deadline: float | None = None) -> PutStream:
        if self._put is not None and self._put.idle:  # the server ended it: start anew
            self._end_stream_locked()
        if self._put is None:
            descriptor = flight.FlightDescriptor.for_path(self.name)
            self._open(descriptor, deadline, self._ended)
        assert self._put is not None
        return self._put

    def _open(
        self,
        descriptor: Any,
        deadline: float | None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        """Open a stream for ``descriptor`` as the sink's own, within ``deadline``.

        gRPC's open waits, without a bound, for its connection (see
        :mod:`~pushtable.flight.client.opening`): with a deadline, the open runs on a thread
        of its own and the call raises :class:`~pushtable.WriteTimeoutError` at its deadline;
        the next call takes the stream it opened. Without one, it opens here.
        """
        path = tuple(descriptor.path)
        opening = self._opening
        if opening is not None and opening.done and not opening.usable(path):
            # Found done with no use: an open that failed (its error was no call's: none
            # waited for it), a stream the server ended meanwhile (idle), or one opened for
            # another first batch. Let go; this call opens anew.
            self._opening = None
            opening.let_go(time.monotonic() + LEAVE_WAIT_S if deadline is None else deadline)
            opening = None
        if opening is None:
            if deadline is None:
                self._opened(PutStream(self._transport, descriptor, self._wire_schema, on_end))
                return
            opening = self._opening = Opening(
                functools.partial(
                    PutStream, self._transport, descriptor, self._wire_schema, on_end
                ),
                path,
            )
            # ``_end_stream`` sets ``_left``, then lets ``_opening`` go: one of the two sees
            # the other, and an open let go before it starts never does
            if self._left or not opening.start():
                self._opening = None
                self._refuse_left()
                raise SinkClosedError(f"remote sink for '{self.name}' was left (its client closed)")
        if not opening.wait(deadline):
            raise self._reopening.timed_out(
                f"timed out opening a stream to remote table '{self.name}' (gRPC had not "
                "reached the server: it is paused, or away)"
            )
        self._opening = None
        put = opening.take()  # the open's error, raised: this call waited for it
        if put is None:  # let go by the client leaving meanwhile
            self._refuse_left()
            raise SinkClosedError(f"remote sink for '{self.name}' was left (its client closed)")
        if opening.path != path:  # waited for, but opened for another first batch
            end_unused(put, deadline)
            self._open(descriptor, deadline, on_end)
            return
        self._opened(put)  # ended as it opened (refused): this call hears why, as ever

    def _let_go_opening(self, deadline: float) -> list[str]:
        """Let go of a stream still opening for a call that timed out; what it still holds."""
        opening, self._opening = self._opening, None
        return [] if opening is None else opening.let_go(deadline)

    def _opened(self, put: PutStream) -> None:
        """Take ``put`` as the open stream, unless the client left meanwhile (then leave it).

        ``_end_stream`` sets ``_left`` and then looks at ``_put`` (and a stream still
        opening): one of the two sees the other, so no stream opened while the client leaves
        stays open.
        """
        self._put = put
        if self._left:
            put.leave(time.monotonic() + LEAVE_WAIT_S)
            self._refuse_left()

    def _drop_stream(self) -> None:
        """Forget a stream the server ended (after an error): the next write opens another."""
        put, self._put = self._put, None
        if put is not None:
            self._acked += put.acked
            self._sent += put.sent
            self._stopped |= isinstance(put.error, ServerStoppedError)
            put.abandon()  # its error was raised already

    def _end_stream(self, timeout: float = END_WAIT_S) -> list[str]:
        """Leave this producer's open stream, if any (its client is closing); the table stays open.

        Bounded by ``timeout`` as a whole, whatever another call of the sink is doing. With
        the sink free, the stream ends cleanly (left half-way through ``timeout`` if the
        server still holds it: a batch in flight waits for room in a full table). With a call
        holding the sink (waiting for room, or for gRPC to take a batch), the stream is left
        at once: the server stops waiting and ends it, and that call raises
        :class:`~pushtable.SinkClosedError`. The sink takes no new batch after this.

        Returns what is still held at ``timeout`` (empty: the stream's slot on the server
        and its threads are free).
        """
        deadline = time.monotonic() + timeout
        self._left = True  # then ``_opening``: a call that sets it looks at this after
        held = self._leave_stream(deadline, timeout)
        # a stream still opening for a call that timed out: it ends too
        held += self._let_go_opening(deadline)
        # and those an earlier (or concurrent) leave let go: not free until they ended
        return held + self._still_leaving(deadline, held)

    def _still_leaving(self, deadline: float, said: list[str]) -> list[str]:
        """What streams left earlier still hold at ``deadline`` (not already in ``said``)."""
        held: list[str] = []
        for put in list(self._leaving):
            for thread in put.threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if put.finished and not put.threads:
                with contextlib.suppress(ValueError):
                    self._leaving.remove(put)
                continue
            name = f"its stream on the server ({put.stream_id})"
            if name not in said:
                held.append(name)
            held += [f"thread {t.name}" for t in put.threads if f"thread {t.name}" not in said]
        return held

    def _leave_stream(self, deadline: float, timeout: float) -> list[str]:
        """:meth:`_end_stream`'s work on the open stream; what it still holds at ``deadline``."""
        put = self._put
        if self._lock.acquire(timeout=min(0.05, timeout / 4)):
            try:  # no call holds the sink: this one takes its stream (none takes it after)
                put, self._put = self._put, None
                if put is not None:
                    self._sent += put.sent
                    self._acked += put.acked
                    self._leaving.append(put)  # a concurrent leave waits for it too
            finally:
                self._lock.release()
            if put is not None:
                half = max(0.0, deadline - time.monotonic()) / 2  # then left, if need be
                with contextlib.suppress(PushTableError):
                    put.finish(timeout=half, leave_for=half)
                self._left_unsettled(put)
        elif (put := self._put) is not None:  # the call holding the sink keeps it: it raises
            self._leaving.append(put)
            put.leave(deadline)
            self._left_unsettled(put)
        if put is None:
            return []
        for thread in put.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        held = [] if put.finished else [f"its stream on the server ({put.stream_id})"]
        return held + [f"thread {t.name}" for t in put.threads]

    def _end_stream_locked(
        self, timeout: float = END_WAIT_S, leave_for: float = LEAVE_WAIT_S
    ) -> None:
        put, self._put = self._put, None
        if put is not None:
            with contextlib.suppress(PushTableError):
                put.finish(timeout=timeout, leave_for=leave_for)
            self._sent += put.sent
            self._acked += put.acked
            self._left_unsettled(put)

    def _left_unsettled(self, put: PutStream) -> None:
        """A stream left before its end was seen: what it had in flight hears so now.

        Its end, if it comes later, finds them settled.
        """
        with put.changed:
            unsettled = [item for item in put.inflight if not item.settled]
        for item in unsettled:
            error = SinkClosedError(
                f"the producer of '{self.name}' left its stream before the server "
                "acknowledged this batch: it may be stored or not (the server may have "
                "queued it), so do not count it either way"
            )
            error.batches_written = 1  # sent: its outcome is unknown, not "not sent"
            error.kept = True  # type: ignore[attr-defined]
            self._settle(item, error)

    def write(self, data: Any, timeout: float | None = None) -> None:
        """Send a batch (or every batch of a table / stream), at most ``window`` unacknowledged.

        It waits while ``window`` batches (or ``window_bytes``) are unacknowledged; ``timeout``
        bounds the whole call, gRPC's write included: the ``WriteTimeoutError`` says whether
        the batch is on its way (``kept``, counted in ``batches_written``: a later ``flush``
        reports its outcome) or was not sent, and never will be.

        Raises the same errors as ``TableSink.write``: ``SchemaMismatchError`` (checked before
        sending; NOT NULL violations come from the server), ``SinkClosedError``,
        ``ReaderGoneError``, ``WriteTimeoutError``; the server's refusal of an earlier batch
        in flight is raised by the next call (the batches after it are sent again: only the
        refused one is lost). ``batches_written`` counts what this call sent.
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        written = 0
        with self._held(deadline, "write"):
            try:
                self._refuse_closed()
                for data_batch in arrow_batches(data):
                    batch = protocol.to_wire(self.name, self.schema, self._wire_schema, data_batch)
                    self._raise_unreported()
                    self._submit_locked(Item(batch), deadline)
                    written += 1
                self._raise_unreported()
            except PushTableError as exc:
                exc.batches_written = written + (1 if getattr(exc, "kept", False) else 0)
                raise

    @contextlib.contextmanager
    def _held(self, deadline: float | None, what: str) -> Iterator[None]:
        """The sink's lock, taken within ``deadline``: a call's timeout bounds its wait for it.

        Another call holds it while it waits for room or for gRPC (a write with no timeout
        into a full table): this call raised nothing until that one returned, past its own
        timeout. A write that times out here sent nothing (``kept=False``).
        """
        left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._lock.acquire(timeout=left):
            message = (
                f"{what} of remote table '{self.name}' timed out waiting for another call of "
                "this sink (it waits for room or for the server)"
            )
            if what in ("write", "advance"):
                raise timed_out(message, 0, kept=False)
            raise WriteTimeoutError(message)
        try:
            yield
        finally:
            self._lock.release()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise SinkClosedError(f"remote sink for '{self.name}' is closed")
        if self._left:
            raise SinkClosedError(f"remote sink for '{self.name}' was left (its client closed)")

    def _raise_unreported(self) -> None:
        """Raise (once) the oldest refusal the server sent for an earlier batch of this sink.

        Or the oldest error of a batch whose task stopped waiting for it (see :meth:`orphan`).
        Each is raised by one call: two refused batches are two errors, by two calls.
        """
        for errors in (self._unreported, self._orphan_errors):
            if errors:
                raise errors.popleft()

    def _forget_unreported(self, error: BaseException) -> None:
        """``error`` is raised by the call at hand: no later call raises it again."""
        with contextlib.suppress(ValueError):
            self._unreported.remove(error)

    def orphan(self, item: Item) -> None:
        """No task waits for ``item``'s outcome any more: an error of it goes elsewhere.

        To the next ``flush`` or ``close`` of the sink (a success goes nowhere).
        """
        item.outcome = self._orphaned
        if item.settled and item.error is not None:  # settled before: told nobody
            self._orphaned(item.error)

    def _orphaned(self, error: BaseException | None) -> None:
        if error is not None and all(e is not error for e in self._orphan_errors):
            self._orphan_errors.append(error)  # its own queue: no other call takes it for its own

    def _settle(self, item: Item, error: BaseException) -> None:
        item.settle(error)
        if item.outcome is None and all(e is not error for e in self._unreported):
            self._unreported.append(error)  # the sync face's next call raises it (once)

    def submit(self, item: Item, deadline: float | None) -> None:
        """Send ``item`` (its batch in the wire schema) once the window has room.

        At most ``window - 1`` batches may be unacknowledged before; the item's ``outcome``
        tells what became of it.

        Raises :class:`~pushtable.WriteTimeoutError` when ``deadline`` passes first, or the
        error that left it unsendable: either way the item was not sent.
        """
        with self._lock:
            self._refuse_closed()
            self._submit_locked(item, deadline)

    def _submit_locked(self, item: Item, deadline: float | None) -> None:
        self._pending.append(item)
        try:
            self._drain_locked(deadline)
        except PushTableError as exc:
            if self._pending and self._pending[-1] is item:
                self._pending.pop()  # not sent: the caller hears why
                if isinstance(exc, WriteTimeoutError):
                    raise timed_out(str(exc), 0, kept=False) from exc.__cause__
            elif isinstance(exc, WriteTimeoutError) and item.claimed:
                # gRPC was still taking it at the deadline: it goes on, its outcome later
                raise timed_out(str(exc), 1, kept=True) from exc.__cause__
            raise
        if item.error is not None and item.outcome is None:
            self._forget_unreported(item.error)
            raise item.error

    def _drain_locked(self, deadline: float | None) -> None:
        """Send every pending item, oldest first (those a refusal left unsent come first).

        Raises :class:`~pushtable.WriteTimeoutError` at ``deadline``, with the items not
        sent still pending (the one gRPC was taking, if any, goes on: it is in flight).
        """
        while self._pending:
            self._refuse_left()
            try:
                put = self._stream(deadline)
            except PushTableError as exc:  # pyarrow may hear a refusal as the call opens
                if not protocol.reopens(exc):
                    raise
                self._reopening.wait(exc, deadline)
                continue
            item = self._pending[0]
            try:
                # raises only once the stream ended
                room = put.wait(self.window - 1, deadline, self.window_bytes - item.nbytes)
            except PushTableError as exc:
                self._recover_or_raise(put, exc, deadline)
                continue
            if not room:
                raise self._reopening.timed_out(
                    f"write to remote table '{self.name}' timed out with "
                    f"{put.sent - put.acked} batch(es) unacknowledged"
                )
            try:
                sent = put.send(item, max(1, self.window // 2), deadline)
            except PushTableError as exc:  # the stream is over: its end says what it took
                if self._pending and self._pending[0] is item:
                    self._pending.popleft()  # in flight on it: its end settles it
                self._recover_or_raise(put, exc, deadline)
                continue
            if sent is Sent.BUSY:  # an earlier batch still holds the stream in gRPC
                raise self._reopening.timed_out(
                    f"write to remote table '{self.name}' timed out while gRPC was still "
                    "taking an earlier batch (the server reads nothing: its table is full)"
                )
            self._pending.popleft()  # sent, in flight, or withdrawn by its writer
            if sent is Sent.PENDING:
                raise self._reopening.timed_out(
                    f"write to remote table '{self.name}' timed out while gRPC was taking "
                    "the batch (the server reads nothing: its table is full)"
                )
            if put.acked:
                self._reopening.reset()  # the stream was taken

    def _refuse_left(self) -> None:
        """A call holding the sink when its client left: the stream is left, the call ends."""
        if self._left:  # the leaving call settles what the stream has in flight
            error = SinkClosedError(
                f"remote sink for '{self.name}' was left (its client closed) during this call: "
                "a batch it had not sent never will be"
            )
            pending, self._pending = list(self._pending), collections.deque()
            for item in pending:
                item.settle(error)
            raise error

    def _ended(self) -> None:
        hook = self.on_stream_end
        if hook is not None:
            hook()

    def tend(self, deadline: float | None) -> None:
        """Settle what a stream that ended had in flight, and send what waits to be sent again.

        For a producer with nothing new to send (an asyncio producer's writer, between
        writes): items whose stream ended learn their outcome now. Raises
        :class:`~pushtable.WriteTimeoutError` if ``deadline`` passes with items still waiting
        for room (they stay pending); any other error is each pending item's.
        """
        with self._lock:
            put = self._put
            try:
                if put is not None and put.finished and put.inflight:
                    error, _ = self._recover(put, put.error or StreamEndedError("the stream ended"))
                    if protocol.reopens(error):
                        self._reopening.wait(error, deadline)
                self._drain_locked(deadline)
            except WriteTimeoutError:
                raise
            except PushTableError as exc:
                while self._pending:
                    self._settle(self._pending.popleft(), exc)

    def request_acks(self, deadline: float | None = None) -> None:
        """Ask the server to acknowledge now whatever this sink has in flight."""
        with self._lock:
            put = self._put
            if put is not None and not put.ended and put.requested < put.sent:
                put.sync(deadline)

    def _recover_or_raise(
        self, put: PutStream, seen: BaseException, deadline: float | None
    ) -> None:
        """Recover from ``put``'s end when it was a refusal, or raise why it ended.

        A refusal of one batch: the rest go again. A refusal of the stream as it opened: all
        go again, after a pause (see :class:`Reopening`). Any other end took nothing more: the
        caller's call fails with it. A stream its client left: ``SinkClosedError``.
        """
        self._refuse_left()
        error, resent = self._recover(put, seen)
        if not resent:
            self._forget_unreported(error)  # raised here, not again by the next call
            raise error
        if protocol.reopens(error):
            self._reopening.wait(error, deadline)

    def _recover(self, put: PutStream, seen: BaseException) -> tuple[BaseException, bool]:
        """Settle what was in flight on ``put``, which ended.

        After a refusal, the refused item gets the error and those after it (never taken)
        wait to be sent again, first; after a refusal of the stream as it opened, all of them
        do; after any other end, each gets the error. Returns the error, and whether it was a
        refusal (with items to send again).
        """
        error = put.verdict(seen)
        refused = getattr(error, "refused_message", None)
        with put.changed:
            items, first = list(put.inflight), put.acked + 1  # the number of items[0]
            put.inflight.clear()
        self._drop_stream()
        if protocol.reopens(error):
            self._pending.extendleft(reversed(items))
            return error, True
        if refused is None or not first <= refused < first + len(items):
            for item in items:
                self._settle(item, error)
            return error, False
        at = refused - first
        for item in items[:at]:  # taken before the refused one: queued (stored, if durable)
            item.settle(None)
        self._settle(items[at], error)
        self._pending.extendleft(reversed(items[at + 1 :]))
        return error, True

    async def awrite(self, data: Any, timeout: float | None = None) -> None:
        """Asyncio form of :meth:`write` (runs it on a worker thread; the loop never blocks)."""
        await asyncio.to_thread(self.write, data, timeout)

    def advance(self, ts: Any, timeout: float | None = None) -> None:
        """``TableSink.advance`` on the server's table, in order with this sink's batches.

        It keeps its place among the batches written before and after it on this sink. ``ts``
        is an ``int``, or a ``datetime`` for a timestamp column. Errors (no ``order_by``, a
        closed table) come back like a write's.
        """
        item = self.advance_item(ts)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held(deadline, "advance"):
            self._refuse_closed()
            self._raise_unreported()
            self._submit_locked(item, deadline)

    def advance_item(
        self, ts: Any, outcome: Callable[[BaseException | None], None] | None = None
    ) -> Item:
        """The message that moves the table's watermark to ``ts`` (see :meth:`advance`)."""
        metadata = protocol.advance_metadata(ts)
        return Item(pa.RecordBatch.from_pylist([], schema=self._wire_schema), metadata, outcome)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the server acknowledged every batch sent (queued in its table)."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held(deadline, "flush"):
            self._flush_locked(deadline)
            self._raise_unreported()

    def _flush_locked(self, deadline: float | None) -> None:
        self._refuse_left()  # its client left: nothing more is acknowledged
        while True:
            self._drain_locked(deadline)
            put = self._put
            if put is None:
                return
            try:
                done = put.wait(0, deadline)  # raises only once the stream ended
            except PushTableError as exc:
                self._recover_or_raise(put, exc, deadline)
                continue
            if not done:
                raise self._reopening.timed_out(f"flush of remote table '{self.name}' timed out")
            if put.acked:
                self._reopening.reset()
            if not self._pending:
                return

    def close(self, timeout: float | None = None) -> None:
        """Flush, end this producer's stream, and close the table (end of stream).

        ``timeout`` bounds the whole call: past it, :class:`~pushtable.WriteTimeoutError`
        and the table stays open (call ``close`` again). Without one, the flush waits as long
        as the table is full, and the stream's end (every batch acknowledged by then) at
        most ``END_WAIT_S``.
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held(deadline, "close"):
            if self._closed:
                return
            self._refuse_closed()
            self._flush_locked(deadline)
            self._raise_unreported()
            put, self._put = self._put, None
            if put is not None:
                self._stopped |= isinstance(put.error, ServerStoppedError)
                self._sent += put.sent
                self._acked += put.acked
                if deadline is None:
                    put.finish(END_WAIT_S)
                else:  # half to end, half to leave (every batch is acknowledged: none lost)
                    put.finish(_left(deadline) / 2, leave_for=_left(deadline) / 2)
            # a stream opened for a write that timed out carries nothing: it ends too
            self._let_go_opening(time.monotonic() + END_WAIT_S if deadline is None else deadline)
            options = None if deadline is None else self._transport.options(_left(deadline))
            try:
                self._transport.action("close", {"name": self.name}, options)
            except ServerUnavailableError as exc:
                self._closed = True
                if self._stopped:  # the server said it stopped: that, not "unreachable"
                    raise ServerStoppedError(
                        f"the pushtable server stopped before the close of '{self.name}' "
                        "reached it: the table was failed with the stop, not closed"
                    ) from exc
                raise
            self._closed = True

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close`, run in a worker thread."""
        await asyncio.to_thread(self.close)

    def fail(self, exc: BaseException) -> None:
        """Make the table's reading query raise (``StreamFailedError`` naming ``exc``)."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(exc).__name__}")
        opening = None
        if self._lock.acquire(timeout=0.05):
            try:
                self._closed = True
                put, self._put = self._put, None
                opening, self._opening = self._opening, None
            finally:
                self._lock.release()
        else:  # a call holds the sink (waiting for room, or for gRPC): it did not wait behind
            self._closed = True  # it for good; the stream is left under it, and it raises
            if (put := self._put) is not None:
                put.leave(time.monotonic() + LEAVE_WAIT_S)
        try:
            self._transport.action(
                "fail", {"name": self.name, "type": type(exc).__name__, "message": str(exc)}
            )
        finally:  # the action failed or not, the stream and an open in flight end
            if put is not None:
                with contextlib.suppress(PushTableError):
                    put.finish(timeout=5.0)
                self._left_unsettled(put)  # what was in flight hears so (its task waited)
            if opening is not None:
                opening.let_go(time.monotonic() + END_WAIT_S)

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
