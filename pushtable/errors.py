"""The exceptions pushtable raises: one hierarchy under :class:`PushTableError`.

Each class also derives from the built-in exception a Python user would catch for the same
problem (``ValueError`` for a schema mismatch, ``TimeoutError`` for a timed-out write), so
``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "InvalidBatchError",
    "PushTableError",
    "ReaderGoneError",
    "SchemaMismatchError",
    "SinkClosedError",
    "StreamConsumedError",
    "WriteTimeoutError",
]


class PushTableError(Exception):
    """Base class of every error pushtable raises."""


class SinkClosedError(PushTableError):
    """A write after ``close()`` or ``fail()``, or a write that ``close()`` interrupted."""


class ReaderGoneError(PushTableError):
    """No query will read this table any more (it stopped early, or the table was dropped)."""


class StreamConsumedError(PushTableError):
    """A second scan of a single-scan table.

    DataFusion reports it as its own exception type; the message starts with this class's
    name and names the table.
    """


class SchemaMismatchError(PushTableError, ValueError):
    """A batch does not match the registered schema; the message names the field and both types."""


class InvalidBatchError(PushTableError, TypeError):
    """The object written is not Arrow data (or its Arrow export failed)."""


class WriteTimeoutError(PushTableError, TimeoutError):
    """``write(..., timeout=...)`` elapsed while the queue stayed full."""
