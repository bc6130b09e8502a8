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
