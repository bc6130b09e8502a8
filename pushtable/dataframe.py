"""Query results whose errors keep their pushtable class.

DataFusion carries only a message out of a table provider, so a second scan or a failed
producer would surface as a plain ``Exception``. :class:`DataFrame` (what
:class:`pushtable.SessionContext` returns from ``sql``/``table``) raises
:class:`~pushtable.StreamConsumedError` and :class:`~pushtable.StreamFailedError` instead,
from every method and from the streams it hands out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import datafusion
from datafusion.record_batch import RecordBatch, RecordBatchStream

from pushtable.errors import query_error

__all__ = ["DataFrame"]


def _translated(exc: Exception) -> BaseException | None:
    """The pushtable error ``exc`` stands for, caused by the producer's own exception."""
    public = query_error(exc)
    if public is not None:
        public.__cause__ = getattr(public, "error", None) or exc
    return public


def _adopt(result: Any) -> Any:
    """Keep what a method returns inside the translating wrappers."""
    if isinstance(result, datafusion.DataFrame) and not isinstance(result, DataFrame):
        return DataFrame(result.df)
    if isinstance(result, RecordBatchStream) and not isinstance(result, _Stream):
        return _Stream(result.rbs)
    if isinstance(result, list) and result and isinstance(result[0], RecordBatchStream):
        return [_adopt(r) for r in result]
    return result


def _translating(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, **kwargs)
        except Exception as exc:
            if (public := _translated(exc)) is None:
                raise
            raise public from public.__cause__
        return _adopt(result)

    return call


class DataFrame(datafusion.DataFrame):
    """A ``datafusion.DataFrame`` that raises pushtable's errors for streaming tables.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext, StreamConsumedError
        >>> ctx = SessionContext()
        >>> sink = ctx.register_streaming_table("t", pa.schema([("v", pa.int64())]))
        >>> sink.close()
        >>> ctx.sql("SELECT count(*) AS n FROM t").to_pydict()
        {'n': [0]}
        >>> try:
        ...     ctx.sql("SELECT * FROM t").collect()
        ... except StreamConsumedError as exc:
        ...     print("second scan refused")
        second scan refused
    """

    #: For an updating aggregate (a ``GROUP BY`` answered as an upsert changelog): the result
    #: columns that key it, so a reader can replace a row by the next one of its key (empty:
    #: one row, which every change replaces). None for every other query.
    upsert_key: list[str] | None = None

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("__") or not callable(attr):
            return attr
        return _translating(attr)

    def __iter__(self) -> Any:
        return iter(self.execute_stream())

    def __aiter__(self) -> Any:
        return self.execute_stream().__aiter__()

    def __repr__(self) -> str:
        return str(_translating(super().__repr__)())


class _Stream(RecordBatchStream):
    """A ``RecordBatchStream`` whose errors are translated like :class:`DataFrame`'s."""

    def __next__(self) -> RecordBatch:
        return _translating(super().__next__)()  # type: ignore[no-any-return]

    async def __anext__(self) -> RecordBatch:
        try:
            return await super().__anext__()
        except Exception as exc:
            if (public := _translated(exc)) is None:
                raise
            raise public from public.__cause__
