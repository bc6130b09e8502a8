"""A producer's stream being opened on a thread of its own, so a call's deadline bounds it.

gRPC's ``DoPut`` returns once the connection is up, and connecting waits without a bound of
its own: to a server that was restarted and paused, or that a connection left idle no longer
reaches, 20 s (gRPC's connect timeout) whatever the caller's ``timeout``. A call with a
deadline therefore opens its stream here and waits for it until its deadline; the open goes
on after, and the sink's next call takes the stream it opened (or lets it go, see
:meth:`Opening.let_go`). Exactly one party owns the stream once opened: whoever
:meth:`Opening.take` or :meth:`Opening.let_go` gives it to first.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pushtable.errors import PushTableError

if TYPE_CHECKING:
    from pushtable.flight.client.put_stream import PutStream

__all__ = ["Opening", "end_unused"]

#: how long a stream opened for nobody is given to end cleanly (it carries nothing)
LET_GO_WAIT_S = 2.0


class Opening:
    """One stream's open, running on its own thread until gRPC returns it (or its error)."""

    def __init__(self, open_stream: Callable[[], PutStream], path: tuple[bytes, ...]) -> None:
        #: the descriptor's path: a call that needs another stream lets this one go
        self.path = path
        self._open = open_stream
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._put: PutStream | None = None
        self._error: BaseException | None = None
        self._owned = False  # taken, or let go: the stream (if any) is someone's
        self._let_go = False
        self._started = False
        self.thread = threading.Thread(target=self._run, name="pushtable-open", daemon=True)

    def start(self) -> bool:
        """Start the open; False if it was let go first (then it never starts)."""
        with self._lock:
            if self._let_go:
                return False
            self._started = True
        self.thread.start()
        return True

    def _run(self) -> None:
        try:
            put = self._open()
        except Exception as exc:  # noqa: BLE001 -- the taker raises it, on its own thread
            self._error = exc
            self._done.set()
            return
        with self._lock:
            self._put = put
            stray = self._let_go and not self._owned
            self._owned |= stray
        self._done.set()
        if stray:
            end_unused(put)

    def usable(self, path: tuple[bytes, ...]) -> bool:
        """Whether a call needing a stream for ``path`` may take this one now it is done.

        Not when the open failed, when the server ended the stream meanwhile (idle, or
        gone), or when it was opened for another first batch.
        """
        put = self._put
        if self.path != path or put is None or self._owned:
            return False
        return not (put.ended or put.idle)

    @property
    def done(self) -> bool:
        """The open returned (a stream, or its error)."""
        return self._done.is_set()

    def wait(self, deadline: float | None) -> bool:
        """Wait until the open returned (or ``deadline``); whether it did."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._done.wait(timeout)

    def take(self) -> PutStream | None:
        """The stream opened (after :meth:`wait` said so), or its error raised.

        None: it was let go meanwhile (the sink was left); the caller does not own it.
        """
        with self._lock:
            if self._owned:
                return None
            self._owned = True
        if self._error is not None:
            raise self._error
        assert self._put is not None
        return self._put

    def let_go(self, deadline: float) -> list[str]:
        """Nobody takes this stream: once opened it ends, here if it is open already.

        Waits until ``deadline`` for the open (its thread ends a stream it opens once let
        go) and for the stream's end. Returns what is still held then (empty: nothing: no
        slot on the server, no thread).
        """
        with self._lock:
            self._let_go = True
            put = None if self._owned else self._put
            self._owned |= put is not None
            started = self._started
        if not started:
            return []  # it never starts
        if put is not None:
            end_unused(put, deadline)
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            return [f"a stream still opening (thread {self.thread.name})"]
        put = self._put
        if put is None:
            return []  # it never opened
        for thread in put.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        held = [] if put.finished else [f"a stream opened for nobody ({put.stream_id})"]
        return held + [f"thread {t.name}" for t in put.threads]


def end_unused(put: PutStream, deadline: float | None = None) -> None:
    """End a stream that carried nothing (left, if the server does not end it in time)."""
    wait = LET_GO_WAIT_S if deadline is None else max(0.001, deadline - time.monotonic()) / 2
    with contextlib.suppress(PushTableError):
        put.finish(timeout=wait, leave_for=wait)
