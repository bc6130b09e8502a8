"""What every call of ``pushtable serve`` shares.

Who the client is, the audit line, how
errors are worded for the wire (a pushtable class the client raises again; never a server
traceback), and the count of calls under way that a stopping server waits for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors
from pushtable.errors import PermissionDeniedError, PushTableError, StatementRefusedError
from pushtable.flight import protocol
from pushtable.flight.server.audit import AuditRecord, audited
from pushtable.flight.server.auth import caller
from pushtable.flight.server.limits import Usage

log = logging.getLogger("pushtable.flight.server.server")

#: How often a blocked handler looks whether its client went away or the server is stopping.
POLL_S = 0.25


class Calls:
    """The streaming calls under way (DoPut, DoGet) and whether the server is stopping.

    Each part of the server holds its calls here, so that ``stop()`` can let them deliver
    their errors before gRPC cancels them, and asks it whether to give up waiting for room.
    """

    def __init__(self, usage: Usage) -> None:
        #: what remote clients hold, against the server's limits (``usage.limits``)
        self.usage = usage
        #: set once ``stop()`` begins: blocked handlers give up within ``POLL_S``
        self.stopping = threading.Event()
        self._count = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def held(self, context: Any) -> Iterator[None]:
        """Count a streaming call for as long as it runs, in one of its client's stream slots."""
        with self.usage.stream(client_of(context), caller(context).name):
            opened(context)  # counted as held from here
            with self._changed:
                self._count += 1
            try:
                yield
            finally:
                with self._changed:
                    self._count -= 1
                    self._changed.notify_all()

    @property
    def count(self) -> int:
        """The streaming calls under way."""
        with self._changed:
            return self._count

    def wait_ended(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every call to end; returns how many are left."""
        with self._changed:
            self._changed.wait_for(lambda: self._count == 0, timeout=timeout)
            return self._count

    def give_up(self, context: Any) -> bool:
        """Whether a handler waiting for room should stop: its client left or the server stops."""
        opening = context.get_middleware(OPENING)
        left = isinstance(opening, _Opening) and opening.left
        return left or bool(context.is_cancelled()) or self.stopping.is_set()


#: The middleware key of :class:`Opening`.
OPENING = "opening"

#: The streaming calls a client opens: each holds a server thread before its first message.
STREAMING = (
    flight.FlightMethod.DO_PUT,
    flight.FlightMethod.DO_GET,
    flight.FlightMethod.DO_EXCHANGE,
)


class _Opening(flight.ServerMiddleware):  # type: ignore[misc]
    """A streaming call counted from its first byte until its handler holds its slot.

    It also carries the call's stream id (the client's ``STREAM_HEADER``) and whether its
    client left it (the ``leave`` action): a handler waiting for room gives up then.
    """

    def __init__(self, usage: Usage, token: str, stream: str | None, ended: Callable[[], None]):
        super().__init__()
        self._usage, self._token = usage, token
        self._lock = threading.Lock()
        self._counted = True
        self.stream = stream
        self.left = False
        self._ended = ended

    def settle(self) -> None:
        """Give the count back (once): the handler took the call's slot, or the call ended."""
        with self._lock:
            counted, self._counted = self._counted, False
        if counted:
            self._usage.opened(self._token)

    def call_completed(self, exception: Any) -> None:
        self.settle()  # a call that ended before its first message (or its handler)
        self._ended()


class Opening(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Counts each streaming call against the stream limits from the moment it opens.

    pyarrow's server runs a DoPut's handler only once its first message came, and holds a
    thread for the call meanwhile: 10,000 DoPut calls that never sent one held 10,041
    threads, under no limit. Each now counts against ``max_streams`` (with the streams
    held) and its token's ``max_streams_per_client`` from its first byte, and one over
    either is refused at once. (A call still waiting for its first message cannot be ended
    by the server: pyarrow gives it no way; the bound is what holds.)
    """

    def __init__(self, usage: Usage, name_of: Callable[[dict[str, list[Any]]], str]) -> None:
        super().__init__()
        self._usage = usage
        self._name_of = name_of  # headers -> the token's name
        self._lock = threading.Lock()
        #: the calls with a stream id, by (token, id): as many as the streams open
        self._streams: dict[tuple[str, str], _Opening] = {}

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> _Opening | None:
        """Count a streaming call as it opens (refused over a limit); other calls pass."""
        if info.method not in STREAMING:
            return None
        token = self._name_of(headers)
        try:
            self._usage.open_call(token)
        except PushTableError as exc:
            raise protocol.server_error(exc) from exc
        ids = headers.get(protocol.STREAM_HEADER) or []
        stream = ids[0] if len(ids) == 1 else None
        if isinstance(stream, bytes):
            stream = stream.decode("utf-8", "replace")
        if stream is not None and len(stream) > protocol.MAX_STREAM_ID_CHARS:
            stream = None
        key = (token, stream) if stream is not None else None
        opening = _Opening(self._usage, token, stream, lambda: self._forget(key, opening))
        if key is not None:
            with self._lock:
                self._streams[key] = opening  # a reused id: the newest call is the one left
        return opening

    def _forget(self, key: tuple[str, str] | None, opening: _Opening) -> None:
        if key is not None:
            with self._lock:
                if self._streams.get(key) is opening:
                    del self._streams[key]

    def leave(self, token: str, stream: str) -> bool:
        """Mark ``token``'s stream ``stream`` as left by its client; whether it was open.

        Only the token that opened a stream can leave it.
        """
        with self._lock:
            opening = self._streams.get((token, stream))
        if opening is None:
            return False
        opening.left = True
        return True


def opened(context: Any) -> None:
    """The call's first message came (its handler runs): it no longer counts as opening."""
    opening = context.get_middleware(OPENING)
    if isinstance(opening, _Opening):
        opening.settle()


def client_of(context: Any) -> str:
    """Who holds a stream slot: the token's name on one connection (the peer's address)."""
    return f"{caller(context).name}@{context.peer()}"


def audit(context: Any, action: str) -> contextlib.AbstractContextManager[AuditRecord]:
    """The audit line of the call ``context`` stands for (see :mod:`.audit`)."""
    return audited(str(context.peer()), caller(context).name, action)


def table_named(body: dict[str, Any]) -> str | None:
    """The table an action's body names, for the audit line."""
    for key in ("name", "table", "topic"):
        if isinstance(body.get(key), str):
            return str(body[key])
    return None


@contextlib.contextmanager
def wire_errors() -> Iterator[None]:
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
    except PushTableError as exc:
        raise protocol.server_error(exc) from exc
    except (ValueError, TypeError, pa.ArrowInvalid) as exc:  # the request is wrong: say so
        public = errors.InvalidRequestError(str(exc))
        protocol.refusing(public, getattr(exc, "refused_message", None))
        raise protocol.server_error(public) from exc
    except OSError as exc:  # pyarrow's IPC reader: the client sent malformed Arrow data
        raise protocol.server_error(
            errors.InvalidBatchError(f"malformed Arrow IPC data: {exc}")
        ) from exc
    except Exception as exc:  # a bug of ours: logged here, named (never a traceback) there
        log.exception("pushtable serve: unexpected error in a call")
        raise protocol.server_error(
            errors.RemoteError(f"internal server error: {type(exc).__name__}: {exc}")
        ) from exc


def query_error(exc: BaseException) -> BaseException:
    """A query's error as the pushtable class it stands for, when it is one."""
    if isinstance(exc, errors.PushTableError):
        return exc
    public = errors.query_error(exc)
    return public if public is not None else errors.RemoteError(str(exc))
