"""The metadata side of a DoPut stream on ``pushtable serve``.

It carries acknowledgements, the stop /
idle / failed notices other threads send on it, and a durable stream's acknowledgements sent
once a commit holds each batch (by the stream's own sender thread, so a client that stops
reading stalls nothing but itself).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors
from pushtable.flight import protocol

#: seconds a write to a DoPut stream's metadata side may wait for the client before another
#: thread gives up on it (a client that stopped reading: its notices are skipped)
NOTICE_WAIT_S = 1.0


class Acks:
    """A DoPut stream's metadata side, written by one thread at a time as gRPC requires.

    It carries acknowledgements, and the stop / idle notices sent to
    it from another thread (one writer at a time, as gRPC requires). A thread other than the
    call's own never waits long for it: a client that stops reading must not hold up the
    idle sweep, a stopping server or a committer.
    """

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._closed = False
        self.last_active = time.monotonic()
        self.told_idle = False
        self.writing = False  # a batch is being written (maybe waiting for room): not idle

    def done(self) -> None:
        """The chunk that set ``writing`` is handled: idle time counts from now."""
        self.writing = False
        self.last_active = time.monotonic()

    def send(self, count: int) -> int:
        """Acknowledge ``count`` batches (returns it), on the call's own thread."""
        with self._lock:
            self.last_active = time.monotonic()
            self._writer.write(protocol.ack(count))
        return count

    def send_if_open(self, count: int) -> None:
        """Acknowledge ``count`` batches from another thread (nothing once the call ended).

        It may wait for a client that does not read: only a stream's own sender calls it.
        """
        with self._lock, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            if not self._closed:
                self.last_active = time.monotonic()
                self._writer.write(protocol.ack(count))

    def stopping(self) -> None:
        """Tell the client the server is stopping (its producer ends the stream)."""
        self._notice(protocol.STOPPING)

    def failed(self) -> None:
        """Tell the client a commit failed (it ends its side, and the error reaches it)."""
        self._notice(protocol.FAILED)

    def idle(self) -> None:
        """Tell the client its stream was idle too long (it reopens one on its next write)."""
        self.told_idle = True
        self._notice(protocol.IDLE)

    def _notice(self, notice: pa.Buffer) -> None:
        """Send a notice from another thread, unless the stream's writer is stuck.

        It is skipped when the writer is stuck on a client
        that does not read (it would not read the notice either).
        """
        if not self._lock.acquire(timeout=NOTICE_WAIT_S):
            return
        try:
            with contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
                if not self._closed:  # the handler has not returned: the call is alive
                    self._writer.write(notice)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Mark the call finished: the handler is returning.

        No write may touch the call after this (gRPC forbids a
        write to a finished call), so it waits for one in progress. A writer stuck on a client
        that does not read holds the lock until gRPC cancels the call; only this stream's
        handler waits for it, never the committer or a stopping server.
        """
        with self._lock:
            self._closed = True


class CommitAcks:
    """A durable stream's acknowledgements, each sent once a commit holds its batch.

    Each batch's count is sent once the commit that
    holds its offset is done; a failed commit ends the stream with its error.

    The committer only notes the count (:meth:`on_commit`); the stream's own sender thread
    writes it (the newest count only: a later one covers every earlier one), so a client
    that stops reading its acknowledgements stalls nothing but itself. Unread for ``stall``
    seconds (``Limits.ack_timeout``), its stream is cut off with :class:`ResourceLimitError`.
    """

    def __init__(self, writer: Acks, topic: str, stall: float, cut_off: Callable[[], None]) -> None:
        self._writer = writer
        self._topic = topic
        self._stall = stall
        self._cut_off = cut_off  # counts the refusal (the server's ``ack_timeout`` refusals)
        self._lock = threading.Condition()
        self._waiting: collections.deque[tuple[int, int]] = collections.deque()
        self._sent = 0  # the newest count the sender was given
        self._to_send: int | None = None
        self._notify_failure = False
        self._writing_since: float | None = None
        self._finished = False
        self.failure: BaseException | None = None
        self.last_ticket = -1
        self._sender = threading.Thread(
            target=self._send_loop, name=f"pushtable-acks-{topic}", daemon=True
        )
        self._sender.start()

    def expect(self, count: int, ticket: int, committed: int) -> None:
        """Batch ``count`` of the stream is acknowledged once offset ``ticket`` is stored."""
        with self._lock:
            self._waiting.append((count, ticket))
            self.last_ticket = max(self.last_ticket, ticket)
        self.on_commit(committed, None)

    def on_commit(self, committed: int, failure: BaseException | None) -> None:
        """After a commit attempt (on the committer's thread): note what to send, never wait."""
        with self._lock:
            if self._finished:
                return
            count = self._sent
            while self._waiting and self._waiting[0][1] < committed:
                count = self._waiting.popleft()[0]
            if count > self._sent:
                self._sent = self._to_send = count
                self._lock.notify_all()
            if failure is not None and self._waiting and self.failure is None:
                self.failure = failure
                self._notify_failure = True  # the client ends its side: the error reaches it
                self._lock.notify_all()
            self._check_stall()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda: self._finished or self._to_send is not None or self._notify_failure
                )
                if self._finished:
                    return
                count, self._to_send = self._to_send, None
                notify, self._notify_failure = self._notify_failure, False
                self._writing_since = time.monotonic()
            try:
                if count is not None:
                    self._writer.send_if_open(count)
                if notify:
                    self._writer.failed()
            finally:
                with self._lock:
                    self._writing_since = None
                    self._lock.notify_all()

    def drain(self) -> None:
        """Wait until the sender wrote the newest count.

        The stream is ending and its client
        waits for it (bounded: a client that does not read is cut off anyway).
        """
        with self._lock:
            self._lock.wait_for(
                lambda: (
                    self._finished
                    or (
                        self._to_send is None
                        and not self._notify_failure
                        and not self._writing_since
                    )
                ),
                timeout=self._stall,
            )

    def _check_stall(self) -> None:
        """Cut the stream off once an acknowledgement waited unread too long (under the lock)."""
        since = self._writing_since
        if self.failure is None and since is not None and time.monotonic() - since > self._stall:
            self.failure = errors.ResourceLimitError(
                f"a producer of durable topic '{self._topic}' did not read its acknowledgements "
                f"for {self._stall:g} s (ack_timeout): its stream is cut off (what was "
                "acknowledged is stored; an idempotent producer resends the rest on a new stream)"
            )
            self._cut_off()

    def raise_failure(self) -> None:
        """Raise the failure that ended the stream (a failed commit, a client cut off)."""
        with self._lock:
            self._check_stall()
            failure = self.failure
        if failure is not None:
            raise failure

    def done(self) -> None:
        """Stop the stream's sender: the stream ended.

        The sender may be stuck on a client that does not read:
        it ends with the call, which gRPC finishes once the handler returns.
        """
        with self._lock:
            self._finished = True
            self._lock.notify_all()
        self._sender.join(timeout=NOTICE_WAIT_S)
