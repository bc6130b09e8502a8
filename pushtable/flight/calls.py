"""What every call of ``pushtable serve`` shares: who the client is, the audit line, and how
errors are worded for the wire (a pushtable class the client raises again; never a server
traceback)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors
from pushtable.errors import PermissionDeniedError, PushTableError, StatementRefusedError
from pushtable.flight import protocol
from pushtable.flight.audit import AuditRecord, audited
from pushtable.flight.auth import caller

log = logging.getLogger("pushtable.flight.server")

#: How often a blocked handler looks whether its client went away or the server is stopping.
POLL_S = 0.25


def client_of(context: Any) -> str:
    """Who holds a stream slot: the token's name on one connection (the peer's address)."""
    return f"{caller(context).name}@{context.peer()}"


def audit(context: Any, action: str) -> contextlib.AbstractContextManager[AuditRecord]:
    """The audit line of the call ``context`` stands for (see :mod:`pushtable.flight.audit`)."""
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
    except (PushTableError, ValueError, TypeError, pa.ArrowInvalid) as exc:
        raise protocol.server_error(exc) from exc
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
