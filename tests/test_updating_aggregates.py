"""Updating aggregates: a ``GROUP BY`` with no window, ``SELECT DISTINCT`` and whole-input
aggregates over live tables answer while rows arrive, as an upsert changelog.

Each output batch holds the groups changed since the previous one with their current values
(the last row seen for a key is its value); applying the changes in order gives exactly the
rows of the same query over the whole input. Shapes that would read a changelog as rows (a
``HAVING``, an aggregate over one) are refused up front, and the state is held to a limit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import datafusion
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushtable import (
    ReaderGoneError,
    ResourceLimitError,
    SessionContext,
    Topic,
    UnboundedQueryError,
    explain_live,
)
from pushtable.flight import Client, Server
from tests.conftest import WAIT, Background, wait_until

T0 = datetime(2026, 11, 25, 12, tzinfo=timezone.utc)
EV = pa.schema(
    [
        pa.field("k", pa.string()),
        pa.field("ts", pa.timestamp("us", tz="Europe/Paris")),
        pa.field("amount", pa.decimal128(12, 2)),
        pa.field("tags", pa.list_(pa.string())),
        pa.field("n", pa.int64()),
    ]
)
BY_KEY = (
    "SELECT k, count(*) AS c, sum(amount) AS total, max(ts) AS last, "
    "count(DISTINCT n) AS kinds FROM ev GROUP BY k"
)


def events(rows: list[tuple[str | None, int]]) -> pa.RecordBatch:
    """Rows of ``ev`` from (key, n): amount n/4 (null when n % 5 == 0), ts T0 + n s."""
    return pa.record_batch(
        {
            "k": [k for k, _ in rows],
            "ts": [T0 + timedelta(seconds=n) for _, n in rows],
            "amount": [None if n % 5 == 0 else Decimal(n) / 4 for _, n in rows],
            "tags": [[f"t{n % 3}"] if n % 2 else None for _, n in rows],
            "n": [n % 7 for _, n in rows],
        },
        schema=EV,
    )


class Changes:
    """The result batches of a live query as they come, read in a background thread."""

    def __init__(self, ctx: SessionContext, sql: str) -> None:
        self.batches: queue.Queue[Any] = queue.Queue()
        stream = ctx.sql(sql).execute_stream()

        def read() -> None:
            try:
                for b in stream:
                    self.batches.put(b.to_pyarrow())
            except Exception as exc:  # noqa: BLE001 - handed to the test
                self.batches.put(exc)
            self.batches.put(None)

        threading.Thread(target=read, daemon=True).start()

    def next(self) -> pa.RecordBatch:
        """The next batch of changes; fails the test if none comes within WAIT."""
        try:
            item = self.batches.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail("no changes came without more data")
        assert item is not None, "the stream ended"
        if isinstance(item, BaseException):
            raise item
        return item

    def rest(self) -> list[pa.RecordBatch]:
        """Every batch up to the end of the stream."""
        out = []
        while (item := self.batches.get(timeout=WAIT)) is not None:
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out


def applied(batches: list[pa.RecordBatch], keys: int) -> list[tuple[Any, ...]]:
    """An upsert changelog applied in order: the last row of each key (its first ``keys``
    columns), sorted."""
    state: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for b in batches:
        for row in b.to_pylist():
            values = tuple(row.values())
            state[values[:keys]] = values
    return sorted(state.values(), key=lambda r: tuple(map(str, r)))


def whole(sql: str, data: list[pa.RecordBatch]) -> list[tuple[Any, ...]]:
    """The same query over the whole input, by datafusion-python over an in-memory table."""
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("ev", [data or [events([])]])
    table = ctx.sql(sql).to_arrow_table()
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=lambda r: tuple(map(str, r)))


def live(unbounded: bool = True, capacity: int = 8, **options: Any) -> tuple[SessionContext, Any]:
    ctx = SessionContext(**options)
    return ctx, ctx.register_streaming_table("ev", EV, capacity, unbounded=unbounded)


def test_each_batch_brings_the_groups_it_changed_with_their_current_values() -> None:
    ctx, sink = live()
    explained = explain_live(ctx, BY_KEY)
    assert (explained.mode, explained.engine) == ("incremental", "pushtable")
    assert "upsert changelog" in explained.reasons[0]
    changes = Changes(ctx, BY_KEY)
    sink.write(events([("a", 1), ("b", 2), ("a", 3)]))
    first = changes.next().to_pylist()
    assert sorted((r["k"], r["c"], r["total"]) for r in first) == [
        ("a", 2, Decimal("1.00")),
        ("b", 1, Decimal("0.50")),
    ]
    sink.write(events([("a", 5), (None, 6)]))  # a changes (amount null: sum unchanged)
    second = changes.next().to_pylist()
    assert sorted((str(r["k"]), r["c"], r["total"], r["kinds"]) for r in second) == [
        ("None", 1, Decimal("1.50"), 1),
        ("a", 3, Decimal("1.00"), 3),
    ]
    (a,) = [r for r in second if r["k"] == "a"]
    assert a["last"] == T0 + timedelta(seconds=5)
    assert str(a["last"].tzinfo) == "Europe/Paris"
    sink.close()
    assert changes.rest() == []


@pytest.mark.parametrize(
    ("sql", "key"),
    [
        ("SELECT k, count(*) AS c FROM ev GROUP BY k", ["k"]),
        ("SELECT count(*) AS c, n AS kind, k FROM ev GROUP BY k, n", ["k", "kind"]),
        ("SELECT count(*) AS c FROM ev", []),
        ("SELECT count(*) AS c FROM ev GROUP BY k", None),  # the key is not in the result
        ("SELECT k FROM ev WHERE n > 1", None),
    ],
)
def test_the_result_says_which_columns_key_its_changes(sql: str, key: list[str] | None) -> None:
    ctx, sink = live()
    assert ctx.sql(sql).upsert_key == key
    sink.close()


def test_a_dataframe_derived_from_an_updating_query_keeps_its_key_while_it_keeps_the_columns() -> (
    None
):
    ctx, sink = live()
    df = ctx.sql("SELECT k, n, count(*) AS c FROM ev GROUP BY k, n")
    assert df.upsert_key == ["k", "n"]
    derived: list[Any] = [df.filter(datafusion.col("c") > 1), df.select("n", "k", "c")]
    assert [d.upsert_key for d in derived] == [["k", "n"], ["k", "n"]]
    narrowed: Any = df.select("k", "c")
    assert narrowed.upsert_key is None  # a key column is gone: no key to upsert by
    sink.close()


def test_distinct_and_a_whole_input_aggregate_answer_as_rows_arrive() -> None:
    ctx, sink = live()
    distinct = Changes(ctx, "SELECT DISTINCT k FROM ev")
    sink.write(events([("x", 1), ("y", 1), ("x", 2)]))
    assert sorted(distinct.next().column("k").to_pylist()) == ["x", "y"]
    sink.write(events([("x", 3), ("z", 4)]))  # only the new key is a change
    assert distinct.next().column("k").to_pylist() == ["z"]
    sink.close()
    assert distinct.rest() == []

    ctx, sink = live()
    totals = Changes(ctx, "SELECT count(*) AS c, sum(amount) AS s FROM ev")
    sink.write(events([("x", 1), ("y", 2)]))
    assert totals.next().to_pylist() == [{"c": 2, "s": Decimal("0.75")}]
    sink.write(events([("x", 3)]))
    assert totals.next().to_pylist() == [{"c": 3, "s": Decimal("1.50")}]
    sink.close()
    assert totals.rest() == []


def test_a_whole_input_aggregate_over_no_rows_answers_at_the_end() -> None:
    ctx, sink = live()
    totals = Changes(ctx, "SELECT count(*) AS c FROM ev")
    sink.close()
    assert [b.to_pylist() for b in totals.rest()] == [[{"c": 0}]]


def test_a_slow_reader_gets_one_batch_of_the_latest_values_not_a_backlog() -> None:
    """Five batches queued before the reader asks: the first answer folds all of them, each
    key once with its value after the fifth."""
    ctx, sink = live(capacity=8)
    stream = ctx.sql("SELECT k, count(*) AS c FROM ev GROUP BY k").execute_stream()
    for i in range(5):
        sink.write(events([("a", i), ("b", i)]))
    first = next(iter(stream)).to_pyarrow()
    assert sorted(first.to_pylist(), key=lambda r: r["k"]) == [
        {"k": "a", "c": 5},
        {"k": "b", "c": 5},
    ]
    sink.close()


def test_a_bounded_table_answers_at_close_unless_changes_are_asked_for() -> None:
    ctx, sink = live(unbounded=False)
    assert explain_live(ctx, BY_KEY).mode == "at_end"
    result = Background(lambda: ctx.sql(BY_KEY).to_arrow_table())
    data = [events([("a", 1), ("b", 2)]), events([("a", 3)])]
    for b in data:
        sink.write(b)
    sink.close()
    assert sorted(map(lambda r: tuple(r.values()), result.join().to_pylist())) == sorted(
        whole(BY_KEY, data)
    )

    ctx, sink = live(unbounded=False)
    assert explain_live(ctx, BY_KEY + " EMIT CHANGES").mode == "incremental"
    changes = Changes(ctx, BY_KEY + " EMIT CHANGES")
    sink.write(events([("a", 1)]))
    assert changes.next().column("c").to_pylist() == [1]  # before close()
    sink.close()
    assert changes.rest() == []


def test_a_topic_subscription_answers_with_changes_before_the_topic_closes() -> None:
    topic = Topic("ev", EV)
    ctx = SessionContext()
    topic.subscribe(ctx, "ev")
    changes = Changes(ctx, "SELECT k, count(*) AS c FROM ev GROUP BY k")
    topic.write(events([("a", 1), ("a", 2)]))
    assert changes.next().to_pylist() == [{"k": "a", "c": 2}]
    topic.write(events([("b", 3)]))
    assert changes.next().to_pylist() == [{"k": "b", "c": 1}]
    topic.close()
    assert changes.rest() == []


def test_emit_changes_over_no_live_table_is_a_clear_error() -> None:
    ctx = SessionContext()
    ctx.register_record_batches("dim", [[events([("a", 1)])]])
    with pytest.raises(ValueError, match=r"EMIT CHANGES .* reads none"):
        ctx.sql("SELECT k, count(*) FROM dim GROUP BY k EMIT CHANGES")


@pytest.mark.parametrize(
    ("sql", "operator", "says"),
    [
        ("SELECT k, count(*) AS c FROM ev GROUP BY k HAVING count(*) < 3", "FilterExec", "HAVING"),
        (
            "SELECT max(c) AS m FROM (SELECT k, count(*) AS c FROM ev GROUP BY k)",
            "UpdatingAggregateExec",
            "changelog",
        ),
        ("SELECT k, count(*) AS c FROM ev GROUP BY k ORDER BY c", "SortExec", "changelog"),
        (
            "SELECT k, n, count(*) FROM ev GROUP BY GROUPING SETS ((k), (n))",
            "AggregateExec",
            "GROUPING SETS",
        ),
    ],
)
def test_shapes_that_would_read_a_changelog_as_rows_are_refused_up_front(
    sql: str, operator: str, says: str
) -> None:
    ctx, sink = live()
    with pytest.raises(UnboundedQueryError, match=says) as refused:
        ctx.sql(sql)
    assert refused.value.operator == operator
    explained = explain_live(ctx, sql)
    assert explained.mode == "rejected"
    assert says in explained.reasons[0]
    sink.write(events([("a", 1)]))  # nothing was consumed: the table still takes a query
    changes = Changes(ctx, "SELECT k, count(*) AS c FROM ev GROUP BY k")
    assert changes.next().to_pylist() == [{"k": "a", "c": 1}]
    sink.close()


def test_state_past_its_limit_fails_the_query_naming_the_limit() -> None:
    ctx, sink = live(memory_limit=4 * 2**20)
    result = Background(lambda: ctx.sql("SELECT k, count(*) FROM ev GROUP BY k").to_arrow_table())
    # The failed query leaves the sink without a reader: the writer is told, by class.
    with pytest.raises(ReaderGoneError):
        for i in range(200):  # 2,000 new keys a batch: well past 4 MiB of keys
            sink.write(events([(f"key-{i}-{j}-" + "x" * 64, j) for j in range(2000)]), timeout=WAIT)
    result.done.wait(WAIT)
    assert isinstance(result.error, ResourceLimitError), result.error
    assert "updating GROUP BY" in str(result.error)
    assert "limit of 4194304 bytes" in str(result.error)


def updating_state() -> tuple[int, int, int]:
    """(streams, groups, bytes) of the process's updating aggregates, from pushtable's stats
    and, the same figures, its Prometheus gauges."""
    import gc

    from prometheus_client import generate_latest

    from pushtable import metrics
    from pushtable.engine import live_state

    gc.collect()  # earlier tests' finished queries let go of their share now, not mid-test
    (state,) = [s for s in live_state() if s.operator == "UpdatingAggregateExec"]
    text = generate_latest(metrics.REGISTRY).decode()
    gauge = f'pushtable_live_state_groups{{operator="UpdatingAggregateExec"}} {state.groups:.1f}'
    assert gauge in text
    return state.streams, state.groups, state.state_bytes


def test_group_state_is_counted_in_the_stats_while_the_query_runs() -> None:
    """Other tests' queries may still run in this process: the figures are read as changes."""
    streams, groups, nbytes = updating_state()
    ctx, sink = live()
    changes = Changes(ctx, "SELECT k, count(*) AS c FROM ev GROUP BY k")
    sink.write(events([("a", 1), ("b", 2), ("c", 3)]))
    changes.next()
    now = updating_state()
    assert now[:2] == (streams + 1, groups + 3)
    assert now[2] > nbytes
    sink.write(events([("a", 4), ("d", 5)]))
    changes.next()
    assert updating_state()[1] == groups + 4
    sink.close()
    changes.rest()
    # The ended query takes its share back once its stream is let go.
    wait_until(lambda: updating_state() == (streams, groups, nbytes), "the share taken back")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "dd", None]), st.integers(0, 40)),
        max_size=60,
    ),
    st.integers(1, 7),
    st.sampled_from(
        [
            (BY_KEY, 1),
            ("SELECT DISTINCT k, n FROM ev", 2),
            (
                "SELECT n, min(amount) AS lo, avg(amount) AS mean, array_agg(k) IS NULL AS none "
                "FROM ev GROUP BY n",
                1,
            ),
            ("SELECT count(*) AS c, sum(n) AS s, min(ts) AS first FROM ev", 0),
            ("SELECT k, count(tags) AS tagged FROM ev WHERE n > 2 GROUP BY k", 1),
        ]
    ),
)
def test_the_changes_applied_in_order_give_the_rows_of_the_whole_input(
    rows: list[tuple[str | None, int]], per: int, query: tuple[str, int]
) -> None:
    """Random keys (with nulls), cut into random batches, written by a producer thread while
    the query reads: the changelog, applied as upserts, equals the query over all the rows."""
    sql, keys = query
    data = [events(rows[i : i + per]) for i in range(0, len(rows), per)]
    ctx, sink = live(capacity=2)
    result = Background(lambda: ctx.sql(sql).to_arrow_table().to_batches())
    producer = Background(lambda: ([sink.write(b, timeout=WAIT) for b in data], sink.close()))
    got = result.join()
    producer.join()  # its error, if any, is the test's: not "did not finish within 30 s"
    assert applied(got, keys) == whole(sql, data)


def test_remote_sql_runs_an_updating_aggregate(server: Server, client: Client) -> None:
    client.create_table("ev", EV, 4, unbounded=True)
    with pytest.raises(UnboundedQueryError, match="HAVING"):
        client.sql("SELECT k, count(*) FROM ev GROUP BY k HAVING count(*) > 1").read_all()
    result = client.sql("SELECT k, count(*) AS c FROM ev GROUP BY k")
    assert result.schema.metadata[b"pushtable.upsert_key"] == b'["k"]'
    with client.sink("ev") as ev:
        ev.write(events([("a", 1), ("b", 2)]))
        ev.write(events([("a", 3)]))
    assert applied(result.read_all().to_batches(), 1) == [("a", 2), ("b", 1)]


KEY_TYPES: dict[str, tuple[pa.DataType, Callable[[int], Any]]] = {
    "int8": (pa.int8(), lambda i: (i * 37) % 256 - 128),
    "uint64 past the int64 range": (pa.uint64(), lambda i: 2**64 - 1 - (i * 7919) % 50),
    "date32": (pa.date32(), lambda i: datetime(1969, 12, 1) + timedelta(days=(i * 13) % 90)),
    "zoned timestamp": (
        pa.timestamp("ns", tz="America/New_York"),
        lambda i: T0 - timedelta(microseconds=(i * 7919) % 4000),
    ),
    "duration": (pa.duration("ms"), lambda i: timedelta(milliseconds=(i * 31) % 600 - 300)),
}


@pytest.mark.parametrize("name", list(KEY_TYPES))
def test_one_integer_like_key_groups_as_datafusion_does(name: str) -> None:
    """A single integer-like key (pushtable's own group table, not DataFusion's): negative and
    past-int64 keys, nulls, thousands of groups across batches and the table's growth; the
    changelog applied equals plain DataFusion's GROUP BY over the same rows."""
    data_type, key = KEY_TYPES[name]
    schema = pa.schema(
        [("g", data_type), ("amount", pa.decimal128(12, 2)), ("ts", EV.field("ts").type)]
    )

    def batch(first: int, rows: int) -> pa.RecordBatch:
        numbers = range(first, first + rows)
        return pa.record_batch(
            {
                "g": pa.array([None if i % 11 == 0 else key(i) for i in numbers], data_type),
                "amount": [None if i % 5 == 0 else Decimal(i) / 4 for i in numbers],
                "ts": [T0 + timedelta(seconds=i) for i in numbers],
            },
            schema=schema,
        )

    sql = (
        "SELECT g, count(*) AS c, sum(amount) AS total, max(ts) AS last, count(DISTINCT ts) AS d "
        "FROM ev GROUP BY g"
    )
    data = [batch(first, rows) for first, rows in ((0, 1), (1, 700), (701, 3000), (3701, 5))]
    ctx = SessionContext()
    sink = ctx.register_streaming_table("ev", schema, 2, unbounded=True)

    def produce() -> None:
        with sink:
            for b in data:
                sink.write(b, timeout=WAIT)

    result = Background(lambda: ctx.sql(sql).to_arrow_table().to_batches())
    producer = Background(produce)
    got = result.join()
    producer.join()
    plain = datafusion.SessionContext()
    plain.register_record_batches("ev", [data])
    want = sorted(
        (tuple(r.values()) for r in plain.sql(sql).to_arrow_table().to_pylist()),
        key=lambda r: tuple(map(str, r)),
    )
    assert len(want) > 40  # many groups across the table's growth
    assert any(r[0] is None for r in want)  # and the null one
    assert applied(got, 1) == want
