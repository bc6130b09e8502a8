"""Flight SQL on the wire: the commands ``pushtable serve`` answers and the messages it sends.

The commands are decoded from their protobuf bytes; the messages sent back are few.

Served (what runs them: :mod:`pushtable.flight.server.query` and
:mod:`pushtable.flight.server.catalog`): ``CommandStatementQuery``; prepared statements
(``CreatePreparedStatement``, ``CommandPreparedStatementQuery``, parameters bound by ``DoPut``,
``ClosePreparedStatement``); the catalog commands ``CommandGetSqlInfo``, ``CommandGetTableTypes``,
``CommandGetCatalogs``, ``CommandGetDbSchemas``, ``CommandGetTables``, ``CommandGetPrimaryKeys``,
``CommandGetExportedKeys``, ``CommandGetImportedKeys``, ``CommandGetCrossReference`` and
``CommandGetXdbcTypeInfo``. Updates, Substrait plans and transactions are refused by name.

Prepared statements are stateless: the handle is the query text, or, once parameters are bound,
the query and the parameters' Arrow IPC bytes (the updated handle of
``DoPutPreparedStatementResult``). Nothing is kept on the server between calls.

The protobuf messages are decoded here by a small reader (varints, length-delimited fields,
packed repeated integers) rather than with the protobuf runtime: the messages are flat, their
field numbers are facts of the spec (``format/FlightSql.proto``), and the server's install then
needs no generated code and no protobuf package. Malformed bytes raise ``ValueError`` saying
what was wrong.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

_PREFIX = "type.googleapis.com/arrow.flight.protocol.sql."
STATEMENT_QUERY = "CommandStatementQuery"
PREPARED_QUERY = "CommandPreparedStatementQuery"
#: The DoAction types of prepared statements (the only actions of Flight SQL served).
ACTIONS = ("CreatePreparedStatement", "ClosePreparedStatement")
#: Flight SQL's other actions: refused by name (no transactions, no Substrait, no cancel: a
#: client stops a query by ending its DoGet).
REFUSED_ACTIONS = (
    "BeginTransaction",
    "EndTransaction",
    "BeginSavepoint",
    "EndSavepoint",
    "CancelQuery",
    "CreatePreparedSubstraitPlan",
)

Field = bytes | int


@dataclass(frozen=True)
class Command:
    """A Flight SQL command: its short name (``CommandGetTables``) and its fields by number.

    Every occurrence of a field is kept, in order: repeated fields keep them all.
    """

    kind: str
    fields: dict[int, list[Field]]

    def text(self, number: int) -> str | None:
        """An optional string field (None: absent)."""
        values = self.fields.get(number)
        if not values:
            return None
        value = values[-1]
        if not isinstance(value, bytes):
            raise ValueError(f"{self.kind}: field {number} must be a string, got a number")
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise ValueError(f"{self.kind}: field {number} is not valid UTF-8") from None

    def raw(self, number: int) -> bytes:
        """An optional bytes field (empty: absent)."""
        values = self.fields.get(number) or [b""]
        value = values[-1]
        if not isinstance(value, bytes):
            raise ValueError(f"{self.kind}: field {number} must be bytes, got a number")
        return value

    def texts(self, number: int) -> list[str]:
        """A repeated string field."""
        out = []
        for value in self.fields.get(number, []):
            if not isinstance(value, bytes):
                raise ValueError(f"{self.kind}: field {number} must hold strings")
            out.append(value.decode(errors="strict"))
        return out

    def flag(self, number: int) -> bool:
        """An optional bool field (False: absent)."""
        values = self.fields.get(number) or [0]
        return bool(values[-1])

    def numbers(self, number: int) -> list[int]:
        """A repeated integer field, packed (one length-delimited run) or not."""
        out: list[int] = []
        for value in self.fields.get(number, []):
            if isinstance(value, int):
                out.append(value)
                continue
            pos = 0
            while pos < len(value):
                n, pos = _varint(value, pos)
                out.append(n)
        return out

    def signed(self, number: int) -> int | None:
        """An optional ``int32``/``int64`` field (negative values are ten-byte varints)."""
        values = self.numbers(number)
        if not values:
            return None
        value = values[-1]
        return value - (1 << 64) if value >= 1 << 63 else value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated protobuf varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("protobuf varint too long")


def message(data: bytes) -> dict[int, list[Field]]:
    """A protobuf message's fields by number: varints as ints, length-delimited fields as bytes.

    Fixed-width fields (none in the commands served) are skipped.
    """
    out: dict[int, list[Field]] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("protobuf field number 0 is invalid")
        if wire == 0:
            value, pos = _varint(data, pos)
            out.setdefault(number, []).append(value)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError("truncated protobuf field")
            out.setdefault(number, []).append(data[pos : pos + size])
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated protobuf field")
    return out


def fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of a message, the last of each number."""
    return {n: v[-1] for n, v in message(data).items() if isinstance(v[-1], bytes)}


def command(data: bytes) -> Command:
    """A Flight SQL command descriptor (a ``google.protobuf.Any``): its name and fields."""
    wrapper = fields(data)
    type_url = wrapper.get(1, b"").decode(errors="replace")
    if not type_url.startswith(_PREFIX):
        raise ValueError(f"not a Flight SQL command: {type_url or 'no type'}")
    return Command(type_url[len(_PREFIX) :], message(wrapper.get(2, b"")))


def statement(cmd: Command) -> tuple[str, pa.RecordBatch | None] | None:
    """The SQL text and bound parameters of a statement or prepared-statement query.

    None for another command.
    """
    if cmd.kind == STATEMENT_QUERY:
        return cmd.text(1) or "", None
    if cmd.kind == PREPARED_QUERY:
        return decode_handle(cmd.raw(1))
    return None


def statement_query(data: bytes) -> str | None:
    """The SQL text of a statement (or prepared statement) query descriptor.

    None for another command; ``ValueError`` for bytes that are not a Flight SQL command.
    """
    found = statement(command(data))
    return None if found is None else found[0]


# -- prepared statements ------------------------------------------------------------------

_HANDLE = b'{"pushtable.sql":'


def encode_handle(query: str, params: pa.RecordBatch | None = None) -> bytes:
    """A prepared statement's handle: the query text, or the query and its bound parameters."""
    if params is None:
        return query.encode()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, params.schema) as writer:
        writer.write_batch(params)
    data = base64.b64encode(sink.getvalue().to_pybytes()).decode()
    return json.dumps({"pushtable.sql": query, "params": data}).encode()


def decode_handle(handle: bytes) -> tuple[str, pa.RecordBatch | None]:
    """The query and the bound parameters (None: none bound) of a handle a client sent back.

    A handle travels through the client: it is decoded and validated as untrusted input.
    """
    if not handle.startswith(_HANDLE):
        try:
            return handle.decode(), None
        except UnicodeDecodeError:
            raise ValueError("a prepared statement handle is not valid UTF-8") from None
    try:
        body = json.loads(handle)
        query, data = str(body["pushtable.sql"]), base64.b64decode(body["params"], validate=True)
        reader = pa.ipc.open_stream(data)
        batches = list(reader)
    except (ValueError, KeyError, TypeError, pa.ArrowInvalid) as exc:
        raise ValueError(f"a malformed prepared statement handle: {exc}") from None
    return query, parameter_batch(pa.Table.from_batches(batches, reader.schema))


def parameter_batch(table: pa.Table) -> pa.RecordBatch:
    """Bound parameters from the network as one batch, validated in full."""
    table = table.combine_chunks()
    batch = (
        table.to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], table.schema)
    )
    batch.validate(full=True)
    return batch


def prepared(body: bytes, describe: Callable[[str], tuple[pa.Schema, pa.Schema]]) -> bytes:
    """Answer ``CreatePreparedStatement`` from ``describe(query)`` (planning, nothing runs).

    The answer holds the handle (the query text), the result's schema and the parameters'
    schema.
    """
    request = fields(body)
    inner = (
        fields(request.get(2, b""))
        if request.get(1, b"").decode(errors="replace").startswith(_PREFIX)
        else request
    )
    try:
        query = inner.get(1, b"").decode()
    except UnicodeDecodeError:
        raise ValueError("a prepared statement's query is not valid UTF-8") from None
    schema, parameters = describe(query)
    result = (
        bytes_field(1, query.encode())
        + bytes_field(2, schema.serialize().to_pybytes())
        + bytes_field(3, parameters.serialize().to_pybytes())
    )
    return _any("ActionCreatePreparedStatementResult", result)


def put_prepared_result(handle: bytes) -> bytes:
    """``DoPutPreparedStatementResult``: the updated handle that carries bound parameters."""
    return bytes_field(1, handle)


# -- encoding (replies, and requests for tests) ---------------------------------------------


def encode_command(kind: str, payload: bytes = b"") -> bytes:
    """``Any(<kind>)`` around an encoded message: a command descriptor as clients send it."""
    return _any(kind, payload)


def encode_statement_query(query: str) -> bytes:
    """``Any(CommandStatementQuery(query))``: what a Flight SQL client sends (for tests)."""
    return _any(STATEMENT_QUERY, bytes_field(1, query.encode()))


def encode_prepared_request(query: str) -> bytes:
    """``ActionCreatePreparedStatementRequest(query)``: a prepare action's body (for tests)."""
    return bytes_field(1, query.encode())


def string_field(number: int, text: str) -> bytes:
    """A length-delimited field (wire type 2) holding ``text`` as UTF-8."""
    return bytes_field(number, text.encode())


def bool_field(number: int, value: bool) -> bytes:
    """A varint field (wire type 0) holding ``value``.

    The tag is a varint too (one byte only for field numbers below 16).
    """
    return varint(number << 3 | 0) + bytes([1 if value else 0])


def _any(name: str, payload: bytes) -> bytes:
    return bytes_field(1, (_PREFIX + name).encode()) + bytes_field(2, payload)


def bytes_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) holding ``payload``."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a non-negative integer, seven bits a byte)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
