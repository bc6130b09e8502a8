"""One DoPut stream of a remote producer, and the batches in flight on it.

A :class:`PutStream` writes batches and reads the server's acknowledgements on a thread of its
own. Every message it sends is an :class:`Item` kept until an acknowledgement covers it, so
when the stream ends early its owner knows exactly what the server took: the acknowledged
items, and, when the call's error is the refusal of message *n* (see
:func:`~pushtable.flight.protocol.refusing`), every message before *n* too, and none after.

A write never holds its caller past its deadline: gRPC's write blocks while the server reads
nothing (its handler waits for room in a full table and the stream's flow-control window is
full), so a write with a deadline runs on the stream's sender thread, and a caller whose
deadline passes first returns with the item *in flight* (:data:`PENDING`): it goes on once
gRPC takes it, and its outcome comes as every sent item's does. An item is claimed for the
wire before it is written (:meth:`Item.claim`), so a producer that stops waiting for an item
either withdraws it for good (:meth:`Item.withdraw`: it is never sent) or learns that it was
sent already — never both.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import (
    ClientClosedError,
    PushTableError,
    ServerStoppedError,
    StreamEndedError,
    WriteTimeoutError,
)
from pushtable.flight import protocol
from pushtable.flight.client.outcome import Item, Sent
from pushtable.flight.client.transport import Transport

__all__ = ["PutStream"]

_LATER = pa.py_buffer(protocol.LATER)
_SYNC = pa.py_buffer(protocol.SYNC)
#: how long a stream that was left is given to end (the server looks every ``POLL_S``)
LEAVE_WAIT_S = 2.0
#: how long a stream left on a server that did not answer is left again, in the background
LEAVE_AGAIN_FOR_S = 300.0


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
        #: items sent and not yet acknowledged, oldest first, and the bytes they reference
        self.inflight: collections.deque[Item] = collections.deque()
        self.inflight_bytes = 0
        self.changed = threading.Condition()
        self.io = threading.Lock()  # one call on the writer at a time
        #: the write the sender thread runs (None: it is idle), under ``changed``
        self._job: Callable[[], None] | None = None
        self._sender: threading.Thread | None = None
        self.left = False  # its producer left it (the ``leave`` action): it ends soon
        self._ack_reader = threading.Thread(
            target=self._read_acks, name="pushtable-acks", daemon=True
        )
        self._ack_reader.start()

    @property
    def ended(self) -> bool:
        """The server ended the stream, or said why it will."""
        return self.finished or self.error is not None

    @property
    def threads(self) -> list[threading.Thread]:
        """The stream's threads still running (acknowledgement reader, sender)."""
        return [t for t in (self._ack_reader, self._sender) if t is not None and t.is_alive()]

    def send(
        self, item: Item | pa.RecordBatch, ack_every: int = 1, deadline: float | None = None
    ) -> Sent:
        """Write one item (its batch already in the stream's wire schema); what became of it.

        The server acknowledges it at once only when ``ack_every`` batches went unasked:
        ``wait`` asks (``SYNC``) for what it needs beyond that. An item its writer withdrew
        is not sent (:data:`Sent.WITHDRAWN`). With a ``deadline``, the call returns by then:
        :data:`Sent.BUSY` if an earlier write still held the stream (this one was not sent),
        :data:`Sent.PENDING` if this one was being written (it goes on). A failed write
        raises :class:`~pushtable.StreamEndedError` and leaves the item in flight: the
        stream's end settles it.
        """
        if not isinstance(item, Item):
            item = Item(item)
        if not self._idle(deadline):
            return Sent.BUSY
        if self.left:
            raise StreamEndedError("the producer left this stream: nothing more is sent on it")
        if not item.claim():
            return Sent.WITHDRAWN
        later = item.metadata is None and self.sent + 1 - self.requested < ack_every
        with self.changed:
            if self.left:  # under the lock its leaver takes what is in flight with: not lost
                raise StreamEndedError("the producer left this stream: its batch was not sent")
            self.inflight.append(item)
            self.inflight_bytes += item.nbytes
        self.sent += 1
        if not later:
            self.requested = self.sent
        write: Callable[[], None]
        if later:
            write = functools.partial(self.writer.write_with_metadata, item.batch, _LATER)
        elif item.metadata is None:
            write = functools.partial(self.writer.write_batch, item.batch)
        else:
            meta = pa.py_buffer(item.metadata)
            write = functools.partial(self.writer.write_with_metadata, item.batch, meta)
        return Sent.SENT if self._write(write, deadline) else Sent.PENDING

    def _idle(self, deadline: float | None) -> bool:
        """Wait until no write of the sender thread holds the stream (False: ``deadline``)."""
        with self.changed:
            while self._job is not None and not self.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(left)
            return True

    def _write(self, write: Callable[[], None], deadline: float | None) -> bool:
        """Run one gRPC write: True once done, False if ``deadline`` passed first (it goes on).

        Without a deadline it runs on the caller's thread (which waits as long as it takes);
        with one, on the stream's sender thread, so the caller is free at its deadline.
        """
        if deadline is None:
            self._wire(write)
            return True
        failed: list[BaseException] = []

        def job() -> None:
            try:
                self._wire(write)
            except BaseException as exc:  # noqa: BLE001 (the caller raises it, if it waits)
                failed.append(exc)

        with self.changed:
            self._job = job
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_jobs, name="pushtable-send", daemon=True
                )
                self._sender.start()
            self.changed.notify_all()
            while self._job is job:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        if failed:
            raise failed[0]
        return True

    def _wire(self, write: Callable[[], None]) -> None:
        try:
            with self.io:
                protocol.call(write)
        except (flight.FlightError, pa.ArrowException) as exc:  # not one of ours: it ended
            raise StreamEndedError(f"the stream ended under a write: {exc}") from exc

    def _send_jobs(self) -> None:
        """The sender thread: runs each write handed to it, until the stream ends."""
        while True:
            with self.changed:
                while self._job is None and not self.finished:
                    self.changed.wait()
                job = self._job
                if job is None:
                    self._sender = None  # the stream ended: a later write starts another
                    return
            try:
                job()
            finally:
                with self.changed:
                    self._job = None
                    self.changed.notify_all()

    def sync(self, deadline: float | None = None) -> None:
        """Ask the server to acknowledge every batch sent so far.

        If the stream has ended, the acknowledgement reader has the verdict. Bounded by
        ``deadline`` as :meth:`send` is (a sync not written by then goes on, or is not sent).
        """
        if not self._idle(deadline):
            return
        with contextlib.suppress(StreamEndedError, PushTableError):
            self._write(functools.partial(self.writer.write_metadata, _SYNC), deadline)
        self.requested = self.sent

    def leave(self, deadline: float | None) -> bool:
        """Leave the stream without taking its writer (a write may hold it); whether it ended.

        The ``leave`` action tells the server to stop waiting for room for this stream and
        end it: a write blocked in gRPC then fails, what the server had not taken is not
        acknowledged. Waits for the end until ``deadline``.
        """
        with self.changed:
            first, self.left = not self.left, True
            self.changed.notify_all()  # a call waiting for room stops waiting (see wait)
        if not self.finished:  # its connection stays open until it ends (its reader forgets it)
            self._transport.unended.add(self)
            if self.finished:
                self._transport.unended.discard(self)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        if not self.finished:
            with contextlib.suppress(PushTableError):
                options = self._transport.options(left if left is not None else LEAVE_WAIT_S)
                self._transport.action("leave", {"stream": self.stream_id}, options, leaving=True)
        ended = self._wait_finished(deadline)
        if not ended and first:  # a server that did not answer (paused): tell it again later
            threading.Thread(target=self._leave_again, name="pushtable-leave", daemon=True).start()
        return ended

    def _leave_again(self) -> None:
        """Send ``leave`` every ``LEAVE_WAIT_S`` until the stream ends (``LEAVE_AGAIN_FOR_S``).

        A server paused when its producer left answers nothing; once it resumes, its handler
        goes on waiting for room for the stream, and a write blocked in gRPC stays blocked,
        until a ``leave`` reaches it.
        """
        until = time.monotonic() + LEAVE_AGAIN_FOR_S
        while not self.finished and time.monotonic() < until:
            try:
                options = self._transport.options(LEAVE_WAIT_S)
                self._transport.action("leave", {"stream": self.stream_id}, options, leaving=True)
            except ClientClosedError:
                return  # the connection is closed: its calls, this stream's too, are over
            except PushTableError:
                pass
            self._wait_finished(time.monotonic() + LEAVE_WAIT_S)

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
                        item = self.inflight.popleft()
                        self.inflight_bytes -= item.nbytes
                        done.append(item)
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
            self._transport.unended.discard(self)
            if self._on_end is not None:
                self._on_end()

    def wait(
        self, most_unacked: int, deadline: float | None, most_bytes: int | None = None
    ) -> bool:
        """Wait until at most ``most_unacked`` batches are unacknowledged (False: timed out).

        With ``most_bytes``, also until those in flight reference at most that many bytes
        (or none is in flight: one batch alone always goes).
        """

        def over() -> bool:
            if self.sent - self.acked > most_unacked:
                return True
            return (
                most_bytes is not None
                and bool(self.inflight)
                and (self.inflight_bytes > most_bytes)
            )

        if self.sent - self.requested > most_unacked or (
            most_bytes is not None and self.requested < self.sent and over()
        ):
            self.sync(deadline)
        with self.changed:
            while over() and not self.finished and not self.left:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(left)
            if self.left and over() and not self.finished and self.error is None:
                # its producer left it (a client closing, a paused server that may never
                # answer the leave): no room comes on it, and its end is not waited for here
                raise StreamEndedError("the producer left this stream: no more room on it")
            if self.error is None and over():
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
        if self._idle(time.monotonic() + timeout):  # a write that holds it fails as it ends
            with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
                self.writer.done_writing()
        with self.changed:
            self.changed.wait_for(lambda: self.finished, timeout)
            if not self.finished:
                return  # the server never ended it: leak it rather than crash
        self._ack_reader.join(timeout)  # it set ``finished`` last: it is ending
        with self.io, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            self.writer.close()

    def wait_finished(self, deadline: float | None) -> bool:
        """Wait until the server ended the stream (or ``deadline``); whether it did."""
        return self._wait_finished(deadline)

    def _wait_finished(self, deadline: float | None) -> bool:
        """Wait until the server ended the stream (or ``deadline``); whether it did."""
        with self.changed:
            while not self.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def finish(self, timeout: float | None = None, leave_for: float = LEAVE_WAIT_S) -> None:
        """End the stream: every acknowledgement read, the server's verdict raised.

        If the server has not ended it within ``timeout`` seconds (its handler waits for room
        for a batch in flight, or a write still holds the stream), the stream is left (see
        :meth:`leave`: what the server had not taken is not acknowledged) and
        :class:`~pushtable.WriteTimeoutError` raised once it ended, or ``leave_for`` seconds later.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._idle(deadline):
            with self.io, contextlib.suppress(PushTableError):  # the ack reader has the verdict
                protocol.call(self.writer.done_writing)
        if not self._wait_finished(deadline):
            self.leave(time.monotonic() + leave_for)
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
