"""``pushtable serve``: streaming tables and topics behind Arrow Flight.

Remote producers push with DoPut; the server writes each batch into the table's sink while the
client waits for room, so backpressure reaches the client (gRPC flow control plus the client's
window of unacknowledged batches). Remote SQL runs with DoGet and streams batches as the query
produces them. Wire conventions: :mod:`pushtable.flight.protocol`.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors
from pushtable.context import SessionContext
from pushtable.errors import (
    PushTableError,
    ServerStoppedError,
    UnknownTableError,
    WriteTimeoutError,
)
from pushtable.flight import protocol, sql
from pushtable.sink import TableSink
from pushtable.topic import Topic

__all__ = ["Server", "serve"]

log = logging.getLogger(__name__)

#: How often a blocked handler looks whether its client went away or the server is stopping.
POLL_S = 0.25


class _BearerAuth(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses every call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        for key, values in headers.items():
            if key.lower() != protocol.AUTH_HEADER:
                continue
            for value in values:
                raw = value if isinstance(value, bytes) else str(value).encode()
                if hmac.compare_digest(raw, self._expected):
                    return None
        raise flight.FlightUnauthenticatedError("pushtable: missing or invalid bearer token")


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
        tls: tuple[str | Path, str | Path] | None = None,
        ctx: SessionContext | None = None,
    ) -> None:
        if tls is not None and location.startswith("grpc://"):
            location = "grpc+tls://" + location.removeprefix("grpc://")
        middleware = {"auth": _BearerAuth(token)} if token else {}
        super().__init__(location, middleware=middleware, tls_certificates=_tls_pairs(tls))
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0]
        self.location = f"{scheme}://{host}:{self.port}"
        self.ctx = ctx if ctx is not None else SessionContext()
        self._tables: dict[str, TableSink | Topic] = {}
        self._staged: dict[tuple[str, str, int], dict[tuple[int, int], list[pa.RecordBatch]]] = {}
        self._published: dict[tuple[str, str], int] = {}
        #: staged shares never written: task attempts Spark did not keep, replayed epochs
        self.dropped_shares = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acks: set[_Acks] = set()  # the open DoPut streams
        self._calls = 0  # DoPut and DoGet calls under way
        self._calls_changed = threading.Condition()

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Count a streaming call, so ``stop()`` can let it deliver its error first."""
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

    def load_config(self, path: str | Path) -> None:
        """Declare the tables of a JSON config file (see docs/network.md)."""
        config = json.loads(Path(path).read_text())
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

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        acks = _Acks(writer)
        with self._lock:
            self._acks.add(acks)
        try:
            with self._call():
                self._do_put(context, descriptor, reader, acks)
        finally:
            acks.close()  # before the call ends: no stop notice may touch a finished call
            with self._lock:
                self._acks.discard(acks)

    def _do_put(self, context: Any, descriptor: Any, reader: Any, writer: _Acks) -> None:
        try:
            path = [p.decode() for p in descriptor.path]
            if len(path) == 6 and path[1] == protocol.STAGE:
                self._stage(context, path, reader, writer)
                return
            if len(path) != 1:
                raise ValueError(f"unexpected DoPut path {path!r}")
            producer = self._table(path[0])
            for count, (batch, metadata) in enumerate(protocol.chunks(reader.read_chunk), 1):
                if (watermark := protocol.advance_value(metadata)) is not None:
                    producer.advance(watermark)
                else:
                    self._write(context, producer, batch)
                writer.send(count)
        except (PushTableError, ValueError, TypeError, pa.ArrowException) as exc:
            raise protocol.server_error(exc) from exc

    def _write(self, context: Any, producer: TableSink | Topic, batch: pa.RecordBatch) -> None:
        """Write, waiting for room without end, unless the client left or the server stops."""
        while True:
            try:
                producer.write(batch, timeout=POLL_S)
                return
            except WriteTimeoutError:
                if context.is_cancelled() or self._stopping.is_set():
                    raise

    def _stage(self, context: Any, path: list[str], reader: Any, writer: _Acks) -> None:
        """Hold one Spark task attempt's batches until its epoch is published."""
        table, _, query, epoch, partition, attempt = path
        producer = self._table(table)
        batches: list[pa.RecordBatch] = []
        for batch in protocol.batches(reader.read_chunk):
            protocol.check_batch_schema(table, producer.schema, batch.schema)
            batches.append(batch)
            writer.send(len(batches))
        with self._lock:
            stage = self._staged.setdefault((table, query, int(epoch)), {})
            stage[(int(partition), int(attempt))] = batches

    # -- DoGet: remote SQL --------------------------------------------------------------

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        """Flight SQL statement queries (:mod:`pushtable.flight.sql`): plan, then one ticket."""
        if descriptor.descriptor_type != flight.DescriptorType.CMD:
            raise NotImplementedError(
                "pushtable serve answers GetFlightInfo for Flight SQL statement queries only"
            )
        try:
            query = sql.statement_query(descriptor.command)
        except ValueError as exc:
            raise protocol.server_error(exc) from exc
        if query is None:
            kind = sql.command(descriptor.command)[0].rsplit(".", 1)[-1]
            raise NotImplementedError(
                f"pushtable serve implements the Flight SQL statement query only; {kind} is "
                "not implemented (see docs/network.md)"
            )
        try:
            schema = self.ctx.sql(query).schema()
        except Exception as exc:
            raise protocol.server_error(_query_error(exc)) from exc
        ticket = flight.Ticket(json.dumps({"sql": query}).encode())
        return flight.FlightInfo(schema, descriptor, [flight.FlightEndpoint(ticket, [])], -1, -1)

    def do_get(self, context: Any, ticket: Any) -> Any:
        try:
            request = json.loads(ticket.ticket)
            df = self.ctx.sql(request["sql"])
            schema = df.schema()
            stream = df.execute_stream()
        except Exception as exc:
            raise protocol.server_error(_query_error(exc)) from exc
        return flight.GeneratorStream(schema, self._results(context, stream))

    def _results(self, context: Any, stream: Any) -> Iterator[pa.RecordBatch]:
        """Batches as the query yields them. A worker thread pulls from the query; this
        generator forwards them and notices a client that left (or a stopping server)."""
        with self._call():
            yield from self._forward(context, stream)

    def _forward(self, context: Any, stream: Any) -> Iterator[pa.RecordBatch]:
        handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
        gone = threading.Event()
        done = object()

        def pull() -> None:
            nonlocal stream
            try:
                for batch in stream:
                    item = batch.to_pyarrow()
                    while not gone.is_set():
                        try:
                            handoff.put(item, timeout=POLL_S)
                            break
                        except queue.Full:
                            continue
                    if gone.is_set():
                        return
                handoff.put(done)
            except Exception as exc:  # noqa: BLE001 - any failure goes to the reader
                handoff.put(exc)
            finally:
                stream = None  # drop the query: its tables' producers learn the reader left

        threading.Thread(target=pull, name="pushtable-sql", daemon=True).start()
        try:
            while True:
                try:
                    item = handoff.get(timeout=POLL_S)
                except queue.Empty:
                    if context.is_cancelled():
                        return
                    continue
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise protocol.server_error(_query_error(item))
                yield item
        finally:
            gone.set()

    # -- actions ------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(name, "see pushtable.flight.protocol") for name in protocol.ACTIONS]

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        if action.type in sql.ACTIONS:
            yield from self._sql_action(action)
            return
        try:
            body = json.loads(action.body.to_pybytes() or b"{}")
            result = self._act(action.type, body)
        except (PushTableError, ValueError, TypeError, KeyError, pa.ArrowException) as exc:
            raise protocol.server_error(exc) from exc
        yield json.dumps(result).encode()

    def _sql_action(self, action: Any) -> Iterator[bytes]:
        """Flight SQL prepared statements (stateless: the handle is the query text)."""
        if action.type == "ClosePreparedStatement":
            return
        try:
            result = sql.prepared(action.body.to_pybytes(), lambda q: self.ctx.sql(q).schema())
        except ValueError as exc:
            raise protocol.server_error(exc) from exc
        except Exception as exc:
            raise protocol.server_error(_query_error(exc)) from exc
        yield result

    def _act(self, kind: str, body: dict[str, Any]) -> Any:
        if kind == "create_table":
            schema = protocol.schema_from(body.pop("schema"))
            if (us := body.pop("max_delay_us", None)) is not None:
                body["max_delay"] = timedelta(microseconds=int(us))
            self.create_table(body.pop("name"), schema, **body)
            return {}
        if kind == "subscribe":
            topic = self._table(body.pop("topic"))
            if not isinstance(topic, Topic):
                raise ValueError(f"{topic.name!r} is a streaming table, not a topic")
            topic.subscribe(self.ctx, body.pop("name"), **body)
            return {}
        if kind == "close":
            self._table(body["name"]).close()
            return {}
        if kind == "fail":
            error = errors.RemoteError(str(body["message"]), remote_type=str(body["type"]))
            self._table(body["name"]).fail(error)
            return {}
        if kind == "stats":
            return asdict(self._table(body["name"]).stats)
        if kind == "tables":
            with self._lock:
                return [
                    {
                        "name": n,
                        "topic": isinstance(p, Topic),
                        "schema": protocol.schema_bytes(p.schema),
                    }
                    for n, p in self._tables.items()
                ]
        if kind == "publish":
            return self._publish(body)
        if kind == "published":
            with self._lock:
                return {"epoch": self._published.get((body["table"], body["query"]), -1)}
        raise ValueError(f"unknown action {kind!r}; expected one of {', '.join(protocol.ACTIONS)}")

    def _publish(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write an epoch's staged batches (the attempts the driver names) once.

        Shares of other attempts (failed or speculative tasks) and of older epochs are
        dropped. If the table refuses a batch midway, the table is failed with that error:
        its reader learns the epoch is incomplete instead of silently missing rows.
        """
        table, query, epoch = body["table"], body["query"], int(body["epoch"])
        producer = self._table(table)
        named = {(int(p[0]), int(p[1])) for p in body["parts"]}
        with self._lock:
            stage = self._staged.pop((table, query, epoch), {})
            dropped = [k for k in self._staged if k[:2] == (table, query) and k[2] < epoch]
            self.dropped_shares += sum(len(self._staged.pop(k)) for k in dropped)
            newest = self._published.get((table, query), -1)
            if epoch <= newest:
                self.dropped_shares += len(stage)
                return {"published": False, "reason": f"epoch {epoch} was published already"}
            self._published[(table, query)] = epoch
            # Shares of attempts Spark did not keep (failed, speculative): never written.
            self.dropped_shares += len(stage.keys() - named)
        missing = [p for p in named if p not in stage]
        written = 0
        try:
            for partition, attempt in sorted(named):
                for batch in stage.get((partition, attempt), []):
                    producer.write(batch)
                    written += 1
        except PushTableError as exc:
            if not isinstance(exc, (errors.SinkClosedError, errors.ReaderGoneError)):
                producer.fail(exc)
            raise
        return {"published": True, "batches": written, "parts_without_data": len(missing)}

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
    """A DoPut stream's metadata side: acknowledgements, and the stop notice sent to it
    from another thread (one writer at a time, as gRPC requires)."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._closed = False

    def send(self, count: int) -> None:
        with self._lock:
            self._writer.write(protocol.ack(count))

    def stopping(self) -> None:
        with self._lock, contextlib.suppress(flight.FlightError, pa.ArrowException, OSError):
            if not self._closed:  # the handler has not returned: the call is alive
                self._writer.write(protocol.STOPPING)

    def close(self) -> None:
        with self._lock:
            self._closed = True


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
    server = Server(f"{scheme}://{host}:{port}", token=token, tls=tls)
    if config is not None:
        server.load_config(config)
    auth = "bearer token required" if token else "no auth"
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
