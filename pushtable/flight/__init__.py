"""Live tables over the network: ``pushtable serve`` (Arrow Flight) and its clients.

- :class:`Server` / :func:`serve`: host streaming tables and topics; remote SQL.
- :func:`connect` → :class:`Client`: declare tables, get a :class:`RemoteSink` (the
  ``TableSink`` API over the wire), run live SQL remotely.

See docs/network.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pushtable.errors import ServerStoppedError
from pushtable.lazy import lazy_names

if TYPE_CHECKING:
    from pushtable.flight.client.aio import AsyncClient
    from pushtable.flight.client.client import Client, RemoteResult, connect
    from pushtable.flight.client.remote_sink import RemoteSink, RemoteSinkStats
    from pushtable.flight.server.auth import Grant, Tokens
    from pushtable.flight.server.limits import Limits
    from pushtable.flight.server.server import Server, serve

#: Names loaded on first use: the client's modules load neither the server nor DataFusion.
_LAZY = {
    "AsyncClient": "pushtable.flight.client.aio",
    "Grant": "pushtable.flight.server.auth",
    "Tokens": "pushtable.flight.server.auth",
    "Client": "pushtable.flight.client.client",
    "RemoteResult": "pushtable.flight.client.client",
    "connect": "pushtable.flight.client.client",
    "Limits": "pushtable.flight.server.limits",
    "RemoteSink": "pushtable.flight.client.remote_sink",
    "RemoteSinkStats": "pushtable.flight.client.remote_sink",
    "Server": "pushtable.flight.server.server",
    "serve": "pushtable.flight.server.server",
}


__getattr__, __dir__ = lazy_names("pushtable.flight", _LAZY, globals())

__all__ = [
    "AsyncClient",
    "Client",
    "Grant",
    "Limits",
    "RemoteResult",
    "RemoteSink",
    "RemoteSinkStats",
    "Server",
    "ServerStoppedError",
    "Tokens",
    "connect",
    "serve",
]
