"""A durable topic's group commit under a fault at each Lance step: every offset stored once.

Each fault is injected once, through the functions the store calls, as a disk or an object
store produces it: writing the data files fails; the commit fails before its manifest lands;
the commit lands and then raises (an object store's reply lost); the commit lands and the
sync after it raises (a late EIO/ENOSPC from fsync). Whatever the step, every offset is stored
exactly once, an acknowledgement comes only once its commit is in, and no data file is left
that no commit holds — on a local disk and on an S3-compatible store (moto's server).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from datafusion import SessionConfig

from pushtable import SessionContext, Topic, lance_commits
from pushtable.durable import store as store_module
from pushtable.durable.log import DurableLog, epoch_of, epoch_sequence
from pushtable.errors import CommitFailedError, WriteTimeoutError
from tests.conftest import WAIT, Background, Place, wait_until

SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("ts", pa.timestamp("us", tz="America/New_York")),
        ("d", pa.decimal128(12, 3)),
        ("tags", pa.list_(pa.string())),
    ]
)


def batch(i: int, n: int = 1000) -> pa.RecordBatch:
    ks = list(range(i * n, (i + 1) * n))
    return pa.record_batch(
        {
            "k": ks,
            "ts": pa.array(ks, pa.int64()).cast(pa.timestamp("us", tz="America/New_York")),
            "d": pa.array(
                [None if k % 11 == 0 else Decimal(k) / 8 for k in ks], pa.decimal128(12, 3)
            ),
            "tags": [None if k % 7 == 0 else [str(k), "x"] for k in ks],
        },
        schema=SCHEMA,
    )


class Once:
    """Raises ``OSError(EIO)`` once, before or after calling the real function."""

    def __init__(self, real: Callable[..., Any], after: bool) -> None:
        self.real, self.after, self.fired = real, after, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fired:
            return self.real(*args, **kwargs)
        self.fired = True
        if not self.after:
            raise OSError(5, "Input/output error (injected)")
        self.real(*args, **kwargs)
        raise OSError(5, "Input/output error (injected, after the call)")


FAULTS = {
    # step: (what to patch, raise after the real call, whether the commit lands)
    "data files": ("write_fragments", False, False),
    "manifest, before it lands": ("LanceDataset.commit", False, False),
    "landed, then its reply lost": ("LanceDataset.commit", True, True),
    "landed, then the sync raised": ("sync_commit", True, True),
}


@pytest.fixture(params=list(FAULTS))
def fault(request: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Once, bool]:
    what, after, lands = FAULTS[request.param]
    if what == "write_fragments":
        once = Once(store_module.write_fragments, after)  # type: ignore[attr-defined]
        monkeypatch.setattr(store_module, "write_fragments", once)
    elif what == "sync_commit":
        once = Once(lance_commits.sync_commit, after)
        monkeypatch.setattr(lance_commits, "sync_commit", once)
    else:
        real = lance.LanceDataset.commit
        once = Once(real, after)
        monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(once))
    once.fired = True  # armed by the test, once the topic exists
    return request.param, once, lands


def test_a_fault_at_any_step_stores_every_offset_once(
    place: Place, fault: tuple[str, Once, bool]
) -> None:
    step, once, lands = fault
    path = place.uri("t.lance")
    topic = Topic(
        "t",
        SCHEMA,
        persist=path,
        commit_interval=0.02,
        upkeep_interval=None,
        storage_options=place.options,
    )
    topic.write(batch(0))
    topic.flush(timeout=WAIT)
    once.fired = False  # the next call of the step fails
    topic.write(batch(1))
    if lands:
        topic.flush(timeout=WAIT)  # it landed: acknowledged, once synced again
        assert topic.stats.commit_failures == 0, step
    else:
        try:  # the failure is reported to a flush waiting for it, then retried
            topic.flush(timeout=WAIT)
        except CommitFailedError as exc:
            reported = str(exc)
            topic.flush(timeout=WAIT)
            assert "not acknowledged" in reported
        assert topic.stats.commit_failures == 1, step
    assert once.fired, step
    topic.write(batch(2))
    topic.close()

    table = place.dataset(path).to_table()
    per_offset = collections.Counter(table.column("_offset").to_pylist())
    assert per_offset == {0: 1000, 1: 1000, 2: 1000}, step
    again = Topic.reopen(path, storage_options=place.options)
    read = again.read(0, 3).read_all()
    assert read.num_rows == 3000
    assert sorted(read.column("k").to_pylist()) == list(range(3000))
    assert (
        read.select(["k", "ts", "d", "tags"])
        .sort_by("k")
        .equals(pa.Table.from_batches([batch(0), batch(1), batch(2)]))
    )
    again.close()
    # No data file that no commit holds (a failed group's fragments are deleted).
    ds = place.dataset(path)
    held = {f.path for fragment in ds.get_fragments() for f in fragment.data_files()}
    assert place.data_files(path) == {Path(h).name for h in held}, step


def test_a_commit_that_keeps_failing_leaves_no_fragments_behind(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = place.uri("t.lance")
    topic = Topic(
        "t",
        SCHEMA,
        persist=path,
        commit_interval=0.01,
        upkeep_interval=None,
        storage_options=place.options,
    )
    topic.write(batch(0))
    topic.flush(timeout=WAIT)
    real = lance.LanceDataset.commit
    failures = {"left": 20}

    def failing(*args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(failing))
    topic.write(batch(1))
    for _ in range(21):  # each flush returns once an attempt failed, or all is stored
        try:
            topic.flush(timeout=WAIT)
            break
        except CommitFailedError:
            pass
    assert failures["left"] == 0
    assert topic.stats.commit_failures == 20, topic.stats.commit_failures
    topic.close()
    ds = place.dataset(path)
    held = {Path(f.path).name for fr in ds.get_fragments() for f in fr.data_files()}
    assert place.data_files(path) == held
    assert ds.count_rows() == 2000


def with_a_reader_taking_one_batch_at_a_time(
    place: Place, schema: pa.Schema
) -> tuple[Topic, DurableLog, Any]:
    """A durable topic committing every millisecond, with a live subscriber of capacity 1
    whose query's stream the test reads batch by batch: (topic, its log, the stream)."""
    topic = Topic(
        "events",
        schema,
        persist=place.uri("events.lance"),
        commit_interval=0.001,
        storage_options=place.options,
    )
    log = topic.durable
    assert log is not None
    ctx = SessionContext(SessionConfig().with_target_partitions(1))
    topic.subscribe(ctx, "live", capacity=1)
    return topic, log, ctx.sql("SELECT k FROM live").execute_stream()


def test_a_spark_epoch_is_stored_by_one_commit_or_none(place: Place) -> None:
    """A Spark epoch's batches go in as one unit (``append_unit``): no commit takes a part of
    it, so a replay after a crash finds all of it stored or none, however Spark splits the
    re-run batch. Here the epoch's live write is held after its second batch (a subscriber
    that takes one batch at a time); a commit asked for meanwhile stores nothing of it (the
    batches were appended one by one, and a commit could take the first ones: a replay split
    differently then skipped rows by sequence number or stored some twice)."""
    schema = pa.schema([pa.field("k", pa.int64())])
    topic, log, stream = with_a_reader_taking_one_batch_at_a_time(place, schema)
    batches = [pa.record_batch({"k": [i, i]}, schema=schema) for i in range(6)]
    sequences = [epoch_sequence(3, i, last=i == 5) for i in range(6)]
    publish = Background(
        lambda: log.append_unit(batches, sequences, "spark:q", 0.05, lambda: False)
    )
    try:
        seen = [next(stream).to_pyarrow()]  # the second batch's live write gets in: the
        # third's waits, with two of the epoch's batches appended
        wait_until(lambda: log.stats["pending_batches"] == 2, "the epoch's write to block")
        log.commit_soon()  # a commit now may take only what is whole: nothing
        assert not log.wait_committed(0, timeout=0.5)
        seen += [next(stream).to_pyarrow() for _ in range(5)]
        ticket = publish.join()
        assert ticket == 5
        assert log.wait_committed(ticket, timeout=WAIT)
        assert sum(b.num_rows for b in seen) == 12
        uri = place.uri("events.lance")
        versions = place.dataset(uri).versions()
        rows = [
            lance.dataset(uri, version=v["version"], storage_options=place.options).count_rows()
            for v in versions
        ]
        assert set(rows) <= {0, 12}, rows  # every version holds none of the epoch or all of it
        assert epoch_of(log.last_stored_sequence("spark:q")) == 3
    finally:
        topic.close()


def test_an_epoch_given_up_midway_is_taken_back_and_its_retry_stores_it_once(
    place: Place,
) -> None:
    """A publish that gives up while the epoch's live write waits (the server stops) takes
    back what it appended: nothing of it is stored, the offsets are given again, and the
    retry stores the epoch once."""
    schema = pa.schema([pa.field("k", pa.int64())])
    topic, log, stream = with_a_reader_taking_one_batch_at_a_time(place, schema)
    batches = [pa.record_batch({"k": [i]}, schema=schema) for i in range(4)]
    sequences = [epoch_sequence(0, i, last=i == 3) for i in range(4)]
    stop = threading.Event()
    publish = Background(lambda: log.append_unit(batches, sequences, "spark:q", 0.05, stop.is_set))
    try:
        wait_until(lambda: log.stats["pending_batches"] == 1, "the epoch's write to block")
        stop.set()  # the stop: the publish gives up
        with pytest.raises(WriteTimeoutError):
            publish.join()
        assert log.stats["pending_batches"] == 0
        assert log.offsets() == {"earliest": 0, "committed": 0, "next": 0}
        assert log.last_sequence("spark:q") == -1
        stop.clear()
        again = Background(
            lambda: log.append_unit(batches, sequences, "spark:q", 0.05, stop.is_set)
        )
        seen = [next(stream).to_pyarrow() for _ in range(5)]  # 1 taken back, then all 4
        assert again.join() == 3
        log.flush(WAIT)
        assert sorted(topic.read(0, 4).read_all()["k"].to_pylist()) == [0, 1, 2, 3]
        assert sum(b.num_rows for b in seen) == 5  # a live reader saw the taken-back batch
    finally:
        topic.close()


def test_a_commit_that_could_not_be_read_back_leaves_no_files_once_settled(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit fails (it did not land) and its stamp cannot be read back either (the store
    away a moment longer): the log cannot tell whether it landed, so it keeps the commit's
    files. Once a read settles it (it did not land), they go: they stayed for good, counted
    against the data dir, on every store."""
    from pushtable.durable.store import LogStore

    path = place.uri("t.lance")
    topic = Topic(
        "t",
        SCHEMA,
        persist=path,
        commit_interval=0.02,
        upkeep_interval=None,
        storage_options=place.options,
    )
    topic.write(batch(0))
    topic.flush(timeout=WAIT)
    real_commit, real_landed = lance.LanceDataset.commit, LogStore.landed
    left = {"commits": 1, "reads": 2}

    def failing(*args: Any, **kwargs: Any) -> Any:
        if left["commits"] > 0:
            left["commits"] -= 1
            raise OSError(5, "Input/output error (injected before the call)")
        return real_commit(*args, **kwargs)

    def unreadable(self: LogStore, *args: Any, **kwargs: Any) -> Any:
        if left["reads"] > 0:
            left["reads"] -= 1
            raise OSError("HTTP 503 Slow Down (injected: the stamp cannot be read)")
        return real_landed(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(failing))
    monkeypatch.setattr(LogStore, "landed", unreadable)
    topic.write(batch(1))
    for _ in range(10):  # each flush returns once an attempt failed, or all is stored
        try:
            topic.flush(timeout=WAIT)
            break
        except CommitFailedError:
            pass
    assert left == {"commits": 0, "reads": 0}, left
    topic.close()
    ds = place.dataset(path)
    held = {Path(f.path).name for fr in ds.get_fragments() for f in fr.data_files()}
    assert place.data_files(path) == held
    assert sorted(collections.Counter(ds.to_table().column("_offset").to_pylist()).items()) == [
        (0, 1000),
        (1, 1000),
    ]


@pytest.mark.parametrize("fenced", [False, True])
def test_a_retention_deletion_that_landed_then_raised_moves_earliest(
    place: Place, monkeypatch: pytest.MonkeyPatch, fenced: bool
) -> None:
    """Retention's ``Delete`` lands and then raises (a late sync, a lost reply): the log kept
    its old ``earliest``, and a read of a deleted offset gave no rows and no error, for good
    (restarts included). The deletion is read back: ``earliest`` moves, and the read is
    told ``OffsetOutOfRangeError``."""
    from pushtable.durable.fence import Fence
    from pushtable.errors import OffsetOutOfRangeError

    real = lance.LanceDataset.commit
    fired: list[int] = []

    def landing_then_raising(*args: Any, **kwargs: Any) -> Any:
        new = real(*args, **kwargs)
        operation = getattr(args[1] if len(args) > 1 else None, "operation", None)
        if isinstance(operation, lance.LanceOperation.Delete) and not fired:
            fired.append(new.version)
            raise OSError(5, "Input/output error (injected after the call landed)")
        return new

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(landing_then_raising))
    log = DurableLog(
        "t",
        SCHEMA,
        place.uri("t.lance"),
        lambda batch, at: None,
        commit_interval=0.02,
        upkeep_interval=None,
        retention_bytes=60_000,
        storage_options=place.options,
        fence=Fence(1) if fenced else None,
    )
    try:
        for i in range(30):
            log.append(batch(i))
            log.flush(timeout=WAIT)
            time.sleep(0.3)  # its retention runs after the acknowledgement
            if fired:
                break
        assert fired, "no deletion was due"
        log.append(batch(99, n=1))  # one more commit, too small for another deletion
        log.flush(timeout=WAIT)
        time.sleep(0.5)
        assert log.offsets()["earliest"] > 0, log.offsets()
        with pytest.raises(OffsetOutOfRangeError):
            log.read(0, 1).read_all()
    finally:
        log.close(timeout=WAIT)


@pytest.mark.parametrize("fenced", [False, True])
def test_a_commit_that_landed_and_was_reported_a_conflict_is_stored_once(
    place: Place, monkeypatch: pytest.MonkeyPatch, fenced: bool
) -> None:
    """A commit lands and is then reported as a conflict (an object store's conditional PUT
    retried after a lost reply finds the manifest its first try wrote): the contention
    loop committed it again over its own version, storing its batches twice. A retry first
    looks for this very commit (its stamp names its offsets) and takes it as landed."""
    from pushtable.durable.fence import Fence

    real = lance.LanceDataset.commit
    fired: list[int] = []

    def landing_then_conflicting(*args: Any, **kwargs: Any) -> Any:
        new = real(*args, **kwargs)
        operation = getattr(args[1] if len(args) > 1 else None, "operation", None)
        if isinstance(operation, lance.LanceOperation.Append) and not fired and new.version >= 3:
            fired.append(new.version)
            raise OSError(f"Commit conflict for version {new.version} (injected after it landed)")
        return new

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(landing_then_conflicting))
    uri = place.uri("t.lance")
    log = DurableLog(
        "t",
        SCHEMA,
        uri,
        lambda batch, at: None,
        commit_interval=0.02,
        upkeep_interval=None,
        storage_options=place.options,
        fence=Fence(1) if fenced else None,
    )
    try:
        for i in range(6):
            log.append(batch(i), producer="p", sequence=i)
            log.flush(timeout=WAIT)
    finally:
        log.close(timeout=WAIT)
    assert fired
    per_offset = collections.Counter(place.dataset(uri).to_table().column("_offset").to_pylist())
    assert sorted(per_offset.items()) == [(i, 1000) for i in range(6)]
