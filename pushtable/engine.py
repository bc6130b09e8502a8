"""Which engine runs a query: datafusion-python, or pushtable's embedded live engine.

datafusion-python 54 sees a live table's declared order only as opaque foreign expressions,
so over an ordered table it can neither emit a ``GROUP BY`` window as it closes nor stream
a running window function. The native crate embeds DataFusion 54 and plans those queries
itself, with the order as a real column ordering; the result comes back as a single-scan
table read by an ordinary ``datafusion.DataFrame``. Every other query runs in
datafusion-python, as before.

:class:`TableSources` remembers how each table of a :class:`pushtable.SessionContext` was
registered, so that the engine can register the same tables when a query needs it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datafusion

from pushtable import _native
from pushtable.errors import (
    InvalidQueryError,
    UnboundedQueryError,
    UnsupportedTableError,
    query_error,
)

__all__ = ["TableSources", "engine_threads", "plan_live", "split_emit_changes"]

#: Spark's window functions, which only the engine has
_SPARK_WINDOWS = re.compile(r"\b(session_)?window\s*\(", re.IGNORECASE)
#: Spark's field access on a window, ``window(ts, '10 seconds').start`` (DataFusion's parser
#: takes ``.start`` after a call for a column name): the arguments hold no parentheses
#: deeper than one level (``INTERVAL`` literals, ``CAST(...)``)
_WINDOW_FIELD = re.compile(
    r"(\b(?:session_)?window\s*\((?:[^()]|\([^()]*\))*\))\s*\.\s*(start|end)\b", re.IGNORECASE
)
_EMIT_CHANGES = re.compile(r"\s+EMIT\s+CHANGES\s*;?\s*\Z", re.IGNORECASE)


def split_emit_changes(sql: str) -> tuple[str, bool]:
    """``sql`` without a trailing ``EMIT CHANGES`` clause, and whether it had one.

    ``EMIT CHANGES`` (ksqlDB's and LaminarDB's words) asks an aggregate over a bounded live
    table for its changes while rows arrive, as it always answers over an unbounded one.

    Example:
        >>> split_emit_changes("SELECT k, count(*) FROM t GROUP BY k EMIT CHANGES")
        ('SELECT k, count(*) FROM t GROUP BY k', True)
    """
    match = _EMIT_CHANGES.search(sql)
    return (sql[: match.start()], True) if match else (sql, False)


def engine_threads() -> int:
    """The live engine's worker threads: ``PUSHTABLE_ENGINE_THREADS``, else the usable cores.

    Without that setting, the cores this process may use (``available_parallelism``: its CPU
    affinity and cgroup quota).

    The engine starts its runtime when the first live query is planned, with this many
    threads, for the life of the process; a setting that is not a whole number >= 1 raises
    ``ValueError`` here and from every query the engine would run (threads the system refuses
    to start: ``OSError``), rather than letting another engine answer instead.

    Example:
        >>> from pushtable.engine import engine_threads
        >>> engine_threads() >= 1
        True
    """
    return _native.engine_threads()


@dataclass(frozen=True)
class LiveState:
    """The state one kind of stateful live operator holds in this process, over its queries.

    Summed over its running queries, it is what grows with the keys (or sessions) a query has
    seen, within each query's ``memory_limit``.
    """

    #: the operator (``UpdatingAggregateExec``: an updating ``GROUP BY``;
    #: ``SessionWindowExec``: Spark's ``session_window``)
    operator: str
    #: its running streams (a query's partitions)
    streams: int
    #: groups (updating aggregates) or sessions not yet dropped (session windows) held
    groups: int
    #: bytes of that state, as counted against the session's memory pool
    state_bytes: int


def live_state() -> list[LiveState]:
    """The state the live engine's stateful operators hold now, one entry per kind.

    It is also served as Prometheus gauges: ``pushtable_live_state_groups``/``_bytes``.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext
        >>> from pushtable.engine import live_state
        >>> def groups() -> int:  # summed over every query of this process
        ...     return {s.operator: s.groups for s in live_state()}["UpdatingAggregateExec"]
        >>> before = groups()
        >>> ctx = SessionContext()
        >>> sink = ctx.register_streaming_table(
        ...     "ev", pa.schema([("k", pa.int64())]), unbounded=True)
        >>> changes = iter(ctx.sql("SELECT k, count(*) AS n FROM ev GROUP BY k"))
        >>> sink.write(pa.record_batch({"k": [1, 2, 2]}))
        >>> next(changes).to_pyarrow().num_rows
        2
        >>> groups() - before
        2
        >>> sink.close()
    """
    return [LiveState(*row) for row in _native.live_state()]


def table_key(name: str) -> str:
    """``name`` as DataFusion registers a table and as SQL names it: unquoted parts lowercased.

    ``register_table("events_foreachBatch", ...)`` registers ``events_foreachbatch``, which is
    what ``SELECT ... FROM events_foreachBatch`` reads: the names a query references
    (``table_references``) are compared with these keys. A name that is no SQL identifier
    chain (``"my table"``, ``x-y``) is kept as it is, as DataFusion keeps it.
    """
    if _UNQUOTED.fullmatch(name):
        return name.lower()
    return name


_UNQUOTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass
class TableSources:
    """How the tables of one context were registered (what the engine can register too).

    Keyed by :func:`table_key`, as the session's catalog is.
    """

    live: dict[str, _native.TableProvider] = field(default_factory=dict)
    providers: dict[str, Any] = field(default_factory=dict)
    memory: set[str] = field(default_factory=set)
    other: dict[str, str] = field(default_factory=dict)
    #: the session's memory pool (bytes), which the engine's sessions get too
    memory_limit: int | None = None
    #: what lets a table go once no query will read it: a subscription's ``close`` (its
    #: topic's producers stop waiting for it), called when the table is deregistered or a
    #: query reading it is refused
    closers: dict[str, Callable[[], None]] = field(default_factory=dict)

    def forget(self, name: str) -> None:
        """Forget how ``name`` was registered, whichever way it was."""
        name = table_key(name)
        self.live.pop(name, None)
        self.providers.pop(name, None)
        self.memory.discard(name)
        self.other.pop(name, None)
        self.closers.pop(name, None)

    def record(self, name: str, table: Any) -> None:
        """``table`` was registered under ``name`` with ``register_table``."""
        name = table_key(name)
        self.forget(name)
        if isinstance(table, _native.TableProvider):
            self.live[name] = table
        elif hasattr(table, "__datafusion_table_provider__"):
            self.providers[name] = table
        else:
            self.other[name] = f"a {type(table).__name__}"

    def record_memory(self, name: str) -> None:
        """``name`` holds in-memory Arrow data (record batches, ``from_arrow``, ...)."""
        name = table_key(name)
        self.forget(name)
        self.memory.add(name)


def _register(
    engine: _native.Engine, ctx: datafusion.SessionContext, sources: TableSources, name: str
) -> str | None:
    """Register ``name`` with the engine; returns why it cannot be, or None."""
    if name in sources.live:
        engine.register_live(name, sources.live[name])
    elif name in sources.providers:
        engine.register_provider(name, sources.providers[name])
    elif name in sources.memory:
        data = datafusion.SessionContext.table(ctx, name).to_arrow_table()
        engine.register_arrow(name, data)
    elif ctx.table_exist(name):
        return sources.other.get(name, "registered directly with datafusion")
    return None


def plan_live(
    ctx: datafusion.SessionContext, sources: TableSources, sql: str
) -> _native.LivePlan | None:
    """Plan ``sql`` with the engine when it needs it, else None.

    It needs it when the query uses a live table's order, or holds an updating aggregate, or
    ends with ``EMIT CHANGES``. None when it reads no live table, when the engine is not
    needed, or when the engine cannot plan it (datafusion-python then runs it, as before).

    Raises :class:`UnsupportedTableError` when the query reads an ordered live table together
    with a table the engine cannot read, naming that table and what to do instead, and
    :class:`UnboundedQueryError` for a shape that would never answer (a join of two live
    tables without a time bound between their order columns, a ``HAVING`` over an updating
    aggregate), naming what is missing; :class:`InvalidQueryError` (a ``ValueError``) for a bad
    argument of Spark's window functions or ``EMIT CHANGES`` over no live table.
    """
    sql, changes = split_emit_changes(sql)
    sql = _WINDOW_FIELD.sub(lambda m: f"{m.group(1)}['{m.group(2).lower()}']", sql)
    names = _native.table_references(sql)
    live = [n for n in names if n in sources.live]
    if not live:
        if changes:
            raise InvalidQueryError(
                "EMIT CHANGES asks a query over a live table for its changes while rows "
                f"arrive; this one reads none (tables: {', '.join(names) or 'none'})"
            )
        return None
    engine = _native.Engine(memory_limit=sources.memory_limit, changes=changes)
    unsupported: dict[str, str] = {}
    for name in names:
        try:
            why = _register(engine, ctx, sources, name)
        except Exception as exc:  # noqa: BLE001 - a third-party provider may raise anything
            why = f"its provider could not be imported ({exc})"
        if why is not None:
            unsupported[name] = why
    try:
        plan = engine.plan(sql)
    except _native.InvalidQuery as exc:  # a bad argument of a function of ours (window(), ...)
        raise InvalidQueryError(str(exc)) from None
    except _native.QueryRefused as exc:  # no engine may run it: it would never answer
        why, operator = exc.args
        refused = UnboundedQueryError(why)
        refused.operator = operator
        raise refused from None
    except RuntimeError as exc:  # DataFusion's planning error (any other error is a bug)
        if changes:
            raise
        if _SPARK_WINDOWS.search(sql):  # only the engine knows them: its error is the answer
            public = query_error(exc)
            if public is not None:
                raise public from None
            raise InvalidQueryError(str(exc)) from None
        if unsupported and any(sources.live[n].ordered for n in live):
            name, what = next(iter(unsupported.items()))
            raise UnsupportedTableError(
                f"table {name!r} ({what}) cannot be read by pushtable's live engine, which "
                f"runs queries over the ordered live table(s) {', '.join(map(repr, live))}; "
                "register it through pushtable.SessionContext as a table provider "
                "(register_table(name, a_lance_dataset) or any "
                "__datafusion_table_provider__ object) or as in-memory data "
                "(register_record_batches, from_arrow, from_pandas)"
            ) from None
        return None
    return plan if plan.reasons or changes or _SPARK_WINDOWS.search(sql) else None
