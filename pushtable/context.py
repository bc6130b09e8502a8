"""Registering streaming tables with a DataFusion session.

:class:`SessionContext` is ``datafusion.SessionContext`` with one more method;
:func:`register_streaming_table` does the same for a session you already have.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta
from importlib.metadata import version
from typing import Any, Literal

import datafusion
import pyarrow as pa

from pushtable import _native, metrics
from pushtable.dataframe import DataFrame
from pushtable.engine import TableSources, plan_live, table_key
from pushtable.explain import LiveExplanation, explain_live
from pushtable.producer import Late
from pushtable.sink import TableSink

__all__ = ["SessionContext", "register_streaming_table"]

#: The DataFusion FFI major the native core is built against. A provider crossing the FFI
#: boundary into another major has a different memory layout: refuse it rather than crash.
DATAFUSION_MAJOR = 54


def _check_datafusion_version() -> None:
    installed = version("datafusion")
    if int(installed.split(".")[0]) != DATAFUSION_MAJOR:
        raise ImportError(
            f"pushtable's native core speaks the DataFusion {DATAFUSION_MAJOR} FFI, but "
            f"datafusion {installed} is installed; install datafusion>={DATAFUSION_MAJOR}.1,"
            f"<{DATAFUSION_MAJOR + 1}"
        )


_check_datafusion_version()


def check_new_table(
    ctx: datafusion.SessionContext, name: str, capacity: int, max_bytes: int | None
) -> None:
    """Refuse a bad table name, an existing one, or bad queue limits, naming the problem."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    ):
        raise ValueError(f"max_bytes must be an integer >= 1 or None, got {max_bytes!r}")
    if ctx.table_exist(name):
        raise ValueError(f"a table named {name!r} is already registered in this context")


#: How much of each batch a write checks: see :func:`register_streaming_table`.
Validate = Literal["basic", "full"]


def check_validate(validate: str) -> str:
    """``validate`` if it names a mode, else a ValueError that lists them."""
    if validate not in ("basic", "full"):
        raise ValueError(f"validate must be 'basic' or 'full', got {validate!r}")
    return validate


def order_columns(order_by: str | Sequence[str] | None, late: str) -> list[str]:
    """``order_by`` as a list of columns (``late`` checked alongside)."""
    if late not in ("reject", "drop"):
        raise ValueError(f"late must be 'reject' or 'drop', got {late!r}")
    return [order_by] if isinstance(order_by, str) else list(order_by or [])


def delay_units(schema: pa.Schema, order: list[str], max_delay: Any) -> int | None:
    """``max_delay`` as an integer in the scale of the order column's values.

    ``max_delay`` is a ``timedelta``, or an ``int`` in the column's own units.
    """
    if max_delay is None:
        return None
    if len(order) != 1:
        raise ValueError("max_delay needs exactly one order_by column")
    field = schema.field(order[0])
    if isinstance(max_delay, timedelta):
        if pa.types.is_timestamp(field.type):
            per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
            return int(max_delay.total_seconds() * per_second[field.type.unit])
        if pa.types.is_date32(field.type):
            return max_delay.days
        raise ValueError(
            f"max_delay as a timedelta needs a timestamp or date order column; "
            f"'{field.name}' is {field.type}: give an int in its units"
        )
    if isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0:
        raise ValueError(f"max_delay must be a timedelta or an int >= 0, got {max_delay!r}")
    return max_delay


def register_streaming_table(
    ctx: datafusion.SessionContext,
    name: str,
    schema: pa.Schema,
    capacity: int = 16,
    *,
    max_bytes: int | None = None,
    unbounded: bool = False,
    order_by: str | Sequence[str] | None = None,
    late: Late = "reject",
    arrival_column: str | None = None,
    max_delay: timedelta | int | None = None,
    validate: Validate = "basic",
) -> TableSink:
    """Register a single-scan table named ``name`` in ``ctx`` and return its :class:`TableSink`.

    One query may scan the table; it sees every batch written, exactly once, while the
    producers are still writing. ``capacity`` (>= 1) bounds the queued batches and
    ``max_bytes`` the queued bytes; writers block beyond either. ``unbounded=True`` marks the
    table infinite, so DataFusion rejects plans that could only finish at end of stream.

    ``order_by`` (a column or a list, ascending) declares the order rows arrive in, so
    DataFusion can stream sorted aggregates and windows over it; the sink *enforces* it: a
    batch out of order within itself or behind the newest value written raises
    :class:`OrderViolationError` and is not queued (``late="reject"``), or loses its late rows,
    counted in ``stats.late_rows`` (``late="drop"``). Nulls in an order column are rejected.

    ``arrival_column="arrived_at"`` adds a ``timestamp[us, tz=UTC]`` column that the sink fills
    with each batch's write time (never going back), so any stream can be windowed by arrival;
    the table is ordered by it unless ``order_by`` says otherwise, and its windows close by
    the clock (a few milliseconds after each boundary, with no new rows). Producers write the
    schema without it.

    ``max_delay`` (with one ``order_by`` column) accepts rows up to that far behind the newest
    seen, in any order: the sink holds them (``stats.held_rows``/``held_bytes``) and releases
    them in order once the watermark — newest minus ``max_delay``, or ``advance(ts)`` — passes
    them; rows behind it are late (``late=``). ``close()`` releases the rest.

    ``validate`` says how much of each batch a write checks (docs/semantics.md, "Trust"). A
    producer in this process is trusted as DataFusion and DuckDB trust one: ``"basic"``
    checks the schema, nullability and that each column's buffers fit its length, at a cost
    per column, never per byte. ``"full"`` also reads every value (UTF-8, offsets,
    dictionary keys): for batches built from raw buffers, at a cost per byte.

    Example:
        >>> import datafusion, pyarrow as pa
        >>> from pushtable import register_streaming_table
        >>> ctx = datafusion.SessionContext()
        >>> sink = register_streaming_table(ctx, "nums", pa.schema([("v", pa.int64())]), 2)
        >>> sink.write(pa.table({"v": [1, 2, 3]}))
        >>> sink.close()
        >>> ctx.sql("SELECT count(*) AS n FROM nums").to_pydict()
        {'n': [3]}
    """
    check_new_table(ctx, name, capacity, max_bytes)
    if not isinstance(schema, pa.Schema):
        schema = pa.schema(schema)
    order = order_columns(order_by, late)
    delay = delay_units(schema, order, max_delay)
    native, provider = _native.streaming_table(
        name,
        schema,
        capacity,
        max_bytes,
        unbounded,
        order,
        late,
        arrival_column,
        delay,
        check_validate(validate),
    )
    ctx.register_table(name, provider)
    # `provider` handed its only reference to the session: from now on the session owns the
    # table, and dropping it unscanned releases blocked producers with ReaderGoneError.
    sink = TableSink(native, name, schema, capacity, max_bytes)
    metrics.track(sink, session=ctx.session_id())
    return sink


class SessionContext(datafusion.SessionContext):
    """A ``datafusion.SessionContext`` that can also register streaming tables.

    Its ``sql``/``sql_with_options``/``table`` return a :class:`pushtable.DataFrame`, whose
    errors from streaming tables are pushtable's own classes (e.g. ``StreamConsumedError``).
    A query that needs an ordered table's order to answer while data arrives (a window
    ``GROUP BY``, a running window function) is planned and run by pushtable's embedded
    engine (:mod:`pushtable.engine`); the DataFrame it returns is an ordinary one.

    Example:
        >>> import threading, pyarrow as pa
        >>> from pushtable import SessionContext
        >>> ctx = SessionContext()
        >>> sink = ctx.register_streaming_table("events", pa.schema([("n", pa.int32())]))
        >>> def produce() -> None:
        ...     with sink:
        ...         for i in range(3):
        ...             sink.write(pa.record_batch({"n": pa.array([i], pa.int32())}))
        >>> threading.Thread(target=produce).start()
        >>> ctx.sql("SELECT sum(n) AS total FROM events").to_pydict()
        {'total': [3]}
    """

    def __init__(self, *args: Any, memory_limit: int | None = None, **kwargs: Any) -> None:
        """``memory_limit`` (bytes) gives the session a fair memory pool with no spilling to disk.

        The pool serves datafusion-python's queries and the live engine's alike: a query over
        its share fails with "Resources exhausted" (the others go on). Otherwise the arguments
        are datafusion's (``config``, ``runtime``).
        """
        if memory_limit is not None:
            if "runtime" in kwargs or len(args) > 1:
                raise ValueError("pass memory_limit or a runtime, not both")
            kwargs["runtime"] = (
                datafusion.RuntimeEnvBuilder()
                .with_disk_manager_disabled()
                .with_fair_spill_pool(memory_limit)
            )
        super().__init__(*args, **kwargs)
        self._sources = TableSources(memory_limit=memory_limit)

    # --- what the live engine needs to know about the tables -----------------------------

    def register_table(self, name: str, table: Any) -> None:
        """Register ``table`` (a table provider, a ``DataFrame`` view, a dataset…) as ``name``.

        A Lance dataset (``lance.LanceDataset``) is read through Lance's own DataFusion
        provider, the same as registering ``lance.FFILanceTableProvider(ds)``: Lance's
        filters and projections are pushed down, and the live engine can join it.

        >>> import tempfile, lance, pyarrow as pa
        >>> ds = lance.write_dataset(pa.table({"a": [1, 2]}), tempfile.mkdtemp() + "/a.lance")
        >>> ctx = SessionContext()
        >>> ctx.register_table("a", ds)
        >>> ctx.sql("SELECT sum(a) AS s FROM a").to_pydict()
        {'s': [3]}
        """
        table = _lance_provider(table)
        super().register_table(name, table)
        self._sources.record(name, table)

    def register_table_provider(self, name: str, provider: Any) -> None:
        """Alias of :meth:`register_table` (datafusion's older name)."""
        self.register_table(name, provider)

    def deregister_table(self, name: str) -> None:
        """Remove the table ``name``; a subscription's topic stops waiting for it at once."""
        close = self._sources.closers.pop(table_key(name), None)
        super().deregister_table(name)
        self._sources.forget(name)
        if close is not None:
            close()

    def _let_go_refused(self, query: str) -> None:
        """A query was refused as it was planned: the subscriptions it names are let go.

        Nothing will read them (a subscription is single-scan and this query will never
        run), and a subscription nobody reads holds its topic's producers once it is full:
        one refused panel of a dashboard froze every other panel of the same topic.
        """
        try:
            names = _native.table_references(query)
        except Exception:  # noqa: BLE001 - a query that does not parse names no table
            return
        for name in names:
            if table_key(name) in self._sources.closers:
                self.deregister_table(name)

    def register_record_batches(self, name: str, partitions: list[list[pa.RecordBatch]]) -> None:
        """Register in-memory record batches as ``name``."""
        super().register_record_batches(name, partitions)
        self._sources.record_memory(name)

    def from_arrow(self, data: Any, name: str | None = None) -> DataFrame:
        """A DataFrame over Arrow data, registered as ``name`` when given."""
        df = DataFrame(super().from_arrow(data, name).df)
        if name is not None:
            self._sources.record_memory(name)
        return df

    def from_pandas(self, data: Any, name: str | None = None) -> DataFrame:
        """A DataFrame over a pandas DataFrame, registered as ``name`` when given."""
        df = DataFrame(super().from_pandas(data, name).df)
        if name is not None:
            self._sources.record_memory(name)
        return df

    def from_pydict(self, data: dict[str, list[Any]], name: str | None = None) -> DataFrame:
        """A DataFrame over a dict of columns, registered as ``name`` when given."""
        df = DataFrame(super().from_pydict(data, name).df)
        if name is not None:
            self._sources.record_memory(name)
        return df

    def register_streaming_table(
        self,
        name: str,
        schema: pa.Schema,
        capacity: int = 16,
        *,
        max_bytes: int | None = None,
        unbounded: bool = False,
        order_by: str | Sequence[str] | None = None,
        late: Late = "reject",
        arrival_column: str | None = None,
        max_delay: timedelta | int | None = None,
        validate: Validate = "basic",
    ) -> TableSink:
        """Register a single-scan streaming table; see :func:`register_streaming_table`."""
        return register_streaming_table(
            self,
            name,
            schema,
            capacity,
            max_bytes=max_bytes,
            unbounded=unbounded,
            order_by=order_by,
            late=late,
            arrival_column=arrival_column,
            max_delay=max_delay,
            validate=validate,
        )

    def sql(self, query: str, *args: Any, **kwargs: Any) -> DataFrame:
        """Plan ``query``; see ``datafusion.SessionContext.sql`` (errors keep their class).

        Example:
            >>> from pushtable import SessionContext
            >>> SessionContext().sql("SELECT 1 AS one").to_pydict()
            {'one': [1]}
        """
        try:
            if not args and not kwargs and (live := self._live(query)) is not None:
                return live
            return DataFrame(super().sql(query, *args, **kwargs).df)
        except Exception:
            self._let_go_refused(query)
            raise

    def sql_with_options(self, query: str, *args: Any, **kwargs: Any) -> DataFrame:
        """Like :meth:`sql`, with ``datafusion.SQLOptions``."""
        try:
            if len(args) + len(kwargs) <= 1 and (live := self._live(query)) is not None:
                return live  # the engine plans queries only: no DDL, DML or SET
            return DataFrame(super().sql_with_options(query, *args, **kwargs).df)
        except Exception:
            self._let_go_refused(query)
            raise

    def reads_live(self, query: str) -> bool:
        """Whether ``query`` reads a live table (a streaming table or a subscription) here.

        Its rows come as producers write, so nothing of it can be awaited up front.

        Example:
            >>> import pyarrow as pa
            >>> from pushtable import SessionContext
            >>> ctx = SessionContext()
            >>> _ = ctx.register_streaming_table("t", pa.schema([("v", pa.int64())]))
            >>> ctx.reads_live("SELECT v FROM t"), ctx.reads_live("SELECT 1")
            (True, False)
        """
        return any(name in self._sources.live for name in _native.table_references(query))

    def _live(self, query: str) -> DataFrame | None:
        """``query`` run by the live engine, if it needs it."""
        plan = plan_live(self, self._sources, query)
        if plan is None:
            return None
        frame = DataFrame(super().read_table(plan.query()).df)
        frame.upsert_key = plan.upsert_key
        if len(set(plan.names)) < len(plan.names):  # SELECT l.a, r.a: two columns named a
            frame.result_names = plan.names
        return frame

    def table(self, name: str) -> DataFrame:
        """The registered table ``name`` as a :class:`pushtable.DataFrame`."""
        return DataFrame(super().table(name).df)

    def explain_live(self, sql: str) -> LiveExplanation:
        """Whether ``sql`` answers while data arrives; see :func:`pushtable.explain_live`.

        Example:
            >>> import pyarrow as pa
            >>> from pushtable import SessionContext
            >>> ctx = SessionContext()
            >>> schema = pa.schema([("k", pa.int64())])
            >>> _ = ctx.register_streaming_table("t", schema, unbounded=True)
            >>> print(ctx.explain_live("SELECT k FROM t ORDER BY k"))  # doctest: +ELLIPSIS
            rejected: an unbounded table cannot feed SortExec...
        """
        return explain_live(self, sql)


def _lance_provider(table: Any) -> Any:
    """``table`` itself, or Lance's DataFusion provider for a ``lance.LanceDataset``.

    datafusion-python would otherwise take a Lance dataset for a pyarrow dataset and fail
    at query time with a TypeError from inside Lance's scanner.
    """
    lance = sys.modules.get("lance")  # a LanceDataset means lance is already imported
    if lance is not None and isinstance(table, lance.LanceDataset):
        return lance.FFILanceTableProvider(table)
    return table
