"""The Flight SQL front of ``pushtable serve``: statement queries, so generic Flight SQL clients
(ADBC's ``adbc_driver_flightsql``, JDBC) can run live SQL.

Served: ``CommandStatementQuery``, and prepared statements without parameters (what DB-API
drivers send for every ``execute``: ``CreatePreparedStatement``, ``CommandPreparedStatementQuery``,
``ClosePreparedStatement``). ``GetFlightInfo`` plans the query (its schema, no execution) and
returns one endpoint whose ticket the server's ``DoGet`` runs, streaming the result as it is
produced. Catalog commands (``GetTables``, ``GetSqlInfo``, …), parameters, updates and
transactions are refused as unimplemented. The two protobuf messages involved are
decoded here by hand (a ``google.protobuf.Any`` around a message with one string field), so
the core needs no protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

_PREFIX = "type.googleapis.com/arrow.flight.protocol.sql."
STATEMENT_QUERY = _PREFIX + "CommandStatementQuery"
PREPARED_QUERY = _PREFIX + "CommandPreparedStatementQuery"
#: The DoAction types of prepared statements (the only actions of Flight SQL served).
ACTIONS = ("CreatePreparedStatement", "ClosePreparedStatement")


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


def fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of a protobuf message (the last of each number wins);
    varint and fixed-width fields are skipped."""
    out: dict[int, bytes] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError("truncated protobuf field")
            out[number] = data[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


def command(data: bytes) -> tuple[str, dict[int, bytes]]:
    """A Flight SQL command descriptor: its type name and its fields."""
    wrapper = fields(data)
    type_url = wrapper.get(1, b"").decode()
    if not type_url.startswith(_PREFIX):
        raise ValueError(f"not a Flight SQL command: {type_url or 'no type'}")
    return type_url, fields(wrapper.get(2, b""))


def statement_query(data: bytes) -> str | None:
    """The SQL text of a statement query descriptor, None for another command.

    A prepared statement's handle *is* its SQL text (see :func:`prepared`), so
    ``CommandPreparedStatementQuery`` is a statement query too. Raises ``ValueError`` for
    bytes that are not a Flight SQL command.
    """
    type_url, body = command(data)
    if type_url not in (STATEMENT_QUERY, PREPARED_QUERY):
        return None
    return body.get(1, b"").decode()


def prepared(body: bytes, schema_of: Callable[[str], pa.Schema]) -> bytes:
    """Answer ``CreatePreparedStatement``: the handle is the query text itself, so nothing
    is kept on the server (``ClosePreparedStatement`` has nothing to free)."""
    request = fields(body)
    inner = (
        fields(request.get(2, b"")) if request.get(1, b"").decode().startswith(_PREFIX) else request
    )
    query = inner.get(1, b"").decode()
    schema = schema_of(query)
    result = _field(1, query.encode()) + _field(2, schema.serialize().to_pybytes())
    return _any("ActionCreatePreparedStatementResult", result)


def encode_statement_query(query: str) -> bytes:
    """``Any(CommandStatementQuery(query))``: what a Flight SQL client sends (for tests)."""
    return _any("CommandStatementQuery", _field(1, query.encode()))


def encode_prepared_request(query: str) -> bytes:
    """``ActionCreatePreparedStatementRequest(query)``: a prepare action's body (for tests)."""
    return _field(1, query.encode())


def _any(name: str, payload: bytes) -> bytes:
    return _field(1, (_PREFIX + name).encode()) + _field(2, payload)


def _field(number: int, payload: bytes) -> bytes:
    size, header = len(payload), bytearray([number << 3 | 2])
    while True:
        byte = size & 0x7F
        size >>= 7
        header.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(header) + payload
