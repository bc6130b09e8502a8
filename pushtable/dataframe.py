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
import pyarrow as pa
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


def _translating(method: Callable[..., Any], source: Any = None) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, **kwargs)
        except Exception as exc:
            if (public := _translated(exc)) is None:
                raise
            raise public from public.__cause__
        return _keyed(source, _adopt(result))

    return call


def _keyed(source: Any, result: Any) -> Any:
    """``result`` with ``source``'s ``upsert_key`` while it keeps every key column.

    A DataFrame derived from an updating query (``.filter``, ``.select``…) is still keyed
    by the same columns, under the same names.
    """
    key = getattr(source, "upsert_key", None)
    if key is None or not isinstance(result, DataFrame) or result is source:
        return result
    if result.upsert_key is None and set(key) <= set(result.schema().names):
        result.upsert_key = list(key)
    return result


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

    #: The result's column names where two of them are alike (``SELECT l.a, r.a``), as plain
    #: DataFusion names them; None otherwise. A live query's result is read through a table,
    #: whose columns must differ: there the two are named by their qualified names (``l.a``,
    #: ``r.a``), which is also what a DataFrame derived from this one (``.select``) sees.
    result_names: list[str] | None = None

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("__") or not callable(attr):
            return attr
        return _translating(attr, source=self)

    def __iter__(self) -> Any:
        return iter(self.execute_stream())

    # --- a result whose column names repeat (see ``result_names``) -------------------------

    def _named(self, data: Any) -> Any:
        """``data`` (a pyarrow table or batch) with the result's own column names."""
        return data if self.result_names is None else data.rename_columns(self.result_names)

    def schema(self) -> pa.Schema:
        """The result's schema (see ``datafusion.DataFrame.schema``)."""
        schema = super().schema()
        if self.result_names is None:
            return schema
        fields = [f.with_name(n) for f, n in zip(schema, self.result_names, strict=True)]
        return pa.schema(fields, metadata=schema.metadata)

    def to_arrow_table(self) -> pa.Table:
        """The whole result as a pyarrow table (see ``datafusion.DataFrame.to_arrow_table``)."""
        return self._named(super().to_arrow_table())

    def collect(self) -> list[pa.RecordBatch]:
        """The whole result as pyarrow batches (see ``datafusion.DataFrame.collect``)."""
        return [self._named(b) for b in super().collect()]

    def collect_partitioned(self) -> list[list[pa.RecordBatch]]:
        """The result's batches by partition (see ``datafusion.DataFrame``)."""
        return [[self._named(b) for b in p] for p in super().collect_partitioned()]

    def to_pydict(self) -> dict[str, list[Any]]:
        """The result as a dict of columns (a repeated name keeps its last column, as pyarrow)."""
        if self.result_names is None:
            return super().to_pydict()
        return self.to_arrow_table().to_pydict()  # type: ignore[no-any-return]

    def to_pylist(self) -> list[dict[str, Any]]:
        """The result as a list of rows (a repeated name keeps its last column, as in pyarrow)."""
        if self.result_names is None:
            return super().to_pylist()
        return self.to_arrow_table().to_pylist()  # type: ignore[no-any-return]

    def to_pandas(self) -> Any:
        """The result as a pandas DataFrame (see ``datafusion.DataFrame.to_pandas``)."""
        if self.result_names is None:
            return super().to_pandas()
        return self.to_arrow_table().to_pandas()

    def execute_stream(self) -> RecordBatchStream:
        """The result's batches as they come (see ``datafusion.DataFrame.execute_stream``)."""
        stream = _Stream(super().execute_stream().rbs)
        stream.names = self.result_names
        return stream

    def execute_stream_partitioned(self) -> list[RecordBatchStream]:
        """One stream per partition (see ``datafusion.DataFrame``)."""
        streams = [_Stream(s.rbs) for s in super().execute_stream_partitioned()]
        for stream in streams:
            stream.names = self.result_names
        return streams  # type: ignore[return-value]

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        if self.result_names is None:
            return super().__arrow_c_stream__(requested_schema)
        batches = (b.to_pyarrow() for b in self.execute_stream())
        reader = pa.RecordBatchReader.from_batches(self.schema(), batches)
        return reader.__arrow_c_stream__(requested_schema)

    def __aiter__(self) -> Any:
        return self.execute_stream().__aiter__()

    def __repr__(self) -> str:
        return str(_translating(super().__repr__)())


class _Ended:
    """What a stream reads once its query failed: nothing more."""

    def __next__(self) -> Any:
        raise StopIteration

    async def __anext__(self) -> Any:
        raise StopAsyncIteration


class _Stream(RecordBatchStream):
    """A ``RecordBatchStream`` whose errors are translated like :class:`DataFrame`'s.

    A query that failed lets go of its plan at once (the native stream is dropped), so every
    live table it reads sees its reader gone (its producer's next write raises
    ``ReaderGoneError``) while the caller still holds this stream.
    """

    #: the result's own column names, where two of them are alike (see ``result_names``)
    names: list[str] | None = None

    def __next__(self) -> RecordBatch:
        try:
            return self._named(_translating(super().__next__)())
        except StopIteration:
            raise
        except Exception:
            self.rbs = _Ended()
            raise

    async def __anext__(self) -> RecordBatch:
        try:
            return self._named(await super().__anext__())
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self.rbs = _Ended()
            if (public := _translated(exc)) is None:
                raise
            raise public from public.__cause__

    def _named(self, batch: RecordBatch) -> RecordBatch:
        if self.names is None:
            return batch
        named = _NamedBatch(batch.record_batch)
        named.names = self.names
        return named


class _NamedBatch(RecordBatch):
    """A result batch whose column names repeat: its pyarrow form carries them."""

    names: list[str]

    def to_pyarrow(self) -> pa.RecordBatch:
        return super().to_pyarrow().rename_columns(self.names)

    def __arrow_c_array__(self, requested_schema: Any = None) -> Any:
        return self.to_pyarrow().__arrow_c_array__(requested_schema)
