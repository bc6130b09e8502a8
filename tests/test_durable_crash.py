"""Durable topics under a killed server: real ``pushtable serve`` processes, SIGKILL, restart on
the same data dir and port, four idempotent producer processes riding it out.

What must hold (docs/network.md, "Durability"): every batch a producer saw acknowledged is in
the Lance dataset the moment the server dies; after the restart the producers finish and
every batch is stored exactly once; a subscription from "earliest" taken after the restart
reads the whole history then the live tail, with no gap and no duplicate.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest

from pushtable.flight import connect
from tests.conftest import WAIT, Background
from tests.durable_producer import SCHEMA

PRODUCER = str(Path(__file__).with_name("durable_producer.py"))
ROOT = str(Path(__file__).parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``pushtable serve --data-dir`` in a child process on a fixed port."""

    def __init__(
        self, data_dir: Path, port: int, *extra: str, prefix: tuple[str, ...] = ()
    ) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pushtable", "serve", "--port", str(port)]
            + ["--data-dir", str(data_dir), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=bool(prefix),  # a tracer and its server: signalled together
        )
        self.group = bool(prefix)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("pushtable serve: listening on grpc://127.0.0.1:"), line
        self.location = line.split("listening on ")[1].split()[0]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def stop(self) -> None:
        if self.group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.terminate()
        try:
            self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Producer:
    """A producer process; ``flushed`` is the newest sequence it saw acknowledged."""

    def __init__(self, location: str, name: str, batches: int, rows: int, every: int) -> None:
        self.name = name
        self.flushed = -1
        self.ready = threading.Event()
        self.done = threading.Event()
        self.progress = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, PRODUCER, location, "events", name, str(batches), str(rows)]
            + [str(every)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.progress:
                if line.strip() == "ready":
                    self.ready.set()
                elif line.startswith("flushed "):
                    self.flushed = int(line.split()[1])
                elif line.strip() == "done":
                    self.done.set()
                self.progress.notify_all()
        with self.progress:
            self.progress.notify_all()

    def finish(self) -> None:
        code = self.proc.wait(120)
        assert self.proc.stderr is not None
        assert code == 0, self.proc.stderr.read()
        assert self.done.is_set()


def stored(data_dir: Path) -> pa.Table:
    """The topic's dataset, read with Lance directly (no server involved)."""
    return lance.dataset(str(data_dir / "events.lance")).to_table(
        columns=["producer", "seq", "row"]
    )


def counts(table: pa.Table) -> dict[tuple[str, int], int]:
    grouped = table.group_by(["producer", "seq"]).aggregate([("row", "count")])
    d = grouped.to_pydict()
    return {(p, s): c for p, s, c in zip(d["producer"], d["seq"], d["row_count"], strict=True)}


@pytest.fixture
def port() -> int:
    return free_port()


def crash_run(
    data_dir: Path,
    port: int,
    *,
    batches: int,
    rows: int,
    every: int,
    kill_after: int,
    prefix: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Four producers; SIGKILL the server once they flushed ``kill_after`` times together;
    check what was acknowledged is stored; restart; subscribe from "earliest"; finish.

    ``prefix`` runs the server under a wrapper (``tests/faulty_serve.py``: commits that
    land, then raise), both times."""
    server = Serve(data_dir, port, prefix=prefix)
    producers: list[Producer] = []
    try:
        connect(server.location).create_topic("events", SCHEMA, durable=True)
        producers = [Producer(server.location, f"p{i}", batches, rows, every) for i in range(4)]

        def flushes() -> int:
            return sum(max(0, (p.flushed + 1) // every) for p in producers)

        for p in producers:  # every producer is connected before the kill
            assert p.ready.wait(WAIT), f"{p.name} did not start"
        for p in producers:  # then driven by the producers' own reports, bounded
            with p.progress:
                p.progress.wait_for(
                    lambda p=p: flushes() >= kill_after or p.done.is_set(),  # type: ignore[misc]
                    timeout=WAIT,
                )
        acknowledged = {p.name: p.flushed for p in producers}
        server.kill()

        after_kill = counts(stored(data_dir))
        for name, upto in acknowledged.items():
            missing = [s for s in range(upto + 1) if after_kill.get((name, s)) != rows]
            assert not missing, f"{name}: acknowledged batches {missing} are not stored"

        server = Serve(data_dir, port, prefix=prefix)
        client = connect(server.location)
        client.subscribe("events", "everything", start="earliest", capacity=64)
        reading = Background(
            lambda: client.sql(
                "SELECT producer, seq, count(*) AS n FROM everything GROUP BY producer, seq"
            ).read_all()
        )
        for p in producers:
            p.finish()
        client.sink("events").close()  # end of stream: the subscription's query completes
        seen = reading.join(timeout=120)
        final = counts(stored(data_dir))
        want = {(f"p{i}", s): rows for i in range(4) for s in range(batches)}
        assert final == want, "every batch exactly once in the dataset"
        live = seen.to_pydict()
        got = {(p, s): n for p, s, n in zip(live["producer"], live["seq"], live["n"], strict=True)}
        assert got == want, "the subscription from earliest saw every batch exactly once"
        return {"acknowledged_at_kill": sum(v + 1 for v in acknowledged.values())}
    finally:
        for p in producers:
            if p.proc.poll() is None:
                p.proc.kill()
        server.stop()


def test_sigkill_during_ingest_loses_nothing_acknowledged_and_duplicates_nothing(
    tmp_path: Path, port: int
) -> None:
    result = crash_run(tmp_path / "data", port, batches=60, rows=500, every=5, kill_after=8)
    assert result["acknowledged_at_kill"] >= 8 * 5


FAULTY_SERVE = str(Path(__file__).with_name("faulty_serve.py"))


@pytest.mark.slow
@pytest.mark.parametrize("run", range(10))
def test_crash_sweep_with_commits_that_land_then_raise(tmp_path: Path, port: int, run: int) -> None:
    """The sweep again, with one manifest commit or sync in five raising after it landed (a
    late fsync error, an object store's lost reply: ``tests/faulty_serve.py``), before and
    after the kill: every batch stored exactly once, none acknowledged lost."""
    rng = random.Random(1000 + run)
    fired = tmp_path / "injected"
    crash_run(
        tmp_path / "data",
        port,
        batches=rng.randint(20, 60),
        rows=rng.choice([1, 100, 2000]),
        every=rng.randint(1, 7),
        kill_after=rng.randint(0, 10),
        prefix=(sys.executable, FAULTY_SERVE, str(run), "0.2", str(fired), "--"),
    )
    # the faults fired (each server of the run counts its own): a sweep without one proves
    # nothing about commits that land and then raise
    assert fired.exists(), "no fault was injected"
    assert fired.read_text().count("\n") >= 1


@pytest.mark.slow
@pytest.mark.parametrize("run", range(30))
def test_crash_sweep_kill_at_random_points(tmp_path: Path, port: int, run: int) -> None:
    """Kill at a random point of ingest (seeded per run), 30 runs: 0 lost, 0 duplicated."""
    rng = random.Random(run)
    crash_run(
        tmp_path / "data",
        port,
        batches=rng.randint(20, 80),
        rows=rng.choice([1, 100, 2000]),
        every=rng.randint(1, 7),
        kill_after=rng.randint(0, 10),
    )
