"""A live view of a running ``pushtable serve`` in the browser (``serve --ui-port``).

The page lists the server's tables and topics with their live rates and queue fill, and runs
a live SQL query whose rows appear as they arrive, in a grid and a line chart; an updating
aggregate's changes replace the rows of their keys in place (a table that updates). The HTTP side
is a small WSGI app on the standard library's threading server (as ``prometheus_client``
serves metrics, and ``/metrics`` is served here too); the chart is Plotly's JavaScript, served
from the installed ``plotly`` package, so the page needs no internet.

The UI holds no authority of its own: every table list, stats read and query is a Flight call
to the server, made with the token the user typed into the page. So the token's grant (read /
write / admin, table patterns), the server's read-only SQL planning, its limits and its audit
log apply exactly as to any other client.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import date, datetime, time
from decimal import Decimal
from importlib import resources
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pyarrow as pa

from pushtable.errors import PermissionDeniedError, UnauthenticatedError
from pushtable.flight.client.client import Client, RemoteResult, connect
from pushtable.flight.server.auth import Tokens
from pushtable.flight.server.metrics_http import MetricsApp
from pushtable.flight.server.query import UPSERT_KEY

Start = Callable[[str, list[tuple[str, str]]], Any]
#: a query's rows are sent at most this many per message, and the page keeps the last 1,000
ROWS_PER_MESSAGE = 500
#: seconds between two lines of a query's stream while no row comes (see :func:`_stream`)
HEARTBEAT_S = 1.0


#: HTTP connections the metrics and browser ports serve at once (a thread each): past it a
#: new connection is closed at once, before anything is read (1,011 idle connections held
#: +1,005 threads and descriptors until a durable commit failed with EMFILE)
MAX_HTTP_CONNECTIONS = 64
#: seconds a connection may take to send its request, or to take a response's next bytes
HTTP_TIMEOUT_S = 10.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # every slot taken: not even read
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # its thread releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # an idle connection is closed, its thread freed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the server's audit log says who did what; access lines would only be noise


def _plotly_js() -> bytes:
    try:
        import plotly
    except ImportError as exc:
        raise RuntimeError(
            "the browser UI draws its chart with Plotly's JavaScript: pip install 'pushtable[ui]'"
        ) from exc
    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()


def _static(name: str) -> bytes:
    return resources.files("pushtable.flight.server").joinpath("static").joinpath(name).read_bytes()


def _json_value(value: Any) -> Any:
    """A value as the page shows it: a window by its start, ISO times, numbers as numbers."""
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Decimal):
        return float(value)  # a chart's axis; the grid shows it as a number too
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()  # Plotly reads ISO dates on a time axis
    if isinstance(value, dict):
        if _WINDOW.issubset(value):  # Spark's window struct<start, end>: by its start
            return _json_value(value["start"])
        return "{" + ", ".join(f"{k}: {_json_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):  # lists, and maps (a list of key/value pairs)
        return "[" + ", ".join(str(_json_value(v)) for v in value) + "]"
    return str(value)


_WINDOW = {"start", "end"}


def _display_type(t: pa.DataType) -> str:
    """The type the page draws a column as (a window struct as its start, a decimal as a number)."""
    if pa.types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} == _WINDOW:
        return str(t.field("start").type)
    if pa.types.is_decimal(t):
        return "double"
    return str(t)


def _rows(batch: pa.RecordBatch) -> list[list[Any]]:
    columns = [c.to_pylist() for c in batch.columns]
    return [[_json_value(c[i]) for c in columns] for i in range(batch.num_rows)]


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


class UiApp:
    """The WSGI app: the page, its assets, ``/api/*`` and ``/metrics``.

    ``/api/*`` makes Flight calls with the caller's token.
    """

    def __init__(
        self,
        location: str,
        tls_root_certs: str | Path | bytes | None = None,
        metrics_app: MetricsApp | None = None,
    ) -> None:
        self.location = location
        self.tls_root_certs = tls_root_certs
        self._assets = {
            "/": ("text/html; charset=utf-8", _static("index.html")),
            "/static/app.js": ("text/javascript; charset=utf-8", _static("app.js")),
            "/static/plotly.min.js": ("text/javascript; charset=utf-8", _plotly_js()),
        }
        #: ``/metrics``, behind the server's tokens (open when it has none)
        self._metrics = metrics_app if metrics_app is not None else MetricsApp(Tokens({}))

    def _client(self, environ: dict[str, Any]) -> Client:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        token = auth[7:] if auth.startswith("Bearer ") else None
        return connect(self.location, token=token or None, tls_root_certs=self.tls_root_certs)

    def __call__(self, environ: dict[str, Any], start: Start) -> Iterable[bytes]:
        """Answer one request: ``/metrics``, an asset, ``/api/tables`` or ``/api/query``."""
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return self._metrics(environ, start)
        if path in self._assets and method == "GET":
            kind, body = self._assets[path]
            start("200 OK", [("Content-Type", kind), ("Cache-Control", "no-store")])
            return [body]
        if path == "/api/tables" and method == "GET":
            return self._tables(environ, start)
        if path == "/api/query" and method == "POST":
            size = int(environ.get("CONTENT_LENGTH") or 0)
            sql = environ["wsgi.input"].read(min(size, 1 << 20)).decode("utf-8", "replace")
            return self._query(environ, start, sql)
        start("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def _tables(self, environ: dict[str, Any], start: Start) -> Iterable[bytes]:
        try:
            with self._client(environ) as client:
                out = []
                for t in client.tables():
                    stats = client.stats(t["name"])
                    out.append(
                        {
                            "name": t["name"],
                            "topic": t["topic"],
                            "columns": [f"{f.name} {f.type}" for f in t["schema"]],
                            "bound_batches": t.get("bound_batches"),
                            "bound_bytes": t.get("bound_bytes"),
                            "stats": stats,
                        }
                    )
        except UnauthenticatedError as exc:
            return _error(start, "401 Unauthorized", exc)
        except PermissionDeniedError as exc:
            return _error(start, "403 Forbidden", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the page, which shows it
            return _error(start, "502 Bad Gateway", exc)
        start("200 OK", [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
        return [json.dumps(out, default=_json_value).encode()]

    def _query(self, environ: dict[str, Any], start: Start, sql: str) -> Iterator[bytes]:
        """The query's result as newline-delimited JSON, read by the browser as a stream.

        First the columns, then rows as they arrive, then the end (or the error). Closing the
        stream cancels the query.
        """
        start(
            "200 OK",
            [("Content-Type", "application/x-ndjson"), ("Cache-Control", "no-store")],
        )
        client = self._client(environ)
        result = None
        try:
            try:
                result = client.sql(sql)
                schema = result.schema
            except Exception as exc:  # noqa: BLE001 - the page shows the server's message
                yield _line({"error": str(exc)})
                return
            head: dict[str, Any] = {
                "columns": schema.names,
                "types": [_display_type(f.type) for f in schema],
            }
            key = (schema.metadata or {}).get(UPSERT_KEY)
            if key is not None:  # an updating aggregate: the page replaces rows by key
                head["key"] = [schema.names.index(name) for name in json.loads(key)]
            yield _line(head)
            yield from _stream(result)
        finally:  # the page went away or asked another query: stop this one on the server
            if result is not None:
                result.cancel()
            client.close()


def _stream(result: RemoteResult) -> Iterator[bytes]:
    """The result's rows as lines, then the end (or the error); a heartbeat while no row comes.

    While no row comes, a line goes out every ``HEARTBEAT_S`` seconds. A page that went away
    is noticed only when a write to it fails: without the heartbeat a query waiting for rows
    would outlive its page for good. The result is read on a thread of this call's own,
    stopped and joined when it ends.
    """
    items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=4)
    stopped = threading.Event()

    def offer(item: tuple[str, Any]) -> bool:
        while not stopped.is_set():
            try:
                items.put(item, timeout=HEARTBEAT_S)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for batch in result:
                if not offer(("batch", batch)):
                    return
            offer(("end", None))
        except Exception as exc:  # noqa: BLE001 - handed to the page
            offer(("error", exc))

    reader = threading.Thread(target=pump, name="pushtable-ui-query", daemon=True)
    reader.start()
    try:
        while True:
            try:
                kind, item = items.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                yield _line({"alive": True})
                continue
            if kind == "end":
                yield _line({"end": True})
                return
            if kind == "error":
                yield _line({"error": str(item)})
                return
            for at in range(0, item.num_rows, ROWS_PER_MESSAGE):
                yield _line({"rows": _rows(item.slice(at, ROWS_PER_MESSAGE))})
    finally:
        stopped.set()
        result.cancel()
        reader.join(HEARTBEAT_S * 4)


def _error(start: Start, status: str, exc: BaseException) -> list[bytes]:
    start(status, [("Content-Type", "application/json")])
    return [json.dumps({"error": str(exc)}).encode()]


class UiServer:
    """The HTTP server of :class:`UiApp` (or of another WSGI app), on a daemon thread."""

    def __init__(
        self, host: str, port: int, app: UiApp | MetricsApp, name: str = "pushtable-ui"
    ) -> None:
        self._http = make_server(host, port, app, _Server, handler_class=_QuietHandler)
        self.url = f"http://{host}:{self._http.server_port}/"
        self._thread = threading.Thread(target=self._http.serve_forever, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the server's socket."""
        self._http.shutdown()
        self._http.server_close()
