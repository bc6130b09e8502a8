"""Pressing Ctrl-C in a test: an interrupt for the main thread, sent once the main thread is
where the test wants it (an event, not a timer), and a report when it does not arrive.

Two ways in, as users' tools deliver them: a real SIGINT (a terminal's Ctrl-C, ``kill -INT``)
and ``_thread.interrupt_main()`` (what Jupyter-style runners and watchdog threads call)."""

from __future__ import annotations

import _thread
import ctypes
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import pytest

from tests.conftest import WAIT


def _c_sigint_handler() -> int | None:
    """The address of the process's C-level SIGINT handler (Linux/glibc), or None."""

    class SigAction(ctypes.Structure):
        _fields_ = [
            ("handler", ctypes.c_void_p),
            ("mask", ctypes.c_ulong * 16),
            ("flags", ctypes.c_int),
            ("restorer", ctypes.c_void_p),
        ]

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        action = SigAction()
        if libc.sigaction(signal.SIGINT, None, ctypes.byref(action)) != 0:
            return None
        return int(action.handler or 0)
    except (OSError, AttributeError):
        return None


#: Python's own C-level handler, as installed when the test run started.
PYTHON_C_HANDLER = _c_sigint_handler()


#: The start of a child script (a fresh process, where no earlier test decided the SIGINT
#: handler): ``full_sink()`` gives a table whose queue is full (kept with its context: a
#: dropped context drops its tables) and ``ctrl_c_once_blocked(sink)`` sends a real SIGINT
#: to the main thread once a write waits there. A child inherits an *ignored* SIGINT (a
#: suite started as a background job of a script, ``cmd &``, as some CI runners do), and
#: Python then leaves it ignored: no Ctrl-C reaches it at all. So the child first puts
#: back what a Python started from a terminal has.
BLOCKED_WRITE_CHILD = """
import signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import pyarrow as pa
from pushtable import SessionContext

schema = pa.schema([("k", pa.int32())])
one = pa.record_batch([pa.array([1], pa.int32())], schema=schema)

def full_sink():
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", schema, capacity=1)
    sink.write(one)
    return ctx, sink

def ctrl_c_once_blocked(sink):
    def press():
        deadline = time.monotonic() + 60
        while sink.stats.waiting_writers == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=press, daemon=True).start()
"""


class CtrlC:
    """Interrupts the main thread once ``ready()`` holds (then ``after`` seconds more).

    ``how`` is ``"signal"`` (a real SIGINT to the main thread) or ``"interrupt_main"``.

    The block must raise ``KeyboardInterrupt`` (which this swallows). A handler that does
    what Python's ``default_int_handler`` does is installed for the duration, so a handler
    an earlier test left (Spark's, an asyncio runner's) does not decide the outcome.
    Otherwise the test fails with a report: whether the signal was sent, whether it arrived
    late, which handlers were installed, and every thread's stack.
    """

    #: How long an interrupt may go unanswered before the main thread's stack is taken
    #: and a second one is sent (the report then says whether that one arrived).
    RESEND_AFTER = 10.0

    def __init__(
        self,
        ready: Callable[[], bool],
        after: float = 0.0,
        how: Literal["signal", "interrupt_main"] = "signal",
    ) -> None:
        self._ready = ready
        self._after = after
        self._how = how
        self.handler_at_send: str | None = None
        self.stuck: list[str] = []
        self.resent_at: float | None = None
        self.unraisable: list[str] = []
        self._previous_unraisable: Callable[[Any], object] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.sent_at: float | None = None
        self.late = False
        self._started_at = 0.0
        self._previous: object = None
        self._thread = threading.Thread(target=self._press, name="ctrl-c", daemon=True)

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        # An interrupt handled inside a finalizer is swallowed ("Exception ignored in ..."):
        # keep a record of anything swallowed that way while the block runs.
        self._previous_unraisable = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        self._started_at = time.monotonic()
        self._thread.start()
        return self

    def _on_sigint(self, signum: int, frame: object) -> None:
        """Python's default behaviour (raise KeyboardInterrupt), except that a SIGINT handled
        after the block already failed is recorded as late instead of aborting pytest."""
        if sys.exc_info()[1] is not None:
            self.late = True
            return
        raise KeyboardInterrupt

    def _on_unraisable(self, unraisable: Any) -> None:
        self.unraisable.append(f"{unraisable.exc_type.__name__} in {unraisable.object!r}")
        if self._previous_unraisable is not None:
            self._previous_unraisable(unraisable)

    def _send(self) -> None:
        if self._how == "signal":
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        else:
            _thread.interrupt_main()

    def _main_stack(self) -> list[str]:
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        return [] if frame is None else [x.rstrip() for x in traceback.format_stack(frame)[-8:]]

    def _press(self) -> None:
        deadline = time.monotonic() + WAIT
        while not self._ready():
            if self._stopped.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.001)
        if self._after and self._stopped.wait(self._after):
            return
        with self._lock:  # never after the block ended: a late SIGINT would hit pytest itself
            if self._stopped.is_set():
                return
            self.sent_at = time.monotonic()
            self.handler_at_send = repr(signal.getsignal(signal.SIGINT))
            self._send()
        if self._stopped.wait(self.RESEND_AFTER):
            return
        with self._lock:  # unanswered: where is the main thread, and does a second one arrive?
            if self._stopped.is_set():
                return
            self.stuck = self._main_stack()
            self.resent_at = time.monotonic()
            self._send()

    def report(self) -> str:
        sent = (
            "never sent (the main thread never reached the state the test waits for)"
            if self.sent_at is None
            else f"sent ({self._how}) {self.sent_at - self._started_at:.3f}s into the block, "
            f"Python-level handler then: {self.handler_at_send}"
        )
        c_handler = _c_sigint_handler()
        lines = [
            f"SIGINT {sent}",
            f"Python-level handler now: {signal.getsignal(signal.SIGINT)!r}",
            f"C-level handler now: {c_handler!r} (Python's at start: {PYTHON_C_HANDLER!r})",
            f"swallowed as unraisable during the block: {self.unraisable or 'nothing'}",
        ]
        if self.resent_at is not None:
            lines.append(f"unanswered after {self.RESEND_AFTER}s; the main thread was at:")
            lines.extend(self.stuck)
            lines.append("a second interrupt was sent then")
        lines.append("threads:")
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"--- {names.get(ident, '?')} ({ident})")
            lines.extend(line.rstrip() for line in traceback.format_stack(frame)[-6:])
        return "\n".join(lines)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Passes (swallows it) for a KeyboardInterrupt raised by the block itself; fails
        the test, with the report, otherwise."""
        with self._lock:
            self._stopped.set()
        self._thread.join(WAIT)
        sys.unraisablehook = self._previous_unraisable or sys.__unraisablehook__
        if self._previous is not None:  # None: not installed from Python; leave ours
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        if isinstance(exc, KeyboardInterrupt) and exc.__context__ is None:
            if self.resent_at is None:
                return True
            what = (
                "the first interrupt went unanswered; "
                "the block raised KeyboardInterrupt only after the second"
            )
            pytest.fail(f"{what}\n{self.report()}", pytrace=False)
        if isinstance(exc, KeyboardInterrupt):
            what = f"the KeyboardInterrupt came only after the call failed: {exc.__context__!r}"
        elif exc is not None:
            what = f"the block raised {exc!r} instead of KeyboardInterrupt"
        else:
            what = "the block returned without KeyboardInterrupt"
        if self.late:
            what += "; a SIGINT was still pending when it ended (delivered late, not lost)"
        pytest.fail(f"{what}\n{self.report()}", pytrace=False)
