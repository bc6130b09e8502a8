"""Joins of two live tables: answered while both are written, exactly the rows of the same
query over the whole inputs, and refused up front when no time bound lets the join forget.

DataFusion 54's ``SymmetricHashJoinExec`` runs them in pushtable's engine: it reads both
inputs as they come, emits an inner match once both rows are in, and prunes each side's
state by the time bound between the two order columns (an outer row comes out unmatched
once the other side has moved past its bound, or at the end).
"""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import SessionContext, UnboundedQueryError, explain_live
from pushtable.flight import Client, Server
from tests.conftest import WAIT, Background
from tests.test_live_answers import Results

T0 = datetime(2026, 11, 25, 12, tzinfo=timezone.utc)
A = pa.schema(
    [
        pa.field("k", pa.int64()),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("amount", pa.decimal128(10, 2)),
    ]
)
B = pa.schema(
    [
        pa.field("k", pa.int64()),
        pa.field("ts", pa.timestamp("us", tz="UTC")),
        pa.field("tag", pa.string()),
    ]
)
BOUND = "b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'"


def sql(kind: str = "JOIN", bound: str = BOUND) -> str:
    on = f"a.k = b.k AND {bound}" if bound else "a.k = b.k"
    return f"SELECT a.k, a.ts, a.amount, b.ts AS b_ts, b.tag FROM a {kind} b ON {on}"


def a_rows(rows: list[tuple[int, int]]) -> pa.RecordBatch:
    """Rows of ``a`` from (key, milliseconds after T0), in time order as given."""
    return pa.record_batch(
        {
            "k": [k for k, _ in rows],
            "ts": [T0 + timedelta(milliseconds=ms) for _, ms in rows],
            "amount": [None if k % 4 == 0 else Decimal(k) / 4 for k, _ in rows],
        },
        schema=A,
    )


def b_rows(rows: list[tuple[int, int]]) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "k": [k for k, _ in rows],
            "ts": [T0 + timedelta(milliseconds=ms) for _, ms in rows],
            "tag": [None if ms % 3 == 0 else f"t{ms}" for _, ms in rows],
        },
        schema=B,
    )


def live(unbounded: bool, capacity: int = 4) -> tuple[SessionContext, Any, Any]:
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", A, capacity, order_by="ts", unbounded=unbounded)
    b = ctx.register_streaming_table("b", B, capacity, order_by="ts", unbounded=unbounded)
    return ctx, a, b


def whole(query: str, a: list[pa.RecordBatch], b: list[pa.RecordBatch]) -> list[tuple[Any, ...]]:
    """The same query over the whole inputs, by datafusion-python over in-memory tables."""
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("a", [a])
    ctx.register_record_batches("b", [b])
    return rows(ctx.sql(query).to_arrow_table())


def rows(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=lambda r: tuple(map(str, r)))


@pytest.mark.parametrize("unbounded", [False, True], ids=["bounded", "unbounded"])
def test_an_inner_match_comes_out_once_both_rows_are_in(unbounded: bool) -> None:
    ctx, a, b = live(unbounded)
    assert explain_live(ctx, sql()).engine == "pushtable"
    results = Results(ctx, sql())
    a.write(a_rows([(1, 0), (2, 100)]))
    b.write(b_rows([(1, 500)]))  # within a second of a's key 1
    (match,) = results.rows(1)
    assert (match["k"], match["tag"]) == (1, "t500")
    b.write(b_rows([(2, 900), (1, 2500)]))  # key 2 matches; key 1 at 2.5 s is too late
    (match,) = results.rows(1)
    assert (match["k"], match["b_ts"]) == (2, T0 + timedelta(milliseconds=900))
    a.close()
    b.close()
    assert results.finish() == []


@pytest.mark.parametrize("unbounded", [False, True], ids=["bounded", "unbounded"])
def test_an_outer_row_comes_out_unmatched_once_the_other_watermark_passes_its_bound(
    unbounded: bool,
) -> None:
    """``advance(ts)`` on one side prunes the other like a row would: an ``a`` row whose
    second has passed on ``b`` comes out with nulls while both tables stay open, once."""
    ctx, a, b = live(unbounded)
    results = Results(ctx, sql("LEFT JOIN"))
    a.write(a_rows([(1, 0), (2, 100)]))
    b.write(b_rows([(2, 700)]))  # key 2 matches; key 1 waits for b to pass 1 s
    (match,) = results.rows(1)
    assert (match["k"], match["tag"]) == (2, "t700")
    b.advance(T0 + timedelta(milliseconds=1500))  # no b row can reach a's key 1 any more
    (unmatched,) = results.rows(1)
    assert (unmatched["k"], unmatched["b_ts"], unmatched["tag"]) == (1, None, None)
    a.advance(T0 + timedelta(milliseconds=3000))  # prunes b's rows: none is an outer row here
    a.write(a_rows([(3, 3000)]))
    b.write(b_rows([(3, 3200)]))
    (match,) = results.rows(1)
    assert match["k"] == 3
    a.close()
    b.close()
    assert results.finish() == []  # each row once: the unmatched one is not repeated


def test_a_full_join_emits_both_sides_unmatched_rows_on_watermarks() -> None:
    ctx, a, b = live(True)
    results = Results(ctx, sql("FULL JOIN"))
    a.write(a_rows([(1, 0)]))
    b.write(b_rows([(5, 100)]))
    b.advance(T0 + timedelta(milliseconds=2000))  # a's key 1 can no longer match
    (left_only,) = results.rows(1)
    assert (left_only["k"], left_only["tag"]) == (1, None)
    a.advance(T0 + timedelta(milliseconds=2000))  # b's key 5 (at 100 ms) can no longer match
    (right_only,) = results.rows(1)
    assert (right_only["k"], right_only["b_ts"]) == (None, T0 + timedelta(milliseconds=100))
    a.close()
    b.close()
    assert results.finish() == []


def write_all(sink: Any, data: list[pa.RecordBatch]) -> None:
    for x in data:
        sink.write(x, timeout=WAIT)


@pytest.mark.parametrize("kind", ["JOIN", "LEFT JOIN", "RIGHT JOIN", "FULL JOIN"])
@pytest.mark.parametrize("unbounded", [False, True], ids=["bounded", "unbounded"])
def test_two_producers_give_the_rows_of_the_whole_input(kind: str, unbounded: bool) -> None:
    ctx, a, b = live(unbounded)
    da = [a_rows([(k % 5, 300 * i + k) for k in range(4)]) for i in range(30)]
    db = [b_rows([(k % 5, 300 * i + 7 * k) for k in range(3)]) for i in range(30)]
    result = Background(lambda: ctx.sql(sql(kind)).to_arrow_table())
    writers = [Background(functools.partial(write_all, s, d)) for s, d in ((a, da), (b, db))]
    for w in writers:
        w.join()  # a producer blocked for good fails here; its error is raised here
    a.close()
    b.close()
    assert rows(result.join()) == whole(sql(kind), da, db)


def test_one_thread_writing_both_tables_in_turn_is_never_blocked() -> None:
    ctx, a, b = live(False, capacity=2)
    result = Background(lambda: ctx.sql(sql()).to_arrow_table())
    da, db = [], []
    for i in range(200):
        da.append(a_rows([(i % 7, 50 * i)]))
        db.append(b_rows([(i % 7, 50 * i + 20)]))
        a.write(da[-1], timeout=WAIT)
        b.write(db[-1], timeout=WAIT)
    a.close()
    b.close()
    assert rows(result.join()) == whole(sql(), da, db)


@pytest.mark.parametrize("unbounded", [False, True], ids=["bounded", "unbounded"])
def test_one_thread_writing_a_burst_to_one_table_then_the_other_is_never_blocked(
    unbounded: bool,
) -> None:
    """50 batches into ``a`` (capacity 2) before any into ``b``: each side is read as it is
    written (a join that waited on the empty side would leave this producer blocked)."""
    ctx, a, b = live(unbounded, capacity=2)
    result = Background(lambda: ctx.sql(sql("LEFT JOIN")).to_arrow_table())
    da = [a_rows([(i % 3, 100 * i)]) for i in range(50)]
    db = [b_rows([(i % 3, 100 * i + 50)]) for i in range(50)]
    for x in da:
        a.write(x, timeout=WAIT)
    for y in db:
        b.write(y, timeout=WAIT)
    a.close()
    b.close()
    assert rows(result.join()) == whole(sql("LEFT JOIN"), da, db)


@pytest.mark.parametrize(
    "bound",
    ["", "a.amount > 0", "b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 month'"],
    ids=["no-bound", "no-time-column", "months"],  # a month has no fixed length
)
def test_a_join_of_two_unbounded_live_tables_without_a_time_bound_is_refused_up_front(
    bound: str,
) -> None:
    ctx, _, _ = live(True)
    with pytest.raises(UnboundedQueryError, match="needs a time bound between their order"):
        ctx.sql(sql(bound=bound))
    explanation = explain_live(ctx, sql(bound=bound))
    assert explanation.mode == "rejected"
    assert "time bound" in explanation.reasons[0]


@pytest.mark.parametrize("zone", ["UTC", "Europe/Paris"])
def test_a_bound_in_days_is_a_time_bound_in_utc_only(zone: str) -> None:
    """A day is 24 hours in UTC only (elsewhere daylight saving makes 23 or 25): a bound in
    days on zoned timestamps is no time bound, and two unbounded tables are refused."""
    ctx = SessionContext()
    for name in ("a", "b"):
        schema = pa.schema([("k", pa.int64()), ("ts", pa.timestamp("us", tz=zone))])
        ctx.register_streaming_table(name, schema, 4, order_by="ts", unbounded=True)
    query = (
        "SELECT a.k, b.ts FROM a JOIN b ON a.k = b.k "
        "AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 day'"
    )
    if zone == "UTC":
        assert explain_live(ctx, query).mode != "rejected"
        ctx.sql(query)  # planned: the bound is 86,400 s
    else:
        with pytest.raises(UnboundedQueryError, match="needs a time bound between their order"):
            ctx.sql(query)


@pytest.mark.parametrize("bound", ["", "a.amount > 0"], ids=["no-bound", "no-time-column"])
def test_a_join_of_two_bounded_live_tables_without_a_time_bound_answers_at_their_end(
    bound: str,
) -> None:
    """Without a bound the join cannot forget rows, but bounded tables end: each side is read
    as it is written and the join answers once they close, as DataFusion does."""
    ctx, a, b = live(False)
    explanation = explain_live(ctx, sql(bound=bound))
    assert (explanation.mode, explanation.engine) == ("at_end", "pushtable")
    result = Background(lambda: ctx.sql(sql(bound=bound)).to_arrow_table())
    da = [a_rows([(k, 100 * i + k) for k in range(3)]) for i in range(6)]
    db = [b_rows([(k, 100 * i + 2 * k) for k in range(2)]) for i in range(6)]
    for x, y in zip(da, db, strict=True):  # one thread writes both tables
        a.write(x, timeout=WAIT)
        b.write(y, timeout=WAIT)
    a.close()
    b.close()
    assert rows(result.join()) == whole(sql(bound=bound), da, db)


def test_a_one_sided_bound_runs_live() -> None:
    """``b.ts >= a.ts`` lets the join forget ``b``'s rows as ``a`` moves on, not ``a``'s:
    it runs (its state held to the session's memory limit), answering as rows arrive."""
    ctx, a, b = live(False)
    assert explain_live(ctx, sql(bound="b.ts >= a.ts")).mode == "incremental"
    results = Results(ctx, sql(bound="b.ts >= a.ts"))
    a.write(a_rows([(1, 0)]))
    b.write(b_rows([(1, 5000)]))
    (match,) = results.rows(1)
    assert match["k"] == 1
    a.close()
    b.close()


def test_a_join_of_unordered_unbounded_live_tables_is_refused() -> None:
    ctx = SessionContext()
    ctx.register_streaming_table("a", A, 4, unbounded=True)
    ctx.register_streaming_table("b", B, 4, unbounded=True)
    with pytest.raises(UnboundedQueryError, match="order_by"):
        ctx.sql(sql())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400)), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400)), min_size=1, max_size=40),
    st.integers(1, 6),
    st.sampled_from(["JOIN", "LEFT JOIN", "RIGHT JOIN", "FULL JOIN"]),
    st.booleans(),
)
def test_any_batches_give_the_rows_of_the_whole_input(
    ea: list[tuple[int, int]], eb: list[tuple[int, int]], per: int, kind: str, advance: bool
) -> None:
    """Random keys and gaps, cut into random batches, written by two producers (with a
    watermark after each batch, or none)."""

    def batches(events: list[tuple[int, int]], make: Any) -> list[pa.RecordBatch]:
        ordered, t = [], 0
        for k, gap in events:
            t += gap
            ordered.append((k, t))
        return [make(ordered[i : i + per]) for i in range(0, len(ordered), per)]

    da, db = batches(ea, a_rows), batches(eb, b_rows)
    ctx, a, b = live(False)
    result = Background(lambda: ctx.sql(sql(kind)).to_arrow_table())

    def produce(sink: Any, data: list[pa.RecordBatch]) -> None:
        for x in data:
            sink.write(x, timeout=WAIT)
            if advance:  # a watermark at the batch's last row: nothing later is behind it
                sink.advance(x.column("ts")[-1].as_py())
        sink.close()

    producers = [Background(functools.partial(produce, s, d)) for s, d in ((a, da), (b, db))]
    got = result.join()
    for p in producers:
        p.join()  # its error, if any, is the test's
    assert rows(got) == whole(sql(kind), da, db)


def test_a_long_join_keeps_its_state_within_the_time_bound() -> None:
    """2 M rows a side through a join whose session may hold 16 MiB: the state kept is what
    the bound says can still match (about a second of rows), never the streams so far."""
    ctx = SessionContext(memory_limit=16 * 2**20)
    a = ctx.register_streaming_table("a", A, 4, order_by="ts")
    b = ctx.register_streaming_table("b", B, 4, order_by="ts")
    count = ctx.sql(f"SELECT count(*) AS n FROM ({sql()})")
    result = Background(lambda: count.to_pydict())
    rows_per, batches = 10_000, 200
    for i in range(batches):  # 10 ms of event time per row: a batch spans 100 s
        ms = [(i * rows_per + r) * 10 for r in range(rows_per)]
        a.write(a_rows([(r % 1000, m) for r, m in enumerate(ms)]), timeout=WAIT)
        b.write(b_rows([(r % 1000, m + 5) for r, m in enumerate(ms)]), timeout=WAIT)
    a.close()
    b.close()
    # each a row matches the b row 5 ms after it (same key: r % 1000), no other within 1 s
    assert result.join() == {"n": [rows_per * batches]}


def test_remote_sql_runs_a_join_of_two_live_tables_and_refuses_one_without_a_bound(
    server: Server, client: Client
) -> None:
    client.create_table("a", A, 4, order_by="ts")
    client.create_table("b", B, 4, order_by="ts")
    client.create_table("ua", A, 4, order_by="ts", unbounded=True)
    client.create_table("ub", B, 4, order_by="ts", unbounded=True)
    with pytest.raises(UnboundedQueryError, match="time bound"):
        client.sql(
            sql(bound="").replace("FROM a", "FROM ua a").replace("JOIN b", "JOIN ub b")
        ).read_all()
    result = client.sql(sql("LEFT JOIN"))
    da = [a_rows([(k, 400 * i + k) for k in range(3)]) for i in range(10)]
    db = [b_rows([(k, 400 * i + 2 * k + 1) for k in range(2)]) for i in range(10)]
    with client.sink("a") as a, client.sink("b") as b:
        for x, y in zip(da, db, strict=True):
            a.write(x)
            b.write(y)
    assert rows(result.read_all()) == whole(sql("LEFT JOIN"), da, db)
