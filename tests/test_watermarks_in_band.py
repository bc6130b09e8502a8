"""Watermarks and backpressure travel with the rows.

A window closes only on a watermark that passed through its own input after every row before
it, whatever stands between the scan and the window (a read-ahead under a scalar subquery or
a join of window aggregates, a shared read, a lookup join); and a read-ahead reads only while
its operator waits on another input, so a paused consumer holds every producer at its
table's ``capacity``. Each answer is diffed against plain DataFusion over the same rows.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushtable import ReaderGoneError, ResourceLimitError, SessionContext, WriteTimeoutError
from tests.conftest import WAIT, Background, fixed_draws

T = pa.schema([("ts", pa.int64()), ("v", pa.int64())])
U = pa.schema([("x", pa.int64())])


def plain(sql: str, tables: dict[str, tuple[pa.Schema, list[dict[str, Any]]]]) -> Counter[Any]:
    """``sql``'s rows by plain DataFusion over in-memory tables, as a multiset."""
    ctx = datafusion.SessionContext()
    for name, (schema, rows) in tables.items():
        ctx.register_record_batches(name, [[pa.RecordBatch.from_pylist(rows, schema=schema)]])
    return Counter(tuple(r.values()) for r in ctx.sql(sql).to_pylist())


def rows_of(batches: list[Any]) -> Counter[Any]:
    return Counter(tuple(r.values()) for b in batches for r in b.to_pyarrow().to_pylist())


def run_live(
    ctx: SessionContext, sql: str, feed: Any, *, emissions: list[int] | None = None
) -> Counter[Any]:
    """Run ``sql`` while ``feed()`` writes; every emission's rows (their count per batch in
    ``emissions``)."""
    stream = ctx.sql(sql).execute_stream()
    got: list[Any] = []

    def read() -> None:
        for batch in stream:
            got.append(batch)

    reader = Background(read)
    feed()
    reader.join()
    if emissions is not None:
        emissions.extend(b.to_pyarrow().num_rows for b in got)
    return rows_of(got)


# Each (ts) of the ordered table, and the advance() after some of them: window 0 (ts 0..9)
# gets rows on both sides of a watermark that does not close it (advance(5)), and the
# watermarks that close windows come between rows.
TS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 19, 20, 21, 25, 33, 34]
ADVANCE_AFTER = {4: 5, 9: 10, 12: 14, 19: 20, 25: 30}


def write_t(t: Any, batch_rows: int = 1) -> list[dict[str, Any]]:
    """Write TS to ``t`` (v = ts % 3), advancing after the marked rows; the rows written."""
    rows = [{"ts": ts, "v": ts % 3} for ts in TS]
    for i in range(0, len(rows), batch_rows):
        part = rows[i : i + batch_rows]
        t.write(pa.RecordBatch.from_pylist(part, schema=T), timeout=WAIT)
        w = ADVANCE_AFTER.get(part[-1]["ts"])
        if w is not None:
            t.advance(w)
    return rows


WINDOW_SHAPES = {
    "scalar subquery over another live table": (
        "SELECT ts / 10 AS w, count(*) AS n, sum(v) AS s, (SELECT max(x) FROM u) AS m "
        "FROM t GROUP BY ts / 10"
    ),
    "join of two window aggregates of one table": (
        "SELECT a.w, a.n, b.s FROM (SELECT ts / 10 AS w, count(*) AS n FROM t GROUP BY ts / 10) a "
        "JOIN (SELECT ts / 10 AS w, sum(v) AS s FROM t GROUP BY ts / 10) b ON a.w = b.w"
    ),
    "join of window aggregates of two tables": (
        "SELECT a.w, a.n, b.s FROM (SELECT ts / 10 AS w, count(*) AS n FROM t GROUP BY ts / 10) a "
        "JOIN (SELECT ts / 10 AS w, sum(v) AS s FROM t2 GROUP BY ts / 10) b ON a.w = b.w"
    ),
}

E = pa.schema([("ts", pa.timestamp("us", tz="UTC")), ("v", pa.int64())])
SESSIONS = (
    "SELECT a.n, b.s FROM (SELECT session_window(ts, '3 seconds') AS sw, count(*) AS n FROM e "
    "GROUP BY session_window(ts, '3 seconds')) a JOIN (SELECT session_window(ts, '3 seconds') "
    "AS sw, sum(v) AS s FROM e GROUP BY session_window(ts, '3 seconds')) b ON a.sw = b.sw"
)


def sparks_sessions(seconds: list[int], gap: int) -> Counter[Any]:
    """Spark's sessions of rows at ``seconds`` (v = 1 each): a row at or past the end of the
    open session (its last row + ``gap``) starts a new one; (count, sum) of each."""
    sessions: list[int] = []
    end = None
    for t in sorted(seconds):
        if end is None or t >= end:
            sessions.append(0)
        sessions[-1] += 1
        end = t + gap
    return Counter((n, n) for n in sessions)


@pytest.mark.parametrize("batch_rows", [1, 3])
@pytest.mark.parametrize("shape", list(WINDOW_SHAPES))
def test_a_window_under_a_read_ahead_closes_once_with_every_row(
    shape: str, batch_rows: int
) -> None:
    """Window 0 came out as 2 + 3 rows and a join of windows answered extra rows: the scan set
    the window's watermark as the read-ahead drained it, ahead of the rows the window had
    folded. Each window now closes once, on a watermark after every row before it."""
    sql = WINDOW_SHAPES[shape]
    ctx = SessionContext()
    t = ctx.register_streaming_table("t", T, capacity=64, order_by="ts")
    t2 = ctx.register_streaming_table("t2", T, capacity=64, order_by="ts")
    u = ctx.register_streaming_table("u", U, capacity=4)
    written: dict[str, list[dict[str, Any]]] = {}

    def feed() -> None:
        written["t"] = write_t(t, batch_rows)
        t.close()
        written["t2"] = write_t(t2, batch_rows)
        t2.close()
        u.write(pa.record_batch({"x": [7, 2]}, schema=U), timeout=WAIT)
        u.close()

    got = run_live(ctx, sql, feed)
    want = plain(
        sql,
        {"t": (T, written["t"]), "t2": (T, written["t2"]), "u": (U, [{"x": 7}, {"x": 2}])},
    )
    assert got == want, (shape, got, want)
    assert sum(want.values()) >= 3  # several windows closed (the check can fail)


@pytest.mark.parametrize("seconds", [[1, 2, 3, 4, 5], [1, 2, 9, 10, 11, 20, 30, 31]])
def test_joined_session_windows_are_sparks(seconds: list[int]) -> None:
    """Two joined ``session_window`` aggregates answered [(1,1,1), (1,2,2), (1,3,3)] where
    Spark's definition gives one session: a watermark after each row reached the windows
    ahead of the rows before it. (DataFusion has no ``session_window``: Spark's definition
    is the reference.)"""
    ctx = SessionContext()
    e = ctx.register_streaming_table("e", E, capacity=64, order_by="ts")
    start = datetime(2026, 12, 1, tzinfo=timezone.utc)

    def feed() -> None:
        for sec in seconds:
            at = start + timedelta(seconds=sec)
            e.write(pa.RecordBatch.from_pylist([{"ts": at, "v": 1}], schema=E), timeout=WAIT)
            e.advance(at + timedelta(seconds=1))  # a watermark after each row
        e.close()

    got = run_live(ctx, SESSIONS, feed)
    assert got == sparks_sessions(seconds, 3), got


def test_explain_live_names_the_watermark_that_reaches_each_window() -> None:
    ctx = SessionContext()
    ctx.register_streaming_table("t", T, capacity=4, order_by="ts")
    ctx.register_streaming_table("u", U, capacity=4)
    text = str(ctx.explain_live(WINDOW_SHAPES["scalar subquery over another live table"]))
    assert "the watermarks of t → ReadAheadExec" in text, text


MB_ROWS = 65_536


def big(start: int) -> pa.RecordBatch:
    """About 1 MB of rows, ``ts`` from ``start``."""
    ts = pa.array(range(start, start + MB_ROWS), pa.int64())
    return pa.record_batch({"ts": ts, "v": pa.array(range(MB_ROWS), pa.int64())})


def accepted_while_paused(sink: Any, start: int, most: int = 60) -> int:
    """How many ~1 MB writes ``sink`` accepts (each waiting at most 0.5 s) while the query's
    consumer is paused."""
    accepted = 0
    with pytest.raises(WriteTimeoutError):
        for i in range(most):
            sink.write(big(start + i * MB_ROWS), timeout=0.5)
            accepted += 1
    return accepted


def test_a_paused_consumer_of_an_interval_self_join_holds_the_producer() -> None:
    """Both sides' read-aheads polled their shared scans continuously: 80 of 80 writes of
    ~1 MB were accepted with the consumer paused."""
    ctx = SessionContext()
    t = ctx.register_streaming_table("t", T, capacity=2, order_by="ts", unbounded=True)
    sql = "SELECT a.ts, b.v FROM t a JOIN t b ON a.v = b.v AND b.ts BETWEEN a.ts - 5 AND a.ts + 5"
    stream = ctx.sql(sql).execute_stream()
    t.write(big(0), timeout=WAIT)
    first = Background(functools.partial(next, iter(stream)))
    assert first.join().to_pyarrow().num_rows > 0  # the consumer read one batch, and pauses
    accepted = accepted_while_paused(t, MB_ROWS)
    assert accepted <= 2 + 2, accepted  # capacity, plus what the join's operators hold
    assert t.stats.queued_batches == 2


def test_a_lookup_join_with_a_closed_live_table_holds_the_other_producer() -> None:
    """Once the bounded side had closed, the probe side's read-ahead kept draining for the
    life of the query: 60 of 60 accepted with the consumer paused."""
    ctx = SessionContext()
    t = ctx.register_streaming_table("t", T, capacity=2, unbounded=True)
    d = ctx.register_streaming_table("d", U, capacity=2)
    stream = ctx.sql("SELECT t.ts, d.x FROM t JOIN d ON t.v = d.x").execute_stream()
    first = Background(functools.partial(next, iter(stream)))
    d.write(pa.record_batch({"x": list(range(100))}, schema=U), timeout=WAIT)
    d.close()
    t.write(big(0), timeout=WAIT)
    assert first.join().to_pyarrow().num_rows > 0
    accepted = accepted_while_paused(t, MB_ROWS)
    assert accepted <= 2 + 2, accepted
    assert t.stats.queued_batches == 2


def test_one_thread_writing_both_tables_of_a_lookup_join_is_never_stuck() -> None:
    """What the read-ahead is for: while the join reads its bounded side whole, the other
    side's rows are read (and held) so that one thread writing many batches to it first,
    past its capacity, then the bounded table, finishes."""
    ctx = SessionContext()
    t = ctx.register_streaming_table("t", T, capacity=2, unbounded=True)
    d = ctx.register_streaming_table("d", U, capacity=2)
    stream = iter(ctx.sql("SELECT t.ts, d.x FROM t JOIN d ON t.v = d.x").execute_stream())
    first = Background(functools.partial(next, stream))  # the consumer waits on the join

    def one_thread() -> None:
        for i in range(10):
            t.write(pa.record_batch({"ts": [i], "v": [i % 3]}, schema=T), timeout=WAIT)
        d.write(pa.record_batch({"x": [0, 1]}, schema=U), timeout=WAIT)
        d.close()

    Background(one_thread).join()
    assert first.join().to_pyarrow().num_rows > 0


def test_a_window_over_a_lookup_join_with_a_live_table_closes_on_advance() -> None:
    """``watermark_source`` did not look through the probe side's read-ahead: the window
    ignored ``advance()`` (it closed only on later rows and at ``close()``)."""
    ctx = SessionContext()
    t = ctx.register_streaming_table("t", T, capacity=16, order_by="ts", unbounded=True)
    d = ctx.register_streaming_table("d", U, capacity=4)
    sql = "SELECT t.ts / 10 AS w, count(*) AS n FROM t JOIN d ON t.v = d.x GROUP BY t.ts / 10"
    stream = iter(ctx.sql(sql).execute_stream())
    first = Background(functools.partial(next, stream))
    d.write(pa.record_batch({"x": [1]}, schema=U), timeout=WAIT)
    d.close()
    for i in range(5):
        t.write(pa.record_batch({"ts": [i], "v": [1]}, schema=T), timeout=WAIT)
    t.advance(10)  # no later row: only the watermark can close window 0
    assert first.join().to_pyarrow().to_pylist() == [{"w": 0, "n": 5}]


EXIT_READ = """
import atexit

def hook():
    try:
        ctx.sql("SELECT v FROM t").to_arrow_table()
        print("read", flush=True)
    except Exception as exc:
        print("raised", type(exc).__name__, exc, flush=True)

atexit.register(hook)  # before pushtable's own: it runs after it

import pyarrow as pa
import pushtable

ctx = pushtable.SessionContext()
sink = ctx.register_streaming_table("t", pa.schema([("v", pa.int64())]), capacity=2)
sink.write(pa.record_batch({"v": [1]}))
print("exiting", flush=True)
"""


def test_an_exit_hook_that_reads_a_live_table_after_pushtables_own_ends() -> None:
    """The read returned Pending for good once pushtable's hook had run: the process never
    exited. It raises, naming why, and the process exits."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_READ)],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "exiting", lines
    assert lines[1].startswith("raised"), lines
    assert "the interpreter is exiting" in lines[1], lines


# --- drawn: rows, batch splits and advance() points, against plain DataFusion -------------

SWEPT = {
    **WINDOW_SHAPES,
    "window over a lookup join with a closed live table": (
        "SELECT t.ts / 10 AS w, count(*) AS n, sum(t.v) AS s FROM t JOIN u ON t.v = u.x "
        "GROUP BY t.ts / 10"
    ),
    "windows over UNION ALL of a table and itself": (
        "SELECT ts / 10 AS w, count(*) AS n FROM t GROUP BY ts / 10 UNION ALL "
        "SELECT ts / 10 AS w, count(v) AS n FROM t WHERE v > 0 GROUP BY ts / 10"
    ),
}


@st.composite
def feeds(draw: Any) -> tuple[list[dict[str, Any]], list[int], dict[int, int]]:
    """Rows of ``t`` in ``ts`` order (gaps of 0..7, ``v`` 0..2 or NULL), where batches end,
    and the ``advance()`` after some batches (at most the next row's ``ts``)."""
    gaps = draw(st.lists(st.integers(0, 7), min_size=1, max_size=30))
    ts = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    vs = draw(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=len(ts), max_size=len(ts)))
    rows = [{"ts": a, "v": b} for a, b in zip(ts, vs, strict=True)]
    cuts = sorted(draw(st.sets(st.integers(1, len(rows)), max_size=len(rows))) | {len(rows)})
    advances = {}
    for i, end in enumerate(cuts[:-1]):
        if draw(st.booleans()):
            advances[i] = draw(st.integers(rows[end - 1]["ts"], rows[end]["ts"]))
    return rows, cuts, advances


TALLY: dict[str, Counter[str]] = {}


@pytest.mark.parametrize("shape", list(SWEPT))
def test_windows_under_every_read_ahead_answer_as_datafusion(shape: str) -> None:
    """Each shape over drawn rows, batch splits and ``advance()`` points: the live answer is
    plain DataFusion's over the same rows; the sweep fails unless windows closed before the
    end (emissions while the producer still wrote) in some case."""
    sql = SWEPT[shape]
    tally = TALLY.setdefault(shape, Counter())

    @fixed_draws(25)
    @given(feeds())
    def case(drawn: tuple[list[dict[str, Any]], list[int], dict[int, int]]) -> None:
        rows, cuts, advances = drawn
        ctx = SessionContext()
        t = ctx.register_streaming_table("t", T, capacity=4, order_by="ts")
        t2 = ctx.register_streaming_table("t2", T, capacity=4, order_by="ts")
        u = ctx.register_streaming_table("u", U, capacity=4)
        stream = ctx.sql(sql).execute_stream()
        got: list[Any] = []
        before_end = []

        def read() -> None:
            for batch in stream:
                got.append(batch)

        reader = Background(read)
        sinks = [t, t2] if "t2" in sql else [t]  # the table a query does not read is full
        u.write(pa.record_batch({"x": [1, 2]}, schema=U), timeout=WAIT)
        u.close()
        start = 0
        for i, end in enumerate(cuts):
            part = pa.RecordBatch.from_pylist(rows[start:end], schema=T)
            for sink in sinks:
                sink.write(part, timeout=WAIT)
                if i in advances:
                    sink.advance(advances[i])
            start = end
        before_end.append(len(got))
        t.close()
        t2.close()
        reader.join()
        want = plain(sql, {"t": (T, rows), "t2": (T, rows), "u": (U, [{"x": 1}, {"x": 2}])})
        assert rows_of(got) == want, (shape, rows, cuts, advances)
        tally["cases"] += 1
        tally["closed windows"] += sum(want.values())
        tally["cases with several windows"] += sum(want.values()) > 1
        tally["cases with an advance"] += bool(advances)
        tally["emitted before close"] += before_end[0]

    case()
    print(shape, dict(tally))  # the note's per-shape tallies (pytest -s)
    # The check can fail: windows closed, several in some case, with advance() between rows.
    # (Joins of window aggregates and scalar subqueries answer once their bounded sides end,
    # so emissions before close() are tallied, not required.)
    assert tally["cases with several windows"] > 0, (shape, tally)
    assert tally["cases with an advance"] > 0, (shape, tally)


SESSIONS_SWEPT = {
    "session windows under a scalar subquery over another live table": (
        "SELECT count(*) AS n, sum(v) AS s, (SELECT max(x) FROM u) AS m FROM e "
        "GROUP BY session_window(ts, '3 seconds')"
    ),
    "a join of two session window aggregates": SESSIONS,
}


@st.composite
def session_feeds(draw: Any) -> tuple[list[int], list[int], dict[int, int]]:
    """Seconds of rows in order (gaps of 0..6: sessions of 3 s split and merge), where batches
    end, and the ``advance()`` (seconds) after some batches, at most the next row's."""
    gaps = draw(st.lists(st.integers(0, 6), min_size=1, max_size=20))
    seconds = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    cuts = sorted(draw(st.sets(st.integers(1, len(seconds)), max_size=len(seconds))))
    cuts = sorted(set(cuts) | {len(seconds)})
    advances = {}
    for i, end in enumerate(cuts[:-1]):
        if draw(st.booleans()):
            advances[i] = draw(st.integers(seconds[end - 1], seconds[end]))
    return seconds, cuts, advances


@pytest.mark.parametrize("shape", list(SESSIONS_SWEPT))
def test_session_windows_under_every_read_ahead_are_sparks(shape: str) -> None:
    """Drawn rows, batch splits and ``advance()`` points: each session closes once with every
    row of it, as Spark defines sessions (DataFusion has none); the sweep fails unless some
    case closed several sessions and some had an ``advance()``."""
    sql = SESSIONS_SWEPT[shape]
    tally = TALLY.setdefault(shape, Counter())
    start = datetime(2026, 12, 1, tzinfo=timezone.utc)

    @fixed_draws(25)
    @given(session_feeds())
    def case(drawn: tuple[list[int], list[int], dict[int, int]]) -> None:
        seconds, cuts, advances = drawn
        ctx = SessionContext()
        e = ctx.register_streaming_table("e", E, capacity=4, order_by="ts")
        u = ctx.register_streaming_table("u", U, capacity=4)

        def feed() -> None:
            u.write(pa.record_batch({"x": [1, 2]}, schema=U), timeout=WAIT)
            u.close()
            begin = 0
            for i, end in enumerate(cuts):
                part = [{"ts": start + timedelta(seconds=x), "v": 1} for x in seconds[begin:end]]
                e.write(pa.RecordBatch.from_pylist(part, schema=E), timeout=WAIT)
                if i in advances:
                    e.advance(start + timedelta(seconds=advances[i]))
                begin = end
            e.close()

        got = run_live(ctx, sql, feed)
        sessions = sparks_sessions(seconds, 3)
        if "max(x)" in sql:
            sessions = Counter({(n, s, 2): c for (n, s), c in sessions.items()})
        assert got == sessions, (shape, seconds, cuts, advances)
        tally["cases"] += 1
        tally["closed sessions"] += sum(sessions.values())
        tally["cases with several sessions"] += sum(sessions.values()) > 1
        tally["cases with an advance"] += bool(advances)

    case()
    print(shape, dict(tally))  # the note's per-shape tallies (pytest -s)
    assert tally["cases with several sessions"] > 0, (shape, tally)
    assert tally["cases with an advance"] > 0, (shape, tally)


K = pa.schema([("k", pa.int64())])
NESTED = {
    "join of a join": "SELECT a.k, b.k, c.k FROM a JOIN b ON a.k = b.k JOIN c ON a.k = c.k",
    "join with a join": (
        "SELECT a.k, b.k, c.k FROM a JOIN (SELECT b.k FROM b JOIN c ON b.k = c.k) b "
        "ON a.k = b.k JOIN c ON a.k = c.k"
    ),
    "scalar subquery over a join": (
        "SELECT a.k, b.k, (SELECT max(k) FROM c) AS m FROM a JOIN b ON a.k = b.k"
    ),
    "IN over a join": "SELECT a.k FROM a JOIN b ON a.k = b.k WHERE a.k IN (SELECT k FROM c)",
}


@pytest.mark.parametrize("first", ["a", "b", "c"])
@pytest.mark.parametrize("shape", list(NESTED))
def test_one_thread_writing_every_table_of_a_nested_join_finishes(shape: str, first: str) -> None:
    """Each operator's read-aheads formed a group of their own: an operator waiting on a join
    below it never had the other tables read, and one thread writing 10 batches to one
    (capacity 2) before the others blocked for good (10 of 12 write orders). One group for
    the whole plan: every order finishes, with plain DataFusion's answer."""
    sql = NESTED[shape]
    ctx = SessionContext()
    sinks = {t: ctx.register_streaming_table(t, K, capacity=2) for t in "abc"}
    rows = [{"k": i} for i in range(10)]

    def feed() -> None:
        for t in [first] + [x for x in "abc" if x != first]:
            for r in rows:
                sinks[t].write(pa.RecordBatch.from_pylist([r], schema=K), timeout=WAIT)
            sinks[t].close()

    got = run_live(ctx, sql, feed)
    assert got == plain(sql, {t: (K, rows) for t in "abc"}), shape
    assert sum(got.values()) == 10


def test_a_failure_below_a_nested_join_ends_the_query_at_once() -> None:
    """The failure of a table read only by the outer join's group was never read while the
    query waited on the inner join: the error was lost, and the query ended with no rows and
    no error once the other tables closed."""
    ctx = SessionContext()
    sinks = {t: ctx.register_streaming_table(t, K, capacity=4) for t in "abc"}
    stream = ctx.sql(NESTED["join of a join"]).execute_stream()
    reader = Background(lambda: [b for b in stream])
    sinks["c"].write(pa.record_batch({"k": [1, 2]}, schema=K), timeout=WAIT)
    sinks["c"].fail(ValueError("boom-c"))
    error = reader.join_error()  # a and b still open: only the failure can end it
    assert "boom-c" in str(error), error


@pytest.mark.parametrize("shape", list(NESTED))
def test_a_query_that_failed_lets_go_of_every_table_at_once(shape: str) -> None:
    """After the query raised, a producer of another of its tables waited on its full queue
    until the consumer dropped the stream (and for good where a read-ahead was started but
    its operator never executed it: its input held another read-ahead of the group, a cycle
    nothing freed). Now each producer's next write raises ``ReaderGoneError`` while the
    consumer still holds the stream that raised."""
    ctx = SessionContext()
    sinks = {t: ctx.register_streaming_table(t, K, capacity=2) for t in "abc"}
    stream = ctx.sql(NESTED[shape]).execute_stream()
    reader = Background(lambda: [b for b in stream])
    sinks["c"].fail(ValueError("boom-c"))
    assert "boom-c" in str(reader.join_error())

    def told(sink: Any) -> None:
        with pytest.raises(ReaderGoneError):
            for i in range(10):  # past capacity: a reader that still held it would block
                sink.write(pa.record_batch({"k": [i]}, schema=K), timeout=WAIT)

    for t in "ab":
        Background(functools.partial(told, sinks[t])).join()
    assert stream is not None  # held to here: the query let go of its tables by itself


def test_a_self_join_past_its_memory_limit_lets_go_of_its_table() -> None:
    """A self hash join failed with ``ResourceLimitError``; its producer's writes then waited
    on the full queue until the stream was dropped (review of 9aad8c0, D4)."""
    ctx = SessionContext(memory_limit=8 << 20)
    t = ctx.register_streaming_table("t", T, capacity=2)
    stream = ctx.sql("SELECT count(*) FROM t a JOIN t b ON a.v = b.v").execute_stream()
    reader = Background(lambda: [b for b in stream])

    def produce() -> int:
        written = 0
        with pytest.raises(ReaderGoneError):
            for i in range(100):  # 100 MB: past the limit many times
                t.write(big(i * MB_ROWS), timeout=WAIT)
                written += 1
        return written

    producer = Background(produce)
    error = reader.join_error()
    assert isinstance(error, ResourceLimitError), error
    assert "memory_limit" in str(error), error
    assert producer.join() < 100
    assert stream is not None


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT k FROM a UNION ALL SELECT k FROM b",  # plain DataFusion runs it: no engine
        "SELECT a.k FROM a JOIN b ON a.k = b.k",  # the engine runs it
    ],
)
def test_a_query_that_failed_lets_go_of_every_table_whoever_runs_it(sql: str) -> None:
    """A query datafusion-python runs itself (a union of two live scans) kept the other
    table's reader after it raised: its producer's writes waited on the full queue until
    the stream was dropped (review of 85728d1). Both paths let go as they raise."""
    ctx = SessionContext()
    a = ctx.register_streaming_table("a", K, capacity=2)
    b = ctx.register_streaming_table("b", K, capacity=2)
    stream = ctx.sql(sql).execute_stream()
    reader = Background(lambda: [x for x in stream])
    a.fail(ValueError("boom-a"))
    assert "boom-a" in str(reader.join_error())
    with pytest.raises(ReaderGoneError):
        for i in range(20):  # past capacity and what DataFusion's merge holds
            b.write(pa.record_batch({"k": [i]}, schema=K), timeout=WAIT)
    assert stream is not None
