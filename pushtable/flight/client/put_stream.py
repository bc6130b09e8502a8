"""One DoPut stream of a remote producer, and the batches in flight on it.

A :class:`PutStream` writes batches and reads the server's acknowledgements on a thread of its
own. Every message it sends is an :class:`Item` kept until an acknowledgement covers it, so
when the stream ends early its owner knows exactly what the server took: the acknowledged
items, and, when the call's error is the refusal of message *n* (see
:func:`~pushtable.flight.protocol.refusing`), every message before *n* too, and none after.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import PushTableError, ServerStoppedError, StreamEndedError, WriteTimeoutError
from pushtable.flight import protocol
from pushtable.flight.client.transport import Transport

__all__ = ["Item", "PutStream"]

_LATER = pa.py_buffer(protocol.LATER)
_SYNC = pa.py_buffer(protocol.SYNC)
#: how long a stream that was left is given to end (the server looks every ``POLL_S``)
LEAVE_WAIT_S = 2.0


class Item:
    """A message a producer sends (a batch, or an ``advance``), until its outcome is known.

    ``outcome`` (if any) is called once, from whichever thread learns it: with None when an
    acknowledgement covers the item, with the error when the server refused it or the stream
    ended with it unacknowledged and unsendable. Calls without a callback keep the error in
    :attr:`error` for the producer's next call to raise.
    """

    __slots__ = ("batch", "error", "metadata", "outcome", "sequence", "settled", "withdrawn")

    def __init__(
        self,
        batch: pa.RecordBatch,
        metadata: bytes | None = None,
        outcome: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.batch = batch
        self.metadata = metadata
        self.outcome = outcome
        self.error: BaseException | None = None
        self.settled = False
        #: an idempotent producer's number for it, once it has one
        self.sequence: int | None = None
        #: its writer stopped waiting for it: a sink that has not sent it yet never does
        #: (checked again once the window has room, so a withdrawal before that always holds)
        self.withdrawn = False

    def settle(self, error: BaseException | None) -> None:
        """Record the item's outcome and tell its callback (once)."""
        if self.settled:
            return
        self.settled = True
        self.error = error
        if self.outcome is not None:
            self.outcome(error)


class PutStream:
    """One DoPut stream and the thread that reads its acknowledgements."""

    def __init__(
        self,
        transport: Transport,
        descriptor: Any,
        schema: pa.Schema,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        #: this stream's id: the ``leave`` action names it
        self.stream_id = uuid.uuid4().hex
        self.writer, self._reader = transport.do_put(descriptor, schema, self.stream_id)
        self._on_end = on_end  # told (on the reader thread) when the stream has ended
        self.schema = schema
        self.sent = 0
        self.acked = 0
        self.requested = 0  # the count the newest acknowledgement asked for covers
        self.error: BaseException | None = None
        self.finished = False
        self.idle = False  # the server ended the stream for idleness: the next write reopens
        #: items sent and not yet acknowledged, oldest first
        self.inflight: collections.deque[Item] = collections.deque()
        self.changed = threading.Condition()
        self.io = threading.Lock()  # one call on the writer at a time
        self._ack_reader = threading.Thread(
            target=self._read_acks, name="pushtable-acks", daemon=True
        )
        self._ack_reader.start()

    @property
    def ended(self) -> bool:
        """The server ended the stream, or said why it will."""
        return self.finished or self.error is not None

    def send(self, item: Item | pa.RecordBatch, ack_every: int = 1) -> None:
        """Write one item (its batch already in the stream's wire schema).

        The server acknowledges it at once only when ``ack_every`` batches went unasked:
        ``wait`` asks (``SYNC``) for what it needs beyond that. A failed write leaves the item
        in flight: the stream's end settles it.
        """
        if not isinstance(item, Item):
            item = Item(item)
        later = item.metadata is None and self.sent + 1 - self.requested < ack_every
        with self.changed:
            self.inflight.append(item)
        try:
            with self.io:
                if later:
                    protocol.call(self.writer.write_with_metadata, item.batch, _LATER)
                elif item.metadata is None:
                    protocol.call(self.writer.write_batch, item.batch)
                else:
                    protocol.call(
                        self.writer.write_with_metadata, item.batch, pa.py_buffer(item.metadata)
                    )
        except (flight.FlightError, pa.ArrowException) as exc:  # not one of ours: it ended
            raise StreamEndedError(f"the stream ended under a write: {exc}") from exc
        self.sent += 1
        if not later:
            self.requested = self.sent

    def sync(self) -> None:
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
                done: list[Item] = []
                with self.changed:
                    count = protocol.acked(buf)
                    while self.acked < count and self.inflight:
                        done.append(self.inflight.popleft())
                        self.acked += 1
                    self.acked = max(self.acked, count)
                    self.changed.notify_all()
                for item in done:  # outside the lock: a callback may hop to a loop
                    item.settle(None)
        except (flight.FlightError, pa.ArrowException) as exc:
            with self.changed:
                self.error = _ended(exc)
        finally:
            with self.changed:
                self.finished = True
                self.changed.notify_all()
            if self._on_end is not None:
                self._on_end()

    def wait(self, most_unacked: int, deadline: float | None) -> bool:
        """Wait until at most ``most_unacked`` batches are unacknowledged (False: timed out)."""
        if self.sent - self.requested > most_unacked:
            self.sync()
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

    def verdict(self, seen: BaseException, timeout: float = 5.0) -> BaseException:
        """Why the stream ended, once its acknowledgement reader is done.

        ``seen`` is what the writer met: the answer when the reader never says more.
        """
        with self.changed:
            self.changed.wait_for(lambda: self.finished, timeout)
            if self.error is None and self.finished and self.inflight:
                self.error = self._verdict()
            return self.error or seen

    def _verdict(self) -> BaseException:
        """Why the server ended the stream early (its error arrives when the stream closes)."""
        try:
            with self.io:
                self.writer.close()
        except (flight.FlightError, pa.ArrowException) as exc:
            return _ended(exc)
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

    def _wait_finished(self, deadline: float | None) -> bool:
        """Wait until the server ended the stream (or ``deadline``); whether it did."""
        with self.changed:
            while not self.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def finish(self, timeout: float | None = None) -> None:
        """End the stream: every acknowledgement read, the server's verdict raised.

        If the server has not ended it within ``timeout`` seconds (its handler waits for room
        for a batch in flight), the stream is left (the ``leave`` action: the server stops
        waiting, and what it had not written is not acknowledged) and
        :class:`~pushtable.WriteTimeoutError` raised once it ended, or ``LEAVE_WAIT_S`` later.
        """
        with self.io, contextlib.suppress(PushTableError):  # the ack reader has the verdict
            protocol.call(self.writer.done_writing)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait_finished(deadline):
            with contextlib.suppress(PushTableError):
                self._transport.action("leave", {"stream": self.stream_id})
            self._wait_finished(time.monotonic() + LEAVE_WAIT_S)
            raise WriteTimeoutError(
                f"the server did not finish the stream within {timeout}s: it was left "
                f"({len(self.inflight)} batch(es) in flight not acknowledged)"
            )
        self._ack_reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        error = self.error
        try:
            with self.io:
                protocol.call(self.writer.close)
        except PushTableError as exc:
            error = error or exc
        if error is not None:
            raise error


def _ended(exc: BaseException) -> BaseException:
    """The pushtable error a DoPut stream's end stands for.

    A Flight error that is not one of ours (gRPC's ``CANCELLED`` when the server shut down
    before its handler took the stream) is the stream ending without a reason: a
    :class:`~pushtable.StreamEndedError`, which an idempotent producer rides out.
    """
    error = protocol.client_error(exc)
    if error is exc and isinstance(exc, flight.FlightError):
        ended = StreamEndedError(f"the server ended the stream: {exc}")
        ended.__cause__ = exc
        return ended
    return error
