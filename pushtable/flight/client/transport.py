"""One connection's Flight calls: what a :class:`~pushtable.flight.Client` owns.

Its producers use them too.

The client declares tables and runs queries; its producers
(:mod:`pushtable.flight.client.remote_sink`, :mod:`pushtable.flight.client.idempotent`) open streams
and send control actions. Both go through a ``Transport``, so the producers need nothing of the
client, and the client nothing of theirs but their public methods.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable.errors import ClientClosedError, PushTableError, WriteTimeoutError
from pushtable.flight import protocol

__all__ = ["REOPEN_FOR_S", "Reopening", "Transport"]

#: The longest gRPC waits between two attempts to reach a server it lost, in milliseconds.
#: gRPC's own default grows to 120 s over a long outage, so a server back after one would not
#: be tried again for up to two minutes: longer than a producer's ``retry`` window, which
#: then ran out with the server up. Capped, a producer reaches a server within about a second
#: of its return.
RECONNECT_BACKOFF_MS = 1000

#: How long a client keeps opening streams that its server refuses as they open, for a count
#: that frees by itself (:func:`~pushtable.flight.protocol.reopening`), when the call has no
#: deadline of its own; then the refusal is raised.
REOPEN_FOR_S = 30.0
#: The longest pause between two such streams (the first is up to 1 ms; each doubles).
REOPEN_PAUSE_S = 0.1


class Reopening:
    """The pauses between streams refused as they opened, and when to stop opening more.

    A server refuses a stream as it opens when its token has as many calls still waiting for
    their first message as it may: a burst of producers or queries opening together on a busy
    server. Those reach their handlers within moments, so the refused call opens another a
    moment later, as a write waits for room in a full table, and the burst gets through. Each
    pause is drawn at random up to a bound that doubles from 1 ms to ``REOPEN_PAUSE_S`` (calls
    refused together do not all come back together). It stops at the call's deadline (a
    :class:`~pushtable.WriteTimeoutError` naming the refusal) or ``REOPEN_FOR_S`` after the
    first refusal since the last :meth:`reset` (the refusal itself). A timeout of the call
    meanwhile names the refusal too (:meth:`timed_out`).
    """

    def __init__(self, what: str) -> None:
        self._what = what  # "remote table 't'": what the timeout's message names
        self._since: float | None = None
        self._refusal: BaseException | None = None  # the last, since a stream was taken
        self._bound = 0.001

    def reset(self) -> None:
        """A stream was taken: the next refusal starts a new run."""
        self._since = None
        self._refusal = None
        self._bound = 0.001

    def timed_out(self, message: str) -> WriteTimeoutError:
        """A call's timeout, saying why its streams did not go if the server refused them."""
        if self._refusal is not None:
            message += f" (the server refused its streams as they opened: {self._refusal})"
        return WriteTimeoutError(message)

    def wait(self, refusal: BaseException, deadline: float | None) -> None:
        """Pause before opening another stream after ``refusal``, or raise: stop trying."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
        self._refusal = refusal
        if now - self._since >= REOPEN_FOR_S:
            self.reset()
            raise refusal
        if deadline is not None and now >= deadline:
            raise self.timed_out(f"timed out opening a stream to {self._what}") from refusal
        pause = random.uniform(0, self._bound)  # a spread, not a secret
        self._bound = min(REOPEN_PAUSE_S, self._bound * 2)
        if deadline is not None:
            pause = min(pause, deadline - now)
        time.sleep(pause)


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
        #: closed by its client: no new call goes, but a stream it left is still told to end
        #: until it has (see :meth:`close_after`)
        self.closed = False
        #: streams left on a server that did not answer, until they end (the connection
        #: stays open for their ``leave``; see :meth:`close_after`)
        self.unended: set[Any] = set()

    def options(self, timeout: float | None) -> Any:
        """Call options with ``timeout`` (None: a stream's, with no timeout)."""
        if timeout is None:
            return self.stream_options
        return flight.FlightCallOptions(headers=self._headers, timeout=timeout)

    def _refuse_closed(self) -> None:
        if self.closed:
            raise ClientClosedError(f"the client of {self.uri} is closed")

    def action(
        self,
        name: str,
        body: dict[str, Any] | None = None,
        options: Any = None,
        *,
        leaving: bool = False,
    ) -> Any:
        """Run action ``name`` with a JSON ``body``; its JSON answer (None: no answer).

        ``leaving``: a stream's ``leave``, sent also once the client is closed (until the
        connection is, see :meth:`close_after`).
        """
        if not leaving:
            self._refuse_closed()
        options = self._control_options if options is None else options
        results = protocol.call(
            lambda: list(self._flight.do_action(protocol.action(name, body), options))
        )
        return json.loads(results[0].body.to_pybytes()) if results else None

    def do_put(self, descriptor: Any, schema: pa.Schema, stream: str) -> tuple[Any, Any]:
        """Open a DoPut stream with id ``stream``: (writer, acknowledgement reader)."""
        self._refuse_closed()
        headers = [*self._headers, (protocol.STREAM_HEADER.encode(), stream.encode())]
        options = flight.FlightCallOptions(headers=headers)
        writer, reader = protocol.call(self._flight.do_put, descriptor, schema, options)
        return writer, reader

    def do_get(self, ticket: dict[str, Any]) -> Any:
        """Open a DoGet stream for a JSON ``ticket``: its reader.

        pyarrow's call returns once the server's first message (the schema) or its error
        came. A refusal as it opened that frees by itself is met by opening it again (see
        :class:`Reopening`): the server ran nothing for it.
        """
        self._refuse_closed()
        reopening = Reopening(f"the server at {self.uri}")
        body = flight.Ticket(json.dumps(ticket).encode())
        while True:
            try:
                return protocol.call(self._flight.do_get, body, self.stream_options)
            except PushTableError as exc:
                if not protocol.reopens(exc):
                    raise
                reopening.wait(exc, None)

    def close(self) -> None:
        """Close the connection (its open streams end)."""
        self.closed = True
        self._flight.close()

    def close_after(self, ended: list[Callable[[float], bool]], within: float) -> None:
        """Refuse new calls now; close the connection once each of ``ended`` says so.

        Each is a stream's wait for its end (given a deadline). A stream its client left
        on a server that did not answer (paused) ends only once a ``leave`` reaches it:
        the connection stays open, in the background, until then (``within`` seconds at
        most), so the stream's slot on the server is freed when the server resumes.
        """
        self.closed = True

        def wait_then_close() -> None:
            deadline = time.monotonic() + within
            for wait in ended:
                wait(deadline)
            self._flight.close()

        threading.Thread(target=wait_then_close, name="pushtable-close", daemon=True).start()
