"""Remote SQL on ``pushtable serve``, streamed as the query produces them.

DoGet tickets, Flight SQL statement queries and prepared
statements. Queries only (DataFusion's ``SQLOptions`` refuse DDL, DML, COPY and SET while
planning), over the tables the caller's token covers, streamed as the query produces them.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import queue
import re
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import datafusion
import pyarrow as pa
import pyarrow.flight as flight

from pushtable import _native, metrics
from pushtable.context import SessionContext
from pushtable.engine import split_emit_changes
from pushtable.errors import (
    InvalidQueryError,
    ResourceLimitError,
    StatementRefusedError,
    UnknownTableError,
    UnsupportedCallError,
)
from pushtable.flight.server import catalog, parameters, sql
from pushtable.flight.server.auth import OPEN, READ, caller
from pushtable.flight.server.calls import POLL_S, Calls, audit, opened, query_error, wire_errors
from pushtable.flight.server.limits import Slot
from pushtable.flight.server.tables import Tables
from pushtable.topic import Topic


def _planned(query: str) -> str:
    """``query`` as it is planned: ``?`` placeholders numbered by the parser's tokenizer.

    Raises ``ValueError`` for a text the tokenizer refuses.
    """
    return _native.number_placeholders(query)[0]


def _references(query: str, strict: bool = False) -> list[str]:
    """The tables the planned text of ``query`` reads (``EMIT CHANGES`` stripped, as planned).

    With ``strict``, ``ValueError`` when they cannot be resolved.
    """
    try:
        text = _planned(query)
    except ValueError:
        if strict:
            raise
        text = query
    return _native.table_references(split_emit_changes(text)[0], strict=strict)


def _readable(context: Any, query: str) -> list[str]:
    """The tables ``query`` names that the caller may read (what its refusal may let go)."""
    grant = caller(context)
    if READ not in grant.roles:
        return []
    return [name for name in _references(query) if grant.covers(name)]


@dataclass
class _Get:
    """A DoGet call under way: its audit line, what it holds until its last batch, its start."""

    record: Any
    held: contextlib.ExitStack
    started: float


class Queries:
    """The server's remote-SQL side (a server part).

    DoGet, Flight SQL's GetFlightInfo, DoPut of parameters
    and prepared-statement actions (a server part).
    """

    def __init__(self, ctx: SessionContext, tables: Tables, calls: Calls) -> None:
        self._ctx = ctx
        self._tables = tables
        self._calls = calls

    def _plan(
        self, context: Any, query: str, params: pa.RecordBatch | None = None
    ) -> datafusion.DataFrame:
        """Plan a remote query, reading only tables the caller's token covers.

        Queries only (no DDL, DML, COPY or SET: refused before
        anything runs), reading only tables the caller's token covers; ``params`` binds its
        placeholders (``?`` or ``$n``).
        """
        grant = caller(context)
        grant.require(READ, "run SQL")
        # The tables are read off the very text that is planned (placeholders numbered by
        # the parser's own tokenizer, ``EMIT CHANGES`` as the engine strips it), and a text
        # whose tables cannot be resolved is refused: never read as "no table" (fail closed).
        try:
            tables = _references(query, strict=True)
            query = _planned(query)
        except ValueError as exc:
            self._calls.usage.refused("statement")
            raise InvalidQueryError(
                f"refused: {exc}; the server runs only a query whose tables it can check"
            ) from None
        grant.require(READ, "read", [t for t in tables if not grant.covers(t)] or ())
        values = parameters.bind(params)
        try:
            if values is None:  # so that the live engine may plan it (it takes no values)
                return self._ctx.sql_with_options(query, _READ_ONLY)
            return self._ctx.sql_with_options(query, _READ_ONLY, param_values=values)
        except Exception as exc:
            refused = _refusal(exc)
            if refused is not None:
                self._calls.usage.refused("statement")
                raise refused from None
            topics = [t for t in tables if isinstance(self._tables.find(t), Topic)]
            if topics and "not found" in str(exc):
                raise UnknownTableError(
                    f"{topics[0]!r} is a topic, which SQL reads through a subscription: "
                    f"client.subscribe({topics[0]!r}, 'its_name'), then SELECT ... FROM its_name "
                    "(one subscription per query: each is a single-scan table)"
                ) from exc
            raise query_error(exc) from exc

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        """Describe a Flight SQL command (its schema) and give the ticket that runs it.

        A statement (:mod:`pushtable.flight.server.sql`) is planned (its
        schema, nothing runs), a catalog command described; then one ticket to run it.
        """
        with wire_errors(), audit(context, "flight_sql_info"):
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise UnsupportedCallError(
                    "pushtable serve answers GetFlightInfo for Flight SQL commands only"
                )
            cmd = sql.command(descriptor.command)
            found = sql.statement(cmd)
            if found is not None:
                query, params = found
                try:
                    df = self._plan(context, query, params)
                except Exception:  # refused: its subscriptions never get a reader
                    self._tables.drop_subscriptions(_readable(context, query))
                    raise
                schema = _described(self._ctx, df)
                if not self._ctx.reads_live(query):
                    # The schema its DoGet will declare (see _query): a client compares the
                    # two. Learning it runs the query to its first batch, in a query slot.
                    with self._calls.usage.query(_tenant(context)):
                        _, schema = _first_declared(df.execute_stream(), schema)
                del df
                body = {"sql": query}
                if params is not None:
                    body["prepared"] = base64.b64encode(sql.encode_handle(query, params)).decode()
            elif cmd.kind in catalog.COMMANDS:
                caller(context).require(READ, "browse the catalog")
                schema = catalog.result_schema(cmd)
                body = {"flight_sql": base64.b64encode(descriptor.command).decode()}
            else:
                raise UnsupportedCallError(
                    f"pushtable serve does not implement the Flight SQL command {cmd.kind} "
                    "(served: statement and prepared-statement queries, the catalog commands; "
                    "see docs/network.md)"
                )
        ticket = flight.Ticket(json.dumps(body).encode())
        return flight.FlightInfo(schema, descriptor, [flight.FlightEndpoint(ticket, [])], -1, -1)

    def do_get(self, context: Any, ticket: Any) -> Any:
        """A ticket's result, streamed.

        Its kind is the first of :data:`_TICKETS`' keys that
        the ticket's JSON object holds.
        """
        opened(context)  # the ticket is its first message: not a call still opening
        call = _Get(None, contextlib.ExitStack(), time.perf_counter())
        with wire_errors(), call.held:  # audit, query slot, stream slot: until the last batch
            call.record = call.held.enter_context(audit(context, "do_get"))
            try:
                body = json.loads(ticket.ticket)
            except ValueError:
                body = None
            kind = (
                next((k for k in _TICKETS if k in body), None) if isinstance(body, dict) else None
            )
            if kind is None:
                raise ValueError(
                    'a DoGet ticket is JSON: {"sql": "<query>"} or '
                    '{"topic": "<durable topic>", "start": <offset>, "end": <offset>}'
                )
            assert isinstance(body, dict)
            return _TICKETS[kind](self, context, body, call)

    def _query(self, context: Any, body: dict[str, Any], call: _Get) -> Any:
        """A query's results (``sql``, or a prepared statement with its parameters bound)."""
        params = None
        if "prepared" in body:
            query, params = sql.decode_handle(base64.b64decode(str(body["prepared"])))
        else:
            query = body["sql"]
            if not isinstance(query, str):
                raise ValueError(f'a DoGet ticket\'s "sql" is the query text, not {query!r}')
        # the audit line names the tables the query reads (a query may read several)
        call.record.table = ",".join(_references(query)) or None
        # A subscription it reads is let go when the query ends, is refused at planning or
        # refused its slot: a single-scan table nothing can read again must not hold its
        # topic's producers.
        call.held.callback(self._tables.drop_subscriptions, _readable(context, query))
        df = self._plan(context, query, params)
        schema = _described(self._ctx, df)
        slot = call.held.enter_context(self._calls.usage.query(_tenant(context)))
        call.held.enter_context(self._calls.held(context))
        stream: Iterator[Any] = iter(df.execute_stream())
        if not self._ctx.reads_live(query):
            # A query over stored data: its first batch is declared, as its batches carry the
            # plan's physical types, which DataFusion's logical schema can miss (a union of
            # int32 and int64, a CASE over a list and a large list, string views). A live
            # query's schema goes out at once instead (its rows wait for producers): a batch
            # that differs is cast to it (see _results).
            stream, schema = _first_declared(stream, schema)
        # Only the worker thread keeps the query: when it lets go, the query ends.
        query_box = [stream]
        del df, stream
        held = call.held.pop_all()
        results = self._results(context, query_box, slot, held, call.record, call.started, schema)
        # A generator that never starts never runs its finally: let go when it is collected.
        weakref.finalize(results, held.close)
        return flight.GeneratorStream(schema, results)

    def _catalog(self, context: Any, body: dict[str, Any], call: _Get) -> Any:
        """A catalog command's result: the tables the caller's token covers."""
        grant = caller(context)
        grant.require(READ, "browse the catalog")
        cmd = sql.command(base64.b64decode(str(body["flight_sql"])))
        schema = self._ctx.catalog(catalog.CATALOG).schema(catalog.DB_SCHEMA)
        tables = [
            (name, schema.table(name).schema) for name in schema.names() if grant.covers(name)
        ]
        return flight.RecordBatchStream(catalog.answer(cmd, tables, _version()))

    def sql_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """Flight SQL's DoPut (a command descriptor): parameters bound to a prepared statement.

        Parameters are bound to a prepared
        statement. The reply is the updated handle carrying them (the server keeps nothing).
        """
        with wire_errors(), audit(context, "flight_sql_put"), self._calls.held(context):
            self._bind(context, descriptor, reader, writer)

    def _bind(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        caller(context).require(READ, "run SQL")
        cmd = sql.command(descriptor.command)
        if cmd.kind != sql.PREPARED_QUERY:
            raise UnsupportedCallError(
                f"pushtable serve runs queries only: DoPut with {cmd.kind} is not implemented "
                "(it binds parameters to a prepared statement query)"
            )
        query, _ = sql.decode_handle(cmd.raw(1))
        table = reader.read_all()
        if table.nbytes > parameters.MAX_BYTES:
            raise ResourceLimitError(
                f"bound parameters of {table.nbytes:,} bytes exceed the limit of "
                f"{parameters.MAX_BYTES:,}"
            )
        batch = sql.parameter_batch(table)  # from the network: checked in full
        parameters.bind(batch)  # one row, or a clear error now rather than at DoGet
        handle = sql.encode_handle(query, batch)
        writer.write(pa.py_buffer(sql.put_prepared_result(handle)))

    def _range(self, context: Any, body: dict[str, Any], call: _Get) -> Any:
        """A durable topic's committed offsets ``[start, end)``, read from its dataset."""
        name = str(body["topic"])
        call.record.table = name
        caller(context).require(READ, "read", [name])
        reader = self._tables.durable(name).read(int(body["start"]), int(body["end"]))
        return flight.RecordBatchStream(reader)

    def _results(
        self,
        context: Any,
        query_box: list[Any],
        slot: Slot,
        held: contextlib.ExitStack,
        record: Any,
        started: float,
        schema: pa.Schema,
    ) -> Iterator[pa.RecordBatch | pa.Table]:
        """Batches as the query yields them; what the call holds is let go at the end.

        Each goes out under the schema the stream declared: a batch whose fields differ from
        it only in nullability (a column DataFusion learned is never null once parameters were
        bound) is relabelled, zero-copy, as ``GeneratorStream`` refuses any other schema.

        A result with dictionary columns goes out batch by batch as one-batch tables: pyarrow's
        ``GeneratorStream`` writes a plain batch without its dictionaries, which the client
        then refuses (apache/arrow#38480); a table goes through an IPC writer that sends them.
        """
        dictionaries = _has_dictionary(schema)
        first = True
        with wire_errors(), held:
            for batch in self._forward(context, query_box, slot):
                if not batch.schema.equals(schema):
                    batch = _as_declared(batch, schema)
                if first:
                    metrics.FIRST_RESULT.observe(time.perf_counter() - started)
                    first = False
                record.rows += batch.num_rows
                yield pa.Table.from_batches([batch]) if dictionaries else batch

    def _forward(self, context: Any, query_box: list[Any], slot: Slot) -> Iterator[pa.RecordBatch]:
        """Forward the batches a worker thread pulls from the query.

        This generator forwards the batches and
        notices a client that left, or one that reads nothing for ``idle_timeout`` (then the
        query is dropped and its slot given back at once).
        """
        handoff: queue.Queue[Any] = queue.Queue(maxsize=HANDOFF)
        gone = threading.Event()
        idle = threading.Event()
        done = object()
        idle_timeout = self._calls.usage.limits.idle_timeout

        stream: Any = query_box.pop()

        def pull() -> None:
            nonlocal stream
            try:
                for batch in stream:
                    item = batch.to_pyarrow()
                    waited = 0.0
                    while not gone.is_set():
                        try:
                            handoff.put(item, timeout=POLL_S)
                            break
                        except queue.Full:
                            waited += POLL_S
                            if waited >= idle_timeout:  # the client reads nothing: let go
                                self._calls.usage.refused("idle_timeout")
                                idle.set()
                                return
                    if gone.is_set():
                        return
                handoff.put(done)
            except Exception as exc:  # noqa: BLE001 - any failure goes to the reader
                handoff.put(exc)
            finally:
                stream = None  # drop the query: its tables' producers learn the reader left
                if idle.is_set():
                    slot.release()

        threading.Thread(target=pull, name="pushtable-sql", daemon=True).start()
        # What the query produced while a message was going out goes out in the next one:
        # one gRPC message and one thread wake-up for several small batches (a result's batch
        # boundaries carry no meaning; nothing waits for more rows than have queued).
        parts: list[pa.RecordBatch] = []
        rows = 0
        try:
            while True:
                try:
                    item = handoff.get_nowait() if parts else handoff.get(timeout=POLL_S)
                except queue.Empty:
                    if parts:
                        yield _joined(parts)
                        parts, rows = [], 0
                    elif idle.is_set():
                        raise ResourceLimitError(
                            f"the query was dropped: its client read nothing for "
                            f"{idle_timeout:g}s (idle_timeout)"
                        ) from None
                    elif context.is_cancelled():
                        return
                    continue
                if item is done or isinstance(item, BaseException):
                    if parts:
                        yield _joined(parts)
                    if isinstance(item, BaseException):
                        raise query_error(item)
                    return
                parts.append(item)
                rows += item.num_rows
                if rows >= GROUP_ROWS:
                    yield _joined(parts)
                    parts, rows = [], 0
        finally:
            gone.set()

    def sql_action(self, context: Any, action: Any) -> bytes | None:
        """Flight SQL prepared statements (stateless: the handle is the query text)."""
        caller(context).require(READ, "run SQL")
        if action.type == "ClosePreparedStatement":
            return None

        def describe(query: str) -> tuple[pa.Schema, pa.Schema]:
            df = self._plan(context, query)
            if not parameters.has_placeholders(_planned(query)):
                return df.schema(), pa.schema([])  # nothing to describe: no walk of the plan
            return df.schema(), parameters.parameter_schema(df)

        return sql.prepared(action.body.to_pybytes(), describe)


#: What a DoGet ticket holds, by the key that says so (the first one present wins).
_TICKETS = {
    "topic": Queries._range,
    "flight_sql": Queries._catalog,
    "prepared": Queries._query,
    "sql": Queries._query,
}


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pushtable")
    except PackageNotFoundError:
        return "unknown"


#: Result batches the query may run ahead of the client by (per call).
HANDOFF = 8
#: Result batches that queued up are sent together up to this many rows per message.
GROUP_ROWS = 65_536

_READ_ONLY = (
    datafusion.SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)
)
_REFUSED = re.compile(r"(DDL|DML|Statement) not supported: (\w+)")


def _has_dictionary(schema: pa.Schema) -> bool:
    """Whether a column of ``schema`` is, or holds, a dictionary."""

    def holds(t: pa.DataType) -> bool:
        if pa.types.is_dictionary(t):
            return True
        return any(holds(t.field(i).type) for i in range(t.num_fields))

    return any(holds(f.type) for f in schema)


def _joined(parts: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One batch of the batches that queued up (no copy for a single one)."""
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)


def _refusal(exc: BaseException) -> StatementRefusedError | None:
    """The refusal a planning error stands for, when DataFusion's SQLOptions refused it."""
    match = _REFUSED.search(str(exc))
    if match is None:
        return None
    kind = {"DDL": "DDL", "DML": "DML", "Statement": "session"}[match.group(1)]
    return StatementRefusedError(
        f"pushtable serve runs queries only: {match.group(2)} is a {kind} statement and is "
        "refused before anything runs (the server's own Python session, Server.ctx, may)"
    )


def _first_declared(stream: Any, schema: pa.Schema) -> tuple[Iterator[Any], pa.Schema]:
    """``stream`` (its first batch taken and put back) and the schema to declare.

    That is the first batch's, with ``schema``'s metadata (``schema`` when there is none).
    """
    first = next(iter(stream), None)
    if first is None:
        return iter(()), schema
    carried = first.to_pyarrow().schema.with_metadata(schema.metadata)
    return itertools.chain([first], stream), carried


def _as_declared(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` under the declared ``schema`` (``GeneratorStream`` refuses any other).

    Fields that differ only in nullability are relabelled, zero-copy; other types are cast
    when every value fits (a live query declares DataFusion's logical types before its first
    batch). A value that does not fit is refused naming the column and both types.
    """
    if batch.schema.types == schema.types:
        return pa.RecordBatch.from_arrays(batch.columns, schema=schema)
    try:
        return batch.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        differ = [
            f"{f.name}: {f.type} declared, {g.type} computed"
            for f, g in zip(schema, batch.schema, strict=True)
            if f.type != g.type
        ]
        raise InvalidQueryError(
            "this live query's rows do not fit the types its plan declared ("
            + "; ".join(differ)
            + f"): {exc}; CAST the column to the computed type in the query"
        ) from None


#: Schema metadata of a remote result that is an upsert changelog: its key columns (JSON).
UPSERT_KEY = b"pushtable.upsert_key"


def _described(ctx: datafusion.SessionContext, df: datafusion.DataFrame) -> pa.Schema:
    """``df``'s schema, with the types DataFusion computes and an upsert changelog's key.

    The types are those of the optimized plan: DataFusion's optimizer may change a column's
    type from what the query's text declares (``sum(d), count(DISTINCT s)`` is rewritten to a
    sum of partial sums, ``decimal128(30, 2)`` over a ``decimal128(10, 2)`` column where the
    text's plan says ``decimal128(20, 2)``), and a live query's schema goes out before its
    first batch. Its metadata says which columns key an updating aggregate's changes
    (:attr:`pushtable.DataFrame.upsert_key`), so a remote reader can apply them.
    """
    schema: pa.Schema = df.schema()
    try:
        computed = ctx.create_dataframe_from_logical_plan(df.optimized_logical_plan()).schema()
    except Exception:  # noqa: BLE001 - the text's types stand (the batches are cast to them)
        computed = schema
    if len(computed) == len(schema):
        fields = [f.with_type(c.type) for f, c in zip(schema, computed, strict=True)]
        schema = pa.schema(fields, metadata=schema.metadata)
    key = getattr(df, "upsert_key", None)
    if key is None:
        return schema
    return schema.with_metadata({**(schema.metadata or {}), UPSERT_KEY: json.dumps(key).encode()})


def _tenant(context: Any) -> str | None:
    """The token a query slot is counted for (None: a server without tokens)."""
    grant = caller(context)
    return None if grant is OPEN else grant.name
