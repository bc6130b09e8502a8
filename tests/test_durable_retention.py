"""Retention and fsync of durable topics, against real ``pushtable serve --data-dir`` processes.

Retention (Kafka's ``retention.ms`` / ``retention.bytes``) deletes whole old fragments in a
Lance transaction stamped with the new ``earliest`` offset: it survives a SIGKILL, a read
below it is an :class:`OffsetOutOfRangeError` naming it, and what is left reads back with no
gap. ``fsync`` (default on) syncs each commit's files before acknowledging it: counted here
with strace on the server process, on and off.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from datafusion import SessionConfig

from pushtable import OffsetOutOfRangeError, SessionContext, SlowSubscriberError, Topic
from pushtable.durable import store
from pushtable.durable.store import OFFSET, LogStore, Stamp, StoredBatch, directory_bytes
from pushtable.flight import Client, Limits, Server, connect
from tests.conftest import WAIT, Place, wait_until
from tests.test_durable_crash import Serve, free_port

SCHEMA = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        pa.field("at", pa.timestamp("us", tz="Europe/Paris")),
        pa.field("amount", pa.decimal128(12, 2)),
        pa.field("tags", pa.list_(pa.string())),
    ]
)
ROWS = 200


def batch(i: int) -> pa.RecordBatch:
    """Batch ``i``: keys ``i*ROWS ..``, zoned times, decimals, nested lists and nulls."""
    ks = list(range(i * ROWS, (i + 1) * ROWS))
    return pa.record_batch(
        {
            "k": ks,
            "at": [None if k % 7 == 0 else k * 1_000_000 for k in ks],
            "amount": [None if k % 5 == 0 else Decimal(k * 101) / 100 for k in ks],
            "tags": [None if k % 3 == 0 else [str(k), "x"] for k in ks],
        },
        schema=SCHEMA,
    )


def until(check: Callable[[], bool], what: str) -> None:
    """Wait (at most ``WAIT`` seconds) for ``check()``: retention runs on its own clock."""
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def write_committed(client: Client, n: int, first: int = 0) -> None:
    """Write batches ``first..first+n`` to ``events``, each acknowledged (one commit each);
    the topic stays open (a sink's ``close()`` would end it)."""
    sink = client.sink("events", producer_id="p", retry=WAIT)
    for i in range(first, first + n):
        sink.write(batch(i))
        sink.flush()


def fragment_bytes(data_dir: Path) -> list[int]:
    """The bytes of each fragment of the topic's dataset, as Lance reports them."""
    return fragment_bytes_at(data_dir / "events.lance")


def fragment_bytes_at(path: Path) -> list[int]:
    ds = lance.dataset(str(path))
    return [sum(f.file_size_bytes or 0 for f in fr.metadata.files) for fr in ds.get_fragments()]


def test_retention_by_bytes_deletes_whole_fragments_and_survives_a_kill(tmp_path: Path) -> None:
    port = free_port()
    server = Serve(tmp_path, port)
    try:
        client = connect(server.location)
        client.create_topic("events", SCHEMA, durable=True, retention_bytes=40_000)
        write_committed(client, 30)
        until(lambda: client.offsets("events")["earliest"] > 0, "retention to delete")
        offsets = client.offsets("events")
        earliest = offsets["earliest"]
        assert 0 < earliest < offsets["committed"] == 30
        # The deletion after the last commit may land after offsets() answered: earliest
        # only moves up.
        with pytest.raises(OffsetOutOfRangeError, match=r"below \d+") as refused:
            client.read("events", 0, offsets["committed"]).read_all()
        assert int(str(refused.value).rsplit("below ", 1)[1].split()[0].rstrip(";.")) >= earliest
        server.kill()
        server = Serve(tmp_path, port)
        client = connect(server.location)
        assert client.offsets("events")["earliest"] >= earliest  # stamped: a restart keeps it

        # Retention may still have been behind at the kill: it catches up after the restart
        # (deleting while the history holds more than the bound), then nothing moves. On
        # disk, whole fragments went: every stored row is at or above earliest.
        def caught_up() -> bool:
            ds = lance.dataset(str(tmp_path / "events.lance"))
            lowest = pa.compute.min(ds.to_table(columns=[OFFSET]).column(OFFSET)).as_py()
            within = sum(fragment_bytes(tmp_path)) <= 40_000
            return within and client.offsets("events")["earliest"] == lowest

        until(caught_up, "retention to catch up")
        again = client.offsets("events")
        got = client.read("events", again["earliest"], again["committed"]).read_all()
        want = pa.Table.from_batches([batch(i) for i in range(again["earliest"], 30)])
        assert got.cast(SCHEMA).equals(want)  # no gap, nothing past the bound
    finally:
        server.stop()


def test_retention_by_age_deletes_while_the_topic_is_idle(tmp_path: Path) -> None:
    topic = Topic(
        "events",
        SCHEMA,
        persist=tmp_path / "events.lance",
        retention=timedelta(milliseconds=300),
        upkeep_interval=None,
    )
    try:
        for i in range(5):
            topic.write(batch(i))
            topic.flush()
        # No write after this: the committer still deletes what ages out.
        until(lambda: topic.offsets()["earliest"] == 5, "the aged history to go")
        assert topic.stats.expirations >= 1
        ctx = SessionContext()
        with pytest.raises(OffsetOutOfRangeError, match=r"offsets 5\.\.5"):
            topic.subscribe(ctx, "old", start=2)
        topic.subscribe(ctx, "rest", start="earliest")
        topic.write(batch(5))
    finally:
        topic.close()
    assert ctx.sql("SELECT min(k) AS lo, count(*) AS n FROM rest").to_pydict() == {
        "lo": [5 * ROWS],
        "n": [ROWS],
    }
    again = Topic.reopen(tmp_path / "events.lance", upkeep_interval=None)
    try:
        assert again.offsets()["earliest"] >= 5  # batch 5 may have aged out too by now
        assert again.durable is not None
        assert again.durable.retention == timedelta(milliseconds=300)  # stored with the topic
    finally:
        again.close()


def data_files(path: Path) -> set[str]:
    return set(os.listdir(path / "data"))


def test_retention_by_bytes_bounds_the_disk_not_only_the_history(tmp_path: Path) -> None:
    """Deleted fragments leave the disk at once (not when their versions age out), and the
    history stays within one commit of the bound: it is held after every commit."""
    keep = 40_000
    path = tmp_path / "events.lance"
    topic = Topic("events", SCHEMA, persist=path, retention_bytes=keep, upkeep_interval=None)
    try:
        worst_history = worst_disk = biggest = 0
        for i in range(60):
            topic.write(batch(i))
            topic.flush()  # one commit per batch: ten times the bound in all
            sizes = fragment_bytes_at(path)
            biggest = max(biggest, *sizes)
            worst_history = max(worst_history, sum(sizes))
            worst_disk = max(worst_disk, directory_bytes(path))
        assert topic.offsets()["earliest"] > 50  # about four 10 KB fragments kept
        assert worst_history <= keep + biggest, (worst_history, keep, biggest)
        # What is not data: the few manifests and transaction files left (a few KB).
        assert worst_disk <= keep + biggest + 32_000, (worst_disk, keep, biggest)
    finally:
        topic.close()


def test_a_reader_keeps_the_version_it_reads_until_it_is_done(tmp_path: Path) -> None:
    path = tmp_path / "events.lance"
    keep = 120_000  # about twelve batches
    topic = Topic("events", SCHEMA, persist=path, retention_bytes=keep, upkeep_interval=None)
    log = topic.durable
    assert log is not None
    try:
        for i in range(10):
            topic.write(batch(i))
            topic.flush()
        reader = log.read(0, 10)  # not read yet: it holds the version it was opened at
        held = data_files(path)
        for i in range(10, 50):
            topic.write(batch(i))
            topic.flush()
        assert topic.offsets()["earliest"] > 10  # retention deleted what the reader reads
        assert held <= data_files(path)  # ... and kept the files for it
        got = reader.read_all()
        assert got.equals(pa.Table.from_batches([batch(i) for i in range(10)]))
        del reader, got
        gc.collect()
        topic.write(batch(50))
        topic.flush()  # the next deletion's cleanup is no longer held back (it runs after
        # the commit's acknowledgement, on the committer's thread)
        wait_until(
            lambda: (
                not held & data_files(path)
                and directory_bytes(path) <= keep + max(fragment_bytes_at(path)) + 32_000
            ),
            "the released version's files to go, and the disk to be back within retention",
        )
    finally:
        topic.close()


def test_a_detached_subscription_lets_go_of_the_history_it_had_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscription from ``earliest`` reads its history from a pinned version; cut loose by
    ``on_slow="detach"`` while its query is stuck, it lets the version go at once (the pin
    was held until the process ended), and retention's cleanup removes its files."""
    monkeypatch.setattr(store, "SCAN_BATCH_ROWS", ROWS)  # history read a batch at a time
    path = tmp_path / "events.lance"
    topic = Topic(  # two batches kept in memory: the rest of the history is read from Lance
        "events", SCHEMA, persist=path, retain=2, retention_bytes=200_000, upkeep_interval=None
    )
    log = topic.durable
    assert log is not None
    ctx = SessionContext(SessionConfig().with_target_partitions(1))  # no partition reads ahead
    try:
        for i in range(20):
            topic.write(batch(i))
            topic.flush()
        sub = topic.subscribe(
            ctx, "late", start="earliest", capacity=2, on_slow="detach", slow_timeout=0.1
        )
        stream = ctx.sql("SELECT k FROM late").execute_stream()
        first = next(stream).to_pyarrow()  # one batch of history read; the query then stalls
        assert first.num_rows > 0
        assert log.store.oldest_pinned() is not None
        held = data_files(path)
        for i in range(20, 60):  # the stuck query's backlog fills: it is detached
            topic.write(batch(i))
            topic.flush()
        assert sub.stats.state == "detached"
        assert log.store.oldest_pinned() is None  # let go without the query polling again
        assert not held & data_files(path)  # and retention's cleanup took the version's files
        with pytest.raises(SlowSubscriberError, match="fell behind"):
            for _ in stream:
                pass
    finally:
        topic.close()


def test_an_executor_read_outlives_upkeep_removing_the_version_it_opened(place: Place) -> None:
    """A Spark executor's read of ``dataset=`` (``read_offsets``) is another process: it
    holds no pin. Compaction and cleanup removing the files of the version it opened before
    it read them used to fail its scan (``Not found: .../data/....lance``); it now reads on
    from the newest version, which holds the same rows for a retained range. On a local disk
    and on an S3-compatible store."""
    path = place.uri("events.lance")
    topic = Topic(
        "events",
        SCHEMA,
        persist=path,
        retention_bytes=400_000,
        upkeep_interval=None,
        storage_options=place.options,
    )
    log = topic.durable
    assert log is not None
    try:
        for i in range(20):
            topic.write(batch(i))
            topic.flush()  # a fragment each: upkeep compacts them
        expected = topic.read(5, 15).read_all()
        # the version is opened, no file read yet
        reader = store.read_offsets(path, 5, 15, storage_options=place.options)
        opened = place.data_files(path)
        log.store.upkeep(timedelta(0))  # compacts (the opened version stays: it is tagged)
        topic.write(batch(20))
        topic.flush()  # a newer stamped version, which the tag moves to ...
        log.store.upkeep(timedelta(0))  # ... so every older version goes
        assert opened - place.data_files(path), "upkeep removed none of the opened version's files"
        assert reader.read_all().equals(expected)
    finally:
        topic.close()


def test_a_read_of_a_version_upkeep_removed_before_its_pin_reads_the_newest(
    tmp_path: Path,
) -> None:
    """A reader chooses its version and pins it; upkeep's cleanup read its floor just before
    the pin and removed that version (narrow: #65's review read it, not run). The read used to
    fail (``Not found``); it goes on from the newest version, which holds the same rows of a
    retained range. Driven here by removing the version first, then reading it pinned."""
    path = tmp_path / "events.lance"
    topic = Topic("events", SCHEMA, persist=path, upkeep_interval=None)
    log = topic.durable
    assert log is not None
    try:
        for i in range(6):
            topic.write(batch(i))
            topic.flush()  # a fragment each: upkeep compacts them
        chosen = log.store.recover().version
        expected = topic.read(1, 5).read_all()
        log.store.upkeep(timedelta(0))  # compacts: a newer version ...
        topic.write(batch(6))
        topic.flush()  # ... the tag moves past the chosen one ...
        log.store.upkeep(timedelta(0))  # ... and every older version goes
        with pytest.raises((OSError, ValueError), match=r"(?i)not found"):
            lance.dataset(str(path), version=chosen).to_table()
        pin = log.store.pin(chosen)
        got = log.store.read(1, 5, chosen, pin).read_all()
        assert got.equals(expected)
        assert log.store.oldest_pinned() is None  # read to its end: the pin is released
    finally:
        topic.close()


def test_an_executor_read_resumes_after_the_row_it_had_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files going mid-read: the read goes on from the newest version at the first row it
    had not yielded, also inside an offset whose rows span batches. (The failure is injected
    after the third batch of the first scan: Lance itself fails a scan so only for files it
    had not opened yet.)"""
    path = tmp_path / "events.lance"
    topic = Topic("events", SCHEMA, persist=path, upkeep_interval=None)
    try:
        for i in range(6):
            topic.write(batch(i))
        topic.flush()
        expected = topic.read(1, 5).read_all()
        monkeypatch.setattr(store, "SCAN_BATCH_ROWS", ROWS * 2 // 3)  # offsets span batches
        real_scan, scans = store._scan, []

        def failing_scan(*args: object) -> Iterator[pa.RecordBatch]:
            scans.append(args[2])  # where each scan starts
            for n, b in enumerate(real_scan(*args)):  # type: ignore[arg-type]
                if len(scans) == 1 and n == 3:
                    raise OSError("LanceError(IO): Not found: data/gone.lance")
                yield b

        monkeypatch.setattr(store, "_scan", failing_scan)
        got = pa.Table.from_batches(list(store.read_offsets(path, 1, 5)))
        assert scans == [1, 2]  # three batches of 133 rows: offset 1 whole, 199 rows of 2
        assert got.equals(expected)
    finally:
        topic.close()


def test_a_data_dir_budget_near_the_retention_bound_is_not_used_up(tmp_path: Path) -> None:
    """``max_data_bytes`` counts what is on disk, which retention now bounds: a topic written
    at ten times its bound on a server whose budget is three times that bound is never
    refused (the deleted fragments' files left the disk as they went)."""
    config = tmp_path / "server.json"
    config.write_text(json.dumps({"limits": {"max_data_bytes": 400_000}}))
    port = free_port()
    server = Serve(tmp_path / "data", port, "--config", str(config))
    try:
        client = connect(server.location)
        client.create_topic("events", SCHEMA, durable=True, retention_bytes=120_000)
        write_committed(client, 120)  # about 1.2 MB in all
        offsets = client.offsets("events")
        assert offsets["committed"] == 120
        assert offsets["earliest"] > 100
        assert directory_bytes(tmp_path / "data") <= 400_000
    finally:
        server.stop()


def test_a_log_opened_over_history_past_its_bound_trims_without_a_new_write(
    tmp_path: Path,
) -> None:
    """Retention by bytes runs after each commit; a log opened over history already past the
    bound (a kill between a commit and its deletion) trims at once, not at a commit that may
    never come. (CI caught the restart test waiting for it.)"""
    from pushtable.durable.log import DurableLog

    path = tmp_path / "events.lance"
    unbounded = DurableLog("events", SCHEMA, path, lambda b, t: None, upkeep_interval=None)
    for i in range(10):
        unbounded.append(batch(i))
        unbounded.flush()
    unbounded.close()
    bounded = DurableLog(
        "events", SCHEMA, path, lambda b, t: None, upkeep_interval=None, retention_bytes=40_000
    )
    try:
        until(lambda: bounded.offsets()["earliest"] > 0, "the history to be trimmed")
        assert sum(fragment_bytes_at(path)) <= 40_000
        assert bounded.offsets()["committed"] == 10  # nothing was written meanwhile
    finally:
        bounded.close()


def test_a_kill_between_a_deletion_and_its_cleanup_leaves_no_files_after_a_restart(
    tmp_path: Path,
) -> None:
    """Retention deletes fragments in a transaction, then cleanup removes their files; a kill
    between the two left the files until the first upkeep (never, with none). A log opened
    with retention finishes the cleanup at once."""
    from pushtable.durable.log import DurableLog

    path = tmp_path / "events.lance"
    store = LogStore(path, SCHEMA)
    for i in range(10):
        store.append([StoredBatch(i, i, batch(i))], Stamp(i + 1, {}, {}, 0))
    # The deletion commits; the process dies before its cleanup (no release).
    assert store.expire(Stamp(10, {}, {}, 0), None, 40_000) is not None
    ds = lance.dataset(str(path))
    held = {Path(f.path).name for fr in ds.get_fragments() for f in fr.data_files()}
    on_disk = {p.name for p in (path / "data").iterdir()}
    assert on_disk > held  # the deleted fragments' files are still there
    log = DurableLog(
        "events", SCHEMA, path, lambda b, t: None, upkeep_interval=None, retention_bytes=40_000
    )
    try:
        until(
            lambda: {p.name for p in (path / "data").iterdir()} == held,
            "the deleted fragments' files to leave the disk",
        )
        assert log.offsets()["committed"] == 10
        assert log.offsets()["earliest"] > 0
    finally:
        log.close()


def test_upkeep_does_not_compact_past_the_room_it_is_given(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "t.lance", SCHEMA)
    for i in range(6):
        store.append([StoredBatch(i, 0, batch(i))], Stamp(i + 1, {}, {}, 0))
    before = len(lance.dataset(str(tmp_path / "t.lance")).get_fragments())
    store.upkeep(timedelta(0), room=100)  # far less than the small fragments' bytes
    assert len(lance.dataset(str(tmp_path / "t.lance")).get_fragments()) == before == 6
    store.upkeep(timedelta(0), room=None)
    assert len(lance.dataset(str(tmp_path / "t.lance")).get_fragments()) == 1
    assert store.recover().next_offset == 6  # the tag keeps the stamped commit readable


def test_bad_retention_is_refused(tmp_path: Path) -> None:
    for bad in ({"retention": timedelta(0)}, {"retention_bytes": 0}, {"retention_bytes": 1.5}):
        with pytest.raises(ValueError, match="retention"):
            Topic("t", SCHEMA, persist=tmp_path / "t.lance", **bad)
    with pytest.raises(ValueError, match="durable topic's stored history"):
        Topic("t", SCHEMA, retention_bytes=10)


def _syncs(trace: Path) -> int:
    return sum(
        1
        for line in trace.read_text().splitlines()
        if ("fsync(" in line or "fdatasync(" in line) and "= 0" in line
    )


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (Debian: strace)")
@pytest.mark.parametrize("fsync", [True, False], ids=["fsync", "no-fsync"])
def test_a_server_syncs_each_commit_before_acknowledging_it(tmp_path: Path, fsync: bool) -> None:
    probe = subprocess.run(["strace", "-o", "/dev/null", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here: {probe.stderr.decode().strip()}")
    trace = tmp_path / "trace"
    extra = () if fsync else ("--no-fsync",)
    prefix = ("strace", "-f", "-e", "trace=fsync,fdatasync", "-o", str(trace))
    server = Serve(tmp_path / "data", free_port(), *extra, prefix=prefix)
    try:
        client = connect(server.location)
        client.create_topic("events", SCHEMA, durable=True)
        before = _syncs(trace)
        write_committed(client, 3)
        after = _syncs(trace)
    finally:
        server.stop()
    if fsync:
        # each commit: its data file and directory, manifest, transaction, three directories
        assert after - before >= 3 * 5
    else:
        assert after == before == 0


def test_a_reader_holds_its_version_no_longer_than_the_server_lets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range read that took a batch and stalled pinned its version for as long as it
    lived: the topic's directory grew to 13x its retention bound in 180 s. A server's
    ``reader_hold`` bounds that: past it, retention's cleanup takes the version's files
    (here a hold of 1 ms), and the reader, if it still needs them, is told with
    ``OffsetOutOfRangeError`` naming the earliest offset, as Kafka's consumer is."""
    server = Server(data_dir=tmp_path / "data", limits=Limits(reader_hold=0.001))
    try:
        with connect(server.location, timeout=WAIT) as client:
            client.create_topic("events", SCHEMA, durable=True, retention_bytes=40_000)
            write_committed(client, 10)
            topic = server.table("events")
            assert isinstance(topic, Topic)
            log = topic.durable
            assert log is not None
            assert log.store.hold == 0.001  # the server's limit, on every durable topic
            first = log.offsets()["earliest"]
            reader = log.read(first, first + 2)  # pinned: held for 1 ms
            held = data_files(tmp_path / "data" / "events.lance")
            write_committed(client, 20, first=10)  # retention deletes; cleanup ignores the pin
            assert not held & data_files(tmp_path / "data" / "events.lance")
            # nothing was read before the files went (the scan starts at the first read):
            # the reader is told, never given other rows
            with pytest.raises(OffsetOutOfRangeError, match="read again from offset") as told:
                reader.read_all()
            assert told.value.earliest > first  # type: ignore[attr-defined]
    finally:
        server.stop()


def test_a_reader_holds_no_more_bytes_than_the_server_lets_it(tmp_path: Path) -> None:
    """A reader stalled within its ``reader_hold`` (an hour here) while producers write fast
    pinned everything retention deleted after its version: 70-81 MB on disk for a 16 MB
    retention after 90 s at 1 MB/s (4-5x; at 100 MB/s, 6 GB). ``reader_hold_bytes`` bounds
    it in bytes too: past them the version's files go, the directory stays within retention
    plus the bound, and the reader is told which offsets remain."""
    keep, hold_bytes = 40_000, 60_000
    limits = Limits(reader_hold=3600.0, reader_hold_bytes=hold_bytes)
    server = Server(data_dir=tmp_path / "data", limits=limits)
    path = tmp_path / "data" / "events.lance"
    try:
        with connect(server.location, timeout=WAIT) as client:
            client.create_topic("events", SCHEMA, durable=True, retention_bytes=keep)
            write_committed(client, 10)
            topic = server.table("events")
            assert isinstance(topic, Topic)
            log = topic.durable
            assert log is not None
            first = log.offsets()["earliest"]
            reader = log.read(first, first + 2)  # pinned, nothing read yet
            held = data_files(path)
            worst = 0
            sink = client.sink("events", producer_id="p", retry=WAIT)
            for i in range(10, 50):
                sink.write(batch(i))
                sink.flush()
                worst = max(worst, directory_bytes(path))
            assert not held & data_files(path), "the stalled reader still holds its files"
            biggest = max(fragment_bytes_at(path))
            assert worst <= keep + hold_bytes + 2 * biggest + 32_000, (worst, biggest)
            with pytest.raises(OffsetOutOfRangeError, match="reader_hold_bytes") as told:
                reader.read_all()
            assert told.value.earliest > first  # type: ignore[attr-defined]
    finally:
        server.stop()


def test_a_read_past_its_hold_whose_files_went_is_told_which_offsets_remain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error a reader past its hold gets when its version's files went mid-read (Lance's
    'Not found' is injected after the first batch: Lance fails so only for files it had not
    opened yet)."""
    path = tmp_path / "events.lance"
    topic = Topic("events", SCHEMA, persist=path, upkeep_interval=None)
    log = topic.durable
    assert log is not None
    try:
        for i in range(4):
            topic.write(batch(i))
        topic.flush()
        monkeypatch.setattr(store, "SCAN_BATCH_ROWS", ROWS)
        real_scan = store._scan

        def vanishing(*args: Any) -> Iterator[pa.RecordBatch]:
            for n, b in enumerate(real_scan(*args)):
                if n == 1:
                    raise OSError("LanceError(IO): Not found: data/gone.lance")
                yield b

        monkeypatch.setattr(store, "_scan", vanishing)
        log.store.hold = 0.0
        reader = log.read(0, 4)
        assert reader.read_next_batch().num_rows == ROWS
        with pytest.raises(OffsetOutOfRangeError, match=r"held version \d+ longer than readers"):
            reader.read_next_batch()
        log.store.hold = None  # without a hold, the same loss is Lance's own error
        reader = log.read(0, 4)
        reader.read_next_batch()
        with pytest.raises(OSError, match="Not found"):
            reader.read_next_batch()
    finally:
        topic.close()


def test_a_readers_byte_hold_counts_what_compaction_replaced(tmp_path: Path) -> None:
    """A stalled reader's pin keeps every version from its own up, so also the files a
    compaction replaced: only retention's deletions were counted against
    ``reader_hold_bytes``, and the directory reached about twice retention plus the bound
    while the pin still counted as within it. Compactions' replaced files count too: the
    directory stays within retention, the bound and a round's writes."""
    from pushtable.durable.log import DurableLog

    keep, hold = 400_000, 600_000
    schema = pa.schema([("v", pa.float64())])
    rng = np.random.default_rng(0)
    path = tmp_path / "t.lance"
    log = DurableLog(
        "t",
        schema,
        path,
        lambda b, at: None,
        commit_interval=0.02,
        upkeep_interval=None,
        retention_bytes=keep,
    )
    log.store.hold, log.store.hold_bytes = 3600.0, hold
    try:

        def commit() -> None:
            log.append(pa.record_batch({"v": rng.random(5_000)}, schema=schema))  # ~40 KB
            log.flush(timeout=WAIT)

        for _ in range(10):
            commit()
        first = log.offsets()["earliest"]
        reader = log.read(first, first + 1)  # pinned, not read (a stalled reader)
        worst = 0
        for _ in range(30):
            commit()
            commit()
            log.upkeep()  # compacts and cleans up, as its rounds do
            worst = max(worst, directory_bytes(path))
        assert worst <= keep + hold + 200_000, worst
        with pytest.raises(OffsetOutOfRangeError):
            reader.read_all()
    finally:
        log.close(timeout=WAIT)
