"""Live tables over the network: ``pushtable serve`` (Arrow Flight) and its clients.

- :class:`Server` / :func:`serve`: host streaming tables and topics; remote SQL.
- :func:`connect` → :class:`Client`: declare tables, get a :class:`RemoteSink` (the
  ``TableSink`` API over the wire), run live SQL remotely.

See docs/network.md.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from pushtable.errors import ServerStoppedError

if TYPE_CHECKING:
    from pushtable.flight.auth import Grant, Tokens
    from pushtable.flight.client import Client, RemoteResult, connect
    from pushtable.flight.limits import Limits
    from pushtable.flight.remote_sink import RemoteSink, RemoteSinkStats
    from pushtable.flight.server import Server, serve

#: Names loaded on first use: the client's modules load neither the server nor DataFusion.
_LAZY = {
    "Grant": "pushtable.flight.auth",
    "Tokens": "pushtable.flight.auth",
    "Client": "pushtable.flight.client",
    "RemoteResult": "pushtable.flight.client",
    "connect": "pushtable.flight.client",
    "Limits": "pushtable.flight.limits",
    "RemoteSink": "pushtable.flight.remote_sink",
    "RemoteSinkStats": "pushtable.flight.remote_sink",
    "Server": "pushtable.flight.server",
    "serve": "pushtable.flight.server",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'pushtable.flight' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
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
