"""``pushtable serve``: streaming tables and topics behind Arrow Flight.

Remote producers push with DoPut; the server writes each batch into the table's sink while the
client waits for room, so backpressure reaches the client (gRPC flow control plus the client's
window of unacknowledged batches). Remote SQL runs with DoGet and streams batches as the query
produces them. Wire conventions: :mod:`pushtable.flight.protocol`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import datafusion
import pyarrow as pa
import pyarrow.flight as flight

from pushtable import _native, errors
from pushtable.context import SessionContext
from pushtable.errors import (
    PermissionDeniedError,
    PushTableError,
    ResourceLimitError,
    ServerStoppedError,
    StatementRefusedError,
    UnknownTableError,
    UnsupportedCallError,
    WriteTimeoutError,
)
from pushtable.flight import protocol, sql
from pushtable.flight.audit import AuditRecord, audited
from pushtable.flight.auth import ADMIN, READ, WRITE, BearerAuth, Grant, Tokens, caller
from pushtable.flight.limits import Limits, Slot, Usage
from pushtable.sink import TableSink
from pushtable.topic import Topic

__all__ = ["Server", "serve"]

log = logging.getLogger(__name__)

#: How often a blocked handler looks whether its client went away or the server is stopping.
POLL_S = 0.25


def _tls_pairs(tls: tuple[str | Path, str | Path] | None) -> list[Any] | None:
    if tls is None:
        return None
    cert, key = (Path(p).read_bytes() for p in tls)
    return [flight.CertKeyPair(cert=cert, key=key)]


class Server(flight.FlightServerBase):  # type: ignore[misc]
    """A Flight server hosting a :class:`pushtable.SessionContext` with live tables.

    It listens as soon as it is constructed (``location`` says where; port 0 picks a free
    one). ``stop()`` fails every table (blocked producers get ``SinkClosedError``, reading
    queries ``StreamFailedError``) and shuts down.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable.flight import Server, connect
        >>> server = Server("grpc://127.0.0.1:0")
        >>> client = connect(server.location)
        >>> client.create_table("t", pa.schema([("v", pa.int64())]))
        >>> with client.sink("t") as sink:
        ...     sink.write(pa.record_batch({"v": [1, 2, 3]}))
        >>> client.sql("SELECT sum(v) AS s FROM t").read_all().to_pydict()
        {'s': [6]}
        >>> server.stop()  # the number of calls left open: 0
        0
    """

    def __init__(
        self,
        location: str = "grpc://127.0.0.1:0",
        *,
        token: str | None = None,
        tokens: Mapping[str, Grant] | Tokens | None = None,
        tls: tuple[str | Path, str | Path] | None = None,
        ctx: SessionContext | None = None,
        limits: Limits | None = None,
    ) -> None:
        if tls is not None and location.startswith("grpc://"):
            location = "grpc+tls://" + location.removeprefix("grpc://")
        self.tokens = _tokens(token, tokens)
        middleware = {"auth": BearerAuth(self.tokens)} if len(self.tokens) else {}
        super().__init__(location, middleware=middleware, tls_certificates=_tls_pairs(tls))
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0]
        self.location = f"{scheme}://{host}:{self.port}"
        self.limits = limits if limits is not None else Limits()
        self.usage = Usage(self.limits)
        #: The operator's session (full power from Python); remote SQL runs queries only, in
        #: its memory pool when the server made it.
        self.ctx = ctx if ctx is not None else _remote_session(self.limits)
        self._tables: dict[str, TableSink | Topic] = {}
        self._staged: dict[tuple[str, str, int], dict[tuple[int, int], _Share]] = {}
        self._published: dict[tuple[str, str], int] = {}
        #: staged shares never written: task attempts Spark did not keep, replayed epochs
        self.dropped_shares = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acks: set[_Acks] = set()  # the open DoPut streams
        self._calls = 0  # DoPut and DoGet calls under way
        self._calls_changed = threading.Condition()
        threading.Thread(target=self._end_idle_streams, name="pushtable-idle", daemon=True).start()

    @contextlib.contextmanager
    def _call(self, context: Any) -> Iterator[None]:
        """Count a streaming call (so ``stop()`` can let it deliver its error first), in one
        of its client's stream slots."""
        with self.usage.stream(_client(context)):
            with self._calls_changed:
                self._calls += 1
            try:
                yield
            finally:
                with self._calls_changed:
                    self._calls -= 1
                    self._calls_changed.notify_all()

    # -- tables -------------------------------------------------------------------------

    def create_table(
        self,
        name: str,
        schema: pa.Schema,
        *,
        topic: bool = False,
        if_not_exists: bool = False,
        **options: Any,
    ) -> TableSink | Topic:
        """Declare a streaming table (or, with ``topic=True``, a topic) named ``name``."""
        with self._lock:
            existing = self._tables.get(name)
            if existing is not None:
                if if_not_exists and existing.schema.equals(schema):
                    return existing
                raise ValueError(f"a table named {name!r} already exists on this server")
            if topic:
                producer: TableSink | Topic = Topic(name, schema, **options)
            else:
                producer = self.ctx.register_streaming_table(name, schema, **options)
            self._tables[name] = producer
            return producer

    @classmethod
    def from_config(
        cls, path: str | Path, location: str = "grpc://127.0.0.1:0", **kw: Any
    ) -> Server:
        """A server set up by a JSON config file: its ``tokens``, ``limits``, ``tables`` and
        ``topics`` (see docs/network.md, "Security"). ``kw`` goes to the constructor."""
        config = _read_config(path)
        tokens = Tokens.from_config(config.get("tokens", []))
        if kw.get("token"):
            tokens = _tokens(kw.pop("token"), dict(_grants(tokens)))
        kw.pop("token", None)
        limits = Limits.from_config(config.get("limits", {}))
        server = cls(location, tokens=tokens, limits=limits, **kw)
        server._declare(config)
        return server

    def load_config(self, path: str | Path) -> None:
        """Declare the tables and topics of a JSON config file (see docs/network.md).

        Tokens and limits take effect when the server is made: :meth:`from_config`.
        """
        config = _read_config(path)
        if "tokens" in config or "limits" in config:
            raise ValueError(
                f"{path}: tokens and limits are set when the server is made; use "
                "Server.from_config(path) or `pushtable serve --config`"
            )
        self._declare(config)

    def _declare(self, config: dict[str, Any]) -> None:
        for kind, is_topic in (("tables", False), ("topics", True)):
            for spec in config.get(kind, []):
                spec = dict(spec)
                schema = pa.schema(
                    [(n, pa.type_for_alias(t)) for n, t in spec.pop("schema").items()]
                )
                self.create_table(spec.pop("name"), schema, topic=is_topic, **spec)

    def _table(self, name: str) -> TableSink | Topic:
        with self._lock:
            producer = self._tables.get(name)
        if producer is None:
            raise UnknownTableError(f"no table named {name!r} on this server")
        return producer

    # -- DoPut: remote producers --------------------------------------------------------

    def _end_idle_streams(self) -> None:
        """Tell each DoPut stream idle for ``idle_timeout`` to end (pushtable's clients do,
        and reopen on their next write); the server's thread for it is then free."""
        timeout = self.limits.idle_timeout
        while not self._stopping.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [
                    a
                    for a in self._acks
                    if not (a.told_idle or a.writing) and now - a.last_active > timeout
                ]
            for acks in idle:
                self.usage.refused("idle_timeout")
                acks.idle()

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        acks = _Acks(writer)
        with self._lock:
            self._acks.add(acks)
        try:
            with _wire_errors(), _audit(context, "do_put") as record, self._call(context):
                self._do_put(context, descriptor, reader, acks, record)
        finally:
            acks.close()  # before the call ends: no stop notice may touch a finished call
            with self._lock:
                self._acks.discard(acks)

    def _do_put(
        self, context: Any, descriptor: Any, reader: Any, writer: _Acks, record: Any
    ) -> None:
        path = [p.decode(errors="replace") for p in descriptor.path]
        grant = caller(context)
        if len(path) == 6 and path[1] == protocol.STAGE:
            record.action, record.table = "stage", path[0]
            grant.require(ADMIN, "stage Spark shares for", [path[0]])
            record.rows = self._stage(context, path, reader, writer)
            return
        if len(path) != 1:
            raise ValueError(
                f"unexpected DoPut path {path!r}: expected [table] or "
                "[table, 'stage', query, epoch, partition, attempt]"
            )
        record.table = path[0]
        grant.require(WRITE, "push to", path)
        producer = self._table(path[0])
        for count, (batch, metadata) in enumerate(protocol.chunks(reader.read_chunk), 1):
            with writer.busy():
                if (watermark := protocol.advance_value(metadata)) is not None:
                    producer.advance(watermark)
                else:
                    self._write(context, producer, protocol.checked(path[0], count, batch))
                    record.rows += batch.num_rows
            writer.send(count)

    def _write(self, context: Any, producer: TableSink | Topic, batch: pa.RecordBatch) -> None:
        """Write, waiting for room without end, unless the client left or the server stops."""
        while True:
            try:
                producer.write(batch, timeout=POLL_S)
                return
            except WriteTimeoutError:
                if context.is_cancelled() or self._stopping.is_set():
                    raise

    def _stage(self, context: Any, path: list[str], reader: Any, writer: _Acks) -> int:
        """Hold one Spark task attempt's batches until its epoch is published; returns rows."""
        table, _, query, epoch_text, partition_text, attempt_text = path
        try:
            epoch, partition, attempt = int(epoch_text), int(partition_text), int(attempt_text)
        except ValueError:
            raise ValueError(
                f"stage path {path!r}: epoch, partition and attempt must be integers"
            ) from None
        producer = self._table(table)
        share = _Share((table, query), self.usage)
        try:
            for batch in protocol.batches(reader.read_chunk):
                protocol.check_batch_schema(table, producer.schema, batch.schema)
                share.add(protocol.checked(table, len(share.batches) + 1, batch))
                writer.send(len(share.batches))
        except BaseException:
            share.release()
            raise
        with self._lock:
            stage = self._staged.setdefault((table, query, epoch), {})
            replaced = stage.pop((partition, attempt), None)
            stage[(partition, attempt)] = share
        if replaced is not None:
            replaced.release()
        return share.rows

    # -- DoGet: remote SQL --------------------------------------------------------------

    def _plan(self, context: Any, query: str) -> datafusion.DataFrame:
        """Plan a remote query: queries only (no DDL, DML, COPY or SET: refused before
        anything runs), reading only tables the caller's token covers."""
        grant = caller(context)
        grant.require(READ, "run SQL")
        tables = _native.table_references(query)
        grant.require(READ, "read", [t for t in tables if not grant.covers(t)] or ())
        try:
            return self.ctx.sql_with_options(query, _READ_ONLY)
        except Exception as exc:
            refused = _refusal(exc)
            if refused is not None:
                self.usage.refused("statement")
                raise refused from None
            raise _query_error(exc) from exc

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        """Flight SQL statement queries (:mod:`pushtable.flight.sql`): plan, then one ticket."""
        with _wire_errors(), _audit(context, "flight_sql_info"):
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise UnsupportedCallError(
                    "pushtable serve answers GetFlightInfo for Flight SQL statement queries only"
                )
            query = sql.statement_query(descriptor.command)
            if query is None:
                kind = sql.command(descriptor.command)[0].rsplit(".", 1)[-1]
                raise UnsupportedCallError(
                    f"pushtable serve implements the Flight SQL statement query only; {kind} is "
                    "not implemented (see docs/network.md)"
                )
            schema = self._plan(context, query).schema()
        ticket = flight.Ticket(json.dumps({"sql": query}).encode())
        return flight.FlightInfo(schema, descriptor, [flight.FlightEndpoint(ticket, [])], -1, -1)

    def do_get(self, context: Any, ticket: Any) -> Any:
        audit = _audit(context, "do_get")
        held = contextlib.ExitStack()  # audit, query slot, stream slot: until the last batch
        with _wire_errors(), held:
            record = held.enter_context(audit)
            try:
                query = json.loads(ticket.ticket)["sql"]
            except (ValueError, KeyError, TypeError):
                query = None
            if not isinstance(query, str):
                raise ValueError('a DoGet ticket is JSON: {"sql": "<query>"}')
            df = self._plan(context, query)
            schema = df.schema()
            slot = held.enter_context(self.usage.query())
            held.enter_context(self._call(context))
            # Only the worker thread keeps the query: when it lets go, the query ends.
            query_box = [df.execute_stream()]
            del df
            results = self._results(context, query_box, slot, held.pop_all(), record)
        # A generator that never starts never runs its finally: let go when it is collected.
        weakref.finalize(results, held.close)
        return flight.GeneratorStream(schema, results)

    def _results(
        self,
        context: Any,
        query_box: list[Any],
        slot: Slot,
        held: contextlib.ExitStack,
        record: Any,
    ) -> Iterator[pa.RecordBatch]:
        """Batches as the query yields them; what the call holds is let go at the end."""
        with _wire_errors(), held:
            for batch in self._forward(context, query_box, slot):
                record.rows += batch.num_rows
                yield batch

    def _forward(self, context: Any, query_box: list[Any], slot: Slot) -> Iterator[pa.RecordBatch]:
        """A worker thread pulls from the query; this generator forwards the batches and
        notices a client that left, or one that reads nothing for ``idle_timeout`` (then the
        query is dropped and its slot given back at once)."""
        handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
        gone = threading.Event()
        idle = threading.Event()
        done = object()
        idle_timeout = self.limits.idle_timeout

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
                                self.usage.refused("idle_timeout")
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
        try:
            while True:
                try:
                    item = handoff.get(timeout=POLL_S)
                except queue.Empty:
                    if idle.is_set():
                        raise ResourceLimitError(
                            f"the query was dropped: its client read nothing for "
                            f"{idle_timeout:g}s (idle_timeout)"
                        ) from None
                    if context.is_cancelled():
                        return
                    continue
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise _query_error(item)
                yield item
        finally:
            gone.set()

    # -- actions ------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(name, "see pushtable.flight.protocol") for name in protocol.ACTIONS]

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        with _wire_errors(), _audit(context, str(action.type)) as record:
            if action.type in sql.ACTIONS:
                result = self._sql_action(context, action)
            else:
                try:
                    body = json.loads(action.body.to_pybytes() or b"{}")
                except ValueError:
                    raise ValueError(f"the body of action {action.type!r} is not JSON") from None
                if not isinstance(body, dict):
                    raise ValueError(f"the body of action {action.type!r} is not a JSON object")
                record.table = _table_named(body)
                result = json.dumps(self._act(caller(context), action.type, body)).encode()
        if result is not None:
            yield result

    def _sql_action(self, context: Any, action: Any) -> bytes | None:
        """Flight SQL prepared statements (stateless: the handle is the query text)."""
        caller(context).require(READ, "run SQL")
        if action.type == "ClosePreparedStatement":
            return None
        return sql.prepared(action.body.to_pybytes(), lambda q: self._plan(context, q).schema())

    def _act(self, grant: Grant, kind: str, body: dict[str, Any]) -> Any:
        if kind == "create_table":
            name = str(body.pop("name"))
            grant.require(ADMIN, "create", [name])
            schema = protocol.schema_from(body.pop("schema"))
            if (us := body.pop("max_delay_us", None)) is not None:
                body["max_delay"] = timedelta(microseconds=int(us))
            with self._lock:
                count = len(self._tables)
            try:
                options = self.limits.check_table_options(count, body)
            except ResourceLimitError:
                self.usage.refused("table_options")
                raise
            self.create_table(name, schema, **options)
            return {}
        if kind == "subscribe":
            grant.require(ADMIN, "subscribe to", [str(body.get("topic"))])
            topic = self._table(body.pop("topic"))
            if not isinstance(topic, Topic):
                raise ValueError(f"{topic.name!r} is a streaming table, not a topic")
            try:
                options = self.limits.check_queue_options(body)
            except ResourceLimitError:
                self.usage.refused("table_options")
                raise
            topic.subscribe(self.ctx, options.pop("name"), **options)
            return {}
        if kind == "close":
            grant.require(WRITE, "close", [str(body["name"])])
            self._table(body["name"]).close()
            return {}
        if kind == "fail":
            grant.require(ADMIN, "fail", [str(body["name"])])
            error = errors.RemoteError(str(body["message"]), remote_type=str(body["type"]))
            self._table(body["name"]).fail(error)
            return {}
        if kind == "stats":
            grant.require((READ, WRITE), "read the stats of", [str(body["name"])])
            return asdict(self._table(body["name"]).stats)
        if kind == "tables":
            grant.require((READ, WRITE), "list tables")
            with self._lock:
                return [
                    {
                        "name": n,
                        "topic": isinstance(p, Topic),
                        "schema": protocol.schema_bytes(p.schema),
                    }
                    for n, p in self._tables.items()
                    if grant.covers(n)
                ]
        if kind == "publish":
            grant.require(ADMIN, "publish an epoch to", [str(body["table"])])
            return self._publish(body)
        if kind == "published":
            grant.require(ADMIN, "read the published epoch of", [str(body["table"])])
            with self._lock:
                return {"epoch": self._published.get((body["table"], body["query"]), -1)}
        raise ValueError(f"unknown action {kind!r}; expected one of {', '.join(protocol.ACTIONS)}")

    def _publish(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write an epoch's staged batches (the attempts the driver names) once.

        Shares of other attempts (failed or speculative tasks) and of older epochs are
        dropped. If the table refuses a batch midway, the table is failed with that error:
        its reader learns the epoch is incomplete instead of silently missing rows.
        """
        table, query, epoch = str(body["table"]), str(body["query"]), int(body["epoch"])
        producer = self._table(table)
        named = {(int(p[0]), int(p[1])) for p in body["parts"]}
        released: list[_Share] = []
        with self._lock:
            stage = self._staged.pop((table, query, epoch), {})
            released.extend(stage.values())
            dropped = [k for k in self._staged if k[:2] == (table, query) and k[2] < epoch]
            for k in dropped:
                shares = self._staged.pop(k)
                self.dropped_shares += len(shares)
                released.extend(shares.values())
            newest = self._published.get((table, query), -1)
            if epoch <= newest:
                self.dropped_shares += len(stage)
                stage = {}
                reply: dict[str, Any] | None = {
                    "published": False,
                    "reason": f"epoch {epoch} was published already",
                }
            else:
                reply = None
                self._published[(table, query)] = epoch
                # Shares of attempts Spark did not keep (failed, speculative): never written.
                self.dropped_shares += len(stage.keys() - named)
        try:
            if reply is not None:
                return reply
            missing = [p for p in named if p not in stage]
            written = 0
            try:
                for part in sorted(named):
                    share = stage.get(part)
                    for batch in share.batches if share is not None else []:
                        producer.write(batch)
                        written += 1
            except PushTableError as exc:
                if not isinstance(exc, (errors.SinkClosedError, errors.ReaderGoneError)):
                    producer.fail(exc)
                raise
            return {"published": True, "batches": written, "parts_without_data": len(missing)}
        finally:
            for share in released:
                share.release()

    # -- lifecycle ----------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> int:
        """Fail every table, let calls deliver their errors, then shut down. Idempotent.

        Blocked producers and reading queries end with an error within ``POLL_S``. A
        producer connected but idle keeps its stream until it writes again or disconnects;
        after ``timeout`` seconds the server is abandoned (it dies with the process) rather
        than waiting for it. Returns the number of calls still open then (0: a clean stop).
        """
        if self._stopping.is_set():
            return 0
        self._stopping.set()
        with self._lock:
            producers = list(self._tables.values())
            streams = list(self._acks)
        for producer in producers:
            producer.fail(ServerStoppedError("the pushtable server stopped"))
        for acks in streams:  # an idle producer's client ends its stream on this notice
            acks.stopping()
        deadline = time.monotonic() + timeout
        with self._calls_changed:  # readers' errors reach them before gRPC cancels calls
            self._calls_changed.wait_for(
                lambda: self._calls == 0, timeout=min(timeout, 2 * POLL_S + 0.5)
            )
        stopper = threading.Thread(target=self.shutdown, name="pushtable-stop", daemon=True)
        stopper.start()
        stopper.join(max(0.0, deadline - time.monotonic()))
        if stopper.is_alive():
            with self._calls_changed:
                open_calls = self._calls
            log.warning("pushtable server stopped with %d call(s) still open", open_calls)
            # pyarrow would wait for them again at interpreter exit; let the process end.
            finalizer = getattr(self, "finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            return max(open_calls, 1)
        return 0


class _Acks:
    """A DoPut stream's metadata side: acknowledgements, and the stop / idle notices sent to
    it from another thread (one writer at a time, as gRPC requires)."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._closed = False
        self.last_active = time.monotonic()
        self.told_idle = False
        self.writing = False  # a batch is being written (maybe waiting for room): not idle

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark the stream active while the block handles a chunk it received."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
            self.last_active = time.monotonic()

    def send(self, count: int) -> None:
        with self._lock:
            self.last_active = time.monotonic()
            self._writer.write(protocol.ack(count))

    def stopping(self) -> None:
        self._notice(protocol.STOPPING)

    def idle(self) -> None:
        self.told_idle = True
        self._notice(protocol.IDLE)

    def _notice(self, notice: pa.Buffer) -> None:
        with self._lock, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            if not self._closed:  # the handler has not returned: the call is alive
                self._writer.write(notice)

    def close(self) -> None:
        with self._lock:
            self._closed = True


_READ_ONLY = (
    datafusion.SQLOptions().with_allow_ddl(False).with_allow_dml(False).with_allow_statements(False)
)
_REFUSED = re.compile(r"(DDL|DML|Statement) not supported: (\w+)")


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


def _read_config(path: str | Path) -> dict[str, Any]:
    config = json.loads(Path(path).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config file is a JSON object")
    unknown = sorted(set(config) - {"tokens", "limits", "tables", "topics"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: tokens, limits, tables, topics")
    return config


def _grants(tokens: Tokens) -> dict[str, Grant]:
    """The secret → grant table of ``tokens`` (the server's own use: never logged)."""
    return {key.decode().removeprefix("Bearer "): g for key, g in tokens._entries}


def _tokens(token: str | None, tokens: Mapping[str, Grant] | Tokens | None) -> Tokens:
    """``--token`` (every role) and the named, scoped tokens, as one table."""
    if isinstance(tokens, Tokens):
        if token:
            raise ValueError("pass token= or a Tokens table, not both")
        return tokens
    grants: dict[str, Grant] = dict(tokens or {})
    if token:
        if token in grants:
            raise ValueError("token= repeats the secret of a named token")
        grants[token] = Grant("token")
    return Tokens(grants)


def _remote_session(limits: Limits) -> SessionContext:
    """The server's session: remote queries share a fair memory pool and never spill to disk
    (the live engine's queries included)."""
    return SessionContext(memory_limit=limits.query_memory)


def _client(context: Any) -> str:
    """Who holds a stream slot: the token's name on one connection (the peer's address)."""
    return f"{caller(context).name}@{context.peer()}"


def _audit(context: Any, action: str) -> contextlib.AbstractContextManager[AuditRecord]:
    return audited(str(context.peer()), caller(context).name, action)


def _table_named(body: dict[str, Any]) -> str | None:
    for key in ("name", "table", "topic"):
        if isinstance(body.get(key), str):
            return str(body[key])
    return None


@contextlib.contextmanager
def _wire_errors() -> Iterator[None]:
    """Errors of a call as Flight errors that carry their pushtable class to the client."""
    try:
        yield
    except (flight.FlightError, GeneratorExit):
        raise
    except (PermissionDeniedError, StatementRefusedError) as exc:
        raise flight.FlightUnauthorizedError(protocol.error_text(exc)) from exc
    except KeyError as exc:
        if isinstance(exc, PushTableError):
            raise protocol.server_error(exc) from exc
        raise protocol.server_error(ValueError(f"the request lacks the field {exc}")) from exc
    except (PushTableError, ValueError, TypeError, pa.ArrowInvalid) as exc:
        raise protocol.server_error(exc) from exc
    except OSError as exc:  # pyarrow's IPC reader: the client sent malformed Arrow data
        raise protocol.server_error(
            errors.InvalidBatchError(f"malformed Arrow IPC data: {exc}")
        ) from exc
    except Exception as exc:  # a bug of ours: logged here, named (never a traceback) there
        log.exception("pushtable serve: unexpected error in a call")
        raise protocol.server_error(
            errors.RemoteError(f"internal server error: {type(exc).__name__}: {exc}")
        ) from exc


class _Share:
    """One task attempt's staged batches, counted against the staging limits until released."""

    def __init__(self, key: tuple[str, str], usage: Usage) -> None:
        self._key = key
        self._usage = usage
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self._bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        nbytes = batch.get_total_buffer_size()
        self._usage.stage(self._key, nbytes)  # raises ResourceLimitError over a limit
        self._bytes += nbytes
        self.rows += batch.num_rows
        self.batches.append(batch)

    def release(self) -> None:
        self._usage.unstage(self._key, self._bytes)
        self._bytes = 0
        self.batches = []


def _query_error(exc: BaseException) -> BaseException:
    """A query's error as the pushtable class it stands for, when it is one."""
    if isinstance(exc, errors.PushTableError):
        return exc
    public = errors.query_error(exc)
    return public if public is not None else errors.RemoteError(str(exc))


def serve(
    host: str = "127.0.0.1",
    port: int = 8815,
    *,
    token: str | None = None,
    tls: tuple[str | Path, str | Path] | None = None,
    config: str | Path | None = None,
    block: bool = True,
    say: Any = print,
) -> Server:
    """Start a server on ``host:port`` (127.0.0.1 by default: not reachable from other machines).

    With ``block=True`` (the command) it serves until Ctrl-C or SIGTERM, then stops cleanly;
    with ``block=False`` it returns the running :class:`Server` (call ``stop()``).
    """
    scheme = "grpc+tls" if tls else "grpc"
    location = f"{scheme}://{host}:{port}"
    if config is not None:
        server = Server.from_config(config, location, token=token, tls=tls)
    else:
        server = Server(location, token=token, tls=tls)
    names = [g.name for g in _grants(server.tokens).values()]
    auth = f"bearer tokens required: {', '.join(names)}" if names else "no auth"
    say(f"pushtable serve: listening on {server.location} ({auth})")
    if not block:
        return server
    import signal

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.2):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        say("pushtable serve: stopping")
        left = server.stop()
        say(
            f"pushtable serve: stopped ({left} idle stream(s) abandoned)"
            if left
            else "pushtable serve: stopped"
        )
    return server
