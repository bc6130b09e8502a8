"""The exceptions pushtable raises: one hierarchy under :class:`PushTableError`.

Each class also derives from the built-in exception a Python user would catch for the same
problem (``ValueError`` for a schema mismatch, ``TimeoutError`` for a timed-out write), so
``except ValueError`` keeps working.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

__all__ = [
    "ClientClosedError",
    "CommitFailedError",
    "DataDirInUseError",
    "EpochCommitError",
    "IncompatibleSinkError",
    "InvalidBatchError",
    "InvalidQueryError",
    "InvalidRequestError",
    "OffsetOutOfRangeError",
    "OrderViolationError",
    "PermissionDeniedError",
    "PushTableError",
    "ReaderGoneError",
    "RemoteError",
    "ResourceLimitError",
    "SchemaDriftError",
    "SchemaMismatchError",
    "SequenceError",
    "ServerStoppedError",
    "ServerUnavailableError",
    "SharesLostError",
    "SinkClosedError",
    "SlowReaderError",
    "SlowSubscriberError",
    "StatementRefusedError",
    "StreamConsumedError",
    "StreamEndedError",
    "StreamFailedError",
    "StreamingQueryFailedError",
    "TableExistsError",
    "UnauthenticatedError",
    "UnboundedQueryError",
    "UnknownTableError",
    "UnsupportedCallError",
    "UnsupportedSparkTypeError",
    "UnsupportedTableError",
    "WorkerPythonError",
    "WriteTimeoutError",
]


class PushTableError(Exception):
    """Base class of every error pushtable raises.

    ``batches_written`` is set by writes of a stream (``pa.Table``, ``__arrow_c_stream__``)
    that failed midway: how many of its batches were enqueued before the error.
    """

    batches_written: int = 0


class SchemaDriftError(PushTableError, ValueError):
    """A Spark epoch's columns differ from its Lance dataset's; the message names the column.

    The difference is a column added, dropped or retyped.
    """


class EpochCommitError(PushTableError, RuntimeError):
    """A Spark epoch could not be committed to Lance.

    Either a conflict that retrying cannot fix, or retries ran out.
    """


class SinkClosedError(PushTableError):
    """A write after ``close()`` or ``fail()``, or a write that ``close()`` interrupted."""


class ReaderGoneError(PushTableError):
    """No query will read this table any more (it stopped early, or the table was dropped)."""


class UnsupportedTableError(PushTableError, ValueError):
    """A query over an ordered live table reads a table pushtable's live engine cannot read.

    The message names that table and says how to register it instead.
    """


class StreamConsumedError(PushTableError):
    """A second scan of a single-scan table; the message names the table.

    Raised by queries of a :class:`pushtable.SessionContext` (DataFusion itself can only
    carry a message across its FFI boundary; pushtable turns it back into this class).
    """


class StreamFailedError(PushTableError):
    """The producer of a streaming table called ``fail(exc)``: raised by the reading query.

    ``error`` (also the ``__cause__``) is ``exc`` itself when it was failed in this process;
    the message names the table and ``exc``'s type and text.
    """

    error: BaseException | None = None


class SlowSubscriberError(PushTableError):
    """A topic subscriber with ``on_slow="detach"`` fell behind and was cut loose.

    Raised by that subscriber's query (the topic's producers and other subscribers go on);
    the message names the topic, the backlog and the timeout.
    """


class UnknownTableError(PushTableError, KeyError):
    """No table (or topic) of that name on the server; the message names it."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnauthenticatedError(PushTableError, PermissionError):
    """The server refused the call: a missing or wrong bearer token."""


class PermissionDeniedError(PushTableError, PermissionError):
    """The server knows the token, but its role (or table scope) does not allow the call.

    The message names the role that is missing, or the table that is out of scope.
    """


class StatementRefusedError(PushTableError, PermissionError):
    """Remote SQL runs queries only: DDL, DML, COPY and SET are refused before anything runs.

    The message names the statement kind.
    """


class ResourceLimitError(PushTableError):
    """A server limit was reached; the message names it, its value and the option that sets it.

    The limits: memory, concurrent queries, streams, staged bytes, table count or size.
    """


class UnboundedQueryError(PushTableError, ValueError):
    """The query needs all of an unbounded live table's input, so it would wait forever.

    Such a query has a ``GROUP BY`` with no window, a sort, a hash join's build side…; the
    message names the operator and the shapes that do answer while data arrives.
    """

    #: the DataFusion operator that needs the whole input (``SortExec``, ``AggregateExec``…)
    operator: str = ""


#: what runs over an unbounded table, said by ``explain_live`` and :class:`UnboundedQueryError`
UNBOUNDED_HINT = (
    "on an unbounded table use row-wise queries (filters, projections, LIMIT) or windows "
    "(declare order_by and GROUP BY a window of it, e.g. date_bin(INTERVAL '1 second', ts): "
    "each window is emitted as it closes), or register the table bounded and close() it to "
    "get whole-input aggregates"
)


class InvalidQueryError(PushTableError, ValueError):
    """A query pushtable checks itself is malformed; raised at planning.

    Either a bad argument of Spark's ``window`` or ``session_window`` (a zero, negative or
    unparseable duration, a slide longer than the window…), or ``EMIT CHANGES`` over no live
    table. The message names the argument.
    """


class TableExistsError(PushTableError, ValueError):
    """A table or topic of that name exists already; the message names it.

    ``create_table(..., if_not_exists=True)`` (``create_topic`` likewise) answers with the
    existing one instead, when its schema is the one asked for.
    """


class InvalidRequestError(PushTableError, ValueError):
    """A call to the server is malformed; the message names what is wrong.

    Either an unknown action, or a field of its request that is missing or of the wrong kind.
    """


class UnsupportedCallError(PushTableError, NotImplementedError):
    """The server does not implement that call; the message names it.

    For example a Flight SQL command other than a statement query, or GetFlightInfo for a path.
    """


class ServerUnavailableError(PushTableError, ConnectionError):
    """The ``pushtable serve`` server cannot be reached (not running, stopped, wrong address)."""


class ClientClosedError(PushTableError, RuntimeError):
    """A call on a client, or on one of its sinks or results, after the client was closed."""


class ServerStoppedError(PushTableError):
    """The ``pushtable serve`` server stopped: its tables were failed with this error."""


class CommitFailedError(PushTableError, OSError):
    """A durable topic could not store batches: the batches it covers are not acknowledged.

    The cause is a full disk, a read-only data dir or a failed Lance commit. The message names
    the topic, the dataset, the offsets and the cause. Nothing unacknowledged counts as stored;
    an idempotent producer may send them again.
    """


class SequenceError(PushTableError, ValueError):
    """An idempotent producer's batch skips sequence numbers: a batch in between was never sent.

    The server last stored an earlier sequence number. The message names both numbers.
    """


class OffsetOutOfRangeError(PushTableError, ValueError):
    """A read of a durable topic from an offset retention has deleted or not yet written.

    Deleted offsets are below ``earliest``. The message names the offsets that can be read.
    """


class SharesLostError(PushTableError):
    """A Spark epoch's staged shares are not on the server any more: nothing of it was published.

    The server restarted after the tasks staged them. Spark runs the batch again when its
    query restarts; the message names the epoch and the partitions.
    """


class StreamingQueryFailedError(PushTableError):
    """The Spark streaming query feeding a live table failed; the message is Spark's."""


class IncompatibleSinkError(PushTableError):
    """A live table cannot take the query's epochs (columns, types or NOT NULL): detached.

    The Lance commit and the query go on; the table's reader gets this error.
    """


class UnsupportedSparkTypeError(PushTableError, TypeError):
    """A micro-batch column has a Spark type pushtable cannot carry as Arrow.

    The message names the column and the type, and what to cast it to. Raised on the driver,
    before any task runs.

    Example:
        >>> from pyspark.sql.types import StructType, StructField, YearMonthIntervalType
        >>> from pushtable.spark import arrow_schema
        >>> arrow_schema(StructType([StructField("age", YearMonthIntervalType())]))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pushtable.errors.UnsupportedSparkTypeError: column 'age' has Spark type interval ...
    """


class DataDirInUseError(PushTableError, RuntimeError):
    """Another ``pushtable serve`` holds the lease of this data dir.

    A data dir is a directory or an object store prefix: two servers would interleave the
    offsets of the same durable topics. The message names the owner and when its lease
    lapses if it is not renewed (a server that died holds it no longer than that).
    """


class WorkerPythonError(PushTableError, RuntimeError):
    """Spark's Python workers would run an interpreter that cannot import pushtable.

    The message names it and says what to set. Raised on the driver, before any task runs.
    """


class StreamEndedError(SinkClosedError):
    """The server ended a producer's stream before acknowledging every batch, without saying why.

    That is, the connection broke: an idempotent producer reconnects and sends them again.
    """


#: The name the Spark bridge once gave a live table's reader that fell behind (an epoch not
#: taken within ``push_timeout``): the same event as a topic's, one class.
SlowReaderError = SlowSubscriberError


class RemoteError(PushTableError):
    """An error from the other side of the wire with no more specific pushtable class.

    ``remote_type`` names the original exception's class when it is known (a remote
    producer's ``fail(exc)``), so readers see ``RuntimeError: ...`` as they would locally.
    """

    def __init__(self, message: str, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type


def describe(exc: BaseException) -> str:
    """``"Type: message"`` on one line: how a failure is named to a stream's reader."""
    name = exc.remote_type if isinstance(exc, RemoteError) and exc.remote_type else None
    return f"{name or type(exc).__name__}: {exc}".replace("\n", " ")


class SchemaMismatchError(PushTableError, ValueError):
    """A batch does not match the registered schema; the message names the field and both types."""


class OrderViolationError(PushTableError, ValueError):
    """A batch breaks the table's declared ``order_by``; nothing of it was queued.

    The message names the order column(s), the offending value and the previous maximum
    (or the two rows out of order within the batch). A null in an order column raises it too.
    """


class InvalidBatchError(PushTableError, TypeError):
    """The object written is not Arrow data (or its Arrow export failed)."""


class WriteTimeoutError(PushTableError, TimeoutError):
    """``write(..., timeout=...)`` elapsed while the queue stayed full."""


# --- errors raised inside queries ----------------------------------------------------------
# A DataFusion query can only carry an error *message* out of a table provider (the FFI
# boundary passes strings), and datafusion-python raises a plain ``Exception``. The native
# core words its two errors recognisably; :func:`query_error` maps them back to classes.

_CONSUMED = re.compile(r"StreamConsumedError: (streaming table '.*?' is single-scan.*?)(?:\n|$)")
_FAILED = re.compile(
    r"pushtable: the producer of streaming table '(?P<table>.*?)' failed: (?P<msg>.*?)(?:\n|$)"
)
_SLOW = re.compile(r"SlowSubscriberError: (the subscriber of '.*?' fell behind.*?)(?:\n|$)")
_KEEP = 1024  # failures remembered for their exception object (the newest ones)
_failures: OrderedDict[tuple[str, str], BaseException] = OrderedDict()
_failures_lock = threading.Lock()


def remember_failure(table: str, message: str, exc: BaseException) -> None:
    """Keep ``exc`` so the reading query can raise it as the cause (see :func:`query_error`)."""
    with _failures_lock:
        _failures[(table, message)] = exc
        _failures.move_to_end((table, message))
        while len(_failures) > _KEEP:
            _failures.popitem(last=False)


_EXHAUSTED = re.compile(r"Resources exhausted:.*", re.DOTALL)
_PIPELINE_BREAKER = re.compile(r"Cannot execute pipeline breaking queries, operator: (\w+)")


def query_error(exc: BaseException) -> PushTableError | None:
    """The pushtable error a DataFusion query error stands for, or None if it is not ours."""
    text = str(exc)
    if match := _CONSUMED.search(text):
        return StreamConsumedError(match.group(1))
    if match := _SLOW.search(text):
        return SlowSubscriberError(match.group(1))
    if match := _PIPELINE_BREAKER.search(text):
        unbounded = UnboundedQueryError(
            f"the query cannot answer over an unbounded live table: {match.group(1)} needs all "
            f"of its input, so it would wait forever; {UNBOUNDED_HINT} "
            "(explain_live(sql) says how a query runs)"
        )
        unbounded.operator = match.group(1)
        return unbounded
    if match := _EXHAUSTED.search(text):
        return ResourceLimitError(
            "the query ran out of its share of the memory pool (a session's memory_limit; "
            f"on pushtable serve, its query_memory): {match.group(0)}"
        )
    if match := _FAILED.search(text):
        table, message = match.group("table"), match.group("msg")
        error = StreamFailedError(f"the producer of streaming table '{table}' failed: {message}")
        with _failures_lock:
            error.error = _failures.get((table, message))
        return error
    return None
