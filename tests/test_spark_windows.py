"""Spark's ``window(ts, size[, slide[, start]])`` over an ordered live table: by Spark's name
and semantics (a row is in every window ``[s, s + size)`` with ``s = start + n * slide`` that
covers it; the value is ``struct<start, end>``), each window emitted once as it closes, with
the rows Spark gives for the same query text; bad durations refused at planning, naming the
argument.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import InvalidQueryError, SessionContext, explain_live
from pushtable.engine import live_state
from pushtable.flight import Client, Server
from tests.conftest import WAIT, Background

T0 = datetime(2026, 11, 25, 12, tzinfo=timezone.utc)
EV = pa.schema(
    [
        pa.field("ts", pa.timestamp("ms", tz="Europe/Paris")),
        pa.field("k", pa.string()),
        pa.field("amount", pa.decimal128(10, 2)),
    ]
)


def events(rows: Sequence[tuple[int, str | None]]) -> pa.RecordBatch:
    """Rows of ``ev`` from (milliseconds after T0, key); amount ms/100, null every 7th."""
    return pa.record_batch(
        {
            "ts": [T0 + timedelta(milliseconds=ms) for ms, _ in rows],
            "k": [k for _, k in rows],
            "amount": [None if ms % 7 == 0 else Decimal(ms) / 100 for ms, _ in rows],
        },
        schema=EV,
    )


def spark_semantics(
    rows: Sequence[tuple[int, str | None]], size: int, slide: int, offset: int
) -> list[tuple[Any, ...]]:
    """``window(ts, size, slide, offset), k, count(*), sum(amount)`` by Spark's definition
    (all in milliseconds): windows [s, s + size) with s = offset + n * slide covering ts."""
    groups: dict[tuple[int, str | None], list[int]] = {}
    for ms, k in rows:
        newest = ms - (ms - offset) % slide
        s = newest
        while s + size > ms:
            groups.setdefault((s, k), []).append(ms)
            s -= slide
    out = []
    for (s, k), members in groups.items():
        amounts = [Decimal(m) / 100 for m in members if m % 7 != 0]
        start, end = T0 + timedelta(milliseconds=s), T0 + timedelta(milliseconds=s + size)
        out.append((start, end, k, len(members), sum(amounts) if amounts else None))
    return sorted(out, key=lambda r: tuple(map(str, r)))


def spark_sessions(rows: Sequence[tuple[int, str | None]], gap: int) -> list[tuple[Any, ...]]:
    """``session_window(ts, gap), k, count(*), sum(amount)`` by Spark's definition (ms): per
    key, a row before its session's end (last row + gap) joins it, else starts a new one."""
    sessions: dict[str | None, list[list[int]]] = {}
    for ms, k in sorted(rows, key=lambda r: r[0]):
        mine = sessions.setdefault(k, [])
        if mine and ms < mine[-1][-1] + gap:
            mine[-1].append(ms)
        else:
            mine.append([ms])
    out = []
    for k, runs in sessions.items():
        for members in runs:
            amounts = [Decimal(m) / 100 for m in members if m % 7 != 0]
            start = T0 + timedelta(milliseconds=members[0])
            end = T0 + timedelta(milliseconds=members[-1] + gap)
            out.append((start, end, k, len(members), sum(amounts) if amounts else None))
    return sorted(out, key=lambda r: tuple(map(str, r)))


def timeline(steps: Sequence[tuple[int, str | None]]) -> list[tuple[int, str | None]]:
    """(gap in ms, key) steps as (ms after T0, key) rows, in time order."""
    rows, t = [], 0
    for gap, k in steps:
        t += gap
        rows.append((t, k))
    return rows


def as_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    out = [(r["w"]["start"], r["w"]["end"], r["k"], r["n"], r["total"]) for r in table.to_pylist()]
    return sorted(out, key=lambda r: tuple(map(str, r)))


def sql(window: str) -> str:
    return (
        f"SELECT {window} AS w, k, count(*) AS n, sum(amount) AS total FROM ev GROUP BY {window}, k"
    )


def same_as_spark(spark: Any, query: str, rows: Sequence[tuple[int, str | None]]) -> list[Any]:
    """``query`` over ``rows`` in Spark and in pushtable (a live table written then closed):
    asserts the two give the same rows, and returns Spark's."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    spark.createDataFrame(events(rows).to_pandas()).createOrReplaceTempView("ev")
    theirs = sorted(
        (
            (
                r["w"]["start"].replace(tzinfo=timezone.utc),
                r["w"]["end"].replace(tzinfo=timezone.utc),
                r["k"],
                r["n"],
                r["total"],
            )
            for r in spark.sql(query).collect()
        ),
        key=lambda r: tuple(map(str, r)),
    )
    ctx, sink = live()
    result = Background(lambda: ctx.sql(query).to_arrow_table())
    sink.write(events(rows))
    sink.close()
    ours = [
        (s.astimezone(timezone.utc), e.astimezone(timezone.utc), k, n, total)
        for s, e, k, n, total in as_rows(result.join())
    ]
    assert sorted(ours, key=lambda r: tuple(map(str, r))) == theirs
    return theirs


class Streamed(queue.Queue[Any]):
    """Result batches as they come, then None; an error of the query is raised by ``get``."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        if isinstance(item, BaseException):
            raise item
        return item


def streamed(ctx: SessionContext, query: str) -> Streamed:
    """The result batches of ``query`` as they come (then None), read by a background thread."""
    out = Streamed()
    stream = ctx.sql(query).execute_stream()

    def read() -> None:
        try:
            for b in stream:
                out.put(b.to_pyarrow())
        except BaseException as exc:  # noqa: BLE001 - raised by the test's next get
            out.put(exc)
            return
        out.put(None)

    threading.Thread(target=read, daemon=True).start()
    return out


def live(**options: Any) -> tuple[SessionContext, Any]:
    ctx = SessionContext()
    return ctx, ctx.register_streaming_table("ev", EV, 4, order_by="ts", **options)


def written_while_read(window: str, rows: list[Any], per: int) -> Any:
    """The live query's answer over ``window`` while a producer thread writes ``rows`` in
    batches of ``per`` (then closes the table)."""
    ctx, sink = live()
    result = Background(lambda: ctx.sql(sql(window)).to_arrow_table())
    data = [events(rows[i : i + per]) for i in range(0, len(rows), per)]
    producer = Background(lambda: ([sink.write(b, timeout=WAIT) for b in data], sink.close()))
    got = result.join()
    producer.join()  # its error, if any, is the test's
    return as_rows(got)


@pytest.mark.parametrize(
    ("window", "size", "slide", "offset"),
    [
        ("window(ts, '10 seconds')", 10_000, 10_000, 0),
        ("window(ts, '10 seconds', '5 seconds')", 10_000, 5_000, 0),
        ("window(ts, INTERVAL '10 seconds', INTERVAL '4 seconds')", 10_000, 4_000, 0),
        ("window(ts, '1 minute', '20 seconds', '7 seconds')", 60_000, 20_000, 7_000),
        ("window(ts, '1500 milliseconds', '500 milliseconds')", 1_500, 500, 0),
    ],
)
def test_windows_close_as_rows_pass_them_with_the_rows_spark_defines(
    window: str, size: int, slide: int, offset: int
) -> None:
    ctx, sink = live()
    explained = explain_live(ctx, sql(window))
    assert (explained.engine, explained.mode) == ("pushtable", "incremental"), explained
    out = streamed(ctx, sql(window))
    first: list[tuple[int, str | None]] = [(ms, "ab"[ms % 2]) for ms in range(0, 30_000, 700)]
    sink.write(events(first))
    # Written far past every window of the first rows: they all close before close().
    later: list[tuple[int, str | None]] = [(200_000, "a")]
    sink.write(events(later))
    early = out.get(timeout=WAIT)
    assert early is not None
    assert early.num_rows > 0
    sink.close()
    batches = [early]
    while (b := out.get(timeout=WAIT)) is not None:
        batches.append(b)
    got = as_rows(pa.Table.from_batches(batches))
    assert got == spark_semantics(first + later, size, slide, offset)
    # each window once
    assert len({(r[0], r[2]) for r in got}) == len(got)


def test_advance_closes_the_windows_the_watermark_passes() -> None:
    ctx, sink = live()
    window = "window(ts, '10 seconds', '5 seconds')"
    out = streamed(ctx, sql(window))
    sink.write(events([(1_000, "a"), (6_000, "a")]))
    # 1 s is in [-5, 5) and [0, 10); 6 s in [0, 10) and [5, 15): [-5, 5) closes at 6 s.
    (row,) = out.get(timeout=WAIT).to_pylist()
    assert (row["w"]["start"], row["n"]) == (T0 - timedelta(seconds=5), 1)
    sink.advance(T0 + timedelta(seconds=12))  # past [0, 10): it closes, [5, 15) stays open
    (row,) = out.get(timeout=WAIT).to_pylist()
    assert (row["w"]["start"], row["w"]["end"], row["n"]) == (T0, T0 + timedelta(seconds=10), 2)
    sink.close()  # end of stream: [5, 15) comes out now, once, and nothing else
    rest = []
    while (b := out.get(timeout=WAIT)) is not None:
        rest += b.to_pylist()
    assert [(r["w"]["start"], r["n"]) for r in rest] == [(T0 + timedelta(seconds=5), 1)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 3_000), st.sampled_from(["a", "b", None])), max_size=50),
    st.integers(1, 6),
    st.sampled_from([(4_000, 4_000, 0), (4_000, 1_000, 0), (3_000, 2_000, 500), (5_000, 5_000, 1)]),
)
def test_any_batches_give_the_rows_spark_defines(
    steps: list[tuple[int, str | None]], per: int, windowing: tuple[int, int, int]
) -> None:
    """Random gaps (some zero) and keys with nulls, cut into random batches written by a
    producer thread while the query reads."""
    size, slide, offset = windowing
    rows = timeline(steps)
    window = f"window(ts, '{size} milliseconds', '{slide} milliseconds', '{offset} milliseconds')"
    assert written_while_read(window, rows, per) == spark_semantics(rows, size, slide, offset)


@pytest.mark.parametrize(
    ("window", "says"),
    [
        ("window(ts, '0 seconds')", "windowDuration must be positive"),
        ("window(ts, '-5 seconds')", "windowDuration must be positive"),
        ("window(ts, 'ten seconds')", "windowDuration 'ten seconds'"),
        ("window(ts, '10 fortnights')", "unknown unit"),
        ("window(ts, '10 seconds', '20 seconds')", "slideDuration (20 seconds) must not be longer"),
        ("window(ts, '10 seconds', '0 seconds')", "slideDuration must be positive"),
        ("window(ts, '1 month')", "months have no fixed length"),
        ("window(ts, INTERVAL '1 month')", "months"),
        ("window(ts, '1 second', '100 microseconds')", "finer than the time column"),
        ("window(k, '1 second')", "needs a timestamp column"),
        ("window(ts, '10 seconds', '5 seconds', '1 second', '2 seconds')", "takes 2 to 4"),
        ("window(ts, '10001 seconds', '1 second')", "in more than 10000 windows"),
        ("session_window(ts, '0 seconds')", "gapDuration must be positive"),
        ("session_window(ts, k)", "gapDuration must be a literal duration"),
        ("session_window(ts, '5 parsecs')", "unknown unit"),
        ("session_window(ts, '5 seconds', '1 second')", "takes 2 arguments"),
        ("session_window(k, '5 seconds')", "needs a timestamp column"),
    ],
)
def test_a_bad_window_is_refused_at_planning_naming_the_argument(window: str, says: str) -> None:
    ctx, sink = live()
    with pytest.raises(InvalidQueryError, match=says.replace("(", r"\(").replace(")", r"\)")):
        ctx.sql(sql(window))
    sink.write(events([(0, "a")]))  # nothing was consumed
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM ev").to_pydict() == {"n": [1]}


@pytest.mark.parametrize(
    ("query", "where"),
    [
        ("SELECT window(ts, '10 seconds', '5 seconds') AS w, k FROM ev", "ProjectionExec"),
        ("SELECT k FROM ev WHERE session_window(ts, '5 seconds')['start'] > ts", "FilterExec"),
        ("SELECT k, window(ts, '4 seconds', '2 seconds')['end'] AS e FROM ev", "ProjectionExec"),
        ("SELECT session_window(ts, '5 seconds') AS w FROM ev", "ProjectionExec"),
    ],
)
def test_a_sliding_or_session_window_outside_a_group_by_is_refused_at_planning(
    query: str, where: str
) -> None:
    """Only a GROUP BY over the order column answers them: anywhere else the query is
    refused when planned (naming where), not failed once rows arrive."""
    ctx, sink = live()
    with pytest.raises(InvalidQueryError, match=f"answered only as a GROUP BY key.*{where}"):
        ctx.sql(query)
    sink.write(events([(0, "a")]))  # nothing was consumed
    sink.close()
    assert ctx.sql("SELECT count(*) AS n FROM ev").to_pydict() == {"n": [1]}


def test_a_session_window_over_a_table_without_order_is_refused_at_planning() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 4)
    with pytest.raises(InvalidQueryError, match=r"ordered by its time column.*AggregateExec"):
        ctx.sql(sql("session_window(ts, '5 seconds')"))
    sink.close()


def test_a_tumbling_window_also_answers_over_a_table_without_order() -> None:
    """Without ``order_by`` a tumbling ``window()`` is a plain function of ``ts``: the
    aggregate answers at close(), as any GROUP BY over a bounded table."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", EV, 4)
    result = Background(lambda: ctx.sql(sql("window(ts, '10 seconds')")).to_arrow_table())
    rows = [(ms, "a") for ms in (0, 4_000, 12_000)]
    sink.write(events(rows))
    sink.close()
    assert as_rows(result.join()) == spark_semantics(rows, 10_000, 10_000, 0)


@pytest.mark.spark
def test_the_same_query_text_gives_the_rows_spark_gives(spark: Any) -> None:
    rows = [(ms, "ab"[ms % 3 % 2]) for ms in range(0, 40_000, 1_300)]
    query = sql("window(ts, '10 seconds', '4 seconds', '1 second')")
    assert same_as_spark(spark, query, rows)


def sessions_held() -> int:
    """Sessions the process's session windows hold (pushtable's stats)."""
    import gc

    gc.collect()  # earlier tests' finished queries let go of their share now, not mid-test
    (state,) = [s for s in live_state() if s.operator == "SessionWindowExec"]
    return state.groups


def test_a_session_closes_once_the_order_passes_its_end() -> None:
    ctx, sink = live()
    window = "session_window(ts, '5 seconds')"
    explained = explain_live(ctx, sql(window))
    assert (explained.engine, explained.mode) == ("pushtable", "incremental"), explained
    held = sessions_held()  # other tests' queries may still run: read as a change
    out = streamed(ctx, sql(window))
    sink.write(events([(0, "a"), (1_000, "b"), (3_000, "a")]))
    # a's session [0, 8 s) and b's [1, 6 s) stay open: nothing has reached their ends
    sink.write(events([(7_000, "c")]))  # past b's end (6 s), not a's (8 s)
    (row,) = out.get(timeout=WAIT).to_pylist()
    assert (row["k"], row["n"], row["w"]["start"], row["w"]["end"]) == (
        "b",
        1,
        T0 + timedelta(seconds=1),
        T0 + timedelta(seconds=6),
    )
    sink.advance(T0 + timedelta(seconds=8))  # a's end: a row at 8 s would start a new session
    (row,) = out.get(timeout=WAIT).to_pylist()
    assert (row["k"], row["n"], row["w"]["end"]) == ("a", 2, T0 + timedelta(seconds=8))
    assert sessions_held() == held + 3  # a, b (closed, kept until a rebuild), c
    sink.close()
    (row,) = out.get(timeout=WAIT).to_pylist()  # c's, at the end of the stream
    assert row["k"] == "c"
    assert out.get(timeout=WAIT) is None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 3_000), st.sampled_from(["a", "b", None])), max_size=60),
    st.integers(1, 6),
    st.sampled_from([1, 1_000, 2_500]),
)
def test_any_batches_give_the_sessions_spark_defines(
    steps: list[tuple[int, str | None]], per: int, gap: int
) -> None:
    rows = timeline(steps)
    window = f"session_window(ts, '{gap} milliseconds')"
    assert written_while_read(window, rows, per) == spark_sessions(rows, gap)


def test_closed_sessions_leave_the_state() -> None:
    """800,000 one-row sessions of 2,000 keys through a session window whose session may
    hold 8 MiB (they would take about 40 MB): the closed sessions do not stay in its state."""
    ctx = SessionContext(memory_limit=8 * 2**20)
    sink = ctx.register_streaming_table("ev", EV, 4, order_by="ts")
    inner = sql("session_window(ts, '1 second')")
    count = ctx.sql(f"SELECT count(*) AS n FROM ({inner})")
    result = Background(lambda: count.to_pydict())
    for i in range(400):
        base = i * 2_000 * 2_000  # 2 s between a key's rows: every row is its own session
        sink.write(
            events([(base + 1_000 * j, f"k{j % 2_000}") for j in range(2_000)]), timeout=WAIT
        )
    sink.close()
    assert result.join() == {"n": [800_000]}


@pytest.mark.spark
def test_the_same_session_query_gives_the_rows_spark_gives(spark: Any) -> None:
    rows = [(ms, "ab"[ms // 1_000 % 2]) for ms in (0, 500, 2_900, 4_000, 9_000, 9_100, 30_000)]
    query = sql("session_window(ts, '3 seconds')")
    theirs = same_as_spark(spark, query, rows)
    assert theirs == spark_sessions(rows, 3_000)


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        (
            "window(ts, '10 seconds', '5 seconds')",
            lambda rows: spark_semantics(rows, 10_000, 5_000, 0),
        ),
        ("session_window(ts, '2 seconds')", lambda rows: spark_sessions(rows, 2_000)),
    ],
)
def test_remote_sql_runs_spark_windows(
    server: Server, client: Client, window: str, expected: Any
) -> None:
    client.create_table("ev", EV, 4, order_by="ts")
    result = client.sql(sql(window))
    rows: list[tuple[int, str | None]] = [(ms, "ab"[ms % 2]) for ms in range(0, 20_000, 900)]
    with client.sink("ev") as ev:
        ev.write(events(rows[:10]))
        ev.write(events(rows[10:]))
    assert as_rows(result.read_all()) == expected(rows)
    with pytest.raises(InvalidQueryError, match="windowDuration must be positive"):
        client.sql(sql("window(ts, '0 seconds')")).read_all()
