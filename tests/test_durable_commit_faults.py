"""A durable topic's group commit under a fault at each Lance step: every offset stored once.

Each fault is injected once, through the functions the store calls, as a disk or an object
store produces it: writing the data files fails; the commit fails before its manifest lands;
the commit lands and then raises (an object store's reply lost); the commit lands and the
sync after it raises (a late EIO/ENOSPC from fsync). Whatever the step, every offset is stored
exactly once, an acknowledgement comes only once its commit is in, and no data file is left
that no commit holds.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest

from pushtable import Topic, lance_commits
from pushtable.durable import store as store_module
from pushtable.errors import CommitFailedError
from tests.conftest import WAIT

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
    tmp_path: Path, fault: tuple[str, Once, bool]
) -> None:
    step, once, lands = fault
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path, commit_interval=0.02, upkeep_interval=None)
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

    table = lance.dataset(str(path)).to_table()
    per_offset = collections.Counter(table.column("_offset").to_pylist())
    assert per_offset == {0: 1000, 1: 1000, 2: 1000}, step
    again = Topic.reopen(path)
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
    ds = lance.dataset(str(path))
    held = {f.path for fragment in ds.get_fragments() for f in fragment.data_files()}
    on_disk = {p.name for p in (path / "data").iterdir()}
    assert on_disk == {Path(h).name for h in held}, step


def test_a_commit_that_keeps_failing_leaves_no_fragments_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.lance"
    topic = Topic("t", SCHEMA, persist=path, commit_interval=0.01, upkeep_interval=None)
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
    assert topic.stats.commit_failures == 20
    topic.close()
    ds = lance.dataset(str(path))
    held = {Path(f.path).name for fr in ds.get_fragments() for f in fr.data_files()}
    assert {p.name for p in (path / "data").iterdir()} == held
    assert ds.count_rows() == 2000
