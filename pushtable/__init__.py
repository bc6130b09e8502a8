"""pushtable: run SQL over Arrow batches while producers are still pushing them.

Example:
    >>> import pyarrow as pa
    >>> from pushtable import SessionContext
    >>> ctx = SessionContext()
    >>> sink = ctx.register_streaming_table("t", pa.schema([("x", pa.int64())]), capacity=8)
    >>> sink.write(pa.record_batch([pa.array([1, 2])], names=["x"]))
    >>> sink.close()
    >>> ctx.sql("SELECT max(x) AS m FROM t").to_pydict()
    {'m': [2]}
"""

from __future__ import annotations

from importlib.metadata import version as _version
from importlib.util import find_spec as _find_spec

from pushtable import cpu as _cpu

_cpu.check()  # before the native core loads: a clear ImportError, not SIGILL

if _find_spec("pushtable._native") is None:  # a source checkout whose core was never built
    raise ImportError(
        "pushtable's native core (pushtable/_native.abi3.so) is not built: run `make setup` "
        "in the source checkout (it builds the core with cargo and maturin), or install the "
        "pushtable wheel"
    )

from pushtable.context import SessionContext, register_streaming_table
from pushtable.dataframe import DataFrame
from pushtable.errors import (
    CommitFailedError,
    EpochCommitError,
    InvalidBatchError,
    InvalidQueryError,
    OffsetOutOfRangeError,
    OrderViolationError,
    PermissionDeniedError,
    PushTableError,
    ReaderGoneError,
    RemoteError,
    ResourceLimitError,
    SchemaDriftError,
    SchemaMismatchError,
    SequenceError,
    ServerStoppedError,
    ServerUnavailableError,
    SharesLostError,
    SinkClosedError,
    SlowSubscriberError,
    StatementRefusedError,
    StreamConsumedError,
    StreamFailedError,
    UnauthenticatedError,
    UnboundedQueryError,
    UnknownTableError,
    UnsupportedCallError,
    UnsupportedTableError,
    WriteTimeoutError,
)
from pushtable.explain import LiveExplanation, explain_live
from pushtable.flight import connect, serve
from pushtable.sink import SinkStats, TableSink
from pushtable.topic import Subscription, SubscriptionStats, Topic, TopicStats

__version__ = _version("pushtable")

__all__ = [
    "CommitFailedError",
    "DataFrame",
    "EpochCommitError",
    "InvalidBatchError",
    "InvalidQueryError",
    "LiveExplanation",
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
    "SessionContext",
    "SharesLostError",
    "SinkClosedError",
    "SinkStats",
    "SlowSubscriberError",
    "StatementRefusedError",
    "StreamConsumedError",
    "StreamFailedError",
    "Subscription",
    "SubscriptionStats",
    "TableSink",
    "Topic",
    "TopicStats",
    "UnauthenticatedError",
    "UnboundedQueryError",
    "UnknownTableError",
    "UnsupportedCallError",
    "UnsupportedTableError",
    "WriteTimeoutError",
    "connect",
    "explain_live",
    "register_streaming_table",
    "serve",
]
