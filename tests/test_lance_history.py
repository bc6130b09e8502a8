"""The exactly-once history walk on real Lance datasets: only "not found" ends it.

A fresh writer object stands for a fresh process after a crash: it has no cached mark and must
find the query's last committed epoch in the dataset's history and tag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from lance.commit import CommitConflictError

from pushtable.lance_epochs import LanceEpochWriter
from tests.spark_support import stamped


class Crash(RuntimeError):
    """The process died here."""


def epoch(e: int) -> pa.Table:
    return pa.table({"id": pa.array([e * 10, e * 10 + 1], pa.int64())})


def crash_after_commit_before_tag(step: str, epoch_id: int) -> None:
    if step == "after_commit" and epoch_id == 2:
        raise Crash("killed after the commit, before the tag moved")


@pytest.fixture
def crashed(tmp_path: Path) -> str:
    """Epochs 0-2 committed by query q; the process died before tagging epoch 2."""
    uri = str(tmp_path / "out.lance")
    first = LanceEpochWriter(uri, "q", fault=crash_after_commit_before_tag)
    first.commit(0, epoch(0))
    first.commit(1, epoch(1))
    with pytest.raises(Crash):
        first.commit(2, epoch(2))
    return uri


class FailOnce:
    """Make ``LanceDataset.<method>`` raise ``error`` on its first call, then behave."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str, error: Exception) -> None:
        self.calls = 0
        original = getattr(lance.LanceDataset, method)

        def flaky(ds: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise error
            return original(ds, *args, **kwargs)

        monkeypatch.setattr(lance.LanceDataset, method, flaky)


def test_an_io_error_in_the_walk_fails_the_epoch_instead_of_duplicating_it(
    crashed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = FailOnce(monkeypatch, "get_transactions", OSError("503 Slow Down: throttled"))
    restarted = LanceEpochWriter(crashed, "q")
    with pytest.raises(OSError, match="throttled"):
        restarted.commit(2, epoch(2))  # Spark fails the epoch and retries it
    assert flaky.calls == 1
    retried = restarted.commit(2, epoch(2))
    assert not retried.committed
    assert "epoch 2 <= last committed epoch 2" in retried.reason
    assert [e for _, e in stamped(Path(crashed))] == [0, 1, 2]  # each epoch once
    assert restarted.commit(3, epoch(3)).committed  # and the query goes on


def test_an_error_reading_the_tag_propagates(crashed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    restarted = LanceEpochWriter(crashed, "q")
    tags = lance.dataset(crashed).tags
    calls = []

    def unreachable(name: str) -> int:
        calls.append(name)
        raise OSError("connection reset by peer")

    monkeypatch.setattr(type(tags), "get_version", lambda self, name: unreachable(name))
    with pytest.raises(OSError, match="connection reset"):
        restarted.commit(2, epoch(2))
    assert calls
    monkeypatch.undo()
    assert not restarted.commit(2, epoch(2)).committed
    assert [e for _, e in stamped(Path(crashed))] == [0, 1, 2]


def test_a_missing_tag_or_cleaned_version_still_means_not_found(tmp_path: Path) -> None:
    uri = str(tmp_path / "fresh.lance")
    writer = LanceEpochWriter(uri, "q")
    assert writer.last_committed_epoch() is None  # no dataset at all
    assert writer.commit(0, epoch(0)).committed  # no tag yet: created
    assert LanceEpochWriter(uri, "q").last_committed_epoch() == 0
    assert LanceEpochWriter(uri, "other").last_committed_epoch() is None


def test_commits_race_real_concurrent_writers(tmp_path: Path) -> None:
    """200 epochs committed while two other writers append 100 times each to the dataset."""
    import threading

    uri = str(tmp_path / "shared.lance")
    writer = LanceEpochWriter(uri, "q", backoff=0.005, max_retries=20)
    writer.commit(0, epoch(0))  # creates the dataset
    stop = threading.Event()
    errors: list[BaseException] = []
    foreign_rows = [0]

    def append_foreign(worker: int) -> None:
        try:
            n = 0
            while not stop.is_set() and n < 100:  # 200 foreign commits among our 200
                rows = pa.table({"id": pa.array([-(worker * 1_000_000 + n) - 1], pa.int64())})
                try:
                    lance.write_dataset(rows, uri, mode="append")
                except CommitConflictError:
                    continue  # a plain Lance writer losing the race: it tries again
                except OSError as exc:
                    # Lance's own retries ran out (three writers on one dataset): it raises
                    # "Commit conflict ... after 20 retries" as an OSError. Still a lost race.
                    if "Commit conflict" not in str(exc):
                        raise
                    continue
                n += 1
                stop.wait(0.002)  # busy, not a denial of service
            foreign_rows[0] += n
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    others = [threading.Thread(target=append_foreign, args=(w,)) for w in (1, 2)]
    for t in others:
        t.start()
    try:
        for e in range(1, 200):
            assert writer.commit(e, epoch(e)).committed
            if e % 50 == 0:  # a replay in the middle of the race is still recognised
                assert not writer.commit(e, epoch(e)).committed
    finally:
        stop.set()
        for t in others:
            t.join(60)
    assert not errors, errors
    assert [e for q, e in stamped(Path(uri)) if q == "q"] == list(range(200))
    ids = lance.dataset(uri).to_table(columns=["id"])["id"].to_pylist()
    ours = sorted(i for i in ids if i >= 0)
    assert ours == sorted(i for e in range(200) for i in (e * 10, e * 10 + 1))
    assert len(ids) - len(ours) == foreign_rows[0]  # no foreign row lost either


def test_update_mode_with_a_key_upserts_each_epoch_once(tmp_path: Path) -> None:
    uri = str(tmp_path / "latest.lance")
    writer = LanceEpochWriter(uri, "q", mode="update", key=["level"])

    def counts(**by_level: int) -> pa.Table:
        return pa.table({"level": list(by_level), "count": pa.array(by_level.values(), pa.int64())})

    assert writer.commit(0, counts(a=1, b=2)).committed
    assert writer.commit(1, counts(a=5)).committed
    assert not writer.commit(1, counts(a=5)).committed  # a replay is recognised
    restarted = LanceEpochWriter(uri, "q", mode="update", key=["level"])
    assert not restarted.commit(1, counts(a=5)).committed  # in a fresh process too
    assert restarted.commit(2, counts(b=7, c=1)).committed
    rows = sorted(lance.dataset(uri).to_table().to_pylist(), key=lambda r: r["level"])
    assert rows == [
        {"level": "a", "count": 5},
        {"level": "b", "count": 7},
        {"level": "c", "count": 1},
    ]
    assert [e for _, e in stamped(Path(uri))] == [0, 1, 2]


def test_a_key_needs_update_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="key= is for mode='update'"):
        LanceEpochWriter(str(tmp_path / "x.lance"), "q", mode="append", key=["k"])
    with pytest.raises(ValueError, match="non-empty list"):
        LanceEpochWriter(str(tmp_path / "x.lance"), "q", mode="update", key="k")
