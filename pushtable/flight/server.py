"""``pushtable serve``: streaming tables and topics behind Arrow Flight.

Remote producers push with DoPut (:mod:`pushtable.flight.ingest`): the server writes each batch
into the table's sink while the client waits for room, so backpressure reaches the client (gRPC
flow control plus the client's window of unacknowledged batches). Remote SQL runs with DoGet
(:mod:`pushtable.flight.query`) and streams batches as the query produces them. Who may do what:
:mod:`pushtable.flight.auth`; what remote clients may use: :mod:`pushtable.flight.limits`. This
module holds the tables, the actions and the server's lifecycle. Wire conventions:
:mod:`pushtable.flight.protocol`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors, metrics
from pushtable.context import SessionContext
from pushtable.errors import (
    PermissionDeniedError,
    ResourceLimitError,
    ServerStoppedError,
    UnknownTableError,
)
from pushtable.flight import actions, protocol, sql
from pushtable.flight.auth import BearerAuth, Grant, Tokens, caller
from pushtable.flight.calls import POLL_S, audit, client_of, table_named, wire_errors
from pushtable.flight.ingest import Ingest, _Acks, _Share
from pushtable.flight.limits import DataBudget, Limits, Usage
from pushtable.flight.query import Queries
from pushtable.sink import TableSink
from pushtable.topic import Topic

__all__ = ["Server", "serve"]

log = logging.getLogger(__name__)

#: a durable topic's name, which is also its dataset's file name under the data dir
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _tls_pairs(tls: tuple[str | Path, str | Path] | None) -> list[Any] | None:
    if tls is None:
        return None
    cert, key = (Path(p).read_bytes() for p in tls)
    return [flight.CertKeyPair(cert=cert, key=key)]


class Server(Ingest, Queries, flight.FlightServerBase):  # type: ignore[misc]
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
        data_dir: str | Path | None = None,
        fsync: bool = True,
    ) -> None:
        self.limits = limits if limits is not None else Limits()
        #: whether durable topics sync each commit to disk before acknowledging it
        self.fsync = fsync
        self.usage = Usage(self.limits)
        self._tables: dict[str, TableSink | Topic] = {}
        #: where durable topics are stored (``DIR/<name>.lance``); None: no durable topics
        self.data_dir = None if data_dir is None else Path(data_dir)
        self._budget: DataBudget | None = None
        if self.data_dir is not None:  # every durable topic is back before calls arrive
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._budget = DataBudget(self.data_dir, self.limits.max_data_bytes, self.usage)
            for path in sorted(self.data_dir.glob("*.lance")):
                self._tables[path.stem] = self._budgeted(Topic.reopen(path, fsync=fsync))
        if tls is not None and location.startswith("grpc://"):
            location = "grpc+tls://" + location.removeprefix("grpc://")
        self.tokens = _tokens(token, tokens)
        middleware = {"auth": BearerAuth(self.tokens)} if len(self.tokens) else {}
        super().__init__(location, middleware=middleware, tls_certificates=_tls_pairs(tls))
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0]
        self.location = f"{scheme}://{host}:{self.port}"
        #: The operator's session (full power from Python); remote SQL runs queries only, in
        #: its memory pool when the server made it.
        self.ctx = ctx if ctx is not None else _remote_session(self.limits)
        self._staged: dict[tuple[str, str, int], dict[tuple[int, int], _Share]] = {}
        self._published: dict[tuple[str, str], int] = {}
        self._publishing: set[tuple[str, str]] = set()
        #: staged shares never written: task attempts Spark did not keep, replayed epochs
        self.dropped_shares = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acks: set[_Acks] = set()  # the open DoPut streams
        self._calls = 0  # DoPut and DoGet calls under way
        self._calls_changed = threading.Condition()
        threading.Thread(target=self._end_idle_streams, name="pushtable-idle", daemon=True).start()
        metrics.track(self)
        #: where ``serve(metrics_port=...)`` serves Prometheus metrics (None: not served)
        self.metrics_url: str | None = None
        #: where ``serve(ui_port=...)`` serves the browser view (None: not served)
        self.ui_url: str | None = None
        self._http_stops: list[Callable[[], None]] = []  # HTTP servers beside this one

    @contextlib.contextmanager
    def _call(self, context: Any) -> Iterator[None]:
        """Count a streaming call (so ``stop()`` can let it deliver its error first), in one
        of its client's stream slots."""
        with self.usage.stream(client_of(context)):
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
        durable: bool = False,
        if_not_exists: bool = False,
        **options: Any,
    ) -> TableSink | Topic:
        """Declare a streaming table (or, with ``topic=True``, a topic) named ``name``;
        ``durable=True`` stores a topic in ``data_dir/<name>.lance``."""
        with self._lock:
            existing = self._tables.get(name)
            if existing is not None:
                if if_not_exists and existing.schema.equals(schema):
                    return existing
                raise ValueError(f"a table named {name!r} already exists on this server")
            if durable:
                producer: TableSink | Topic = self._durable_topic(name, schema, options)
            elif topic:
                producer = Topic(name, schema, **options)
            else:
                producer = self.ctx.register_streaming_table(name, schema, **options)
            self._tables[name] = producer
            return producer

    def _durable_topic(self, name: str, schema: pa.Schema, options: dict[str, Any]) -> Topic:
        if self.data_dir is None or self._budget is None:
            raise ValueError(
                "durable topics need a data dir: start the server with --data-dir DIR "
                "(Server(..., data_dir=DIR))"
            )
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(
                f"a durable topic's name is its dataset's file name: letters, digits, '_', "
                f"'-' and '.', not starting with '.' or '-'; got {name!r}"
            )
        if (us := options.pop("retention_us", None)) is not None:
            options["retention"] = timedelta(microseconds=int(us))
        path = self.data_dir / f"{name}.lance"
        return self._budgeted(Topic(name, schema, persist=path, fsync=self.fsync, **options))

    def _budgeted(self, topic: Topic) -> Topic:
        """``topic``'s writes and upkeep held to the data dir's ``max_data_bytes``."""
        assert topic.durable is not None
        assert self._budget is not None
        topic.durable.reserve = self._budget.reserve
        topic.durable.room = self._budget.room
        return topic

    @classmethod
    def from_config(
        cls, path: str | Path, location: str = "grpc://127.0.0.1:0", **kw: Any
    ) -> Server:
        """A server set up by a JSON config file: its ``tokens``, ``limits``, ``tables`` and
        ``topics`` (see docs/network.md, "Security"). ``kw`` goes to the constructor."""
        config = _read_config(path)
        tokens = Tokens.from_config(config.get("tokens", []))
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
                if "schema" not in spec or "name" not in spec:
                    raise ValueError(f"each of {kind!r} needs a 'name' and a 'schema': {spec}")
                schema = pa.schema(
                    [(n, pa.type_for_alias(t)) for n, t in spec.pop("schema").items()]
                )
                if spec.get("durable"):  # a restart found it in the data dir already
                    spec.setdefault("if_not_exists", True)
                if (seconds := spec.pop("retention_seconds", None)) is not None:
                    spec["retention"] = timedelta(seconds=seconds)
                self.create_table(spec.pop("name"), schema, topic=is_topic, **spec)

    def _durable(self, name: str) -> Topic:
        topic = self._table(name)
        if not isinstance(topic, Topic) or topic.durable is None:
            raise ValueError(f"'{name}' is not a durable topic (create_topic(..., durable=True))")
        return topic

    def _table(self, name: str) -> TableSink | Topic:
        with self._lock:
            producer = self._tables.get(name)
        if producer is None:
            raise UnknownTableError(f"no table named {name!r} on this server")
        return producer

    # -- actions ------------------------------------------------------------------------

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        with wire_errors(), audit(context, "list_actions"):
            return [(name, a.does) for name, a in actions.ACTIONS.items()]

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        with wire_errors(), audit(context, str(action.type)) as record:
            if action.type in sql.ACTIONS:
                result = self._sql_action(context, action)
            else:
                try:
                    body = json.loads(action.body.to_pybytes() or b"{}")
                except ValueError:
                    raise ValueError(f"the body of action {action.type!r} is not JSON") from None
                if not isinstance(body, dict):
                    raise ValueError(f"the body of action {action.type!r} is not a JSON object")
                record.table = table_named(body)
                result = json.dumps(self._act(caller(context), action.type, body)).encode()
        if result is not None:
            yield result

    def _act(self, grant: Grant, kind: str, body: dict[str, Any]) -> Any:
        """Action ``kind``: its request checked (:mod:`pushtable.flight.actions`), its role
        required on the tables it touches, then its handler."""
        req = actions.request(kind, body)
        action = actions.ACTIONS[kind]
        grant.require(action.role, action.does, req.tables)
        return _HANDLERS[kind](self, req, grant)

    def _create_table(self, req: actions.NewTable, grant: Grant) -> Any:
        body = dict(req.options)
        for key in ("persist", "upkeep_interval", "fsync"):
            if key in body:
                raise PermissionDeniedError(
                    f"a remote client cannot set {key!r}: the server places durable topics "
                    "under its data dir (create_topic(..., durable=True))"
                )
        schema = protocol.schema_from(req.schema)
        if (us := body.pop("max_delay_us", None)) is not None:
            body["max_delay"] = timedelta(microseconds=int(us))
        with self._lock:
            count = len(self._tables)
        try:
            options = self.limits.check_table_options(count, body)
        except ResourceLimitError:
            self.usage.refused("table_options")
            raise
        self.create_table(req.name, schema, **options)
        return {}

    def _subscribe(self, req: actions.Subscribe, grant: Grant) -> Any:
        topic = self._table(req.topic)
        if not isinstance(topic, Topic):
            raise ValueError(f"{topic.name!r} is a streaming table, not a topic")
        try:
            options = self.limits.check_queue_options(dict(req.options))
        except ResourceLimitError:
            self.usage.refused("table_options")
            raise
        options["start"] = protocol.start_value(options.get("start", "now"))
        topic.subscribe(self.ctx, options.pop("name"), **options)
        return {}

    def _offsets(self, req: actions.Named, grant: Grant) -> Any:
        return self._durable(req.name).offsets()

    def _consumed(self, req: actions.Consumed, grant: Grant) -> Any:
        self._durable(req.name).consumed(req.consumer, req.offset)
        return {}

    def _producer(self, req: actions.Producer, grant: Grant) -> Any:
        log = self._durable(req.name).durable
        assert log is not None
        return {"sequence": log.last_sequence(req.producer_id)}

    def _close(self, req: actions.Named, grant: Grant) -> Any:
        self._table(req.name).close()
        return {}

    def _fail(self, req: actions.Fail, grant: Grant) -> Any:
        self._table(req.name).fail(errors.RemoteError(req.message, remote_type=req.type))
        return {}

    def _stats(self, req: actions.Named, grant: Grant) -> Any:
        return asdict(self._table(req.name).stats)

    def _tables_of(self, req: actions.Listing, grant: Grant) -> Any:
        out = []
        with self._lock:
            for n, p in self._tables.items():
                if grant.covers(n):
                    report = p.metrics_report()
                    out.append(
                        {
                            "name": n,
                            "topic": isinstance(p, Topic),
                            "durable": isinstance(p, Topic) and p.durable is not None,
                            "schema": protocol.schema_bytes(p.schema),
                            "bound_batches": report.bound_batches,  # for a queue's fill
                            "bound_bytes": report.bound_bytes,
                        }
                    )
        return out

    def _published_epoch_of(self, req: actions.Epochs, grant: Grant) -> Any:
        return {"epoch": self.published_epoch(req.table, req.query)}

    # -- lifecycle ----------------------------------------------------------------------

    def metrics_report(self) -> metrics.ServerReport:
        """What the Prometheus metrics read of this server when scraped."""
        return metrics.ServerReport(str(self.location), *self.usage.snapshot())

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
        for stop_http in self._http_stops:
            stop_http()
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


#: Each action's handler (the action table, its roles and requests: pushtable.flight.actions).
_HANDLERS: dict[str, Callable[[Server, Any, Grant], Any]] = {
    "create_table": Server._create_table,
    "subscribe": Server._subscribe,
    "close": Server._close,
    "fail": Server._fail,
    "stats": Server._stats,
    "tables": Server._tables_of,
    "publish": lambda server, req, grant: server._publish(req),
    "published": Server._published_epoch_of,
    "offsets": Server._offsets,
    "producer": Server._producer,
    "consumed": Server._consumed,
    "discard": lambda server, req, grant: server._discard(req),
}
assert _HANDLERS.keys() == actions.ACTIONS.keys(), "an action without a handler, or the reverse"


def _read_config(path: str | Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config file is a JSON object")
    unknown = sorted(set(config) - {"tokens", "limits", "tables", "topics"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: tokens, limits, tables, topics")
    return config


def _tokens(token: str | None, tokens: Mapping[str, Grant] | Tokens | None) -> Tokens:
    """``--token`` (every role) and the named, scoped tokens, as one table."""
    table = tokens if isinstance(tokens, Tokens) else Tokens(dict(tokens or {}))
    return table.with_token(token, Grant("token")) if token else table


def _remote_session(limits: Limits) -> SessionContext:
    """The server's session: remote queries share a fair memory pool and never spill to disk
    (the live engine's queries included)."""
    return SessionContext(memory_limit=limits.query_memory)


def serve(
    host: str = "127.0.0.1",
    port: int = 8815,
    *,
    token: str | None = None,
    tls: tuple[str | Path, str | Path] | None = None,
    config: str | Path | None = None,
    metrics_port: int | None = None,
    ui_port: int | None = None,
    data_dir: str | Path | None = None,
    fsync: bool = True,
    block: bool = True,
    say: Any = print,
) -> Server:
    """Start a server on ``host:port`` (127.0.0.1 by default: not reachable from other machines).

    ``metrics_port`` serves Prometheus metrics; ``ui_port`` serves the browser view (tables,
    rates, a live query; see :mod:`pushtable.flight.ui`) and ``/metrics`` too. ``data_dir``
    holds durable topics; a server started on it again reopens each of them; with ``fsync``
    (default) their acknowledgements wait until each commit is synced to disk.
    With ``block=True`` (the command) it serves until Ctrl-C or SIGTERM, then stops cleanly;
    with ``block=False`` it returns the running :class:`Server` (call ``stop()``).
    """
    scheme = "grpc+tls" if tls else "grpc"
    location = f"{scheme}://{host}:{port}"
    if config is not None:
        server = Server.from_config(
            config, location, token=token, tls=tls, data_dir=data_dir, fsync=fsync
        )
    else:
        server = Server(location, token=token, tls=tls, data_dir=data_dir, fsync=fsync)
    names = server.tokens.names
    auth = f"bearer tokens required: {', '.join(names)}" if names else "no auth"
    say(f"pushtable serve: listening on {server.location} ({auth})")
    if server.data_dir is not None:
        durable = [n for n, t in server._tables.items() if isinstance(t, Topic) and t.durable]
        synced = "fsync on" if fsync else "fsync OFF: an OS crash may lose acknowledged batches"
        say(
            f"pushtable serve: data dir {server.data_dir} ({len(durable)} durable topic(s), "
            f"{synced})"
        )
    if metrics_port is not None:
        import prometheus_client

        http, _ = prometheus_client.start_http_server(
            metrics_port, addr=host, registry=metrics.REGISTRY
        )
        server.metrics_url = f"http://{host}:{http.server_port}/metrics"
        server._http_stops.append(http.shutdown)
        say(f"pushtable serve: metrics on {server.metrics_url}")
    if ui_port is not None:
        from pushtable.flight.ui import UiApp, UiServer

        ui = UiServer(host, ui_port, UiApp(server.location, tls_root_certs=tls[0] if tls else None))
        server.ui_url = ui.url
        server._http_stops.append(ui.stop)
        say(f"pushtable serve: browser view on {server.ui_url}")
    if block:
        run_until_stopped(server, say)
    return server


def run_until_stopped(server: Server, say: Any = print) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop ``server`` cleanly (what the command does)."""
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
