"""Durable topics: acknowledged means committed, offsets, reads from any start, idempotent
producers, restart, failed commits, limits and who may create them (real Lance datasets and
real Flight servers; the crash tests with killed server processes are in
test_durable_crash.py)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import datafusion
import lance
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable import SessionContext, Topic
from pushtable.errors import (
    CommitFailedError,
    InvalidRequestError,
    PermissionDeniedError,
    ResourceLimitError,
    SchemaMismatchError,
    SequenceError,
)
from pushtable.flight import Client, Limits, RemoteSink, Server, connect, protocol
from pushtable.flight.client.idempotent import DURABLE_WINDOW, IdempotentSink
from pushtable.flight.server.auth import Grant
from pushtable.producer import batch_bytes
from tests.conftest import WAIT, Background, wait_until

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])


def rows(start: int, n: int = 2) -> pa.RecordBatch:
    return pa.record_batch(
        {"k": list(range(start, start + n)), "s": [f"r{i}" for i in range(start, start + n)]},
        schema=SCHEMA,
    )


def stored_keys(path: Path) -> list[int]:
    return sorted(lance.dataset(str(path)).to_table(columns=["k"]).column("k").to_pylist())


# -- in process ----------------------------------------------------------------------------


def test_flush_returns_once_a_commit_holds_every_batch(tmp_path: Path) -> None:
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path, commit_interval=30.0)  # only flush commits
    topic.write(rows(0))
    topic.write(pa.Table.from_batches([rows(2), rows(4)]))
    assert topic.stats.committed_offset == 0
    assert topic.stats.pending_batches == 3
    topic.flush(timeout=WAIT)
    assert stored_keys(path) == list(range(6))
    assert topic.offsets() == {"earliest": 0, "committed": 3, "next": 3}
    ds = lance.dataset(str(path))
    tx = ds.get_transactions(1)[0]
    assert tx is not None
    stamped = dict(tx.transaction_properties or {})
    assert stamped["pushtable.next_offset"] == "3"
    assert ds.to_table(columns=["_offset"]).column(0).to_pylist() == [0, 0, 1, 1, 2, 2]
    topic.close()


def test_group_commit_stores_everything_of_an_interval_in_one_transaction(
    tmp_path: Path,
) -> None:
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance", commit_interval=30.0)
    for i in range(20):
        topic.write(rows(2 * i))
    topic.flush(timeout=WAIT)
    assert topic.stats.commits == 1
    topic.close()


def test_subscriptions_start_at_earliest_an_offset_a_time_or_latest(tmp_path: Path) -> None:
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance", retain=1)
    for i in range(4):
        topic.write(rows(10 * i, 1))
    topic.flush(timeout=WAIT)  # offsets 0..3 stored; offset 3 also in memory (retain=1)
    topic.write(rows(40, 1))  # offset 4 pending, maybe
    ctx = SessionContext()
    topic.subscribe(ctx, "all", start="earliest")
    topic.subscribe(ctx, "from2", start=2)
    topic.subscribe(ctx, "from3", start=3)
    topic.subscribe(ctx, "latest", start="latest")
    cut = datetime.now(timezone.utc)
    topic.write(rows(50, 1))
    topic.subscribe(ctx, "since", start=cut)
    topic.write(rows(60, 1))
    topic.close()

    def keys(table: str) -> list[int]:
        return ctx.sql(f"SELECT k FROM {table} ORDER BY k").to_pydict()["k"]

    assert keys("all") == [0, 10, 20, 30, 40, 50, 60]
    assert keys("from2") == [20, 30, 40, 50, 60]
    assert keys("from3") == [30, 40, 50, 60]
    assert keys("latest") == [50, 60]
    assert keys("since") == [50, 60]


def test_a_subscription_from_a_time_does_not_hold_up_producers(tmp_path: Path) -> None:
    """The start time is looked up in Lance before the append lock is taken: a write goes
    through while that lookup is still running (held here on an event), and the read then
    has every batch from the time on, the one written meanwhile too."""
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance")
    topic.write(rows(0, 1))
    topic.flush(timeout=WAIT)
    cut = datetime.now(timezone.utc)
    topic.write(rows(10, 1))
    topic.flush(timeout=WAIT)  # stored and not kept in memory: the start needs Lance
    log = topic.durable
    assert log is not None
    looking, release = threading.Event(), threading.Event()
    offset_at = log.store.offset_at

    def slow_offset_at(when: datetime, version: int | None = None) -> int | None:
        looking.set()
        assert release.wait(WAIT), "the test did not release the lookup"
        return offset_at(when, version)

    log.store.offset_at = slow_offset_at  # type: ignore[method-assign]
    ctx = SessionContext()
    subscribing = Background(lambda: topic.subscribe(ctx, "since", start=cut))
    assert looking.wait(WAIT)
    written = Background(lambda: topic.write(rows(20, 1), timeout=WAIT))
    written.join(timeout=WAIT)  # not blocked behind the lookup
    release.set()
    subscribing.join(timeout=WAIT)
    topic.write(rows(30, 1))
    topic.close()
    assert ctx.sql("SELECT k FROM since ORDER BY k").to_pydict()["k"] == [10, 20, 30]


def test_a_subscription_taken_while_writers_write_sees_no_gap_and_no_duplicate(
    tmp_path: Path,
) -> None:
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance", commit_interval=0.005)
    stop = threading.Event()
    written: list[int] = []

    def produce() -> None:
        i = 0
        while not stop.is_set() or i < 50:
            topic.write(rows(i, 1))
            written.append(i)
            i += 1

    producer = Background(produce)
    ctx = SessionContext()
    wait_until(lambda: len(written) >= 20, "20 batches written")  # subscribe mid-stream
    topic.subscribe(ctx, "mid", start=10)
    reading = Background(lambda: ctx.sql("SELECT k FROM mid").to_pydict()["k"])
    stop.set()
    producer.join()
    topic.close()
    assert sorted(reading.join()) == list(range(10, len(written)))


def test_read_returns_the_same_committed_rows_every_time(tmp_path: Path) -> None:
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance")
    for i in range(5):
        topic.write(rows(2 * i))
    topic.flush(timeout=WAIT)
    first = topic.read(1, 4).read_all()
    topic.durable.upkeep()  # type: ignore[union-attr]  # compaction rewrites fragments
    assert topic.read(1, 4).read_all().equals(first)
    assert first.column("k").to_pylist() == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"offsets \[3, 9\) cannot be read"):
        topic.read(3, 9)
    topic.close()


def test_a_topic_made_again_on_its_path_continues_its_offsets(tmp_path: Path) -> None:
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path, retain=4, order_by="k")
    for i in range(3):
        topic.write(rows(2 * i))
    topic.close()
    again = Topic.reopen(path)
    assert again.name == "t"
    assert again.schema.equals(SCHEMA)
    assert again.retain == 4
    assert again.offsets()["next"] == 3
    ctx = SessionContext()
    again.subscribe(ctx, "all", start="earliest")
    again.write(rows(6))
    again.close()
    assert ctx.sql("SELECT k FROM all ORDER BY k").to_pydict()["k"] == list(range(8))
    with pytest.raises(ValueError, match="holds a topic with schema"):
        Topic("t", pa.schema([("other", pa.int32())]), persist=path)


def test_consumer_positions_are_reported_and_kept_by_the_next_commit(tmp_path: Path) -> None:
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path)
    for i in range(3):
        topic.write(rows(2 * i))
    topic.flush(timeout=WAIT)
    topic.consumed("query-a", 2)
    assert topic.stats.consumers == {"query-a": 2}
    with pytest.raises(ValueError, match=r"offsets 0\.\.3 are committed"):
        topic.consumed("query-a", 4)
    topic.write(rows(6))  # the next commit stores the position
    topic.close()
    assert Topic.reopen(path).stats.consumers == {"query-a": 2}


def test_reserved_column_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'_offset'"):
        Topic("t", pa.schema([("_offset", pa.int64())]), persist=tmp_path / "t.lance")


def test_offsets_and_times_need_a_durable_topic() -> None:
    topic = Topic("t", SCHEMA)
    with pytest.raises(ValueError, match="needs a durable topic"):
        topic.subscribe(SessionContext(), "x", start=3)
    with pytest.raises(ValueError, match="needs a durable topic"):
        topic.offsets()


def break_dataset(path: Path) -> Path:
    """Make the dataset's data directory a file: every fragment write fails (ENOTDIR), even
    for root, who ignores a read-only mode."""
    data = path / "data"
    moved = path.with_name(path.name + ".data")
    shutil.move(str(data), str(moved))
    data.write_text("not a directory")
    return moved


def mend_dataset(path: Path, moved: Path) -> None:
    (path / "data").unlink()
    shutil.move(str(moved), str(path / "data"))


def test_a_failed_commit_is_not_acknowledged_and_is_retried(tmp_path: Path) -> None:
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path, commit_interval=0.05)
    topic.write(rows(0))
    topic.flush(timeout=WAIT)
    moved = break_dataset(path)
    topic.write(rows(2))
    with pytest.raises(CommitFailedError, match=r"offsets 1\.\.1 in .*t\.lance failed"):
        topic.flush(timeout=WAIT)
    with pytest.raises(CommitFailedError):  # no new batch while nothing can be stored
        topic.write(rows(4))
    assert lance.dataset(str(path)).count_rows() == 2  # the manifest: offset 0 only
    assert topic.offsets()["committed"] == 1
    mend_dataset(path, moved)
    topic.flush(timeout=WAIT)  # the committer retried: the pending batch is stored once
    assert stored_keys(path) == [0, 1, 2, 3]
    topic.write(rows(4))
    topic.close()
    assert stored_keys(path) == list(range(6))


def test_close_stops_and_joins_the_threads_of_the_topic_even_when_its_commit_fails(
    tmp_path: Path,
) -> None:
    """A topic's committer and upkeep threads end with ``close()``; a close whose last commit
    fails raises that error and leaves no committer retrying behind a closed topic."""

    def threads_of(name: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.endswith(f"-{name}") and t.is_alive()]

    good = Topic("good", SCHEMA, persist=tmp_path / "good.lance", upkeep_interval=0.05)
    good.write(rows(0))
    assert {t.name for t in threads_of("good")} == {
        "pushtable-commit-good",
        "pushtable-upkeep-good",
    }
    good.close()
    assert threads_of("good") == []
    assert stored_keys(tmp_path / "good.lance") == [0, 1]

    path = tmp_path / "bad.lance"
    bad = Topic("bad", SCHEMA, persist=path, commit_interval=0.05)
    bad.write(rows(0))
    bad.flush(timeout=WAIT)
    break_dataset(path)
    bad.write(rows(2))
    with pytest.raises(CommitFailedError, match=r"offsets 1\.\.1"):
        bad.close()
    assert threads_of("bad") == []  # not retrying behind the closed topic
    assert lance.dataset(str(path)).count_rows() == 2  # what was acknowledged, only


# -- on a server ---------------------------------------------------------------------------


def data_dir(server: Server) -> Path:
    assert server.data_dir is not None
    assert server.data_dir.local is not None
    return server.data_dir.local


@pytest.fixture
def durable_server(tmp_path: Path) -> Iterator[Server]:
    server = Server(data_dir=tmp_path / "data")
    yield server
    server.stop()


def test_remote_acknowledgements_mean_committed(durable_server: Server) -> None:
    client = connect(durable_server.location)
    client.create_topic("t", SCHEMA, durable=True, commit_interval=30.0)
    sink = client.sink("t", producer_id="a")
    assert isinstance(sink, IdempotentSink)
    for i in range(5):
        sink.write(rows(2 * i))
    sink.flush(timeout=WAIT)
    assert sink.unacknowledged == 0
    assert stored_keys(data_dir(durable_server) / "t.lance") == list(range(10))
    assert client.offsets("t") == {"earliest": 0, "committed": 5, "next": 5}
    assert client.read("t", 3, 5).read_all().column("k").to_pylist() == [6, 7, 8, 9]
    plain = client.sink("t")  # no producer id: acknowledged once committed too
    plain.write(rows(10))
    plain.flush(timeout=WAIT)
    assert client.offsets("t")["committed"] == 6


def test_a_durable_producer_keeps_at_most_window_bytes_in_flight(durable_server: Server) -> None:
    """Past ``window_bytes`` unacknowledged, a write waits for the commit it asks for, long
    before ``window`` batches: with a commit interval of a minute, only those requests
    commit, so the commits counted are the times the bytes bound was reached."""
    client = connect(durable_server.location)
    client.create_topic("t", SCHEMA, durable=True, commit_interval=60.0)
    batch = rows(0, 1000)
    sink = client.sink("t", producer_id="p", window_bytes=2 * batch.get_total_buffer_size() + 1)
    assert isinstance(sink, IdempotentSink)
    assert sink.window == DURABLE_WINDOW == 256  # the count bound is far
    for i in range(6):
        sink.write(rows(1000 * i, 1000), timeout=WAIT)
        assert sink.unacknowledged <= 3  # the one just sent and two before it at most
    assert client.stats("t")["commits"] >= 2
    sink.flush(timeout=WAIT)
    assert client.offsets("t")["committed"] == 6


def sliced(batches: int, rows_each: int) -> list[pa.RecordBatch]:
    """``table.to_batches(max_chunksize=...)`` of one large table: slices sharing its buffers,
    with a zoned timestamp, a decimal and a nullable string beside the key."""
    n = batches * rows_each
    table = pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "s": pa.array([None if i % 7 == 0 else f"r{i}" for i in range(n)]),
            "ts": pa.array(range(n), pa.timestamp("us", tz="Europe/Paris")),
            "amount": pa.array([Decimal(i) / 8 for i in range(n)], pa.decimal128(18, 4)),
        }
    )
    out: list[pa.RecordBatch] = table.to_batches(max_chunksize=rows_each)
    assert out[0].get_total_buffer_size() >= table.nbytes  # each slice holds the whole table
    return out


def test_slices_of_one_table_count_their_own_bytes_in_a_producers_window(
    durable_server: Server,
) -> None:
    """A producer writing ``table.to_batches()`` of one large table: each slice is sent as its
    own rows, so it counts those against ``window_bytes`` -- not the table's buffers, which
    held the window to one batch at a time (one commit and one round trip a batch: 16x slower
    than a hand-rolled Flight + Lance server on an object store)."""
    batches = sliced(10, 20_000)
    client = connect(durable_server.location)
    schema = batches[0].schema
    client.create_topic("t", schema, durable=True, commit_interval=60.0)  # no commit unasked
    sink = client.sink("t", producer_id="p", window_bytes=4 * batches[0].nbytes)
    assert isinstance(sink, IdempotentSink)
    assert batches[0].get_total_buffer_size() > sink.window_bytes
    for b in batches[:3]:  # three slices fit: none waits for a commit (timeout: it would)
        sink.write(b, timeout=2.0)
    assert sink.unacknowledged == 3
    assert client.stats("t")["commits"] == 0
    for b in batches[3:]:
        sink.write(b, timeout=WAIT)
    sink.flush(timeout=WAIT)
    got = client.read("t", 0, 10).read_all()
    assert got.equals(pa.Table.from_batches(batches))


def test_slices_of_one_table_count_their_own_bytes_against_a_durable_logs_pending_bound(
    tmp_path: Path,
) -> None:
    """In process, a durable topic's ``max_pending_bytes`` counts what each slice references:
    counted as the whole table, every write of a slice forced a commit of its own."""
    from pushtable.durable.log import DurableLog

    batches = sliced(20, 10_000)[:10]  # half a table: ten slices, each holding all twenty
    bound = 12 * batches[0].nbytes
    assert batches[0].get_total_buffer_size() > bound
    log = DurableLog(
        "t",
        batches[0].schema,
        tmp_path / "t.lance",
        lambda b, t: None,
        commit_interval=60.0,
        max_pending_bytes=bound,
        upkeep_interval=None,
    )
    try:
        for b in batches:
            log.append(b, timeout=WAIT)
        assert log.stats["commits"] == 0  # all ten wait for one commit, within the bound
        log.flush(timeout=WAIT)
        assert log.stats["commits"] == 1
        stored = lance.dataset(str(tmp_path / "t.lance")).to_table(
            columns=["k", "s", "ts", "amount"]
        )
        assert stored.sort_by("k").equals(pa.Table.from_batches(batches))
    finally:
        log.close()


def test_a_resend_after_a_lost_acknowledgement_is_not_stored_twice(
    durable_server: Server,
) -> None:
    """The same (producer, sequence) sent on two streams, as a producer does after it lost
    the first stream's acknowledgements: the second is acknowledged, not appended."""
    client = connect(durable_server.location)
    client.create_topic("t", SCHEMA, durable=True)
    raw = flight.FlightClient(durable_server.location)
    for _ in range(2):
        descriptor = flight.FlightDescriptor.for_path("t", "producer", "sensor-7", "0")
        writer, acks = raw.do_put(descriptor, SCHEMA)
        for i in range(3):
            writer.write_batch(rows(2 * i))
        writer.done_writing()
        last = None
        while (buf := acks.read()) is not None:
            last = int.from_bytes(buf.to_pybytes(), "little")
        writer.close()
        assert last == 3  # all three acknowledged, both times
    assert stored_keys(data_dir(durable_server) / "t.lance") == list(range(6))
    sink = client.sink("t", producer_id="sensor-7")  # continues after what is stored
    sink.write(rows(6))
    sink.flush(timeout=WAIT)
    assert stored_keys(data_dir(durable_server) / "t.lance") == list(range(8))
    writer, acks = raw.do_put(flight.FlightDescriptor.for_path("t", "producer", "x", "5"), SCHEMA)
    writer.write_batch(rows(100))
    writer.done_writing()
    with pytest.raises(flight.FlightError, match=r"SequenceError.*sent sequence 5") as caught:
        while acks.read() is not None:
            pass
        writer.close()
    assert isinstance(protocol.client_error(caught.value), SequenceError)  # the client's class


def stored_once_then_broken(server: Server) -> tuple[Client, RemoteSink, Path, Path]:
    """A durable topic ``t`` with producer ``a``'s first batch stored, then its data dir
    broken (:func:`break_dataset`): (client, sink, dataset path, where its data went)."""
    client = connect(server.location)
    client.create_topic("t", SCHEMA, durable=True, commit_interval=0.05)
    sink = client.sink("t", producer_id="a")
    sink.write(rows(0))
    sink.flush(timeout=WAIT)
    path = data_dir(server) / "t.lance"
    return client, sink, path, break_dataset(path)


def test_a_commit_failure_surfaces_on_the_producer(durable_server: Server) -> None:
    client, sink, path, moved = stored_once_then_broken(durable_server)
    sink.write(rows(2))
    with pytest.raises(CommitFailedError, match=r"'t': storing offsets 1\.\.1"):
        sink.flush(timeout=WAIT)
    assert lance.dataset(str(path)).count_rows() == 2
    assert client.offsets("t")["committed"] == 1
    mend_dataset(path, moved)
    sink.flush(timeout=WAIT)  # sent again: stored once
    assert stored_keys(path) == [0, 1, 2, 3]


def test_a_restarted_server_reopens_its_durable_topics(tmp_path: Path) -> None:
    server = Server(data_dir=tmp_path / "data")
    client = connect(server.location)
    client.create_topic("t", SCHEMA, durable=True)
    sink = client.sink("t", producer_id="a")
    sink.write(rows(0))
    sink.flush(timeout=WAIT)
    server.stop()
    server = Server(data_dir=tmp_path / "data")
    try:
        client = connect(server.location)
        assert [(t["name"], t["durable"]) for t in client.tables()] == [("t", True)]
        assert client.offsets("t")["next"] == 1
        client.subscribe("t", "all", start="earliest")
        reading = Background(lambda: client.sql("SELECT k FROM all").read_all())
        sink = client.sink("t", producer_id="a")
        sink.write(rows(2))
        sink.close()
        assert sorted(reading.join().column("k").to_pylist()) == [0, 1, 2, 3]
    finally:
        server.stop()


def test_the_data_dir_has_a_byte_limit(tmp_path: Path) -> None:
    server = Server(data_dir=tmp_path / "data", limits=Limits(max_data_bytes=200_000))
    try:
        client = connect(server.location)
        client.create_topic("t", SCHEMA, durable=True)
        sink = client.sink("t", producer_id="a")
        noise = [os.urandom(16).hex() for _ in range(2_000)]  # stored at about its Arrow size
        big = pa.record_batch({"k": list(range(2_000)), "s": noise}, schema=SCHEMA)
        stored = 0
        with pytest.raises(ResourceLimitError, match="max_data_bytes"):
            for _ in range(20):
                sink.write(big)
                sink.flush(timeout=WAIT)
                stored += 1
        assert stored >= 1  # the limit refused a later batch, not the first
        assert client.offsets("t")["committed"] == stored  # nothing refused was stored
        # What is stored stays readable.
        assert client.read("t", 0, stored).read_all().num_rows == stored * big.num_rows
    finally:
        server.stop()


def test_a_topic_over_its_own_budget_stops_only_its_own_producers(tmp_path: Path) -> None:
    """``max_data_bytes`` is the whole data dir: one topic filling it refused every
    producer of every topic. ``max_topic_bytes`` bounds each topic's dataset: past it, that
    topic's producer is refused by name, and another topic takes writes all along."""
    limits = Limits(max_data_bytes=10_000_000, max_topic_bytes=200_000)
    server = Server(data_dir=tmp_path / "data", limits=limits)
    try:
        client = connect(server.location)
        client.create_topic("noisy", SCHEMA, durable=True)
        client.create_topic("quiet", SCHEMA, durable=True)
        noisy = client.sink("noisy", producer_id="a")
        quiet = client.sink("quiet", producer_id="b")
        noise = [os.urandom(16).hex() for _ in range(2_000)]  # stored at about its Arrow size
        big = pa.record_batch({"k": list(range(2_000)), "s": noise}, schema=SCHEMA)
        stored = 0
        with pytest.raises(ResourceLimitError, match=r"durable topic 'noisy'.*max_topic_bytes"):
            for _ in range(20):
                noisy.write(big)
                noisy.flush(timeout=WAIT)
                stored += 1
        assert stored >= 1
        for i in range(3):  # the other topic is not held up
            quiet.write(rows(2 * i))
            quiet.flush(timeout=WAIT)
        assert client.offsets("quiet")["committed"] == 3
        assert client.offsets("noisy")["committed"] == stored
    finally:
        server.stop()


def test_only_admin_creates_durable_topics_and_no_client_chooses_a_path(
    tmp_path: Path,
) -> None:
    tokens = {"w": Grant("writer", roles=frozenset({"write"})), "a": Grant("admin")}
    server = Server(data_dir=tmp_path / "data", tokens=tokens)
    try:
        writer = connect(server.location, token="w")
        with pytest.raises(PermissionDeniedError):
            writer.create_topic("t", SCHEMA, durable=True)
        admin = connect(server.location, token="a")
        with pytest.raises(PermissionDeniedError, match="cannot set 'persist'"):
            admin._action(
                "create_table",
                {
                    "name": "x",
                    "schema": bytes(SCHEMA.serialize()).hex(),
                    "topic": True,
                    "persist": "/tmp/elsewhere.lance",
                },
            )
        with pytest.raises(InvalidRequestError, match="dataset's file name"):
            admin.create_topic("../escape", SCHEMA, durable=True)
        assert not (tmp_path / "escape.lance").exists()
    finally:
        server.stop()


def test_durable_topics_need_a_data_dir(tmp_path: Path) -> None:
    server = Server()
    try:
        with pytest.raises(InvalidRequestError, match="--data-dir"):
            connect(server.location).create_topic("t", SCHEMA, durable=True)
    finally:
        server.stop()


def test_upkeep_while_writes_go_on_keeps_every_row_once_and_the_tagged_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction and version cleanup run while a producer writes: a batch is appended while
    upkeep runs (once, a commit that landed during a compaction had Lance rebase the
    compaction over it and the rows came back out of offset order: its commit now waits), old
    versions go, the tag names the newest stamped commit, and every row is read back once,
    in order, before and after a restart."""
    from datetime import timedelta

    from pushtable import lance_commits
    from pushtable.durable.store import TAG

    path = tmp_path / "t.lance"
    topic = Topic(
        "t", SCHEMA, persist=path, upkeep_interval=None, keep_versions=timedelta(0), retain=0
    )
    for i in range(20):  # many small fragments to compact
        topic.write(rows(2 * i))
        topic.flush(timeout=WAIT)
    upkeep_opened, appended = threading.Event(), threading.Event()
    real_upkeep = lance_commits.upkeep

    def upkeep_after_an_append(uri: str, **kwargs: object) -> None:
        upkeep_opened.set()
        assert appended.wait(WAIT), "no batch was appended during upkeep"
        real_upkeep(uri, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lance_commits, "upkeep", upkeep_after_an_append)

    def produce() -> None:
        assert upkeep_opened.wait(WAIT)
        for i in range(20, 30):
            topic.write(rows(2 * i))  # accepted now; its commit comes after upkeep
            appended.set()
            topic.flush(timeout=WAIT)

    producer = Background(produce)
    log = topic.durable
    assert log is not None
    log.upkeep()
    producer.join()
    log.upkeep()  # once more, with nothing in between: compaction settles
    ds = lance.dataset(str(path))
    assert ds.tags.list()[TAG]["version"] == log.store.recover().version
    assert len(ds.versions()) <= 3  # cleanup ran: not one version per commit (30+)
    assert len(ds.get_fragments()) < 30  # compaction ran: not one fragment per commit
    committed = topic.offsets()["committed"]
    assert committed == 30
    keys = list(range(60))
    assert topic.read(0, committed).read_all().column("k").to_pylist() == keys
    topic.close()
    again = Topic.reopen(path, upkeep_interval=None)
    assert again.offsets()["next"] == 30
    assert again.read(0, 30).read_all().column("k").to_pylist() == keys
    again.close()


def test_retain_bytes_bounds_the_committed_batches_kept_in_memory(tmp_path: Path) -> None:
    """A durable topic keeps its newest committed batches in memory within ``retain_bytes``
    (history beyond them is read from Lance): the stats show the bound held, and a
    subscription from an offset below the kept batches reads every row once, in order."""
    batches = [rows(100 * i, 100) for i in range(10)]
    sizes = [batch_bytes(b) for b in batches]  # what the topic counts
    bound = sum(sizes[-3:])  # the newest three fit, four do not
    topic = Topic("t", SCHEMA, persist=tmp_path / "t.lance", retain_bytes=bound)
    for b in batches:
        topic.write(b)
    topic.flush(timeout=WAIT)
    stats = topic.stats
    assert (stats.retained_batches, stats.retained_bytes) == (3, bound)
    # One partition reads the subscription: with several, each takes batches as it polls and
    # the result's order is theirs (the order is the promise checked here).
    ctx = SessionContext(datafusion.SessionConfig().with_target_partitions(1))
    topic.subscribe(ctx, "from2", start=2)  # offsets 2..6 from Lance, 7..9 from memory
    topic.write(rows(1000, 100))
    topic.close()
    got = ctx.sql("SELECT k FROM from2").to_pydict()["k"]
    assert got == [*range(200, 1000), *range(1000, 1100)]
    assert topic.stats.retained_bytes <= bound
    none = Topic("n", SCHEMA, persist=tmp_path / "n.lance", retain_bytes=0)
    none.write(rows(0, 100))
    none.flush(timeout=WAIT)
    assert (none.stats.retained_batches, none.stats.retained_bytes) == (0, 0)
    none.close()


def test_a_failed_commit_says_the_producer_keeps_its_batches_and_they_are_stored_once(
    durable_server: Server,
) -> None:
    """``CommitFailedError`` used to read "not acknowledged" while the idempotent sink kept
    the batches and sent them later (and a write raising it reported ``batches_written=0``):
    a producer that wrote them again stored them twice. Now the error says they are kept
    (their sequences named, do not write them again), and a producer that does as it says
    stores every batch once."""
    client, sink, path, moved = stored_once_then_broken(durable_server)
    sink.write(rows(2))
    sink.write(rows(4))
    with pytest.raises(CommitFailedError) as failed:
        sink.flush(timeout=WAIT)
    text = str(failed.value)
    assert "keeps its 2 unacknowledged batch(es) (sequences 1..2" in text, text
    assert "do not write them again" in text, text
    assert getattr(failed.value, "kept", False) is True
    # The flush took the failure (its stream ended with it): the next write goes out on a
    # new stream, kept with the others, and the next flush names all three. (This test let
    # the write raise or not, and checked the error only if it did: it never did.)
    sink.write(rows(6))
    with pytest.raises(CommitFailedError, match=r"keeps its 3 .*\(sequences 1\.\.3"):
        sink.flush(timeout=WAIT)
    mend_dataset(path, moved)
    deadline = time.monotonic() + WAIT
    while True:  # as the error says: flush again (an attempt under way at the mend fails)
        try:
            sink.flush(timeout=WAIT)
            break
        except CommitFailedError:
            assert time.monotonic() < deadline, "the commit never recovered"
    assert stored_keys(path) == list(range(8))  # each once
    client.close()


def test_consumer_names_and_counts_are_bounded_by_name(durable_server: Server) -> None:
    """Every commit stores every consumer's position: a 200 KB consumer name made each
    commit carry it (320 MB of transaction files for 20 one-row commits). Names are at most
    256 bytes and a topic keeps 1,024 consumers; past either, the call is refused by name
    (through the server too), and the positions kept are unchanged."""
    client = connect(durable_server.location)
    client.create_topic("t", SCHEMA, durable=True)
    sink = client.sink("t", producer_id="a")
    sink.write(rows(0))
    sink.flush(timeout=WAIT)
    with pytest.raises(InvalidRequestError, match=r"consumer name takes at most 256 bytes"):
        client.consumed("t", "c" * 200_000, 1)
    for i in range(1024):
        client.consumed("t", f"reader-{i}", 1)
    with pytest.raises(ResourceLimitError, match=r"positions of 1,024 consumers already"):
        client.consumed("t", "one-more", 1)
    client.consumed("t", "reader-7", 1)  # a known consumer moves on
    consumers = client.stats("t")["consumers"]
    assert len(consumers) == 1024
    assert "one-more" not in consumers
    client.close()


def test_producer_ids_are_bounded_and_an_idle_one_makes_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every commit stores each idempotent producer's last sequence, so a topic keeps at most
    ``MAX_PRODUCERS`` (1,024; 3 here): a new producer id past it is refused by name while the
    others are active; once the longest-idle one has appended nothing for ``PRODUCER_IDLE_S``
    it goes (its sequence starts afresh, as Kafka's expired producer ids do), the new one is
    taken, and commits (and a restart) keep only the producers kept."""
    import pushtable.durable.producers as durable_log

    monkeypatch.setattr(durable_log, "MAX_PRODUCERS", 3)
    server = Server(data_dir=tmp_path / "data")
    client = connect(server.location)
    client.create_topic("t", SCHEMA, durable=True)
    for i, name in enumerate(("a", "b", "c")):
        sink = client.sink("t", producer_id=name)
        sink.write(rows(i))
        sink.flush(timeout=WAIT)
    late = client.sink("t", producer_id="d")
    with pytest.raises(ResourceLimitError, match=r"sequences of 3 idempotent producers.*'d'"):
        late.write(rows(3))
        late.flush(timeout=WAIT)
    monkeypatch.setattr(durable_log, "PRODUCER_IDLE_S", 0.0)  # every one idle long enough
    late = client.sink("t", producer_id="d")
    late.write(rows(3))
    late.flush(timeout=WAIT)

    def last(producer: str) -> int:
        return int(client._action("producer", {"name": "t", "producer_id": producer})["sequence"])

    assert [last(p) for p in "abcd"] == [-1, 0, 0, 0]  # "a", idle longest, went
    assert client.offsets("t")["next"] == 4  # nothing refused was stored
    client.close()
    server.stop()
    server = Server(data_dir=tmp_path / "data")  # the newest commit stores b, c, d only
    client = connect(server.location)
    assert [last(p) for p in "abcd"] == [-1, 0, 0, 0]
    client.close()
    server.stop()


def test_a_refused_batch_of_an_idempotent_producer_is_let_go_and_the_rest_stored_once(
    durable_server: Server,
) -> None:
    """A batch the server refuses (a NULL in a NOT NULL column: its data, not an outage)
    used to stay in the idempotent sink and go again with every call, refused each time:
    every later flush raised, and nothing written after it was ever stored. The refusal is
    now raised once; the batches after it take its number and are stored, each once."""
    schema = pa.schema([pa.field("k", pa.int64(), nullable=False)])
    client = connect(durable_server.location)
    client.create_topic("t", schema, durable=True)
    sink = client.sink("t", producer_id="p")
    sink.write(pa.record_batch({"k": [1]}, schema=schema))
    sink.flush(timeout=WAIT)
    bad = pa.record_batch([pa.array([None], pa.int64())], schema=schema)
    refusals: list[SchemaMismatchError] = []
    for data in (bad, pa.record_batch({"k": [2]}, schema=schema)):
        try:  # the refusal comes with a later call: whichever hears it
            sink.write(data)
        except SchemaMismatchError as exc:
            refusals.append(exc)
    for _ in range(3):
        try:
            sink.flush(timeout=WAIT)
        except SchemaMismatchError as exc:
            refusals.append(exc)
    assert len(refusals) == 1, refusals  # raised once
    assert "NOT NULL" in str(refusals[0])
    sink.write(pa.record_batch({"k": [3]}, schema=schema))
    sink.flush(timeout=WAIT)
    stored = client.read("t", 0, client.offsets("t")["committed"]).read_all()
    assert stored.column("k").to_pylist() == [1, 2, 3]
    client.close()


def test_pending_batches_count_against_the_disk_budget_until_committed(tmp_path: Path) -> None:
    """Batches accepted and not yet committed count against ``max_data_bytes`` and
    ``max_topic_bytes``: near the limit the budget measured the disk again and forgot them
    (24 batches accepted under a 4 MiB limit, 11.8 MiB on disk once committed). With a
    commit every 30 s, the writes past the limit are refused while pending, and once
    committed the data dir holds about what the budget allowed."""
    limit = 1_000_000
    for i, limits in enumerate((Limits(max_data_bytes=limit), Limits(max_topic_bytes=limit))):
        server = Server(data_dir=tmp_path / f"data-{i}", limits=limits)
        try:
            client = connect(server.location)
            client.create_topic("t", SCHEMA, durable=True, commit_interval=30.0)
            topic = server.table("t")  # written in process: nothing asks for a commit
            assert isinstance(topic, Topic)
            assert topic.durable is not None
            noise = [os.urandom(16).hex() for _ in range(2_000)]  # ~88 KB
            big = pa.record_batch({"k": list(range(2_000)), "s": noise}, schema=SCHEMA)
            accepted = 0
            with pytest.raises(ResourceLimitError, match=r"max_(data|topic)_bytes"):
                for _ in range(40):
                    topic.write(big, timeout=WAIT)
                    accepted += 1
            assert topic.durable.offsets()["committed"] == 0  # all pending when refused
            assert 1 <= accepted <= limit // big.get_total_buffer_size(), accepted
            topic.flush(timeout=WAIT)
            assert client.offsets("t")["committed"] == accepted
            assert topic.durable.store.disk_bytes() <= 1.5 * limit
        finally:
            server.stop()
