"""A remote answer is the in-process answer: the same rows and types through pushtable's
Flight client and through ADBC's Flight SQL driver as ``ctx.sql`` gives on the server.

The shapes here failed remotely while they answered in process: a result whose batches carry
other physical types than the logical plan declares (a union of int32 and int64, a decimal
times zero, ``CASE`` over structs or over a list and a large list, a dictionary ``coalesce``),
a query ADBC prepares whose plan is deep (``GROUPING SETS``), and a scalar subquery in an
``ORDER BY`` over two live tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import adbc_driver_flightsql.dbapi as flightsql
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings

from pushtable.flight import Server, connect
from tests.conftest import WAIT, Background
from tests.differential import SHAPES, Case, L, Query, R, oracle, plain, remote, rows, same, split
from tests.test_differential import HEALTH, cases

K = pa.array([1, 2, None, 3], pa.int64())
T = pa.table(
    {
        "k": K,
        "s": pa.array(["a", None, "b", "a"]),
        "c": pa.array(
            [Decimal("1.25"), None, Decimal("-3.50"), Decimal("0.00")], pa.decimal128(9, 2)
        ),
        "st1": pa.array(
            [{"a": 1, "b": "x"}, None, {"a": 3, "b": None}, {"a": None, "b": "y"}],
            pa.struct([("a", pa.int64()), ("b", pa.string())]),
        ),
        "st2": pa.array(
            [{"a": 9, "b": "z"}, {"a": 8, "b": None}, None, {"a": 7, "b": "w"}],
            pa.struct([("a", pa.int64()), ("b", pa.string())]),
        ),
        "l1": pa.array([[1, 2], None, [], [None]], pa.list_(pa.int64())),
        "ll1": pa.array([[3], [4, None], None, []], pa.large_list(pa.int64())),
        "g": pa.array(["foo", None, "baz", None]).dictionary_encode(),
        "ts": pa.array([0, 1_000_000, None, 3_000_000], pa.timestamp("us", tz="Asia/Tokyo")),
    }
)
U1 = pa.table({"y": pa.array([1, None, 3], pa.int32())})
U2 = pa.table({"y": pa.array([2**40, None], pa.int64())})

QUERIES = [
    "SELECT * FROM (SELECT y FROM u1 UNION ALL SELECT y FROM u2)",
    "SELECT k, c * 0 AS z FROM t",
    "SELECT k, CASE WHEN k > 1 THEN st1 ELSE st2 END AS st FROM t",
    "SELECT k, CASE WHEN k > 1 THEN l1 ELSE ll1 END AS l FROM t",
    "SELECT k, coalesce(g, arrow_cast('bar', 'Dictionary(Int64, LargeUtf8)')) AS c FROM t",
    "SELECT k, s, count(*) AS n, sum(c) AS sc FROM t GROUP BY GROUPING SETS ((k, s), (k), (s))",
    "SELECT k, s, ts FROM t WHERE ts > TIMESTAMP '1970-01-01T09:00:00+09:00' OR s IS NULL",
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(token="s3cret")
    s.ctx.register_record_batches("t", [T.to_batches()])
    s.ctx.register_record_batches("u1", [U1.to_batches()])
    s.ctx.register_record_batches("u2", [U2.to_batches()])
    yield s
    s.stop()


def _same(sql: str, how: str, got: pa.Table, want: pa.Table) -> None:
    assert got.column_names == want.column_names, (how, sql)
    assert [plain(t) for t in got.schema.types] == [plain(t) for t in want.schema.types], (
        how,
        sql,
        got.schema,
        want.schema,
    )
    assert sorted(rows(got), key=repr) == sorted(rows(want), key=repr), (how, sql)


@pytest.mark.parametrize("sql", QUERIES)
def test_a_query_answers_the_same_in_process_through_flight_and_through_adbc(
    server: Server, sql: str
) -> None:
    want = server.ctx.sql(sql).to_arrow_table()
    assert want.num_rows
    with connect(server.location, token="s3cret") as client:
        _same(sql, "flight", client.sql(sql).read_all(), want)
    options = {"adbc.flight.sql.authorization_header": "Bearer s3cret"}
    with (
        flightsql.connect(server.location, db_kwargs=options, autocommit=True) as conn,
        conn.cursor() as cur,
    ):
        cur.execute(sql)
        _same(sql, "adbc", cur.fetch_arrow_table(), want)


def test_a_live_table_named_with_capitals_streams_remotely(server: Server) -> None:
    """The server took ``events_foreachBatch`` for stored data (its name, as registered, did
    not match the one the query references, lowercased) and held the DoGet for a first batch
    no producer had written: the client's ``sql`` never returned (Spark Connect's slow test
    hung CI that way)."""
    client = connect(server.location, token="s3cret")
    client.create_table("Events_Remote", pa.schema([("id", pa.int64())]))
    result = Background(lambda: client.sql("SELECT id FROM Events_Remote"))
    rows_of = result.join(timeout=WAIT)  # the call answers before any row is written
    with client.sink("Events_Remote") as sink:
        sink.write(pa.record_batch({"id": [1, 2]}))
    assert rows_of.read_all()["id"].to_pylist() == [1, 2]


def test_a_scalar_subquery_in_an_order_by_over_two_live_tables_answers(server: Server) -> None:
    a = pa.schema([("x", pa.int64())])
    b = pa.schema([("v", pa.decimal128(6, 1))])
    sql = "SELECT x FROM a ORDER BY x + (SELECT max(v) FROM b)"
    with connect(server.location, token="s3cret") as client:
        client.create_table("a", a, 4)
        client.create_table("b", b, 4)
        result = Background(lambda: client.sql(sql).read_all())
        with client.sink("b") as sb:
            sb.write(pa.record_batch({"v": pa.array([Decimal("1.5"), None], b.field("v").type)}))
        with client.sink("a") as sa:
            sa.write(pa.record_batch({"x": [3, None, 1]}, schema=a))
        got = result.join(WAIT)
    assert got.column("x").to_pylist() == [1, 3, None]


@pytest.mark.parametrize("way", ["flight", "adbc"])
def test_a_live_querys_declared_types_are_those_datafusion_computes(way: str) -> None:
    """``sum(d), count(DISTINCT s)``: DataFusion's optimizer sums partial sums, so plain
    DataFusion answers ``decimal128(30, 2)`` over a ``decimal128(10, 2)`` column where the
    query text's plan says ``decimal128(20, 2)``. A live query declares its schema before its
    first batch: the server declared the text's types and cast the rows to them (the slow
    sweep found it), so the remote answer's type differed from the batch answer's."""
    sql = "SELECT k, sum(d) AS sd, count(DISTINCT s) AS ds FROM l GROUP BY k"
    rows_l: list[dict[str, Any]] = [
        {"k": 0, "s": None, "d": Decimal("2.25")},
        {"k": 0, "s": "a", "d": None},
    ]
    case = Case(
        query=Query(sql, {"l"}, ordered=False, shape="aggregate"),
        l_rows=[{**r, "f": None, "ts": None, "g": None, "lst": None, "st": None} for r in rows_l],
        r_rows=[],
        l_cuts=[1],
        r_cuts=[],
        r_live=False,
        capacity=1,
        m_rows=[],
        before=0,
    )
    want = oracle(case)
    assert want.schema.field("sd").type == pa.decimal128(30, 2)  # what the bug lost
    same(case, remote(case, way), want)


# --- the differential grammar, three ways -----------------------------------------------------


def _tables(case: Case) -> dict[str, pa.Table]:
    """The case's tables as stored data (``l2``: the batches after the subscriptions)."""
    tables = {
        "l": pa.Table.from_pylist(case.l_rows, schema=L),
        "r": pa.Table.from_pylist(case.r_rows, schema=R),
        "m": pa.Table.from_pylist(case.m_rows, schema=R),
    }
    if case.query.subscriptions:
        later = split(case.l_rows, L, case.l_cuts)[case.before :]
        tables["l2"] = pa.Table.from_batches(later, schema=L)
    return tables


@pytest.mark.parametrize("shape", SHAPES)
def test_the_grammar_answers_the_same_through_flight_and_adbc(server: Server, shape: str) -> None:
    """Each shape of ``tests/differential.py`` over stored tables on a server: the rows and
    types of ``ctx.sql`` on the server, of pushtable's Flight client and of ADBC agree (the
    live answers are diffed against DataFusion in ``tests/test_differential.py``)."""
    options = {"adbc.flight.sql.authorization_header": "Bearer s3cret"}
    answered = []
    with (
        connect(server.location, token="s3cret") as client,
        flightsql.connect(server.location, db_kwargs=options, autocommit=True) as conn,
        conn.cursor() as cur,
    ):

        @settings(
            max_examples=8,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(cases(shape))
        def diff(case: Case) -> None:
            for name, table in _tables(case).items():
                if server.ctx.table_exist(name):
                    server.ctx.deregister_table(name)
                empty = [pa.RecordBatch.from_pylist([], schema=table.schema)]
                server.ctx.register_record_batches(name, [table.to_batches() or empty])
            sql = case.query.sql
            want = server.ctx.sql(sql).to_arrow_table()
            same(case, client.sql(sql).read_all(), want)
            cur.execute(sql)
            same(case, cur.fetch_arrow_table(), want)
            answered.append(want.num_rows > 0)

        diff()
    assert any(answered), f"{shape}: no case had a row to compare ({len(answered)} cases)"


def _remote_sweep(
    shape: str, examples: int, derandomize: bool, *, skip_empty: bool = False
) -> list[bool]:
    """Whether each case's answer had rows; with ``skip_empty`` only those are run remotely
    (an empty answer is compared in process by ``tests/test_differential.py``)."""
    answered: list[bool] = []

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=HEALTH,
    )
    @given(cases(shape))
    def diff(case: Case) -> None:
        want = oracle(case)
        answered.append(want.num_rows > 0)
        if skip_empty and not want.num_rows:
            return
        for way in ("flight", "adbc"):
            same(case, remote(case, way), want)

    diff()
    return answered


@pytest.mark.parametrize("shape", SHAPES)
def test_live_tables_fed_by_remote_sinks_answer_as_datafusion_through_flight_and_adbc(
    shape: str,
) -> None:
    """Each shape of ``tests/differential.py`` over *live* tables on a server, fed by remote
    sinks (the network's ingest path) while the query runs, read through pushtable's Flight
    client and through ADBC: the rows and types plain DataFusion gives over the same rows.
    (8 cases a shape, those with rows run: the slow sweep runs 40 a shape, every one.)"""
    answered = _remote_sweep(shape, 8, derandomize=True, skip_empty=True)
    assert any(answered), f"{shape}: no case had a row to compare ({len(answered)} cases)"


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_live_tables_fed_by_remote_sinks_sweep(shape: str) -> None:
    """The same, 40 cases a shape drawn anew each run, every one compared, at least one with
    rows. (The floor of rows in a fifth of the cases is the in-process sweep's, over 263 cases a
    shape: 40 of hypothesis's draws start with its simplest, often empty, tables, and two
    shapes fell to 4 of 40 in one run.)"""
    answered = _remote_sweep(shape, 40, derandomize=False)
    assert any(answered), f"{shape}: no case had a row ({len(answered)} cases)"
