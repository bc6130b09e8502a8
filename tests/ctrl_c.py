"""Pressing Ctrl-C in a test: a real SIGINT to the main thread, sent once the main thread is
where the test wants it (an event, not a timer), and a report when it does not arrive."""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

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


class CtrlC:
    """Sends SIGINT to the main thread once ``ready()`` holds (then ``after`` seconds more).

    The block must raise ``KeyboardInterrupt`` (which this swallows). A handler that does
    what Python's ``default_int_handler`` does is installed for the duration, so a handler
    an earlier test left (Spark's, an asyncio runner's) does not decide the outcome.
    Otherwise the test fails with a report: whether the signal was sent, whether it arrived
    late, which handlers were installed, and every thread's stack.
    """

    def __init__(self, ready: Callable[[], bool], after: float = 0.0) -> None:
        self._ready = ready
        self._after = after
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.sent_at: float | None = None
        self.late = False
        self._started_at = 0.0
        self._previous: object = None
        self._thread = threading.Thread(target=self._press, name="ctrl-c", daemon=True)

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
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
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def report(self) -> str:
        sent = (
            "never sent (the main thread never reached the state the test waits for)"
            if self.sent_at is None
            else f"sent {self.sent_at - self._started_at:.3f}s into the block"
        )
        c_handler = _c_sigint_handler()
        lines = [
            f"SIGINT {sent}",
            f"Python-level handler now: {signal.getsignal(signal.SIGINT)!r}",
            f"C-level handler now: {c_handler!r} (Python's at start: {PYTHON_C_HANDLER!r})",
            "threads:",
        ]
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
        if self._previous is not None:  # None: not installed from Python; leave ours
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        if isinstance(exc, KeyboardInterrupt) and exc.__context__ is None:
            return True
        if isinstance(exc, KeyboardInterrupt):
            what = f"the KeyboardInterrupt came only after the call failed: {exc.__context__!r}"
        elif exc is not None:
            what = f"the block raised {exc!r} instead of KeyboardInterrupt"
        else:
            what = "the block returned without KeyboardInterrupt"
        if self.late:
            what += "; a SIGINT was still pending when it ended (delivered late, not lost)"
        pytest.fail(f"{what}\n{self.report()}", pytrace=False)
