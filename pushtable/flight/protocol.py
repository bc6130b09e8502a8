"""The wire conventions ``pushtable serve`` and its clients share (Arrow Flight).

- **DoPut** ``path=[table]``: a producer's stream of batches; the server acknowledges the
  batches it queued with an 8-byte little-endian count of them (its ``app_metadata``): after
  each batch, except one whose ``app_metadata`` is ``LATER`` (the client will ask again
  within its window), after a metadata-only ``SYNC`` message, and once more when the stream
  ends. An empty batch whose ``app_metadata`` is ``{"advance": ...}`` (JSON) is a watermark,
  in order with the batches around it (``RemoteSink.advance``); it is acknowledged like a
  batch.
- **DoPut** ``path=[topic, "producer", producer_id, first_sequence]``: an idempotent
  producer's stream into a durable topic; its batches are numbered from ``first_sequence``
  and a batch the topic stored before is acknowledged, not appended again. On a durable
  topic every acknowledgement means *committed* (stored in its Lance dataset); the server
  sends ``FAILED`` when a commit holding the stream's batches failed (the stream then ends
  with that error).
- **DoPut** ``path=[table, "stage", query, epoch, partition, attempt]``: one Spark task's
  share of an epoch, held until the driver publishes the epoch (``publish`` action).
- **DoGet** ticket ``{"sql": ...}``: the query's result batches as the query produces them.
- **DoGet** ticket ``{"topic": ..., "start": s, "end": e}``: a durable topic's committed
  batches of offsets ``[s, e)``, the same rows every time.
- **Actions** (JSON bodies and results): ``create_table``, ``subscribe``, ``close``, ``fail``,
  ``stats``, ``tables``, ``publish``, ``published``, ``offsets`` (a durable topic's
  ``earliest``/``committed``/``next``), ``producer`` (an idempotent producer's last stored
  sequence).
- **Errors**: a pushtable error crosses as ``[pushtable:ClassName] message [/pushtable]`` inside
  Flight's error text, and is raised again on the client as the same class. ``[refused:n]``
  after it: the refusal of message *n* of a DoPut (those before it were taken, none after);
  ``[reopen]``: the call (DoPut or DoGet) was refused as it opened, for a count that frees
  by itself (its token's calls still waiting for their first message), so nothing was taken
  and a client may open another a moment later. A ``[/pushtable]`` inside the message (a
  caller's words echoed) is sent as ``[/ pushtable]``.
- **Auth**: ``authorization: Bearer <token>`` on every call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from pushtable import errors

STAGE = "stage"
PRODUCER = "producer"
AUTH_HEADER = "authorization"
#: a DoPut's id, chosen by its client: the ``leave`` action names it to end a stream whose
#: handler waits for room (pyarrow's client cannot cancel a DoPut, and a stream whose client
#: said ``done_writing`` is still the server's until its last batch is written)
STREAM_HEADER = "pushtable-stream"
#: the longest stream id a server keeps (longer ones are ignored: that stream cannot be left)
MAX_STREAM_ID_CHARS = 64

_E = TypeVar("_E", bound=BaseException)
#: what ends a pushtable error's message on the wire (see :func:`error_text`)
_END = "[/pushtable]"

_ERROR = re.compile(
    r"\[pushtable:(?P<cls>\w+)\] (?P<msg>.*?) \[/pushtable\]"
    r"(?:\[refused:(?P<refused>\d+)\])?(?P<reopen>\[reopen\])?",
    re.DOTALL,
)


def error_text(exc: BaseException) -> str:
    """How the server words a pushtable error for the wire.

    A refusal of one message of a DoPut stream carries its number (see :func:`refusing`). The
    message may hold what a caller wrote (a table's name in a query): its own ``[/pushtable]``
    is broken up, or the client would end the message there and read what follows as the
    server's marks (a query naming ``"x [/pushtable][reopen]"`` was retried for 30 s and its
    error cut short).
    """
    message = str(exc).replace(_END, "[/ pushtable]")
    text = f"[pushtable:{type(exc).__name__}] {message} {_END}"
    number = getattr(exc, "refused_message", None)
    if number is not None:
        text = f"{text}[refused:{number}]"
    return f"{text}[reopen]" if reopens(exc) else text


def refusing(exc: BaseException, number: int | None) -> None:
    """Mark ``exc`` as the server's refusal of message ``number`` (1-based) of a DoPut stream.

    The client then knows which of its messages in flight were taken (those before it), which
    was refused, and that none after it was (it sends those again on a new stream): the
    number travels in the call's error, which no lost metadata message can reorder.
    """
    if number is not None:
        exc.refused_message = number  # type: ignore[attr-defined]


def reopening(exc: _E) -> _E:
    """Mark ``exc`` as a refusal of a call (DoPut, DoGet) as it opened that frees by itself.

    Its token had as many calls still waiting for their first message as it may: they reach
    their handlers within moments (a burst of producers opening at once, a busy server), so
    the client opens another stream a moment later instead of failing the write or query.
    The call took nothing: every message sent on it goes again. Returns ``exc``.
    """
    exc.reopen = True  # type: ignore[attr-defined]
    return exc


def reopens(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal marked by :func:`reopening`."""
    return getattr(exc, "reopen", False) is True


def checked(table: str, number: int, batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch from the wire, validated in full, so nothing unchecked may reach a query.

    A message may lie about its lengths (longer than its buffers), offsets, UTF-8 or
    dictionary keys. Data from the network is untrusted: a table's own write trusts what it
    is given (``validate="basic"``), so this is the check. pyarrow runs it without the GIL.
    """
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise errors.InvalidBatchError(
            f"batch {number} for table {table!r} is not valid Arrow data ({exc}); it was refused"
        ) from None
    return batch


def server_error(exc: BaseException) -> flight.FlightServerError:
    """A Flight error that carries ``exc``'s class and message to the client."""
    return flight.FlightServerError(error_text(exc))


def client_error(exc: BaseException) -> BaseException:
    """The pushtable error a Flight error stands for (``exc`` itself if it is not one of ours)."""
    if isinstance(exc, flight.FlightUnauthenticatedError):
        return errors.UnauthenticatedError(f"the server refused the call: {exc}")
    match = _ERROR.search(str(exc))
    if match is None:
        if isinstance(exc, flight.FlightTimedOutError):  # the call's own deadline passed
            timed_out = errors.WriteTimeoutError(f"the call to the server timed out: {exc}")
            timed_out.__cause__ = exc
            return timed_out
        if isinstance(exc, flight.FlightUnavailableError):
            return errors.ServerUnavailableError(
                f"the server is not reachable: {exc}{_tls_hint(exc)}"
            )
        if isinstance(exc, pa.ArrowInvalid) and "FlightClient is closed" in str(exc):
            closed = errors.ClientClosedError(f"the client was closed: {exc}")
            closed.__cause__ = exc
            return closed
        if isinstance(exc, pa.ArrowInvalid) and "Destination already closed" in str(exc):
            # A write on a DoPut stream whose far end is gone (the server died or ended it
            # while batches were on the way): the stream ended, as a read would have said.
            ended = errors.StreamEndedError(f"the server ended the stream: {exc}")
            ended.__cause__ = exc
            return ended
        return exc
    cls = getattr(errors, match.group("cls"), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.PushTableError)):
        cls = errors.RemoteError
    public = cls(match.group("msg"))
    public.__cause__ = exc
    if match.group("refused") is not None:
        public.refused_message = int(match.group("refused"))  # type: ignore[attr-defined]
    if match.group("reopen") is not None:
        reopening(public)
    if isinstance(public, errors.StreamFailedError):
        public.error = _cause(match.group("msg"))
    return public


_FAILED_WITH = re.compile(r"failed: (?P<cls>\w+): (?P<msg>.*)$", re.DOTALL)


def _cause(message: str) -> BaseException | None:
    """What a remote producer failed its table with, from a ``StreamFailedError``'s message.

    A pushtable class comes back as itself (a stopping server's ``ServerStoppedError``),
    another as a :class:`~pushtable.RemoteError` naming it.
    """
    match = _FAILED_WITH.search(message)
    if match is None:
        return None
    cls = getattr(errors, match.group("cls"), None)
    if isinstance(cls, type) and issubclass(cls, errors.PushTableError):
        return cls(match.group("msg"))
    return errors.RemoteError(match.group("msg"), remote_type=match.group("cls"))


def _tls_hint(exc: BaseException) -> str:
    """What a TLS/plain mismatch looks like from the client, said in words.

    gRPC reports a plain connection to a TLS server as "Socket closed" and the reverse as a
    failed handshake.
    """
    text = str(exc).lower()
    if "ssl" in text or "handshake" in text or "wrong_version_number" in text:
        return (
            " (the TLS handshake failed: if the server runs without TLS, connect with grpc://, "
            "not grpc+tls://)"
        )
    if "socket closed" in text:
        return (
            " (a server with TLS closes a plain connection this way: if it was started with "
            "--tls-cert, connect with grpc+tls:// and its CA as tls_root_certs)"
        )
    return ""


#: The metadata a stopping server sends on every open DoPut stream: end it (no count is this big).
STOPPING = pa.py_buffer(b"\xff" * 8)
#: The metadata a server sends on a DoPut stream idle for ``idle_timeout``: end it; the
#: client's next write opens a new one.
IDLE = pa.py_buffer(b"\xfe" * 8)
#: The metadata a server sends on a durable topic's DoPut stream when a commit holding its
#: batches failed: end it; the call then ends with the commit's error.
FAILED = pa.py_buffer(b"\xfd" * 8)
#: What a server refuses one batch of a stream with (not the table or the stream as a whole):
#: the data is wrong for the table (schema, NOT NULL, order, an advance it cannot take) or is
#: not valid Arrow.
BATCH_REFUSALS: tuple[type[BaseException], ...] = (ValueError, errors.InvalidBatchError)


def producer_path(path: list[str]) -> tuple[str, int] | None:
    """``(producer_id, first_sequence)`` of an idempotent producer's DoPut path, else None."""
    if len(path) != 4 or path[1] != PRODUCER:
        return None
    try:
        first = int(path[3])
    except ValueError:
        raise ValueError(f"DoPut path {path!r}: the first sequence must be an integer") from None
    if not path[2] or first < 0:
        raise ValueError(f"DoPut path {path[:2]!r}: a producer id and a sequence >= 0 are needed")
    if len(path[2].encode()) > MAX_PRODUCER_ID_BYTES:
        raise ValueError(
            f"a producer id takes at most {MAX_PRODUCER_ID_BYTES} bytes, got "
            f"{len(path[2].encode()):,} (it is stored with every commit of the topic)"
        )
    return path[2], first


#: The longest producer id a server takes: each is stored in every commit of its topic.
MAX_PRODUCER_ID_BYTES = 256


def retriable(exc: BaseException) -> bool:
    """Whether an idempotent producer should reconnect and resend after ``exc``, by its class.

    It should when the server is unreachable (gRPC's UNAVAILABLE: refused, reset, closed),
    stopped, or ended the stream without a word (:class:`~pushtable.StreamEndedError`); never
    after a refusal of the data itself.
    """
    return isinstance(
        exc, (errors.ServerUnavailableError, errors.ServerStoppedError, errors.StreamEndedError)
    )


#: A batch's ``app_metadata`` asking for no acknowledgement of its own: a later one (or
#: ``SYNC``) covers it. One acknowledgement per half window spares both sides a gRPC message
#: and a thread wake-up per batch.
#:
#: Its length is part of the protocol: Flight frames ``app_metadata`` (2 bytes of framing plus
#: the bytes) before the batch's body, so it shifts every buffer of the body as the server
#: receives it. 14 bytes shift them by 16, keeping them 8-byte aligned wherever a batch sent
#: with no metadata is; with 15 (the first version) every buffer landed at an odd address and
#: the server's import copied the whole batch to align it (see ``tests/test_flight_wire.py``).
LATER = b"pushtable:lazy"
#: ``LATER`` as the first clients sent it (still understood).
LATER_V1 = b"pushtable:later"
#: A metadata-only DoPut message: acknowledge what is queued now (``flush``).
SYNC = b"pushtable:sync"


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a client's Flight call, raising pushtable's error classes for the server's errors."""
    try:
        return fn(*args, **kwargs)
    except (flight.FlightError, pa.ArrowException) as exc:
        raise client_error(exc) from exc


def ack(count: int) -> pa.Buffer:
    """The app_metadata that acknowledges ``count`` batches (8 bytes, little-endian)."""
    return pa.py_buffer(count.to_bytes(8, "little"))


def acked(buf: pa.Buffer) -> int:
    """The batch count an acknowledgement's app_metadata carries (see :func:`ack`)."""
    return int.from_bytes(buf.to_pybytes(), "little")


def schema_bytes(schema: pa.Schema) -> str:
    """A schema as JSON-safe text (its IPC serialization, hex)."""
    return bytes(schema.serialize()).hex()


def schema_from(text: str) -> pa.Schema:
    """A schema from its :func:`schema_bytes` text."""
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(text)))


def action(name: str, body: dict[str, Any] | None = None) -> flight.Action:
    """The Flight action ``name`` with ``body`` as JSON (an empty object when None)."""
    return flight.Action(name, json.dumps(body or {}).encode())


def wire_schema(schema: pa.Schema) -> pa.Schema:
    """The schema a table's batches cross the wire with: every field nullable.

    NOT NULL is the server's sink's to check, on the data, with its own message.
    """
    return pa.schema([f.with_nullable(True) for f in schema])


def to_wire(
    table: str, schema: pa.Schema, wire: pa.Schema, batch: pa.RecordBatch
) -> pa.RecordBatch:
    """``batch`` checked against the table's ``schema`` and labelled with its ``wire`` schema.

    A batch already in the wire schema (a table with no NOT NULL column, the usual case) is
    sent as it is: one C++ comparison (0.15 µs) instead of a field-by-field check and a new
    batch (16 µs a batch on a 2-core machine, a twentieth of the client's time at 8,192 rows).
    """
    got = batch.schema
    if got.equals(wire):
        return batch
    if not got.equals(schema):
        check_batch_schema(table, schema, got)
    return pa.RecordBatch.from_arrays(batch.columns, schema=wire)


def batches(read_chunk: Callable[[], Any]) -> Iterator[pa.RecordBatch]:
    """The record batches of a Flight stream, read with ``read_chunk`` until it ends."""
    for batch, _ in chunks(read_chunk):
        if batch is not None:
            yield batch


def chunks(read_chunk: Callable[[], Any]) -> Iterator[tuple[pa.RecordBatch | None, Any]]:
    """The (batch, app_metadata) chunks of a Flight stream, until it ends.

    ``batch`` is None for a metadata-only message.
    """
    while True:
        try:
            chunk = read_chunk()
        except StopIteration:
            return
        yield chunk.data, chunk.app_metadata


def delay_option(max_delay: Any) -> dict[str, Any]:
    """``max_delay`` for a ``create_table`` action body (JSON has no timedelta)."""
    if max_delay is None:
        return {}
    if isinstance(max_delay, timedelta):
        return {"max_delay_us": round(max_delay / timedelta(microseconds=1))}
    return {"max_delay": max_delay}


def start_option(start: Any) -> Any:
    """A subscription's ``start`` for an action body.

    A name, ``{"offset": n}`` or ``{"time": iso}``.
    """
    if isinstance(start, datetime):
        return {"time": start.isoformat()}
    if isinstance(start, int) and not isinstance(start, bool):
        return {"offset": start}
    return start


def start_value(option: Any) -> Any:
    """What :func:`start_option` encoded."""
    if isinstance(option, dict):
        if "offset" in option:
            return int(option["offset"])
        if "time" in option:
            return datetime.fromisoformat(str(option["time"]))
        raise ValueError(f"unknown start {option!r}: expected an offset or a time")
    return option


def advance_metadata(ts: Any) -> bytes:
    """A watermark as DoPut ``app_metadata``: an int as is, a datetime in ISO form."""
    if isinstance(ts, datetime):
        return json.dumps({"advance": {"iso": ts.isoformat()}}).encode()
    if isinstance(ts, int) and not isinstance(ts, bool):
        return json.dumps({"advance": {"int": ts}}).encode()
    raise TypeError(f"advance() takes an int or a datetime, got {type(ts).__name__}")


def is_later(metadata: Any) -> bool:
    """Whether a batch's ``app_metadata`` asks for no acknowledgement of its own."""
    return metadata is not None and metadata in (LATER, LATER_V1)


def advance_value(metadata: Any) -> Any:
    """The watermark an ``app_metadata`` carries, or None for an ordinary batch."""
    if metadata is None or metadata.size == 0 or is_later(metadata):
        return None
    try:
        body = json.loads(metadata.to_pybytes())
    except (ValueError, UnicodeDecodeError):
        raise ValueError("unexpected DoPut app_metadata: not JSON") from None
    advance = body.get("advance") if isinstance(body, dict) else None
    if not isinstance(advance, dict) or len(advance) != 1:
        raise ValueError(
            'unexpected DoPut app_metadata: expected {"advance": {"int": <integer>}} or '
            '{"advance": {"iso": "<ISO 8601 timestamp>"}}'
        )
    if isinstance(advance.get("iso"), str):
        try:
            return datetime.fromisoformat(advance["iso"])
        except ValueError:
            raise ValueError(
                f"advance(): {advance['iso'][:64]!r} is not an ISO 8601 timestamp"
            ) from None
    value = advance.get("int")
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    raise ValueError(
        'unexpected DoPut app_metadata: "advance" takes {"int": <a 64-bit integer>} or '
        '{"iso": "<ISO 8601 timestamp>"}'
    )


def check_batch_schema(table: str, expected: pa.Schema, got: pa.Schema) -> None:
    """Refuse a batch whose columns differ from the table's, before it is sent.

    The server's sink checks NOT NULL on the data.
    """
    if got.names != expected.names:
        raise errors.SchemaMismatchError(
            f"table '{table}': the batch has columns {got.names}, expected {expected.names}"
        )
    for field, want in zip(got, expected, strict=True):
        if field.type != want.type:
            raise errors.SchemaMismatchError(
                f"table '{table}': field '{field.name}' has type {field.type} in the batch, "
                f"expected {want.type}"
            )
