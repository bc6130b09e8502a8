"""Live tables over the network: ``pushtable serve`` (Arrow Flight) and its clients.

- :class:`Server` / :func:`serve`: host streaming tables and topics; remote SQL.
- :func:`connect` → :class:`Client`: declare tables, get a :class:`RemoteSink` (the
  ``TableSink`` API over the wire), run live SQL remotely.

See docs/network.md.
"""

from __future__ import annotations

from pushtable.errors import ServerStoppedError
from pushtable.flight.auth import Grant, Tokens
from pushtable.flight.client import Client, RemoteResult, connect
from pushtable.flight.limits import Limits
from pushtable.flight.remote_sink import RemoteSink, RemoteSinkStats
from pushtable.flight.server import Server, serve

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
