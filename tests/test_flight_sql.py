"""Flight SQL: a generic client (ADBC's Flight SQL driver, as JDBC/BI tools use) runs live SQL
on ``pushtable serve``."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import adbc_driver_flightsql.dbapi as flightsql
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushtable.flight import Client, Server, connect
from pushtable.flight.server import sql
from pushtable.flight.server.auth import Grant
from pushtable.flight.server.catalog import sql_type_name
from tests.conftest import SCHEMA, WAIT, Background, batch, wait_until


@pytest.fixture
def secured() -> Iterator[Server]:
    s = Server(token="s3cret")
    yield s
    s.stop()


def adbc(server: Server, token: str | None = "s3cret") -> flightsql.Connection:
    options = {"adbc.flight.sql.authorization_header": f"Bearer {token}"} if token else {}
    return flightsql.connect(server.location, db_kwargs=options, autocommit=True)


def test_an_adbc_client_reads_a_live_table_while_it_is_written(secured: Server) -> None:
    client = connect(secured.location, token="s3cret")
    client.create_table("t", SCHEMA)
    with adbc(secured) as conn, conn.cursor() as cur:

        def run() -> pa.Table:
            cur.execute("SELECT k FROM t ORDER BY k")
            return cur.fetch_arrow_table()

        reading = Background(run)
        # The statement is planned and running before any data exists: it answers live.
        wait_until(lambda: secured._calls.count == 1, "the Flight SQL query under way")
        with client.sink("t") as sink:
            sink.write(batch(3))
            sink.write(batch(2, start=3))
        assert reading.join().column("k").to_pylist() == list(range(5))


def test_adbc_errors_and_refusals(secured: Server) -> None:
    with adbc(secured) as conn, conn.cursor() as cur:
        with pytest.raises(flightsql.Error, match=r"table 'datafusion\.public\.nope' not found"):
            cur.execute("SELECT * FROM nope")
        with pytest.raises(flightsql.Error, match="CommandPreparedStatementUpdate is not impl"):
            cur.executemany("SELECT ? AS x", [(1,), (2,)])  # an update: refused by name
    with (
        adbc(secured, token="wrong") as conn,
        conn.cursor() as cur,
        pytest.raises(flightsql.Error, match=r"(?i)unauthenticated|bearer"),
    ):
        cur.execute("SELECT 1")


def test_statement_queries_decode_and_other_descriptors_are_refused(
    server: Server, client: Client
) -> None:
    assert sql.statement_query(sql.encode_statement_query("SELECT 1 AS x")) == "SELECT 1 AS x"
    with pytest.raises(ValueError, match="not a Flight SQL command"):
        sql.statement_query(b"\x0a\x03abc")
    raw = flight.FlightClient(server.location)
    info = raw.get_flight_info(
        flight.FlightDescriptor.for_command(sql.encode_statement_query("SELECT 41 + 1 AS x"))
    )
    assert info.schema.names == ["x"]
    assert raw.do_get(info.endpoints[0].ticket).read_all().to_pydict() == {"x": [42]}
    with pytest.raises(flight.FlightServerError, match="Flight SQL commands only"):
        raw.get_flight_info(flight.FlightDescriptor.for_path("t"))
    with pytest.raises(flight.FlightServerError, match="CommandStatementUpdate"):
        raw.get_flight_info(
            flight.FlightDescriptor.for_command(sql.encode_command("CommandStatementUpdate"))
        )
    with pytest.raises(flight.FlightServerError, match="truncated protobuf"):
        raw.get_flight_info(
            flight.FlightDescriptor.for_command(
                sql.encode_command("CommandGetTables", b"\x1a\x09ev")
            )
        )
    raw.close()


@pytest.mark.parametrize(
    "kind",
    ["CommandStatementSubstraitPlan", *sql.REFUSED_ACTIONS],
)
def test_substrait_transactions_and_cancel_query_are_refused_by_name(
    server: Server, kind: str
) -> None:
    """docs/network.md: Substrait plans, transactions and ``CancelQuery`` are refused with an
    error that names the command, by class (``UnsupportedCallError``)."""
    from pushtable import UnsupportedCallError
    from pushtable.flight import protocol

    raw = flight.FlightClient(server.location)
    with pytest.raises(flight.FlightServerError) as refused:
        if kind.startswith("Command"):
            raw.get_flight_info(flight.FlightDescriptor.for_command(sql.encode_command(kind)))
        else:
            list(raw.do_action(flight.Action(kind, b"")))
    raw.close()
    error = protocol.client_error(refused.value)
    assert isinstance(error, UnsupportedCallError), error
    assert f"Flight SQL {'command' if kind.startswith('Command') else 'action'} {kind}" in str(
        error
    )


# -- the catalog, as tools browse it ---------------------------------------------------------

EVENTS = pa.schema([("k", pa.int64()), ("s", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])


@pytest.fixture
def browsed() -> Iterator[Server]:
    """A server with two tables, and a token that sees only ``events*``."""
    s = Server(
        token="s3cret",
        tokens={"dash": Grant("dashboard", roles={"read"}, tables=("events*",))},
    )
    client = connect(s.location, token="s3cret")
    client.create_table("events", EVENTS)
    client.create_table("secrets", pa.schema([("x", pa.float64())]))
    yield s
    s.stop()


def test_get_info_and_table_types(browsed: Server) -> None:
    with adbc(browsed) as conn:
        info = conn.adbc_get_info()
        assert info["vendor_name"] == "pushtable"
        assert info["vendor_arrow_version"] == pa.__version__
        assert conn.adbc_get_table_types() == ["TABLE"]
    raw = flight.FlightClient(browsed.location)
    options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer s3cret")])
    wanted = sql.encode_command("CommandGetSqlInfo", b"\x0a\x04\x00\x03\x9c\x04")  # 0, 3, 540
    info_flight = raw.get_flight_info(flight.FlightDescriptor.for_command(wanted), options)
    got = raw.do_get(info_flight.endpoints[0].ticket, options).read_all()
    assert got.schema.equals(info_flight.schema)
    assert got.column("info_name").to_pylist() == [0, 3]  # 540 is not an id this server has
    assert got.column("value").to_pylist() == ["pushtable", True]  # name; read-only
    raw.close()


def test_get_objects_at_each_depth_with_filters(browsed: Server) -> None:
    with adbc(browsed) as conn:
        catalogs = conn.adbc_get_objects(depth="catalogs").read_all().to_pylist()
        assert [c["catalog_name"] for c in catalogs] == ["datafusion"]
        schemas = conn.adbc_get_objects(depth="db_schemas").read_all().to_pylist()
        assert [s["db_schema_name"] for s in schemas[0]["catalog_db_schemas"]] == ["public"]
        tables = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
        listed = tables[0]["catalog_db_schemas"][0]["db_schema_tables"]
        assert [(t["table_name"], t["table_type"]) for t in listed] == [
            ("events", "TABLE"),
            ("secrets", "TABLE"),
        ]
        columns = conn.adbc_get_objects(depth="all", table_name_filter="ev%").read_all()
        found = columns.to_pylist()[0]["catalog_db_schemas"][0]["db_schema_tables"]
        assert [t["table_name"] for t in found] == ["events"]
        assert [c["column_name"] for c in found[0]["table_columns"]] == ["k", "s", "ts"]
        type_names = [c["xdbc_type_name"] for c in found[0]["table_columns"]]
        assert type_names == [sql_type_name(f.type) for f in EVENTS]
        assert None not in type_names
        none = conn.adbc_get_objects(depth="tables", catalog_filter="elsewhere").read_all()
        assert none.to_pylist() == []
        assert conn.adbc_get_table_schema("events").equals(EVENTS)


def test_a_catalog_pattern_is_matched_without_backtracking(browsed: Server) -> None:
    """``'%' * 55 + 'x'`` as a schema filter held the GIL 9-13 s (a regex's backtracking
    grows as K^6): every other tenant froze. Patterns are matched segment by segment; these
    answer at once (bounded by the call's wait, as any), and as a LIKE does."""

    def objects(
        db_schema_filter: str | None = None, table_name_filter: str | None = None
    ) -> list[str]:
        with adbc(browsed) as conn:
            found = conn.adbc_get_objects(
                depth="tables",
                db_schema_filter=db_schema_filter,
                table_name_filter=table_name_filter,
            )
            got = found.read_all().to_pylist()
        return [
            t["table_name"]
            for c in got
            for d in c["catalog_db_schemas"]
            for t in d["db_schema_tables"]
        ]

    calls = [
        Background(lambda: objects(db_schema_filter="%" * 80 + "x")),
        Background(
            lambda: objects(db_schema_filter="%" * 80 + "c", table_name_filter="%" * 80 + "s")
        ),
        Background(lambda: objects(table_name_filter="_%v%_t%")),
    ]
    assert [call.join(timeout=WAIT) for call in calls] == [[], ["events", "secrets"], ["events"]]
    with adbc(browsed) as conn, pytest.raises(flightsql.Error, match="at most 1,024 characters"):
        conn.adbc_get_objects(depth="tables", table_name_filter="%" * 2000).read_all()


@settings(max_examples=300, deadline=None)
@given(pattern=st.text(alphabet="ab%_\\", max_size=8), name=st.text(alphabet="ab_%\\", max_size=8))
def test_a_catalog_pattern_matches_as_like_does(pattern: str, name: str) -> None:
    """The matcher against a LIKE written as a regex (``%`` any run, ``_`` one character,
    ``\\`` escapes), on names made of the pattern's own characters."""
    import re

    from pushtable.flight.server.catalog import _Like

    out, escaped = [], False
    for ch in pattern:
        if escaped:
            out.append(re.escape(ch))
            escaped = False
        elif ch == "\\":
            escaped = True
        else:
            out.append({"%": ".*", "_": "."}.get(ch, re.escape(ch)))
    like = re.compile("".join(out), re.DOTALL)
    assert _Like(pattern).matches(name) == (like.fullmatch(name) is not None)


def test_a_scoped_token_sees_only_its_tables_in_every_catalog_command(browsed: Server) -> None:
    with adbc(browsed, token="dash") as conn:
        tables = conn.adbc_get_objects(depth="all").read_all().to_pylist()
        listed = tables[0]["catalog_db_schemas"][0]["db_schema_tables"]
        assert [t["table_name"] for t in listed] == ["events"]
        # ADBC looks the table up through GetTables, whose listing leaves it out: not found.
        with pytest.raises(flightsql.ProgrammingError, match="NOT_FOUND: No table found"):
            conn.adbc_get_table_schema("secrets")
        with conn.cursor() as cur, pytest.raises(flightsql.Error, match="dashboard"):
            cur.execute("SELECT * FROM secrets")


def test_key_and_type_commands_answer_typed_results(browsed: Server) -> None:
    raw = flight.FlightClient(browsed.location)
    options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer s3cret")])

    def run(kind: str, body: bytes = b"") -> pa.Table:
        descriptor = flight.FlightDescriptor.for_command(sql.encode_command(kind, body))
        info = raw.get_flight_info(descriptor, options)
        table = raw.do_get(info.endpoints[0].ticket, options).read_all()
        assert table.schema.equals(info.schema), kind
        return table

    table = sql.string_field(3, "events")
    for kind in ("CommandGetPrimaryKeys", "CommandGetExportedKeys", "CommandGetImportedKeys"):
        assert run(kind, table).num_rows == 0
    assert run("CommandGetPrimaryKeys", table).schema.names[-1] == "key_sequence"
    types = run("CommandGetXdbcTypeInfo")
    codes = types.column("data_type").to_pylist()
    assert codes == sorted(codes)
    assert {"BIGINT", "VARCHAR", "TIMESTAMP", "DOUBLE"} <= set(
        types.column("type_name").to_pylist()
    )
    bigint = run("CommandGetXdbcTypeInfo", b"\x08" + b"\xfb" + b"\xff" * 8 + b"\x01")  # -5
    assert bigint.column("type_name").to_pylist() == ["BIGINT"]
    with_schema = run("CommandGetTables", sql.bool_field(5, True))
    assert pa.ipc.read_schema(pa.py_buffer(with_schema.column("table_schema")[0].as_py())).equals(
        EVENTS
    )
    raw.close()


def test_parameters_of_several_types_are_bound(browsed: Server) -> None:
    client = connect(browsed.location, token="s3cret")
    with client.sink("events") as sink:
        sink.write(
            pa.record_batch(
                {
                    "k": [1, 2, 3],
                    "s": ["a", "b", "c"],
                    "ts": pa.array([0, 1_000_000, 2_000_000], pa.timestamp("us", tz="UTC")),
                },
                schema=EVENTS,
            )
        )
    with adbc(browsed) as conn, conn.cursor() as cur:
        after = datetime(1970, 1, 1, 0, 0, 0, 500_000, tzinfo=timezone.utc)
        cur.execute(
            "SELECT k, s, ? AS tag, ? * 2.0 AS twice, ? AS flag FROM events "
            "WHERE k >= ? AND s <> ? AND ts > ? ORDER BY k",
            ("t", 1.25, True, 1, "c", after),
        )
        got = cur.fetch_arrow_table().to_pydict()
    assert got == {"k": [2], "s": ["b"], "tag": ["t"], "twice": [2.5], "flag": [True]}


def test_bound_parameters_over_1_mib_are_refused_and_smaller_ones_bind(browsed: Server) -> None:
    """docs/network.md: bound parameters travel in the statement's handle, at most 1 MiB.

    ``length(?)`` also failed twice before: describing a placeholder inside a function call
    ("Converting Expr::ScalarFunction to a Python object is not implemented"), then a result
    column DataFusion knew was never null once bound ("schema does not match the declared
    schema of this GeneratorStream")."""
    from pushtable.flight.server.parameters import MAX_BYTES

    with adbc(browsed) as conn, conn.cursor() as cur:
        cur.execute("SELECT length(?) AS n", ("x" * 1000,))
        assert cur.fetch_arrow_table().to_pydict() == {"n": [1000]}
        with pytest.raises(flightsql.Error, match=f"{MAX_BYTES:,}"):
            cur.execute("SELECT length(?) AS n", ("x" * (MAX_BYTES + 1),))
            cur.fetch_arrow_table()


def test_a_prepared_statement_reports_its_parameter_types(browsed: Server) -> None:
    raw = flight.FlightClient(browsed.location)
    options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer s3cret")])
    query = "SELECT k FROM events WHERE k > ? AND s = ? AND ts < $3 -- what is '?' here"
    body = sql.encode_prepared_request(query)
    [result] = raw.do_action(flight.Action("CreatePreparedStatement", body), options)
    reply = sql.command(result.body.to_pybytes())
    assert reply.kind == "ActionCreatePreparedStatementResult"
    assert pa.ipc.read_schema(pa.py_buffer(reply.raw(2))).names == ["k"]
    params = pa.ipc.read_schema(pa.py_buffer(reply.raw(3)))
    assert params.names == ["$1", "$2", "$3"]
    assert params.types == [pa.int64(), pa.string(), pa.timestamp("us", tz="UTC")]
    raw.close()


def test_pandas_and_polars_read_through_an_adbc_connection(browsed: Server) -> None:
    import pandas as pd
    import polars as pl

    client = connect(browsed.location, token="s3cret")
    client.create_table("numbers", pa.schema([("k", pa.int64())]))
    with client.sink("numbers") as sink:
        sink.write(pa.record_batch({"k": [1, 2, 3]}))
    with adbc(browsed) as conn:
        frame = pd.read_sql("SELECT sum(k) AS total FROM numbers", conn)
    assert frame["total"].tolist() == [6]
    with adbc(browsed) as conn:
        polars_frame = pl.read_database("SELECT 1 + 1 AS two", connection=conn)
    assert polars_frame["two"].to_list() == [2]


# The hand-written codec against protobuf's own encoder and decoder (the runtime Spark
# Connect installs): every field number protobuf allows, every value.
FIELD_NUMBERS = st.integers(1, 2**29 - 1)


@given(FIELD_NUMBERS, st.booleans())
def test_a_bool_field_encodes_as_protobuf_encodes_it(number: int, value: bool) -> None:
    from google.protobuf.internal import encoder, wire_format

    expected = encoder.TagBytes(number, wire_format.WIRETYPE_VARINT) + encoder._VarintBytes(
        int(value)
    )
    assert sql.bool_field(number, value) == expected
    assert sql.Command("T", sql.message(expected)).flag(number) is value


@given(FIELD_NUMBERS, st.text(max_size=300))
def test_a_string_field_encodes_and_decodes_as_protobuf_does(number: int, text: str) -> None:
    from google.protobuf.internal import encoder, wire_format

    raw = text.encode()
    expected = (
        encoder.TagBytes(number, wire_format.WIRETYPE_LENGTH_DELIMITED)
        + encoder._VarintBytes(len(raw))
        + raw
    )
    assert sql.string_field(number, text) == expected
    assert sql.Command("T", sql.message(expected)).text(number) == text


# Every message the server reads or writes, declared once as FlightSql.proto declares it (field
# numbers and types), and built by protobuf's runtime: what protobuf encodes, the hand-written
# reader reads the same; what the server encodes, protobuf parses back the same.
_MESSAGES = """
CommandStatementQuery: string query = 1; optional bytes transaction_id = 2
CommandPreparedStatementQuery: bytes prepared_statement_handle = 1
CommandGetSqlInfo: repeated uint32 info = 1
CommandGetDbSchemas: optional string catalog = 1; optional string db_schema_filter_pattern = 2
CommandGetTables: optional string catalog = 1; optional string db_schema_filter_pattern = 2;
    optional string table_name_filter_pattern = 3; repeated string table_types = 4;
    bool include_schema = 5
CommandGetPrimaryKeys: optional string catalog = 1; optional string db_schema = 2; string table = 3
CommandGetXdbcTypeInfo: optional int32 data_type = 1
ActionCreatePreparedStatementRequest: string query = 1; optional bytes transaction_id = 2
ActionCreatePreparedStatementResult: bytes prepared_statement_handle = 1;
    bytes dataset_schema = 2; bytes parameter_schema = 3
DoPutPreparedStatementResult: optional bytes prepared_statement_handle = 1
"""


def declared() -> dict[str, list[tuple[str, int, str, str]]]:
    """:data:`_MESSAGES` by message: ``(field, number, type, label)`` as the .proto says."""
    out: dict[str, list[tuple[str, int, str, str]]] = {}
    for entry in _MESSAGES.replace(";\n    ", "; ").strip().splitlines():
        message, _, body = entry.partition(": ")
        for part in body.split("; "):
            words, number = part.split(" = ")
            *label, kind, field_name = words.split()
            out.setdefault(message, []).append((field_name, int(number), kind, "".join(label)))
    return out


@functools.cache
def proto(name: str) -> Any:
    """The protobuf class of message ``name`` of package ``arrow.flight.protocol.sql``."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    kinds = descriptor_pb2.FieldDescriptorProto
    types = {
        "string": kinds.TYPE_STRING,
        "bytes": kinds.TYPE_BYTES,
        "uint32": kinds.TYPE_UINT32,
        "int32": kinds.TYPE_INT32,
        "bool": kinds.TYPE_BOOL,
    }
    file = descriptor_pb2.FileDescriptorProto(
        name="flight_sql_test.proto", package="arrow.flight.protocol.sql", syntax="proto3"
    )
    for message, fields in declared().items():
        m = file.message_type.add(name=message)
        for field_name, number, kind, label in fields:
            f = m.field.add(
                name=field_name,
                number=number,
                type=types[kind],
                label=kinds.LABEL_REPEATED if label == "repeated" else kinds.LABEL_OPTIONAL,
            )
            if label == "optional":  # proto3 `optional`: presence, through a synthetic oneof
                f.proto3_optional = True
                f.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name=f"_{field_name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"arrow.flight.protocol.sql.{name}")
    )


def build(name: str, **values: Any) -> Any:
    """Message ``name`` with ``values`` set (None: an optional field left unset)."""
    return proto(name)(**{k: v for k, v in values.items() if v is not None})


def packed(name: str, msg: Any) -> bytes:
    """``msg`` in a ``google.protobuf.Any``, as a Flight SQL client sends a command."""
    from google.protobuf import any_pb2

    wrapper = any_pb2.Any()
    wrapper.Pack(msg)
    assert wrapper.type_url.endswith(f"arrow.flight.protocol.sql.{name}")
    data: bytes = wrapper.SerializeToString()
    return data


_texts = st.text(max_size=40)


@settings(max_examples=100, deadline=None)
@given(
    query=_texts,
    catalog=st.none() | _texts,
    schema_pattern=st.none() | _texts,
    table_pattern=st.none() | _texts,
    table_types=st.lists(_texts, max_size=3),
    include_schema=st.booleans(),
    info=st.lists(st.integers(0, 2**32 - 1), max_size=5),
    data_type=st.none() | st.integers(-(2**31), 2**31 - 1),
    handle=st.binary(max_size=60),
)
def test_every_command_protobuf_encodes_reads_back_the_same(
    query: str,
    catalog: str | None,
    schema_pattern: str | None,
    table_pattern: str | None,
    table_types: list[str],
    include_schema: bool,
    info: list[int],
    data_type: int | None,
    handle: bytes,
) -> None:
    cmd = sql.command(packed("CommandStatementQuery", build("CommandStatementQuery", query=query)))
    assert (cmd.kind, sql.statement(cmd)) == ("CommandStatementQuery", (query, None))
    msg = build("CommandPreparedStatementQuery", prepared_statement_handle=handle)
    cmd = sql.command(packed("CommandPreparedStatementQuery", msg))
    assert cmd.raw(1) == handle
    cmd = sql.command(packed("CommandGetSqlInfo", build("CommandGetSqlInfo", info=info)))
    assert cmd.numbers(1) == info  # packed, as proto3 encodes a repeated integer
    msg = build("CommandGetDbSchemas", catalog=catalog, db_schema_filter_pattern=schema_pattern)
    cmd = sql.command(packed("CommandGetDbSchemas", msg))
    assert (cmd.text(1), cmd.text(2)) == (catalog, schema_pattern)
    msg = build(
        "CommandGetTables",
        catalog=catalog,
        db_schema_filter_pattern=schema_pattern,
        table_name_filter_pattern=table_pattern,
        table_types=table_types,
        include_schema=include_schema,
    )
    cmd = sql.command(packed("CommandGetTables", msg))
    assert (cmd.text(1), cmd.text(2), cmd.text(3)) == (catalog, schema_pattern, table_pattern)
    assert (cmd.texts(4), cmd.flag(5)) == (table_types, include_schema)
    msg = build("CommandGetPrimaryKeys", catalog=catalog, db_schema=schema_pattern, table=query)
    cmd = sql.command(packed("CommandGetPrimaryKeys", msg))
    assert (cmd.text(1), cmd.text(2), cmd.text(3) or "") == (catalog, schema_pattern, query)
    msg = build("CommandGetXdbcTypeInfo", data_type=data_type)
    assert sql.command(packed("CommandGetXdbcTypeInfo", msg)).signed(1) == data_type


@settings(max_examples=50, deadline=None)
@given(query=_texts, handle=st.binary(max_size=60), wrapped=st.booleans())
def test_every_reply_the_server_encodes_protobuf_parses_back_the_same(
    query: str, handle: bytes, wrapped: bool
) -> None:
    from google.protobuf import any_pb2

    schema = pa.schema([("k", pa.int64())])
    params = pa.schema([("$1", pa.utf8())])
    request = build("ActionCreatePreparedStatementRequest", query=query)
    body = (
        packed("ActionCreatePreparedStatementRequest", request)
        if wrapped
        else (request.SerializeToString())
    )
    asked: list[str] = []

    def describe(q: str) -> tuple[pa.Schema, pa.Schema]:
        asked.append(q)
        return schema, params

    reply = any_pb2.Any.FromString(sql.prepared(body, describe))
    result = proto("ActionCreatePreparedStatementResult")()
    assert reply.Unpack(result)
    assert asked == [query]
    assert result.prepared_statement_handle == query.encode()
    assert pa.ipc.read_schema(pa.py_buffer(result.dataset_schema)).equals(schema)
    assert pa.ipc.read_schema(pa.py_buffer(result.parameter_schema)).equals(params)
    put = proto("DoPutPreparedStatementResult").FromString(sql.put_prepared_result(handle))
    assert put.prepared_statement_handle == handle
