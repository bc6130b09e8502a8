"""One connection's Flight calls: what a :class:`~pushtable.flight.Client` owns.

Its producers use them too.

The client declares tables and runs queries; its producers
(:mod:`pushtable.flight.client.remote_sink`, :mod:`pushtable.flight.client.idempotent`) open streams
and send control actions. Both go through a ``Transport``, so the producers need nothing of the
client, and the client nothing of theirs but their public methods.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.flight import protocol

__all__ = ["Transport"]

#: The longest gRPC waits between two attempts to reach a server it lost, in milliseconds.
#: gRPC's own default grows to 120 s over a long outage, so a server back after one would not
#: be tried again for up to two minutes: longer than a producer's ``retry`` window, which
#: then ran out with the server up. Capped, a producer reaches a server within about a second
#: of its return.
RECONNECT_BACKOFF_MS = 1000


class Transport:
    """A Flight connection to ``uri`` with its token and timeouts. Thread-safe.

    ``timeout`` bounds each control call (:meth:`action`), not streams.

    Example:
        >>> from pushtable.flight import Server
        >>> server = Server()
        >>> Transport(server.location).action("tables")
        []
        >>> server.stop()
        0
    """

    def __init__(
        self,
        uri: str,
        *,
        token: str | None = None,
        tls_root_certs: str | Path | bytes | None = None,
        timeout: float | None = 30.0,
    ) -> None:
        roots = tls_root_certs
        if isinstance(roots, (str, Path)):
            roots = Path(roots).read_bytes()
        kwargs: dict[str, Any] = {
            "generic_options": [("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)]
        }
        if roots is not None:
            kwargs["tls_root_certs"] = roots
        self.uri = uri
        self._flight = flight.FlightClient(uri, **kwargs)
        self._headers = (
            [(protocol.AUTH_HEADER.encode(), f"Bearer {token}".encode())] if token else []
        )
        #: options of a stream's call: no timeout (a stream lasts as long as its data)
        self.stream_options = flight.FlightCallOptions(headers=self._headers)
        self._control_options = flight.FlightCallOptions(headers=self._headers, timeout=timeout)

    def options(self, timeout: float | None) -> Any:
        """Call options with ``timeout`` (None: a stream's, with no timeout)."""
        if timeout is None:
            return self.stream_options
        return flight.FlightCallOptions(headers=self._headers, timeout=timeout)

    def action(self, name: str, body: dict[str, Any] | None = None, options: Any = None) -> Any:
        """Run action ``name`` with a JSON ``body``; its JSON answer (None: no answer)."""
        options = self._control_options if options is None else options
        results = protocol.call(
            lambda: list(self._flight.do_action(protocol.action(name, body), options))
        )
        return json.loads(results[0].body.to_pybytes()) if results else None

    def do_put(self, descriptor: Any, schema: pa.Schema, stream: str) -> tuple[Any, Any]:
        """Open a DoPut stream with id ``stream``: (writer, acknowledgement reader)."""
        headers = [*self._headers, (protocol.STREAM_HEADER.encode(), stream.encode())]
        options = flight.FlightCallOptions(headers=headers)
        writer, reader = protocol.call(self._flight.do_put, descriptor, schema, options)
        return writer, reader

    def do_get(self, ticket: dict[str, Any]) -> Any:
        """Open a DoGet stream for a JSON ``ticket``: its reader."""
        return protocol.call(
            self._flight.do_get, flight.Ticket(json.dumps(ticket).encode()), self.stream_options
        )

    def close(self) -> None:
        """Close the connection (its open streams end)."""
        self._flight.close()
