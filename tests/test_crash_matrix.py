"""Hard crashes (``os._exit``) at every step of an epoch, then a restart on the same checkpoint.

The Lance dataset must hold every source row exactly once. Orphaned data files (written, never
committed) are counted and then removed the documented way (``cleanup_old_versions`` with
``delete_unverified=True``). Every test here runs under ``-m slow`` (Spark starts: tens of
seconds each). One crashes once at every step, as a chain: each restart recovers the previous
crash and then crashes at the next step of a later epoch, as a job on a flaky cluster does
(one Spark start per crash, not two). The others crash at every (path, step, epoch) point,
a chain per path and step. The default suite's crash checks are the server kills of
``test_spark_durable_kill.py`` and ``test_durable_crash.py``.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lance
import pytest

from tests.crash_child import CRASH_EXIT
from tests.spark_support import ids, stamped, write_epochs

pytestmark = pytest.mark.spark

STEPS = ["before_arrow", "before_commit", "after_commit", "after_push"]
EPOCHS, ROWS = 4, 25
ROOT = Path(__file__).resolve().parent.parent


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.crash_child", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def orphaned_files(uri: Path) -> int:
    """Data files in the dataset folder that the latest version does not reference."""
    ds = lance.dataset(str(uri))
    referenced = {Path(f.path).name for frag in ds.get_fragments() for f in frag.data_files()}
    on_disk = {p.name for p in (uri / "data").glob("*.lance")}
    return len(on_disk - referenced)


def crash_chain(tmp: Path, crashes: list[tuple[str, int]], path: str) -> int:
    """Run the stream into ``tmp/out.lance``, crashing at each (step, epoch) in turn, then
    once more to the end: every run but the last must die at its step (proof the step was
    reached), the last must finish. Returns the rows the last run's live reader counted
    (-1: it had no live table)."""
    src, uri, chk = tmp / "src", tmp / "out.lance", tmp / "chk"
    write_epochs(src, EPOCHS, ROWS)
    for step, epoch in crashes:
        crashed = _child(str(src), str(uri), str(chk), step, str(epoch), path)
        assert crashed.returncode == CRASH_EXIT, f"{step}@{epoch}: {crashed.stdout}{crashed.stderr}"
    restarted = _child(str(src), str(uri), str(chk), "none", "-1", path)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    (line,) = [x for x in restarted.stdout.splitlines() if x.startswith("live rows ")]
    return int(line.split()[-1])


def live_within_lance(live: int, uri: Path) -> None:
    """What the last run's live reader saw was pushed after its commit: some rows (that run
    had epochs left), never more than Lance holds."""
    assert 0 < live <= len(ids(uri)), (live, len(ids(uri)))


def exactly_once(uri: Path) -> dict[str, int]:
    """Duplicates, losses and orphaned files; then the documented cleanup, rows intact."""
    got = ids(uri)
    expected = list(range(EPOCHS * ROWS))
    duplicates = len(got) - len(set(got))
    losses = len(set(expected) - set(got))
    orphans = orphaned_files(uri)
    lance.dataset(str(uri)).cleanup_old_versions(older_than=timedelta(0), delete_unverified=True)
    assert orphaned_files(uri) == 0
    assert ids(uri) == expected  # cleanup removed only what no version referenced
    return {"duplicates": duplicates, "losses": losses, "orphans": orphans}


@pytest.mark.slow  # 80 s; the chains below crash at every point too (this one mixes steps)
@pytest.mark.timeout(600)  # five Spark starts in a row: 80 s idle here, twice that under load
def test_a_crash_at_every_step_in_turn_keeps_rows_exactly_once(tmp_path: Path) -> None:
    # Epoch k crashes at step k: before Arrow, before the commit (fragments written), after
    # the commit (the replay must be skipped), after the live push (Spark never recorded it).
    live = crash_chain(tmp_path, [(step, epoch) for epoch, step in enumerate(STEPS)], "driver")
    live_within_lance(live, tmp_path / "out.lance")
    outcome = exactly_once(tmp_path / "out.lance")
    assert outcome["duplicates"] == 0
    assert outcome["losses"] == 0
    assert outcome["orphans"] >= 1  # the before_commit crash's fragments, never committed


def level_counts(uri: Path) -> dict[str, int]:
    rows = lance.dataset(str(uri)).to_table().to_pylist()
    assert len(rows) == len({r["level"] for r in rows}), rows  # one row per key
    return {r["level"]: r["count"] for r in rows}


def check_upserts(uri: Path) -> None:
    """Update mode with key=: the dataset holds each level's final count, each epoch once."""
    epochs = [e for _, e in stamped(uri)]
    assert epochs == sorted(set(epochs)), epochs  # no epoch committed twice
    per_epoch_a = sum(1 for r in range(ROWS) if r % 2 == 0)
    assert level_counts(uri) == {"a": EPOCHS * per_epoch_a, "b": EPOCHS * (ROWS - per_epoch_a)}


#: every step of each path the bridge has (the executor path writes fragments on executors)
PATH_STEPS = [
    *(("driver", step) for step in STEPS),
    *(("executor", step) for step in [*STEPS, "after_fragments"]),
    *(("update", step) for step in STEPS),
]


@pytest.mark.slow
@pytest.mark.timeout(900)  # five Spark starts: 100 s idle here
@pytest.mark.parametrize(("path", "step"), PATH_STEPS)
def test_a_crash_at_one_step_of_every_epoch_in_turn(tmp_path: Path, path: str, step: str) -> None:
    """Every (path, step, epoch) point crashed once: the chain crashes at ``step`` in epoch 0,
    then, recovering that, in epoch 1, and so on, then runs to the end (one Spark start per
    crash, as a job on a flaky cluster; the points a seeded sweep of 70 single crashes drew,
    with repeats, in 140 starts)."""
    live = crash_chain(tmp_path, [(step, epoch) for epoch in range(EPOCHS)], path)
    if path == "update":
        check_upserts(tmp_path / "out.lance")
        return
    live_within_lance(live, tmp_path / "out.lance")
    outcome = exactly_once(tmp_path / "out.lance")
    assert outcome["duplicates"] == 0
    assert outcome["losses"] == 0
    if step == "before_commit":
        assert outcome["orphans"] >= 1  # fragments written, never committed
