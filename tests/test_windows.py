"""The live engine: windows that emit as they close, watermarks, running window functions.

Every test runs real queries through ``pushtable.SessionContext.sql``; results are read
while the producer still holds the table open, and each wait is bounded by ``WAIT``.
"""

from __future__ import annotations

import itertools
import queue
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushtable import (
    OrderViolationError,
    SessionContext,
    SinkClosedError,
    Topic,
    UnsupportedTableError,
)
from tests.conftest import WAIT, wait_until

TS = pa.timestamp("ms", tz="UTC")
SCHEMA = pa.schema([("ts", TS), ("k", pa.string()), ("v", pa.int64())])
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def rows(*items: tuple[float, str, int]) -> pa.RecordBatch:
    """A batch of (seconds after T0, k, v) rows."""
    return pa.record_batch(
        [
            pa.array([T0 + timedelta(seconds=s) for s, _, _ in items], TS),
            pa.array([k for _, k, _ in items], pa.string()),
            pa.array([v for _, _, v in items], pa.int64()),
        ],
        schema=SCHEMA,
    )


class LiveRows:
    """Reads a query's stream in a thread; each result row lands in a queue as it comes."""

    def __init__(self, ctx: SessionContext, sql: str) -> None:
        self.rows: queue.Queue[dict[str, Any]] = queue.Queue()
        self.error: BaseException | None = None
        self.done = threading.Event()
        stream = ctx.sql(sql).execute_stream()  # planned now: the scan is claimed at once
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        try:
            for b in stream:
                for row in b.to_pyarrow().to_pylist():
                    self.rows.put(row)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            self.done.set()

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` result rows; fails the test if they do not come within WAIT."""
        out = []
        for _ in range(n):
            try:
                out.append(self.rows.get(timeout=WAIT))
            except queue.Empty:
                pytest.fail(f"only {len(out)} of {n} rows came (error: {self.error!r})")
        return out

    def nothing_yet(self) -> bool:
        """No row has come out so far."""
        return self.rows.empty()

    def finish(self) -> list[dict[str, Any]]:
        """The rows left after the stream ends."""
        assert self.done.wait(WAIT), "the query did not end"
        if self.error is not None:
            raise self.error
        out = []
        while not self.rows.empty():
            out.append(self.rows.get_nowait())
        return out


WINDOW_SQL = (
    "SELECT date_bin(INTERVAL '1 second', ts) AS w, count(*) AS n, sum(v) AS s FROM t GROUP BY 1"
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@settings(max_examples=25, deadline=None)
@given(
    # seconds as tenths: runs of equal keys, windows spanning batches, batches spanning windows
    # (batches of 16+ rows within one window take the engine's two-row shortcut)
    steps=st.lists(st.sampled_from([0, 0, 0, 1, 1, 2, 5, 12]), min_size=1, max_size=150),
    cuts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=20),
    other_key=st.booleans(),
)
def test_live_windows_equal_the_same_query_over_the_whole_input(
    steps: list[int], cuts: list[int], other_key: bool
) -> None:
    """The window alone as key (groups are runs) and window + key (a group table) both give
    exactly what datafusion-python gives over the same rows at rest: with aggregates folded
    whole for a batch inside one window (count, sum, min, max, avg) and row by row (FILTER)."""
    tenths = [sum(steps[: i + 1]) for i in range(len(steps))]
    data = [(t / 10, "abc"[i % 3], i) for i, t in enumerate(tenths)]
    written, start, c = [], 0, 0
    while start < len(data):
        size = cuts[c % len(cuts)]
        written.append(rows(*data[start : start + size]))
        start, c = start + size, c + 1
    keys = "w, k" if other_key else "w"
    sql = (
        f"SELECT date_bin(INTERVAL '1 second', ts) AS w, {'k, ' if other_key else ''}"
        f"count(*) AS n, sum(v) AS s, min(v) AS lo, max(v) AS hi, avg(v) AS mean, "
        f"count(*) FILTER (WHERE v % 2 = 0) AS even FROM t GROUP BY {keys}"
    )
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    live = LiveRows(ctx, sql)
    for b in written:
        sink.write(b, timeout=WAIT)
    sink.close()
    got = live.finish()
    reference = SessionContext()
    reference.register_record_batches("t", [written])
    expected = reference.sql(f"{sql} ORDER BY {keys}").to_pylist()
    order = (lambda r: (r["w"], r["k"])) if other_key else (lambda r: r["w"])
    assert sorted(got, key=order) == expected
    assert [r["w"] for r in got] == sorted(r["w"] for r in got)  # emitted in window order


@pytest.mark.parametrize("unbounded", [False, True])
def test_a_window_is_emitted_when_the_next_one_starts(unbounded: bool) -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=unbounded)
    live = LiveRows(ctx, WINDOW_SQL)
    sink.write(rows((0.1, "a", 1), (0.5, "b", 2)))
    sink.write(rows((0.9, "a", 3)))
    # The engine has taken both batches (and folded them in the same poll): window 0 is
    # still open, so nothing came out. A partial window 0 emitted early would also show
    # below, as a first row with fewer than 3 rows in it.
    wait_until(lambda: sink.stats.queued_batches == 0, "the engine to read both batches")
    assert live.nothing_yet()
    sink.write(rows((1.2, "a", 10)))  # the first row of window 1 closes window 0
    [first] = live.take(1)
    assert first == {"w": at(0), "n": 3, "s": 6}
    sink.write(rows((1.3, "b", 20), (3.0, "c", 5)))
    assert live.take(1) == [{"w": at(1), "n": 2, "s": 30}]
    sink.close()  # end of stream emits the rest
    assert live.finish() == [{"w": at(3), "n": 1, "s": 5}]


def test_a_table_registered_with_capitals_windows_live_too() -> None:
    """DataFusion registers ``Events_Live`` as ``events_live``: the engine found no live
    table under that key, handed the query to datafusion-python, and window 0 came only at
    the end of the stream."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("Events_Live", SCHEMA, order_by="ts")
    assert ctx.reads_live("SELECT * FROM Events_Live")
    live = LiveRows(ctx, WINDOW_SQL.replace("FROM t", "FROM Events_Live"))
    sink.write(rows((0.1, "a", 1), (1.2, "a", 10)))  # window 1's first row closes window 0
    assert live.take(1) == [{"w": at(0), "n": 1, "s": 1}]
    sink.close()
    assert live.finish() == [{"w": at(1), "n": 1, "s": 10}]


def test_every_aggregate_is_exact_per_window_and_key() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts")
    sql = (
        "SELECT date_bin(INTERVAL '1 second', ts) AS w, k, count(*) AS n, sum(v) AS s, "
        "avg(v) AS a, min(v) AS lo, max(v) AS hi, count(DISTINCT v) AS d, "
        "approx_percentile_cont(0.5) WITHIN GROUP (ORDER BY v) AS p "
        "FROM t GROUP BY w, k"
    )
    live = LiveRows(ctx, sql)
    data = [(i * 0.25, "ab"[i % 2], (i * 7) % 5) for i in range(16)]  # windows 0..3
    written = [rows(*data[i : i + 3]) for i in range(0, 16, 3)]
    for b in written:
        sink.write(b)
    got = live.take(6)  # windows 0..2 (two keys each) closed by the rows of window 3
    sink.close()
    got += live.finish()
    reference = SessionContext()
    reference.register_record_batches("t", [written])
    expected = reference.sql(sql + " ORDER BY w, k").to_pylist()
    assert sorted(got, key=lambda r: (r["w"], r["k"])) == expected


def test_integer_buckets_and_date_trunc_are_windows_too() -> None:
    ctx = SessionContext()
    schema = pa.schema([("ts", pa.int64()), ("v", pa.int64())])
    sink = ctx.register_streaming_table("t", schema, order_by="ts")
    live = LiveRows(ctx, "SELECT ts / 1000 AS bucket, sum(v) AS s FROM t GROUP BY ts / 1000")
    sink.write(pa.table({"ts": [1, 999, 1000], "v": [1, 2, 3]}))
    assert live.take(1) == [{"bucket": 0, "s": 3}]
    sink.close()
    assert live.finish() == [{"bucket": 1, "s": 3}]

    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts")
    live = LiveRows(ctx, "SELECT date_trunc('minute', ts) AS m, count(*) AS n FROM t GROUP BY 1")
    sink.write(rows((1, "a", 1), (59, "a", 1), (61, "a", 1)))
    assert live.take(1) == [{"m": at(0), "n": 2}]
    sink.close()
    assert live.finish() == [{"m": at(60), "n": 1}]


def test_a_topic_subscription_windows_like_a_table() -> None:
    topic = Topic("events", SCHEMA, order_by="ts")
    ctx = SessionContext()
    topic.subscribe(ctx, "t", unbounded=True)
    live = LiveRows(ctx, WINDOW_SQL)
    topic.write(rows((0.2, "a", 1), (1.5, "a", 2)))
    assert live.take(1) == [{"w": at(0), "n": 1, "s": 1}]
    topic.advance(at(2))  # a topic's watermark reaches every subscription
    assert live.take(1) == [{"w": at(1), "n": 1, "s": 2}]
    topic.close()
    assert live.finish() == []


# --- watermarks ------------------------------------------------------------------------


def test_advance_emits_closed_windows_with_no_new_row() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    live = LiveRows(ctx, WINDOW_SQL)
    sink.write(rows((0.1, "a", 1), (1.1, "a", 2), (1.9, "a", 3)))
    assert live.take(1) == [{"w": at(0), "n": 1, "s": 1}]
    sink.advance(at(2))  # window [1, 2) ends at the watermark
    assert live.take(1) == [{"w": at(1), "n": 2, "s": 5}]
    with pytest.raises(OrderViolationError, match="watermark"):
        sink.write(rows((1.95, "late", 100)))
    sink.write(rows((2.5, "a", 7)))  # the sink is still usable
    sink.advance(at(2.5))  # a watermark inside an open window closes nothing
    sink.advance(at(1))  # one behind the current one changes nothing
    sink.close()
    assert live.finish() == [{"w": at(2), "n": 1, "s": 7}]


def test_late_rows_after_a_watermark_are_dropped_and_counted_with_late_drop() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", late="drop")
    live = LiveRows(ctx, WINDOW_SQL)
    sink.write(rows((0.5, "a", 1)))
    sink.advance(at(1))
    assert live.take(1) == [{"w": at(0), "n": 1, "s": 1}]
    sink.write(rows((0.7, "late", 100), (1.5, "a", 2)))
    assert sink.stats.late_rows == 1
    sink.close()
    assert live.finish() == [{"w": at(1), "n": 1, "s": 2}]


def test_advance_needs_an_ordered_table_and_an_open_one() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("plain", SCHEMA)
    with pytest.raises(ValueError, match="order_by"):
        sink.advance(at(1))
    ordered = ctx.register_streaming_table("t", SCHEMA, order_by="ts")
    ordered.close()
    with pytest.raises(SinkClosedError, match="closed"):
        ordered.advance(at(1))


def per_second(outer: str) -> tuple[Any, LiveRows]:
    """An ordered, unbounded table ``t`` and the live rows of ``outer`` (a SELECT list) over
    its per-second counts by ``k``: ``second``, ``k``, ``n``."""
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    per_second = (
        "(SELECT date_bin(INTERVAL '1 second', ts) AS second, k, count(*) AS n "
        "FROM t GROUP BY 1, 2)"
    )
    return sink, LiveRows(ctx, f"{outer} FROM {per_second}")


def test_watermarks_reach_windows_over_windows() -> None:
    sink, live = per_second(
        "SELECT second, k, n, sum(n) OVER (PARTITION BY k ORDER BY second "
        "ROWS UNBOUNDED PRECEDING) AS running"
    )
    sink.write(rows((0.1, "a", 0), (0.2, "a", 0), (1.1, "a", 0)))
    assert live.take(1) == [{"second": at(0), "k": "a", "n": 2, "running": 2}]
    sink.advance(at(2))
    assert live.take(1) == [{"second": at(1), "k": "a", "n": 1, "running": 3}]
    sink.close()
    assert live.finish() == []


def test_running_totals_over_windows_come_as_each_window_closes() -> None:
    # The per-key running totals per second, with the default (RANGE) frame: no row
    # has a peer in its partition, so none waits for the next window.
    sink, live = per_second(
        "SELECT second, k, n, sum(n) OVER (PARTITION BY k ORDER BY second) AS running"
    )
    sink.write(rows((0.1, "a", 0), (0.2, "b", 0), (0.3, "b", 0), (1.1, "a", 0)))
    assert sorted(live.take(2), key=lambda r: r["k"]) == [
        {"second": at(0), "k": "a", "n": 1, "running": 1},
        {"second": at(0), "k": "b", "n": 2, "running": 2},
    ]
    sink.write(rows((2.1, "b", 0)))
    assert live.take(1) == [{"second": at(1), "k": "a", "n": 1, "running": 2}]
    sink.close()
    assert live.finish() == [{"second": at(2), "k": "b", "n": 1, "running": 3}]


def test_a_running_frame_with_peers_keeps_its_meaning() -> None:
    # ORDER BY second alone: both keys of a second are peers and share the total, so a row
    # can come only once the next window shows the peers are complete.
    sink, live = per_second("SELECT second, k, sum(n) OVER (ORDER BY second) AS running")
    sink.write(rows((0.1, "a", 0), (0.2, "b", 0), (1.1, "a", 0), (2.1, "a", 0)))
    assert sorted(live.take(2), key=lambda r: r["k"]) == [
        {"second": at(0), "k": "a", "running": 2},
        {"second": at(0), "k": "b", "running": 2},
    ]
    sink.close()
    assert sorted(live.finish(), key=lambda r: r["second"]) == [
        {"second": at(1), "k": "a", "running": 3},
        {"second": at(2), "k": "a", "running": 4},
    ]


# --- running window functions, the DataFrame API, explain -------------------------------


def test_a_running_total_streams_row_by_row() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    live = LiveRows(ctx, "SELECT v, sum(v) OVER (ORDER BY ts ROWS UNBOUNDED PRECEDING) AS r FROM t")
    sink.write(rows((0.1, "a", 1)))
    assert live.take(1) == [{"v": 1, "r": 1}]
    sink.write(rows((0.2, "a", 2), (0.3, "a", 3)))
    assert live.take(2) == [{"v": 2, "r": 3}, {"v": 3, "r": 6}]
    sink.close()
    assert live.finish() == []


@pytest.mark.parametrize(
    "sql",
    [
        WINDOW_SQL + " HAVING count(*) > 1",
        f"SELECT * FROM ({WINDOW_SQL}) WHERE n > 1",
        "SELECT w, n FROM (SELECT date_bin(INTERVAL '1 second', ts) AS w, count(*) AS n, "
        "sum(count(*)) OVER (ORDER BY date_bin(INTERVAL '1 second', ts)) AS total "
        "FROM t GROUP BY 1) WHERE total > 0 AND n > 1",
    ],
)
def test_a_filter_over_window_results_passes_each_window_at_once(sql: str) -> None:
    # DataFusion's FilterExec gathers 8,192 rows before it emits; above live results it must not.
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    live = LiveRows(ctx, sql)
    sink.write(rows((0.1, "a", 1), (0.2, "b", 2), (1.1, "a", 3)))  # closes window 0 (2 rows)
    assert [(r["w"], r["n"]) for r in live.take(1)] == [(at(0), 2)]
    sink.write(
        rows((2.5, "a", 4), (2.6, "a", 5), (3.0, "b", 6))
    )  # window 1 (1 row) is filtered out
    assert [(r["w"], r["n"]) for r in live.take(1)] == [(at(2), 2)]
    sink.close()
    assert live.finish() == []


def test_the_result_is_an_ordinary_dataframe() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts")
    df = ctx.sql(WINDOW_SQL).filter("n > 1").select("w", "n")
    sink.write(rows((0.1, "a", 1), (0.2, "a", 1), (1.5, "a", 1), (2.5, "a", 1), (2.6, "a", 1)))
    sink.close()
    assert df.to_arrow_table().to_pylist() == [{"w": at(0), "n": 2}, {"w": at(2), "n": 2}]


def test_explain_live_names_the_engine() -> None:
    ctx = SessionContext()
    ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    ctx.register_streaming_table("u", SCHEMA)
    windows = ctx.explain_live(WINDOW_SQL)
    assert windows.mode == "incremental"
    assert windows.engine == "pushtable"
    assert "windows emit as they close" in str(windows)
    assert "WindowAggregateExec" in windows.plan
    rows_only = ctx.explain_live("SELECT k FROM u WHERE v > 1")
    assert (rows_only.mode, rows_only.engine) == ("incremental", "datafusion")
    at_end = ctx.explain_live("SELECT k, count(*) FROM u GROUP BY k")
    assert (at_end.mode, at_end.engine) == ("at_end", "datafusion")


RUNNING_SUM = "SELECT ts, sum(v) OVER (ORDER BY ts ROWS UNBOUNDED PRECEDING) AS s FROM {}"


@pytest.mark.parametrize(
    ("query", "mode", "engine"),
    [
        # running window functions stream in the table's order...
        (RUNNING_SUM.format("t"), "incremental", "pushtable"),
        # ...but over a table without that order they sort the whole input first
        (RUNNING_SUM.format("u"), "at_end", "datafusion"),
        # a projection needs no engine of ours
        ("SELECT ts, k, v * 2 AS w FROM t", "incremental", "datafusion"),
        # lookups into pandas, Lance and in-memory tables, per batch
        ("SELECT t.ts, p.name FROM t JOIN pdn p ON t.k = p.k", "incremental", "pushtable"),
        ("SELECT t.ts, n.name FROM t LEFT JOIN ln n ON t.k = n.k", "incremental", "pushtable"),
    ],
)
def test_explain_live_says_what_each_shape_does(
    tmp_path: Path, query: str, mode: str, engine: str
) -> None:
    """What ``explain_live`` says is what the query then does: rows before ``close()`` when it
    says incremental, none when it says at_end."""
    import lance
    import pandas as pd

    ctx = SessionContext()
    sinks = {
        "t": ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True),
        "u": ctx.register_streaming_table("u", SCHEMA),
    }
    names = pa.table({"k": ["a", "b"], "name": ["alpha", "beta"]})
    ctx.from_pandas(pd.DataFrame(names.to_pydict()), name="pdn")
    ctx.register_table("ln", lance.write_dataset(names, str(tmp_path / "names.lance")))
    explained = ctx.explain_live(query)
    assert (explained.mode, explained.engine) == (mode, engine), str(explained)
    sink = sinks["u" if " FROM u" in query else "t"]
    live = LiveRows(ctx, query)
    sink.write(rows((2.0, "a", 10), (3.0, "b", 1)))
    if mode == "incremental":
        assert len(live.take(2)) == 2  # before close()
        sink.close()
        assert live.finish() == []
    else:
        sink.close()
        assert len(live.finish()) == 2  # at the end, whole


def test_windows_join_in_memory_tables() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", SCHEMA, order_by="ts")
    names = pa.record_batch({"k": ["a", "b"], "name": ["alpha", "beta"]})
    ctx.register_record_batches("names", [[names]])
    sql = (
        "SELECT date_bin(INTERVAL '1 second', t.ts) AS w, names.name, count(*) AS n "
        "FROM t JOIN names ON t.k = names.k GROUP BY 1, 2"
    )
    assert ctx.explain_live(sql).engine == "pushtable"
    live = LiveRows(ctx, sql)
    sink.write(rows((0.1, "a", 1), (0.2, "b", 1), (0.3, "a", 1), (1.5, "b", 1)))
    got = live.take(2)
    assert sorted(got, key=lambda r: r["name"]) == [
        {"w": at(0), "name": "alpha", "n": 2},
        {"w": at(0), "name": "beta", "n": 1},
    ]
    sink.close()
    assert live.finish() == [{"w": at(1), "name": "beta", "n": 1}]


def test_a_table_the_engine_cannot_read_is_named() -> None:
    ctx = SessionContext()
    ctx.register_streaming_table("t", SCHEMA, order_by="ts", unbounded=True)
    ctx.register_view("v", ctx.sql("SELECT 'a' AS k"))
    with pytest.raises(UnsupportedTableError, match=r"'v'.*register_record_batches"):
        ctx.sql(
            "SELECT date_bin(INTERVAL '1 second', t.ts) AS w, count(*) FROM t "
            "JOIN v ON t.k = v.k GROUP BY 1"
        )


# --- arrival time ---------------------------------------------------------------------------


def test_arrival_windows_close_by_the_clock_with_no_new_row() -> None:
    ctx = SessionContext()
    schema = pa.schema([("k", pa.string())])
    sink = ctx.register_streaming_table("t", schema, arrival_column="arrived_at", unbounded=True)
    live = LiveRows(
        ctx,
        "SELECT date_bin(INTERVAL '50 milliseconds', arrived_at) AS w, count(*) AS n "
        "FROM t GROUP BY 1",
    )
    before = datetime.now(timezone.utc)
    sink.write(pa.table({"k": ["a", "b", "c"]}))
    [row] = live.take(1)  # no other row: the clock closed the window
    assert row["n"] == 3
    assert before - timedelta(milliseconds=50) <= row["w"] <= datetime.now(timezone.utc)
    assert not sink.stats.closed
    sink.close()
    assert live.finish() == []


def test_arrival_stamps_never_go_back_and_producers_write_without_them() -> None:
    ctx = SessionContext()
    schema = pa.schema([("k", pa.int64())])
    sink = ctx.register_streaming_table("t", schema, 32, arrival_column="arrived_at")
    for i in range(20):
        sink.write(pa.table({"k": [i, i]}))
    sink.close()
    got = ctx.sql("SELECT k, arrived_at FROM t").to_arrow_table()
    assert got.schema.field("arrived_at").type == pa.timestamp("us", tz="UTC")
    stamps = got["arrived_at"].to_pylist()
    assert stamps == sorted(stamps)
    assert got["k"].to_pylist() == [i for i in range(20) for _ in range(2)]


def test_arrival_column_errors_name_the_problem() -> None:
    ctx = SessionContext()
    schema = pa.schema([("k", pa.int64())])
    with pytest.raises(ValueError, match="'k' is already a column"):
        ctx.register_streaming_table("t", schema, arrival_column="k")
    sink = ctx.register_streaming_table("u", schema, arrival_column="at")
    with pytest.raises(ValueError, match="watermark is the clock"):
        sink.advance(datetime.now(timezone.utc))
    topic = Topic("events", schema, arrival_column="at")
    topic.subscribe(ctx, "v")
    assert ctx.table("v").schema().names == ["k", "at"]


# --- over the network -------------------------------------------------------------------


def test_a_remote_watermark_travels_in_order_with_the_batches() -> None:
    from pushtable.flight import Server, connect

    server = Server()
    try:
        with connect(server.location) as client:
            client.create_table("t", SCHEMA, order_by="ts", unbounded=True)
            result = client.sql(WINDOW_SQL)  # planned on the server by its live engine
            rows_seen: queue.Queue[dict[str, Any]] = queue.Queue()

            def read() -> None:
                for b in result:
                    for row in b.to_pylist():
                        rows_seen.put(row)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            with client.sink("t") as sink:
                sink.write(rows((0.1, "a", 1), (0.2, "a", 2)))
                sink.advance(at(1))  # after the batch, on the same stream
                assert rows_seen.get(timeout=WAIT) == {"w": at(0), "n": 2, "s": 3}
                sink.write(rows((1.5, "a", 4)))
            reader.join(WAIT)
            assert rows_seen.get(timeout=WAIT) == {"w": at(1), "n": 1, "s": 4}
    finally:
        server.stop()


# --- bounded disorder -----------------------------------------------------------------------


def test_rows_within_max_delay_are_reordered_and_windows_stay_exact() -> None:
    ctx = SessionContext()
    sink = ctx.register_streaming_table(
        "t", SCHEMA, order_by="ts", max_delay=timedelta(seconds=1), unbounded=True
    )
    live = LiveRows(ctx, WINDOW_SQL)
    sink.write(rows((0.5, "a", 1), (0.2, "a", 2)))  # out of order within the batch
    sink.write(rows((0.9, "a", 3), (0.1, "a", 4)))  # and across batches
    assert sink.stats.held_rows == 4  # nothing passed the watermark (0.9 - 1 s) yet
    sink.write(rows((1.2, "a", 5), (2.4, "a", 6)))  # watermark 1.4: window 0 is complete
    assert live.take(1) == [{"w": at(0), "n": 4, "s": 10}]
    assert sink.stats.held_rows == 1  # 2.4 waits; 1.2 went out
    assert sink.stats.held_bytes > 0
    with pytest.raises(OrderViolationError, match="late"):
        sink.write(rows((1.3, "late", 100)))  # behind the watermark 1.4
    sink.write(rows((1.9, "a", 7)))  # within max_delay of 2.4: accepted
    sink.advance(at(2))  # releases 1.9; window 1 ends at the watermark
    assert live.take(1) == [{"w": at(1), "n": 2, "s": 12}]
    sink.close()  # releases 2.4
    assert live.finish() == [{"w": at(2), "n": 1, "s": 6}]


def test_late_rows_beyond_max_delay_are_dropped_and_counted_with_late_drop() -> None:
    ctx = SessionContext()
    schema = pa.schema([("ts", pa.int64()), ("v", pa.int64())])
    sink = ctx.register_streaming_table("t", schema, 8, order_by="ts", max_delay=10, late="drop")
    sink.write(pa.table({"ts": [100, 95, 120], "v": [1, 1, 1]}))  # watermark 110
    sink.write(pa.table({"ts": [105, 111, 130], "v": [1, 1, 1]}))  # 105 is late: dropped
    assert sink.stats.late_rows == 1
    sink.close()
    got = ctx.sql("SELECT ts FROM t").to_arrow_table()["ts"].to_pylist()
    assert got == [95, 100, 111, 120, 130]
    with pytest.raises(ValueError, match="exactly one order_by"):
        ctx.register_streaming_table("u", schema, max_delay=10)
    with pytest.raises(ValueError, match="timestamp or date"):
        ctx.register_streaming_table("w", schema, order_by="ts", max_delay=timedelta(seconds=1))


def test_remote_tables_take_arrival_time_and_bounded_disorder() -> None:
    from pushtable.flight import Server, connect

    server = Server()
    try:
        with connect(server.location) as client:
            client.create_table("d", SCHEMA, 8, order_by="ts", max_delay=timedelta(seconds=1))
            client.create_table("a", pa.schema([("k", pa.int64())]), 8, arrival_column="at")
            with client.sink("d") as sink:
                sink.write(rows((0.5, "a", 1), (0.2, "b", 2), (0.9, "c", 3)))
            with client.sink("a") as sink:
                sink.write(pa.table({"k": [1, 2]}))
            ordered = pa.Table.from_batches(list(client.sql("SELECT k FROM d")))
            assert ordered["k"].to_pylist() == ["b", "a", "c"]
            stamped = pa.Table.from_batches(list(client.sql("SELECT k, at FROM a")))
            assert stamped.schema.field("at").type == pa.timestamp("us", tz="UTC")
            assert stamped["k"].to_pylist() == [1, 2]
    finally:
        server.stop()


def test_sparks_field_access_on_a_window_reads_its_start_and_end() -> None:
    """``window(ts, '10 seconds').start`` as Spark writes it (DataFusion's parser takes
    ``.start`` after a call for a column name): the same as ``window(...)['start']``."""
    from pushtable import SessionContext

    schema = pa.schema([("ts", pa.timestamp("us", tz="UTC")), ("v", pa.int64())])
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", schema, order_by="ts")
    t0 = datetime(2026, 11, 26, tzinfo=timezone.utc)
    df = ctx.sql(
        "SELECT window(ts, '10 seconds').start AS w, window(ts,'10 seconds') . END AS e, "
        "count(*) AS n FROM ev GROUP BY window(ts, '10 seconds')"
    )
    sink.write(
        pa.record_batch({"ts": [t0, t0 + timedelta(seconds=12)], "v": [1, 2]}, schema=schema)
    )
    sink.close()
    got = df.to_pydict()
    assert got["w"] == [t0, t0 + timedelta(seconds=10)]
    assert got["e"] == [t0 + timedelta(seconds=10), t0 + timedelta(seconds=20)]
    assert got["n"] == [1, 1]


def test_a_spark_window_query_the_engine_refuses_names_why_not_an_unknown_function() -> None:
    """A windowed GROUP BY sorted by its count on an unbounded table: the sort's refusal,
    at ctx.sql and from explain_live, never datafusion-python's "Invalid function 'window'"."""
    from pushtable import SessionContext, UnboundedQueryError, explain_live

    schema = pa.schema([("ts", pa.timestamp("us", tz="UTC")), ("v", pa.int64())])
    ctx = SessionContext()
    ctx.register_streaming_table("ev", schema, order_by="ts", unbounded=True)
    sql = "SELECT window(ts, '10 seconds') AS w, count(*) AS n FROM ev GROUP BY 1 ORDER BY n DESC"
    with pytest.raises(UnboundedQueryError, match="SortExec"):
        ctx.sql(sql)
    assert explain_live(ctx, sql).mode == "rejected"


def _live_and_plain(data: pa.Table, edges: list[int], live_sql: str) -> tuple[pa.Table, Any]:
    """``live_sql``'s answer over ``data`` written as the batches ``edges`` cut (a table
    ordered by ``ts``, written while the query runs), and a plain DataFusion session holding
    the same rows as ``t`` to compare with."""
    import datafusion

    ctx = SessionContext()
    sink = ctx.register_streaming_table("t", data.schema, capacity=4, order_by="ts")
    frame = ctx.sql(live_sql)

    def produce() -> None:
        with sink:
            for a, b in itertools.pairwise(edges):
                sink.write(data.slice(a, b - a).combine_chunks().to_batches()[0], timeout=WAIT)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    live = frame.to_arrow_table()
    producer.join(WAIT)
    assert not producer.is_alive()
    plain = datafusion.SessionContext()
    plain.register_record_batches("t", [data.to_batches()])
    return live, plain


DENSE = pa.schema(
    [
        ("ts", pa.timestamp("us", tz="Europe/Paris")),
        ("d", pa.decimal128(18, 4)),
        ("x", pa.float64()),
        ("s", pa.string()),
    ]
)
DENSE_AGGS = (
    "count(*) AS n, count(d) AS nd, sum(d) AS sd, max(x) AS mx, min(x) AS nx, min(s) AS ms, "
    "max(ts) AS last"
)
#: (live query, the same windows in plain SQL: a sliding window's row is in 3 windows)
DENSE_QUERIES = {
    "tumbling": (
        f"SELECT date_bin(INTERVAL '1 second', ts) AS w, {DENSE_AGGS} FROM t GROUP BY 1",
        "SELECT date_bin(INTERVAL '1 second', ts) AS w, * FROM t",
    ),
    "sliding": (
        f"SELECT window(ts, '3 seconds', '1 second')['start'] AS w, {DENSE_AGGS} FROM t "
        "GROUP BY window(ts, '3 seconds', '1 second')",
        " UNION ALL ".join(
            f"SELECT date_bin(INTERVAL '1 second', ts) - INTERVAL '{k} seconds' AS w, * FROM t"
            for k in range(3)
        ),
    ),
}


@pytest.mark.parametrize("shape", DENSE_QUERIES)
def test_batches_spanning_many_windows_are_the_batch_answer(shape: str) -> None:
    """Batches of up to thousands of rows that close hundreds of windows each (a window every
    few rows, some of one row, gaps with none): every window's row is plain DataFusion's
    answer over the same rows — a batch is cut into its windows' runs, never misassigned.
    Decimals, nulls, strings, zoned timestamps; batch edges inside windows."""
    import numpy as np

    live_sql, rows_sql = DENSE_QUERIES[shape]
    rng = np.random.default_rng(7)
    n = 20_000
    # 0-900 ms apart (about 2.2 rows a window), and 1 % of gaps of 5 s (windows with no row)
    steps = rng.integers(0, 900, n) + np.where(rng.random(n) < 0.01, 5_000, 0)
    ts = 1_767_225_600_000_000 + np.cumsum(steps) * 1_000
    data = pa.table(
        {
            "ts": pa.array(ts, DENSE.field("ts").type),
            "d": pa.array(
                [None if i % 7 == 0 else Decimal(f"{i % 1000}.{i % 10000:04d}") for i in range(n)],
                DENSE.field("d").type,
            ),
            # no NaN: DataFusion 54's grouped max/min over NaN depend on row order (max of
            # [NaN, -0.5] is -0.5, of [1.0, NaN] NaN), so no answer is "the" answer
            "x": pa.array(rng.normal(size=n), mask=rng.random(n) < 0.05),
            "s": pa.array([None if i % 5 == 0 else f"s{i % 13}" for i in range(n)]),
        },
        schema=DENSE,
    )
    edges = [0, *sorted(set(rng.integers(1, n, 12).tolist())), n]
    live, plain = _live_and_plain(data, edges, live_sql)
    want = plain.sql(f"SELECT w, {DENSE_AGGS} FROM ({rows_sql}) GROUP BY w").to_arrow_table()
    want = want.set_column(0, "w", want["w"].cast(live.schema.field("w").type))  # ns -> us
    assert max(b - a for a, b in itertools.pairwise(edges)) > 1_000  # a batch, many windows
    assert live.num_rows > 5_000  # thousands of windows, so each batch closed hundreds
    assert sorted(live.to_pylist(), key=repr) == sorted(want.to_pylist(), key=repr)


#: (time unit, zone, date_bin's interval, its origin or None, mean step between rows in the
#: unit): windows of a few hundred rows, so batches of thousands span several (the engine
#: finds them by date_bin's arithmetic on the raw times, confirmed by the key itself); the
#: last two do not fit that arithmetic (an interval finer than the unit, a month) and take
#: the general path
BINNED = {
    "ms, 1 s": ("ms", "UTC", "1 second", None, 4),
    "us, 250 ms, origin": ("us", "Europe/Paris", "250 milliseconds", "2026-01-01T00:00:00.1", 900),
    "ns, 7 s, before 1970": ("ns", None, "7 seconds", None, 25_000_000),
    "s, 1 day, origin": ("s", "UTC", "1 day", "2025-12-31T06:00:00", 300),
    "ms, 1.5 ms": ("ms", "UTC", "1500 microseconds", None, 1),
    "s, 1 month": ("s", "UTC", "1 month", None, 10_000),
}


@pytest.mark.parametrize("case", BINNED)
def test_batches_cut_by_date_bins_arithmetic_are_the_batch_answer(case: str) -> None:
    """Windows of a few hundred rows in batches of up to thousands, every unit, zones, an
    origin, times before 1970: each window's row is plain DataFusion's over the same rows —
    aggregates folded per part (count, sum, min, max, avg: a state of two fields) and row by
    row (a FILTER, count DISTINCT) alike."""
    import numpy as np

    unit, zone, interval, origin, step = BINNED[case]
    rng = np.random.default_rng(11)
    n = 12_000
    first = (
        -1_000 * step * 60
        if case.endswith("1970")
        else 1_767_225_600 * {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[unit]
    )
    ts = first + np.cumsum(rng.integers(0, 2 * step + 1, n))  # runs of equal times too
    schema = pa.schema(
        [("ts", pa.timestamp(unit, tz=zone)), ("d", pa.decimal128(18, 4)), ("s", pa.string())]
    )
    data = pa.table(
        {
            "ts": pa.array(ts, schema.field("ts").type),
            "d": pa.array(
                [None if i % 7 == 0 else Decimal(f"{i % 1000}.{i % 10000:04d}") for i in range(n)],
                schema.field("d").type,
            ),
            "s": pa.array([None if i % 5 == 0 else f"s{i % 13}" for i in range(n)]),
        },
        schema=schema,
    )
    key = f"date_bin(INTERVAL '{interval}', ts"
    key += f", TIMESTAMP '{origin}')" if origin else ")"
    sql = (
        f"SELECT {key} AS w, count(*) AS n, count(d) AS nd, sum(d) AS sd, min(s) AS ms, "
        "max(ts) AS last, avg(d) AS ad, count(DISTINCT s) AS ds, "
        "sum(d) FILTER (WHERE s > 's5') AS sf FROM t GROUP BY 1"
    )
    edges = [0, *sorted(set(rng.integers(1, n, 8).tolist())), n]
    live, plain = _live_and_plain(data, edges, sql)
    want = plain.sql(sql).to_arrow_table()
    assert max(b - a for a, b in itertools.pairwise(edges)) > 2_000  # batches span windows
    assert 10 < live.num_rows < n // 16 or case.endswith(("1.5 ms", "month"))
    assert sorted(live.to_pylist(), key=repr) == sorted(want.to_pylist(), key=repr)


@pytest.mark.parametrize("edges", [[0, 40, 100], [0, 25, 50, 100], [0, 100]])
def test_an_average_over_a_window_of_nulls_is_null(edges: list[int]) -> None:
    """A window whose values are all null averages to NULL, as plain DataFusion says. The
    engine folded a batch inside one window through the row accumulator, whose state for
    all-null rows (a count of 0, a null sum) DataFusion's group accumulator took for a group
    with rows: NaN for a float, and for a decimal a division by zero that aborted the
    process. Batches of 16+ rows in one window, windows cut across batches, one batch."""
    n = 100
    # windows of 25 rows (1 s each): the second and fourth hold nulls only
    ts = [1_767_225_600_000 + i * 40 for i in range(n)]
    empty = [(i // 25) % 2 == 1 for i in range(n)]
    data = pa.table(
        {
            "ts": pa.array(ts, pa.timestamp("ms", tz="UTC")),
            "x": pa.array([None if e else i * 0.5 for i, e in enumerate(empty)], pa.float64()),
            "d": pa.array(
                [None if e else Decimal(f"{i}.25") for i, e in enumerate(empty)],
                pa.decimal128(18, 4),
            ),
            "i": pa.array([None if e else i for i, e in enumerate(empty)], pa.int32()),
        }
    )
    sql = (
        "SELECT date_bin(INTERVAL '1 second', ts) AS w, avg(x) AS ax, avg(d) AS ad, "
        "avg(i) AS ai, sum(x) AS sx, min(d) AS md, count(i) AS ci FROM t GROUP BY 1"
    )
    live, plain = _live_and_plain(data, edges, sql)
    want = plain.sql(f"{sql} ORDER BY 1").to_pylist()
    assert [r["ax"] for r in want] == [6.0, None, 31.0, None]  # the check can fail
    assert sorted(live.to_pylist(), key=lambda r: r["w"]) == want
