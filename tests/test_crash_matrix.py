"""Hard crashes (``os._exit``) at every step of an epoch, then a restart on the same checkpoint.

The Lance dataset must hold every source row exactly once. Orphaned data files (written, never
committed) are counted and then removed the documented way (``cleanup_old_versions`` with
``delete_unverified=True``). The default run crashes once at every step, as a chain: each
restart recovers the previous crash and then crashes at the next step of a later epoch, as a
job on a flaky cluster does (one Spark start per crash, not two). ``-m slow`` takes each step
alone and sweeps 50 random (step, epoch, path) runs.
"""

from __future__ import annotations

import random
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


def crash_and_restart(tmp: Path, step: str, epoch: int, executor: bool) -> dict[str, int]:
    live = crash_chain(tmp, [(step, epoch)], "executor" if executor else "driver")
    live_within_lance(live, tmp / "out.lance")
    return exactly_once(tmp / "out.lance")


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


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_hard_crash_at_each_step_keeps_rows_exactly_once(tmp_path: Path, step: str) -> None:
    outcome = crash_and_restart(tmp_path, step, epoch=1, executor=False)
    assert outcome["duplicates"] == 0
    assert outcome["losses"] == 0
    if step == "before_commit":
        assert outcome["orphans"] >= 1  # fragments written, never committed


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


def crash_and_restart_upserts(tmp: Path, step: str, epoch: int) -> None:
    crash_chain(tmp, [(step, epoch)], "update")
    check_upserts(tmp / "out.lance")


@pytest.mark.slow  # three Spark starts (49 s): the default suite stays under eight minutes
@pytest.mark.timeout(600)
def test_crashes_of_an_upserting_query_before_and_after_a_commit(tmp_path: Path) -> None:
    crash_chain(tmp_path, [("before_commit", 1), ("after_commit", 2)], "update")
    check_upserts(tmp_path / "out.lance")


@pytest.mark.slow
@pytest.mark.parametrize("step", ["before_commit", "after_commit"])
def test_hard_crash_of_an_upserting_query(tmp_path: Path, step: str) -> None:
    crash_and_restart_upserts(tmp_path, step, epoch=1)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(20))
def test_random_crash_sweep_of_upserts(tmp_path: Path, run: int) -> None:
    rng = random.Random(1000 + run)
    step, epoch = rng.choice(STEPS), rng.randrange(EPOCHS)
    crash_and_restart_upserts(tmp_path, step, epoch)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(50))
def test_random_crash_sweep(tmp_path: Path, run: int) -> None:
    rng = random.Random(run)
    executor = rng.random() < 0.3
    steps = [*STEPS, "after_fragments"] if executor else STEPS
    step, epoch = rng.choice(steps), rng.randrange(EPOCHS)
    outcome = crash_and_restart(tmp_path, step, epoch, executor)
    print(f"run {run}: step={step} epoch={epoch} executor={executor} -> {outcome}")
    assert outcome["duplicates"] == 0
    assert outcome["losses"] == 0
