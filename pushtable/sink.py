"""The producer side of a streaming table: :class:`TableSink`.

A sink is what :func:`pushtable.register_streaming_table` returns. Threads call
:meth:`TableSink.write`, asyncio tasks ``await`` :meth:`TableSink.awrite`; both block (or
suspend) while ``capacity`` batches are queued, and both raise the same errors.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pushtable import _native, metrics
from pushtable.errors import (
    InvalidBatchError,
    OrderViolationError,
    PushTableError,
    ReaderGoneError,
    SchemaMismatchError,
    SinkClosedError,
    WriteTimeoutError,
    describe,
    remember_failure,
)
from pushtable.producer import ProducerScope, SinkStats, check_timeout

if TYPE_CHECKING:
    pass

__all__ = ["SinkStats", "TableSink"]

log = logging.getLogger(__name__)

_ERRORS: dict[type[BaseException], type[PushTableError]] = {
    _native.ClosedError: SinkClosedError,
    _native.ReaderGoneError: ReaderGoneError,
    _native.SchemaError: SchemaMismatchError,
    _native.WriteTimeout: WriteTimeoutError,
    _native.InputError: InvalidBatchError,
    _native.OrderError: OrderViolationError,
}


def _public_error(exc: _native.NativeError) -> PushTableError:
    public = _ERRORS.get(type(exc), PushTableError)(str(exc))
    public.batches_written = getattr(exc, "batches_written", 0)
    return public


def _at_exit() -> None:
    """Keep the interpreter's exit from aborting the process.

    On Python < 3.14 a thread that takes the GIL once the interpreter finalizes is ended
    with ``pthread_exit``, which aborts a process whose thread is inside native code
    (``FATAL: exception not rethrown``). From here on native code parks any thread that
    enters or leaves it, and the scans yield nothing more. The short pause lets threads
    already waiting for the GIL take it *before* finalizing begins: they go on into native
    code and park there, instead of being ended on the way back.
    """
    _native.interpreter_finalizing()
    if threading.active_count() > 1:
        time.sleep(0.05)


atexit.register(_at_exit)


def _on_main_thread() -> bool:
    """Only Python's main thread receives Ctrl-C, so only its blocked writes poll for it."""
    return threading.get_ident() == threading.main_thread().ident


class _Producer(ProducerScope):
    """The producer API shared by :class:`TableSink` and :class:`pushtable.Topic`."""

    def __init__(self, native: _native.Sink, name: str, schema: pa.Schema) -> None:
        self._native = native
        self.name = name
        self.schema = schema
        self.error: BaseException | None = None

    def write(self, data: Any, timeout: float | None = None) -> None:
        """Enqueue a batch, blocking while the queue is full (the GIL is released meanwhile).

        ``data`` is a ``pa.RecordBatch``, a ``pa.Table`` or any object with
        ``__arrow_c_array__`` / ``__arrow_c_stream__``. A batch that does not match the
        schema raises :class:`SchemaMismatchError` and is not enqueued. Blocked writers are
        served in arrival order. ``timeout=None`` (or ``math.inf``) waits without limit.

        A stream (``pa.Table``, ``__arrow_c_stream__``) is read and enqueued one batch at a
        time, so backpressure reaches a lazy stream's own producer. If it fails midway
        (timeout, a NOT NULL violation, a closed sink), the batches before the failing one
        stay queued and the error's ``batches_written`` says how many there were.

        Raises:
            WriteTimeoutError: ``timeout`` seconds passed with the queue still full.
            SinkClosedError: the sink was closed or failed (also when that happens while blocked).
            ReaderGoneError: the query reading the table stopped, or the table was dropped.
        """
        try:
            self._native.write(data, timeout, _on_main_thread())
        except _native.NativeError as exc:
            raise _public_error(exc) from None

    async def awrite(self, data: Any, timeout: float | None = None) -> None:
        """Asyncio counterpart of :meth:`write`: suspends instead of blocking the loop.

        Each task learns the outcome of its own write; ``timeout`` counts from the call,
        wherever the request waits. Cancelling the task leaves every batch of the request
        not yet enqueued unwritten (a single batch is all or nothing; for a stream, the
        batches enqueued before the cancellation stay queued).
        """
        timeout = check_timeout(timeout)
        if isinstance(data, pa.RecordBatch):  # room right now: no thread hop at all
            try:
                self._native.write(data, 0.0)
                return
            except _native.WriteTimeout:
                pass  # full, or earlier writers are waiting in line: wait off the loop
            except _native.NativeError as exc:
                raise _public_error(exc) from None
        await _wait_off_loop(self._native, data, timeout)

    @property
    def watermark_type(self) -> pa.DataType | None:
        """The type :meth:`advance` takes (the first ``order_by`` column's), or None.

        None where the table has no watermark (no integer, date or timestamp ``order_by``
        column).
        """
        data_type: pa.DataType | None = self._native.watermark_type()
        return data_type

    def advance(self, ts: Any) -> None:
        """Declare a watermark: no row whose first ``order_by`` column is below ``ts`` will come.

        A live query's windows that end at or before ``ts`` are emitted at once, with no new
        row; a row below ``ts`` written later is late (``late="reject"`` raises
        :class:`OrderViolationError`, ``late="drop"`` drops it). ``ts`` is a value of the
        column's type (a ``datetime`` for a timestamp column, an ``int``…); an ``int`` for a
        timestamp column is in the column's unit. A watermark at or below the current one
        changes nothing. Raises ``ValueError`` for a table without ``order_by``.
        """
        data_type = self.watermark_type
        if data_type is None:
            raise ValueError(
                f"'{self.name}' declares no integer, date or timestamp order_by column, so it "
                "cannot have a watermark"
            )
        value = pa.scalar(ts, type=data_type)
        if pa.types.is_date32(data_type):
            value = value.cast(pa.int32())
        try:
            self._native.advance(int(value.cast(pa.int64()).as_py()))
        except _native.NativeError as exc:
            raise _public_error(exc) from None

    def close(self) -> None:
        """End of stream: the query finishes after the queued batches. Idempotent."""
        self._native.close()

    async def aclose(self) -> None:
        """Asyncio counterpart of :meth:`close` (it never blocks, so it never suspends)."""
        self.close()

    def fail(self, exc: BaseException) -> None:
        """Make the reading query raise ``exc``; never blocks, even on a full queue.

        The query raises :class:`StreamFailedError` naming the exception's type and text,
        with ``exc`` as its ``error`` and cause; :attr:`error` keeps it too. Queued batches
        are discarded. Ignored once the reader has finished.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"fail() takes an exception, got {type(exc).__name__}")
        message = describe(exc)
        if self._native.fail(message):
            self.error = exc
            remember_failure(self.name, message, exc)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`fail` was called."""
        return bool(self._native.stats()["closed"])


class TableSink(_Producer):
    """Write end of a single-scan streaming table.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext
        >>> ctx = SessionContext()
        >>> sink = ctx.register_streaming_table("t", pa.schema([("v", pa.int64())]), capacity=4)
        >>> with sink:
        ...     sink.write(pa.record_batch([pa.array([1, 2, 3])], names=["v"]))
        >>> ctx.sql("SELECT sum(v) AS s FROM t").to_pydict()
        {'s': [6]}
    """

    def __init__(
        self,
        native: _native.Sink,
        name: str,
        schema: pa.Schema,
        capacity: int,
        max_bytes: int | None,
    ) -> None:
        super().__init__(native, name, schema)
        self.capacity = capacity
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        s = self.stats
        state = "failed" if s.failed else "closed" if s.closed else "open"
        return f"TableSink(name={self.name!r}, {state}, rows={s.rows}, queued={s.queued_batches})"

    @property
    def stats(self) -> SinkStats:
        """Current counters (see :class:`SinkStats`)."""
        return SinkStats(**self._native.stats())

    def metrics_report(self) -> metrics.QueueReport:
        """What the Prometheus metrics read of this table when scraped."""
        return metrics.QueueReport(self.name, self.stats, self.capacity, self.max_bytes)


# --- where asyncio meets the blocking native write ---------------------------------------

#: Threads that wait for room on behalf of suspended ``awrite`` calls. A request that finds
#: no free thread waits in the executor's queue, its timeout and cancellation still honoured.
_AWRITE_THREADS = 64
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _awrite_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(_AWRITE_THREADS, thread_name_prefix="pushtable-awrite")
        return _executor


async def _wait_off_loop(native: _native.Sink, data: Any, timeout: float | None) -> None:
    """Run a blocking write on an executor thread; the awaiting task owns its outcome.

    The write carries a cancel token: a timeout seen here, or the task's cancellation,
    cancels it under the channel's lock, so no batch of the request is enqueued after that.
    """
    start = time.monotonic()
    token = native.token()

    def blocking_write() -> int:
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return native.write(data, remaining, False, token)

    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(_awrite_executor(), blocking_write)
    try:
        await asyncio.wait_for(asyncio.shield(future), timeout)
    except _native.NativeError as exc:
        raise _public_error(exc) from None
    except (TimeoutError, asyncio.TimeoutError):
        written = token.cancel()
        future.add_done_callback(_retrieve)
        if isinstance(data, pa.RecordBatch) and written:
            return  # enqueued just as the timeout fired: the write succeeded
        error = WriteTimeoutError(
            f"awrite to streaming table timed out after {timeout}s with the queue full"
        )
        error.batches_written = written
        raise error from None
    except asyncio.CancelledError:
        token.cancel()
        future.add_done_callback(_retrieve)
        raise


def _retrieve(future: asyncio.Future[int]) -> None:
    """Consume the outcome of an abandoned request (cancelled or timed out)."""
    if not future.cancelled():
        future.exception()
