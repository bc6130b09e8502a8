"""``pushtable serve``: streaming tables and topics behind Arrow Flight.

Remote producers push with DoPut (:mod:`pushtable.flight.server.ingest`): the server writes each
batch into the table's sink while the client waits for room, so backpressure reaches the client
(gRPC flow control plus the client's window of unacknowledged batches). Remote SQL runs with DoGet
(:mod:`pushtable.flight.server.query`) and streams batches as the query produces them. Who may do
what: :mod:`pushtable.flight.server.auth`; what remote clients may use:
:mod:`pushtable.flight.server.limits`. This module holds the tables, the actions and the server's
lifecycle. Wire conventions: :mod:`pushtable.flight.protocol`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import lance_commits, metrics
from pushtable.context import SessionContext
from pushtable.durable.fence import Fence
from pushtable.errors import DataDirInUseError, ServerStoppedError, UnsupportedCallError
from pushtable.flight.server import actions, sql
from pushtable.flight.server.auth import BearerAuth, Grant, Tokens, caller
from pushtable.flight.server.calls import (
    OPENING,
    POLL_S,
    Calls,
    Opening,
    audit,
    table_named,
    wire_errors,
)
from pushtable.flight.server.data_dir import DataDir
from pushtable.flight.server.ingest import Ingest
from pushtable.flight.server.lease import Lease
from pushtable.flight.server.limits import Limits, Usage
from pushtable.flight.server.query import Queries
from pushtable.flight.server.staging import Staging
from pushtable.flight.server.tables import Tables
from pushtable.sink import TableSink
from pushtable.topic import Topic

__all__ = ["Server", "serve"]

log = logging.getLogger(__name__)

#: An action's handler: its checked request and the caller's grant, to a JSON-able answer.
Handler = Callable[[Any, Grant], Any]


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

    The server is assembled from parts, each owning its state: the tables
    (:mod:`~pushtable.flight.server.tables`), DoPut (:mod:`~pushtable.flight.server.ingest`),
    Spark's staged epochs (:mod:`~pushtable.flight.server.staging`) and remote SQL
    (:mod:`~pushtable.flight.server.query`). This class routes Flight's calls to them and answers
    actions through one table: each action's role and request
    (:data:`pushtable.flight.server.actions.ACTIONS`) and its handler here.

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
        storage_options: dict[str, str] | None = None,
    ) -> None:
        self.limits = limits if limits is not None else Limits()
        #: whether durable topics sync each commit to disk before acknowledging it
        self.fsync = fsync
        self.usage = Usage(self.limits)
        #: where durable topics are stored (``<root>/<name>.lance``: a local directory or an
        #: object store prefix, reached with ``storage_options``); None: no durable topics
        self.data_dir = None if data_dir is None else DataDir(data_dir, storage_options)
        #: The operator's session (full power from Python); remote SQL runs queries only, in
        #: its memory pool when the server made it.
        self.ctx = ctx if ctx is not None else _remote_session(self.limits)
        #: one server at a time serves a data dir (see :mod:`.lease`)
        self._lease: Lease | None = None
        self._losing = threading.Lock()
        self._lost = False  # the data dir was lost (its topics failed, once)
        if self.data_dir is not None:
            # unique per server (two in one process are two owners), readable by a person
            owner = (
                f"pushtable serve (pid {os.getpid()} on {socket.gethostname()}, "
                f"{uuid.uuid4().hex[:8]})"
            )
            self._lease = Lease(self.data_dir, owner, on_lost=self._lost_data_dir)
            self._lease.acquire()  # DataDirInUseError: another server serves it
        try:
            self._start(location, tls, token, tokens, fsync)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise

    def _start(
        self,
        location: str,
        tls: tuple[str | Path, str | Path] | None,
        token: str | None,
        tokens: Mapping[str, Grant] | Tokens | None,
        fsync: bool,
    ) -> None:
        fence = None
        if (lease := self._lease) is not None:
            assert lease.epoch is not None
            fence = Fence(lease.epoch, lease.current, self._lost_data_dir, lease.held)
        self._tables = Tables(self.ctx, self.usage, self.data_dir, fsync, fence)
        if tls is not None and location.startswith("grpc://"):
            location = "grpc+tls://" + location.removeprefix("grpc://")
        self.tokens = _tokens(token, tokens)
        middleware: dict[str, flight.ServerMiddlewareFactory] = (
            {"auth": BearerAuth(self.tokens)} if len(self.tokens) else {}
        )
        self._opening = Opening(self.usage, self.tokens.name_of)
        middleware[OPENING] = self._opening  # after auth
        try:
            super().__init__(location, middleware=middleware, tls_certificates=_tls_pairs(tls))
        except pa.ArrowException as exc:  # gRPC says only "Server did not start properly"
            raise OSError(_unstarted(location, exc)) from exc
        scheme, _, rest = location.partition("://")
        host = rest.rsplit(":", 1)[0]
        self.location = f"{scheme}://{host}:{self.port}"
        self._calls = Calls(self.usage)
        self._staging = Staging(self._tables, self.usage, self._calls.stopping)
        self._ingest = Ingest(self._tables, self._staging, self._calls)
        self._queries = Queries(self.ctx, self._tables, self._calls)
        #: Each action's handler (their roles and requests: pushtable.flight.server.actions).
        self._handlers: dict[str, Handler] = {
            "create_table": self._tables.create_remote,
            "subscribe": self._tables.subscribe,
            "unsubscribe": self._tables.unsubscribe,
            "close": self._tables.close,
            "fail": self._tables.fail,
            "stats": self._tables.stats,
            "tables": self._tables.listing,
            "offsets": self._tables.offsets,
            "producer": self._tables.producer,
            "leave": lambda req, grant: {"left": self._opening.leave(grant.name, req.stream)},
            "consumed": self._tables.consumed,
            "publish": self._staging.publish,
            "published": self._staging.published,
            "discard": self._staging.discard,
        }
        assert self._handlers.keys() == actions.ACTIONS.keys(), "an action without a handler"
        metrics.track(self)
        #: where ``serve(metrics_port=...)`` serves Prometheus metrics (None: not served)
        self.metrics_url: str | None = None
        #: where ``serve(ui_port=...)`` serves the browser view (None: not served)
        self.ui_url: str | None = None
        self._http_stops: list[Callable[[], None]] = []  # HTTP servers beside this one

    # -- tables -------------------------------------------------------------------------

    def create_table(self, name: str, schema: pa.Schema, **options: Any) -> TableSink | Topic:
        """Declare a streaming table, a topic or a durable topic named ``name``.

        ``topic=True`` makes a topic; ``durable=True`` stores a topic in
        ``data_dir/<name>.lance``; ``if_not_exists=True`` returns the table of that name and
        schema when there is one. The other options are those of
        :meth:`pushtable.SessionContext.register_streaming_table` or :class:`pushtable.Topic`.
        """
        return self._tables.create(name, schema, **options)

    def table(self, name: str) -> TableSink | Topic:
        """The table or topic named ``name``, for the operator to write or read from Python.

        The operator writes or reads it from Python;
        :class:`~pushtable.UnknownTableError` when there is none.
        """
        return self._tables.get(name)

    @property
    def dropped_shares(self) -> int:
        """Staged Spark shares never written.

        Task attempts Spark did not keep, replayed or
        aborted epochs.
        """
        return self._staging.dropped_shares

    def published_epoch(self, table: str, query: str) -> int:
        """The newest epoch of Spark query ``query`` published into ``table`` (-1: none)."""
        return self._staging.published_epoch(table, query)

    @classmethod
    def from_config(
        cls, path: str | Path, location: str = "grpc://127.0.0.1:0", **kw: Any
    ) -> Server:
        """A server set up by a JSON config file.

        Its ``tokens``, ``limits``, ``tables`` and
        ``topics`` (see docs/network.md, "Security"). ``kw`` goes to the constructor.
        """
        config = _read_config(path)
        tokens = Tokens.from_config(config.get("tokens", []))
        limits = Limits.from_config(config.get("limits", {}))
        if "storage_options" not in kw:
            kw["storage_options"] = storage_options_of(config, path)
        server = cls(location, tokens=tokens, limits=limits, **kw)
        server._tables.declare(config)
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
        self._tables.declare(config)

    # -- Flight's calls -----------------------------------------------------------------

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        """A producer's stream, or Flight SQL's parameters for a prepared statement.

        A producer's stream (:mod:`~pushtable.flight.server.ingest`), or Flight SQL's parameters
        for a prepared statement (a command descriptor: :mod:`~pushtable.flight.server.query`).
        """
        if descriptor.descriptor_type == flight.DescriptorType.CMD:
            self._queries.sql_put(context, descriptor, reader, writer)
        else:
            self._ingest.do_put(context, descriptor, reader, writer)

    def do_get(self, context: Any, ticket: Any) -> Any:
        """A ticket's results: remote SQL, a catalog command or a durable topic's range."""
        return self._queries.do_get(context, ticket)

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        """A Flight SQL command described (its schema) with the ticket that runs it."""
        return self._queries.get_flight_info(context, descriptor)

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        """Every action the server answers, with what it does."""
        with wire_errors(), audit(context, "list_actions"):
            return [(name, a.does) for name, a in actions.ACTIONS.items()]

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        """An action (a JSON body, or a Flight SQL prepared-statement action) and its answer."""
        with wire_errors(), audit(context, str(action.type)) as record:
            if action.type in sql.ACTIONS:
                result = self._queries.sql_action(context, action)
            elif action.type in sql.REFUSED_ACTIONS:
                raise UnsupportedCallError(
                    f"pushtable serve does not implement the Flight SQL action {action.type} "
                    "(read-only SQL: no transactions or Substrait plans; a query is cancelled "
                    "by ending its DoGet; see docs/network.md)"
                )
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
        """Answer action ``kind``.

        Its request checked (:mod:`pushtable.flight.server.actions`), its role
        required on the tables it touches, then its handler.
        """
        req = actions.request(kind, body)
        action = actions.ACTIONS[kind]
        grant.require(action.role, action.does, req.tables)
        return self._handlers[kind](req, grant)

    # -- lifecycle ----------------------------------------------------------------------

    def metrics_report(self) -> metrics.ServerReport:
        """What the Prometheus metrics read of this server when scraped."""
        return metrics.ServerReport(str(self.location), *self.usage.snapshot())

    def _lost_data_dir(self, why: str) -> None:
        """Another server took the data dir's lease: fail this one's durable topics.

        They acknowledge nothing more; their producers and readers hear why.
        """
        with self._losing:
            if self._lost:
                return  # told by each topic its successor fenced: once is enough
            self._lost = True
        lost = DataDirInUseError(why)
        durable = [
            producer
            for _, producer in self._tables.all()
            if isinstance(producer, Topic) and producer.durable is not None
        ]
        for producer in durable:  # all at once: nothing pending is committed any more
            assert producer.durable is not None
            producer.durable.abandon(lost)
        for producer in durable:  # then each is failed (its threads joined)
            producer.fail(lost)

    def stop(self, timeout: float = 10.0) -> int:
        """Fail every table, let calls deliver their errors, then shut down. Idempotent.

        Blocked producers and reading queries end with an error within ``POLL_S``. A
        producer connected but idle keeps its stream until it writes again or disconnects;
        after ``timeout`` seconds the server is abandoned (it dies with the process) rather
        than waiting for it. Returns the number of calls still open then (0: a clean stop).
        """
        if self._calls.stopping.is_set():
            return 0
        self._calls.stopping.set()
        for stop_http in self._http_stops:
            stop_http()
        deadline = time.monotonic() + timeout  # one bound for the whole stop
        # every durable topic stores what is pending at once, within half the stop
        self._tables.fail_all(ServerStoppedError("the pushtable server stopped"), timeout / 2)
        self._ingest.stopping()  # an idle producer's client ends its stream on this notice
        # readers' errors reach them before gRPC cancels calls
        self._calls.wait_ended(min(timeout, 2 * POLL_S + 0.5))
        stopper = threading.Thread(target=self.shutdown, name="pushtable-stop", daemon=True)
        stopper.start()
        stopper.join(max(0.0, deadline - time.monotonic()))
        self._ingest.join(max(0.0, deadline - time.monotonic()))
        if self._lease is not None:  # its topics are failed: another server may serve them
            # within the stop's bound (the store may be away: then the lease lapses instead)
            releasing = threading.Thread(
                target=self._lease.release, name="pushtable-release", daemon=True
            )
            releasing.start()
            releasing.join(max(0.0, deadline - time.monotonic()))
        if stopper.is_alive():
            open_calls = self._calls.count
            log.warning("pushtable server stopped with %d call(s) still open", open_calls)
            # pyarrow would wait for them again at interpreter exit; let the process end.
            for finalizer in _exit_shutdowns(self):
                finalizer.detach()
            return max(open_calls, 1)
        return 0


def _exit_shutdowns(server: flight.FlightServerBase) -> list[weakref.finalize[Any, Any]]:
    """The ``weakref.finalize`` hooks pyarrow registered to shut ``server`` down at exit.

    pyarrow 26 keeps no handle on it: its hook (gRPC's ``Shutdown`` with no deadline) is found
    among the process's finalizers by its referent. Left in place after a stop abandoned a
    call, it waits at interpreter exit for that call forever: a client that opened a DoGet
    and stopped reading kept ``pushtable serve`` alive after SIGTERM.
    """
    registry = getattr(weakref.finalize, "_registry", {})
    found = []
    for finalizer in list(registry):
        held = finalizer.peek()
        if held is not None and held[0] is server:
            found.append(finalizer)
    return found


def _read_config(path: str | Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config file is a JSON object")
    known = ("tokens", "limits", "tables", "topics", "storage_options", "storage_options_env")
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {', '.join(known)}")
    return config


def storage_options_of(config: dict[str, Any], path: str | Path) -> dict[str, str] | None:
    """The data dir's storage options of a config file.

    ``storage_options`` holds values as Lance takes them, ``storage_options_env`` the
    variables options are read from (a secret stays out of the file). Never printed: a
    refusal names keys only.
    """
    options: dict[str, str] = {}
    given = config.get("storage_options", {})
    from_env = config.get("storage_options_env", {})
    for key, what in (("storage_options", given), ("storage_options_env", from_env)):
        if not isinstance(what, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in what.items()
        ):
            raise ValueError(f"{path}: {key} is an object of strings")
    options.update(given)
    for option, variable in from_env.items():
        value = os.environ.get(variable)
        if value is None:
            raise ValueError(
                f"{path}: storage option {option!r} reads ${variable}, which is not set"
            )
        options[option] = value
    return options or None


def _tokens(token: str | None, tokens: Mapping[str, Grant] | Tokens | None) -> Tokens:
    """``--token`` (every role) and the named, scoped tokens, as one table."""
    table = tokens if isinstance(tokens, Tokens) else Tokens(dict(tokens or {}))
    return table.with_token(token, Grant("token")) if token else table


def _remote_session(limits: Limits) -> SessionContext:
    """The server's session, whose memory pool remote queries share.

    Remote queries share a fair memory pool and never spill to disk
    (the live engine's queries included).
    """
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
    rates, a live query; see :mod:`pushtable.flight.server.ui`) and ``/metrics`` too. ``data_dir``
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
        durable = [n for n, t in server._tables.all() if isinstance(t, Topic) and t.durable]
        if not lance_commits.is_local(str(server.data_dir)):  # an object store's put is durable
            synced = "on an object store: a commit is durable once its put returns"
        else:
            synced = "fsync on" if fsync else "fsync OFF: an OS crash may lose acknowledged batches"
        say(
            f"pushtable serve: data dir {server.data_dir} ({len(durable)} durable topic(s), "
            f"{synced})"
        )
    if metrics_port is not None or ui_port is not None:
        from pushtable.flight.server.metrics_http import MetricsApp
        from pushtable.flight.server.ui import UiApp, UiServer

        scrape = MetricsApp(server.tokens)  # the server's tokens, each seeing its own tables
    if metrics_port is not None:
        http = UiServer(host, metrics_port, scrape, name="pushtable-metrics")
        server.metrics_url = f"{http.url}metrics"
        server._http_stops.append(http.stop)
        say(f"pushtable serve: metrics on {server.metrics_url}")
    if ui_port is not None:
        roots = tls[0] if tls else None
        ui = UiServer(
            host, ui_port, UiApp(server.location, tls_root_certs=roots, metrics_app=scrape)
        )
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


def _unstarted(location: str, exc: BaseException) -> str:
    """Why a server could not listen at ``location``, in words (gRPC logs it, raises no reason)."""
    _, _, rest = location.partition("://")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, int(port)))
    except OSError as bind_error:
        return f"cannot listen on {host}:{port}: {bind_error.strerror} (another server there?)"
    except ValueError:
        pass
    return f"cannot listen on {location}: {exc}"
