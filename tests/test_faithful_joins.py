"""Joins over live tables answer what plain DataFusion answers over the same rows.

Null equality (``IS NOT DISTINCT FROM``, ``EXCEPT``, ``INTERSECT``), two columns of one name,
two live tables without a time bound (bounded ones answer; a bounded one with an unbounded
one is a lookup once it closes; two unbounded ones are refused up front), and one table named
several times in a query (read once, shared by its scans). Each is diffed against plain
DataFusion; the random sweep of the same promise is ``tests/test_differential.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import datafusion
import pyarrow as pa
import pytest

from pushtable import (
    ResourceLimitError,
    SessionContext,
    StreamConsumedError,
    UnboundedQueryError,
    explain_live,
)
from tests.conftest import WAIT, Background
from tests.test_live_answers import Results

ID = pa.schema([("id", pa.int64())])


def oracle(sql: str, tables: dict[str, pa.Table]) -> pa.Table:
    ctx = datafusion.SessionContext()
    for name, table in tables.items():
        ctx.register_record_batches(
            name, [table.to_batches() or [pa.record_batch([], table.schema)]]
        )
    return ctx.sql(sql).to_arrow_table()


def multiset(table: pa.Table) -> list[tuple[Any, ...]]:
    columns = [c.to_pylist() for c in table.columns]
    return sorted((tuple(c[i] for c in columns) for i in range(table.num_rows)), key=repr)


def live_and_memory(l_ids: list[int | None], r_ids: list[int | None]) -> SessionContext:
    """``l`` live (written in one-row batches, then closed), ``r`` in memory."""
    ctx = SessionContext()
    ctx.register_record_batches("r", [[pa.record_batch({"id": pa.array(r_ids, pa.int64())})]])
    sink = ctx.register_streaming_table("l", ID, capacity=len(l_ids) + 1)
    for i in l_ids:
        sink.write(pa.record_batch({"id": pa.array([i], pa.int64())}))
    sink.close()
    return ctx


# --- 1. null equality in the lookup join -----------------------------------------------------

NULL_SAFE = [
    ("SELECT id FROM l EXCEPT SELECT id FROM r", [(2,)]),
    ("SELECT id FROM l INTERSECT SELECT id FROM r", [(1,), (None,)]),
    ("SELECT l.id FROM l JOIN r ON l.id IS NOT DISTINCT FROM r.id", [(1,), (None,)]),
    ("SELECT l.id FROM l JOIN r ON l.id = r.id", [(1,)]),
    ("SELECT id FROM l WHERE id NOT IN (SELECT id FROM r)", []),
    ("SELECT l.id, r.id AS rid FROM l LEFT JOIN r ON l.id IS NOT DISTINCT FROM r.id", None),
]


@pytest.mark.parametrize(("sql", "expected"), NULL_SAFE)
def test_a_lookup_join_keeps_the_null_equality_of_the_join_it_replaces(
    sql: str, expected: list[tuple[Any, ...]] | None
) -> None:
    ctx = live_and_memory([1, 2, None], [1, None])
    want = oracle(
        sql,
        {
            "l": pa.table({"id": pa.array([1, 2, None], pa.int64())}),
            "r": pa.table({"id": pa.array([1, None], pa.int64())}),
        },
    )
    if expected is not None:
        assert multiset(want) == sorted(expected, key=repr)  # what SQL says, not only DataFusion
    assert multiset(ctx.sql(sql).to_arrow_table()) == multiset(want)


LOOKUP_SHAPES = [
    # semi: live rows with a match in the dimension
    ("SELECT id FROM l WHERE EXISTS (SELECT 1 FROM r WHERE r.id = l.id)", [(1,), (1,)]),
    ("SELECT id FROM l WHERE id IN (SELECT id FROM r)", [(1,), (1,)]),
    # anti: live rows without one (a NULL key matches nothing, so it stays)
    ("SELECT id FROM l WHERE NOT EXISTS (SELECT 1 FROM r WHERE r.id = l.id)", None),
    # the dimension on the left of a RIGHT JOIN: every live row, matched or not
    ("SELECT l.id, r.id AS rid FROM r RIGHT JOIN l ON r.id = l.id", None),
    ("SELECT l.id, r.id AS rid FROM l LEFT JOIN r ON r.id = l.id", None),
]


@pytest.mark.parametrize(("sql", "expected"), LOOKUP_SHAPES)
def test_lookup_semi_anti_and_dimension_right_joins_answer_as_datafusion(
    sql: str, expected: list[tuple[Any, ...]] | None
) -> None:
    """docs/semantics.md's join shapes: semi and anti joins of a live table against an
    in-memory one, and ``dim RIGHT JOIN live``, diffed against DataFusion (with duplicate
    keys and NULLs on both sides)."""
    l_ids, r_ids = [1, 2, None, 1, 3], [1, None, 1, 4]
    ctx = live_and_memory(l_ids, r_ids)
    want = oracle(
        sql,
        {
            "l": pa.table({"id": pa.array(l_ids, pa.int64())}),
            "r": pa.table({"id": pa.array(r_ids, pa.int64())}),
        },
    )
    if expected is not None:  # each live row once, as SQL says: a semi join never repeats
        assert multiset(want) == sorted(expected, key=repr)
    assert multiset(ctx.sql(sql).to_arrow_table()) == multiset(want)


def test_explain_live_names_the_join_and_its_null_semantics() -> None:
    ctx = live_and_memory([1], [1])
    strict = explain_live(ctx, "SELECT l.id FROM l JOIN r ON l.id = r.id")
    assert strict.engine == "pushtable"
    assert any("lookup join" in r and "a NULL key matches nothing" in r for r in strict.reasons)
    safe = explain_live(ctx, "SELECT id FROM l INTERSECT SELECT id FROM r")
    assert any("RightSemi" in r and "NULL keys match each other" in r for r in safe.reasons), safe


# --- 2. two columns of one name ---------------------------------------------------------------


def test_a_join_result_may_hold_two_columns_of_one_name() -> None:
    ctx = SessionContext()
    ctx.register_record_batches("dim", [[pa.record_batch({"a": [1, 2], "x": ["p", "q"]})]])
    sink = ctx.register_streaming_table("live", pa.schema([("a", pa.int64())]))
    sink.write(pa.record_batch({"a": [1, 2, 3]}))
    sink.close()
    got = ctx.sql("SELECT live.a, dim.a FROM live JOIN dim ON live.a = dim.a").to_arrow_table()
    assert got.column_names == ["a", "a"]
    assert multiset(got) == [(1, 1), (2, 2)]


def test_every_way_of_reading_such_a_result_names_the_columns_as_datafusion_does() -> None:
    def fresh() -> SessionContext:
        ctx = SessionContext()
        ctx.register_record_batches("dim", [[pa.record_batch({"a": [1, 2], "x": ["p", "q"]})]])
        sink = ctx.register_streaming_table("live", pa.schema([("a", pa.int64())]))
        sink.write(pa.record_batch({"a": [1, 2, 3]}))
        sink.close()
        return ctx

    sql = "SELECT * FROM live JOIN dim ON live.a = dim.a"
    ctx = fresh()  # each read below runs the single-scan query once, on its own session
    assert ctx.sql(sql).schema().names == ["a", "a", "x"]
    batches = ctx.sql(sql).collect()
    assert all(b.schema.names == ["a", "a", "x"] for b in batches)
    ctx = fresh()
    streamed = [b.to_pyarrow() for b in ctx.sql(sql).execute_stream()]
    assert all(b.schema.names == ["a", "a", "x"] for b in streamed)
    assert sum(b.num_rows for b in streamed) == 2
    ctx = fresh()
    assert pa.table(ctx.sql(sql)).column_names == ["a", "a", "x"]  # the Arrow C stream
    ctx = fresh()
    assert list(ctx.sql(sql).to_pandas().columns) == ["a", "a", "x"]
    # a DataFrame derived from it names the two apart, by their qualified names
    ctx = fresh()
    derived = ctx.sql(sql).select(datafusion.col('"dim.a"')).to_pydict()
    assert sorted(derived["dim.a"]) == [1, 2]


# --- 3. two live tables without a time bound -------------------------------------------------

A = pa.schema([("k", pa.int64()), ("v", pa.string())])
B = pa.schema([("k", pa.int64()), ("w", pa.decimal128(8, 2))])
JOINS = [
    "SELECT a.k, a.v, b.w FROM a JOIN b ON a.k = b.k",
    "SELECT a.k, b.w FROM a LEFT JOIN b ON a.k = b.k",
    "SELECT a.k, b.k AS bk FROM a FULL JOIN b ON a.k = b.k",
    "SELECT k FROM a EXCEPT SELECT k FROM b",
    "SELECT k FROM a INTERSECT SELECT k FROM b",
    "SELECT k, v FROM a WHERE k IN (SELECT k FROM b)",
    "SELECT k, v FROM a WHERE NOT EXISTS (SELECT 1 FROM b WHERE b.k = a.k)",
    "SELECT k FROM a WHERE k NOT IN (SELECT k FROM b)",
    "SELECT a.k, b.k AS bk FROM a JOIN b ON a.k < b.k",
    "SELECT count(*) AS n FROM a CROSS JOIN b",
    # DataFusion 54 answers a scalar subquery whole before it executes its main input: found
    # hanging by the differential check (the main input's table was not read meanwhile)
    "SELECT k, v FROM a WHERE k > (SELECT avg(k) FROM b)",
]


def ab_rows() -> tuple[list[pa.RecordBatch], list[pa.RecordBatch]]:
    a = [pa.record_batch({"k": [i % 5, None], "v": [f"v{i}", None]}, schema=A) for i in range(12)]
    b = [pa.record_batch({"k": [i % 7]}, schema=pa.schema([B.field("k")])) for i in range(9)]
    b = [
        pa.record_batch({"k": x.column(0), "w": pa.array([None], B.field("w").type)}, schema=B)
        for x in b
    ]
    return a, b


@pytest.mark.parametrize("sql", JOINS)
def test_two_bounded_live_tables_written_by_one_thread_join_as_datafusion_does(sql: str) -> None:
    """One producer writes both tables in turn, each queue holding one batch: the join reads
    each side as it is written, and answers once the tables close."""
    a_batches, b_batches = ab_rows()
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", A, capacity=1)
    b = ctx.register_streaming_table("b", B, capacity=1)
    assert explain_live(ctx, sql).engine == "pushtable"
    result = Background(ctx.sql(sql).to_arrow_table)
    for x, y in zip(a_batches, b_batches + [None] * 3, strict=True):
        a.write(x, timeout=WAIT)
        if y is not None:
            b.write(y, timeout=WAIT)
    a.close()
    b.close()
    want = oracle(
        sql, {"a": pa.Table.from_batches(a_batches), "b": pa.Table.from_batches(b_batches)}
    )
    assert multiset(result.join()) == multiset(want)


def test_a_bounded_live_table_joins_an_unbounded_one_as_a_lookup_once_it_closes() -> None:
    ctx = SessionContext()
    events = ctx.register_streaming_table("events", A, capacity=1, unbounded=True)
    users = ctx.register_streaming_table("users", B, capacity=1)
    sql = "SELECT e.k, e.v, u.w FROM events e JOIN users u ON e.k = u.k"
    explanation = explain_live(ctx, sql)
    assert explanation.mode == "incremental"
    assert any("once its bounded live side has closed" in r for r in explanation.reasons)
    results = Results(ctx, sql)
    events.write(pa.record_batch({"k": [1], "v": ["early"]}, schema=A), timeout=WAIT)
    events.write(pa.record_batch({"k": [2], "v": ["early2"]}, schema=A), timeout=WAIT)  # read ahead
    users.write(pa.record_batch({"k": [1, 2], "w": [None, None]}, schema=B), timeout=WAIT)
    users.close()
    assert sorted(r["v"] for r in results.rows(2)) == ["early", "early2"]
    events.write(pa.record_batch({"k": [2, 3], "v": ["late", "none"]}, schema=A), timeout=WAIT)
    assert [r["v"] for r in results.rows(1)] == ["late"]  # while events stays open
    events.close()
    assert results.finish() == []


def test_a_join_keeping_a_bounded_sides_unmatched_rows_against_an_unbounded_one_is_refused() -> (
    None
):
    ctx = SessionContext()
    ctx.register_streaming_table("events", A, unbounded=True)
    ctx.register_streaming_table("users", B)
    with pytest.raises(UnboundedQueryError, match="unbounded"):
        ctx.sql("SELECT u.k, e.v FROM users u LEFT JOIN events e ON e.k = u.k")


def test_two_unbounded_live_tables_without_a_time_bound_are_refused_up_front() -> None:
    ctx = SessionContext()
    ctx.register_streaming_table("a", A, unbounded=True)
    ctx.register_streaming_table("b", B, unbounded=True)
    with pytest.raises(UnboundedQueryError, match="time bound"):
        ctx.sql("SELECT a.k FROM a JOIN b ON a.k = b.k")
    with pytest.raises(UnboundedQueryError, match="unbounded"):
        ctx.sql("SELECT a.k FROM a CROSS JOIN b")
    assert explain_live(ctx, "SELECT k FROM a EXCEPT SELECT k FROM b").mode == "rejected"


def test_a_read_ahead_past_the_memory_limit_fails_naming_it() -> None:
    """The probe side waits in memory while the build side is open: past the session's
    memory_limit the query fails naming it, and the producer is told the reader is gone."""
    ctx = SessionContext(memory_limit=2 * 2**20)
    a = ctx.register_streaming_table("a", A, capacity=1)
    ctx.register_streaming_table("b", B, capacity=1)  # never written: its side stays open
    result = Background(ctx.sql("SELECT a.k, b.w FROM b JOIN a ON a.k = b.k").to_arrow_table)
    big = pa.record_batch({"k": list(range(50_000)), "v": ["x" * 20] * 50_000}, schema=A)
    stop = threading.Event()

    def produce() -> None:
        for _ in range(100):
            if stop.is_set():
                return
            try:
                a.write(big, timeout=WAIT)
            except Exception:  # noqa: BLE001 - the reader went away: what the test waits for
                return

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    error = result.join_error()
    stop.set()
    assert isinstance(error, ResourceLimitError), repr(error)
    assert "memory_limit" in str(error)
    producer.join(WAIT)
    assert not producer.is_alive()


def test_a_client_joins_a_table_it_created_filled_and_closed(server: Any, client: Any) -> None:
    """Over the network: `events` stays open, `users` is created, filled and closed by the
    client; the join is a lookup once users closes."""
    client.create_table("events", A, 4, unbounded=True)
    client.create_table("users", B, 4)
    with client.sink("users") as users:
        users.write(pa.record_batch({"k": [1, 2], "w": [None, None]}, schema=B))
    result = client.sql("SELECT e.k, e.v FROM events e JOIN users u ON e.k = u.k")
    with client.sink("events") as events:
        events.write(pa.record_batch({"k": [1, 3, 2], "v": ["a", "c", "b"]}, schema=A))
    assert sorted(result.read_all().column("v").to_pylist()) == ["a", "b"]


# --- 4. one table named several times --------------------------------------------------------

T = pa.schema([("x", pa.int64()), ("s", pa.string())])
TWICE = [
    "SELECT a.x, b.s FROM t a JOIN t b ON a.x = b.x",
    "WITH c AS (SELECT x, s FROM t WHERE x IS NOT NULL) "
    "SELECT a.x, b.s FROM c a JOIN c b ON a.x = b.x",
    "SELECT x, s FROM t UNION ALL SELECT x, s FROM t WHERE x > 1",
    "SELECT x FROM t WHERE x > ANY (SELECT x FROM t WHERE s = 'b')",
    "SELECT x, s FROM t WHERE x = (SELECT max(x) FROM t)",
    "SELECT a.x, b.x AS bx FROM t a LEFT JOIN t b ON a.x < b.x",
]


@pytest.mark.parametrize("capacity", [1, 16])
@pytest.mark.parametrize("sql", TWICE)
def test_a_table_named_several_times_is_read_once_for_all_its_scans(
    sql: str, capacity: int
) -> None:
    data = [
        pa.record_batch(
            {"x": [i, None if i % 3 == 0 else i + 1], "s": ["a" if i % 2 else "b", None]}, schema=T
        )
        for i in range(8)
    ]
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", T, capacity=capacity)
    explanation = explain_live(ctx, sql)
    assert any("scans live table 't' several times" in r for r in explanation.reasons), explanation
    result = Background(ctx.sql(sql).to_arrow_table)
    for b in data:
        sink.write(b, timeout=WAIT)
    sink.close()
    assert multiset(result.join()) == multiset(oracle(sql, {"t": pa.Table.from_batches(data)}))
    # a second query still finds the table consumed
    with pytest.raises(StreamConsumedError, match="single-scan"):
        ctx.sql("SELECT a.x FROM t a JOIN t b ON a.x = b.x").collect()


def test_a_self_join_of_an_ordered_table_with_a_time_bound_streams() -> None:
    from datetime import datetime, timedelta, timezone

    t0 = datetime(2026, 11, 26, tzinfo=timezone.utc)
    schema = pa.schema([("k", pa.int64()), ("ts", pa.timestamp("us", tz="UTC"))])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", schema, 2, order_by="ts")
    sql = (
        "SELECT a.k, b.ts FROM ev a JOIN ev b ON a.k = b.k "
        "AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'"
    )
    results = Results(ctx, sql)
    sink.write(pa.record_batch({"k": [1], "ts": [t0]}, schema=schema))
    (row,) = results.rows(1)  # the row meets itself, while the table stays open
    assert row["k"] == 1
    sink.write(pa.record_batch({"k": [1], "ts": [t0 + timedelta(milliseconds=500)]}, schema=schema))
    assert len(results.rows(2)) == 2  # (first, second) and (second, second)
    sink.close()
    assert results.finish() == []
