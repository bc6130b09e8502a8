"""Spark's stage/publish path into a durable topic, against real ``pushtable serve --data-dir``
processes killed with SIGKILL: publish answers once a commit holds the epoch (a kill right
after loses nothing), the publish watermark is stored in the same commit as the rows (a
replay after a restart is not written twice), shares lost with a restart are an error (never
"published" with nothing in it), and a refusal or a failed commit leaves the epoch
unpublished and retryable without ending the topic."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from pushtable import (
    CommitFailedError,
    ResourceLimitError,
    SchemaMismatchError,
    SharesLostError,
    SinkClosedError,
    Topic,
)
from pushtable.flight import Client, Server, connect
from tests.conftest import WAIT
from tests.publish_driver import SCHEMA as DRIVER_SCHEMA
from tests.test_durable import break_dataset, mend_dataset
from tests.test_durable_crash import ROOT, Serve, free_port

SCHEMA = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("tag", pa.string())])
DRIVER = str(Path(__file__).with_name("publish_driver.py"))
QUERY = "query-1"


def epoch_batches(epoch: int, parts: int = 2, rows: int = 5) -> list[list[pa.RecordBatch]]:
    """``parts`` shares of ``rows`` rows each; k is unique over every epoch."""
    return [
        [
            pa.record_batch(
                {"k": [(epoch * parts + p) * rows + r for r in range(rows)], "tag": ["x"] * rows},
                schema=SCHEMA,
            )
        ]
        for p in range(parts)
    ]


def stage(
    client: Client, epoch: int, shares: list[list[pa.RecordBatch]]
) -> list[tuple[int, int, int]]:
    """Stage each share as partition p, attempt 0; the parts with their rows for publish."""
    for p, batches in enumerate(shares):
        client.stage("events", QUERY, epoch, p, 0, batches, SCHEMA)
    return [(p, 0, sum(b.num_rows for b in batches)) for p, batches in enumerate(shares)]


def stored_ks(client: Client) -> list[int]:
    end = client.offsets("events")["committed"]
    return sorted(client.read("events", 0, end).read_all().column("k").to_pylist())


def expected(epochs: range, parts: int = 2, rows: int = 5) -> list[int]:
    return list(range(epochs.start * parts * rows, epochs.stop * parts * rows))


class Killable:
    """A ``pushtable serve --data-dir`` process holding the durable topic ``events``, and a
    client of it; ``restart()`` kills it (SIGKILL) and starts it again on the same port."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.server = Serve(data_dir, self.port)
        self.client = connect(self.server.location)
        self.client.create_topic("events", SCHEMA, durable=True)

    def restart(self) -> Client:
        self.server.kill()
        self.server = Serve(self.data_dir, self.port)
        self.client = connect(self.server.location)
        return self.client


def test_a_published_epoch_survives_a_kill_and_a_replay_is_not_written_twice(
    tmp_path: Path,
) -> None:
    served = Killable(tmp_path / "data")
    try:
        client = served.client
        for epoch in range(2):
            parts = stage(client, epoch, epoch_batches(epoch))
            assert client.publish("events", QUERY, epoch, parts)
        client = served.restart()  # at once: publish answered, the commit holds epoch 1
        assert stored_ks(client) == expected(range(2))
        assert client.published("events", QUERY) == 1  # stored with the rows: survives
        # Spark replays epoch 1 after its own restart: nothing is written twice.
        parts = stage(client, 1, epoch_batches(1))
        assert not client.publish("events", QUERY, 1, parts)
        parts = stage(client, 2, epoch_batches(2))
        assert client.publish("events", QUERY, 2, parts)
        assert stored_ks(client) == expected(range(3))
    finally:
        served.server.stop()


def test_shares_lost_with_a_restart_are_an_error_and_the_epoch_stays_unpublished(
    tmp_path: Path,
) -> None:
    served = Killable(tmp_path / "data")
    try:
        parts = stage(served.client, 0, epoch_batches(0))
        client = served.restart()  # staged, not published: staging is in memory
        with pytest.raises(SharesLostError, match=r"epoch 0 .*partition\(s\) \[0, 1\]"):
            client.publish("events", QUERY, 0, parts)
        # Parts without row counts may have had rows: never "published" with nothing in it.
        with pytest.raises(SharesLostError, match=r"epoch 0 .*partition\(s\) \[0, 1\]"):
            client.publish("events", QUERY, 0, [(0, 0), (1, 0)])
        assert client.published("events", QUERY) == -1
        assert stored_ks(client) == []
        # Spark runs the batch again: its tasks stage anew and the publish goes through.
        parts = stage(client, 0, epoch_batches(0))
        assert client.publish("events", QUERY, 0, parts)
        assert stored_ks(client) == expected(range(1))
        # A part without rows is never a lost share (an empty partition stages nothing).
        assert client.publish("events", QUERY, 1, [(0, 0, 0)])
    finally:
        served.server.stop()


@pytest.fixture
def published_once(tmp_path: Path) -> Iterator[tuple[Server, Client]]:
    """A server (in this process) with a durable topic holding epoch 0 of :data:`QUERY`."""
    server = Server(data_dir=tmp_path / "data")
    try:
        client = connect(server.location)
        client.create_topic("events", SCHEMA, durable=True)
        assert client.publish("events", QUERY, 0, stage(client, 0, epoch_batches(0)))
        yield server, client
    finally:
        server.stop()


def test_a_refused_batch_leaves_the_epoch_retryable_and_the_topic_open(
    published_once: tuple[Server, Client],
) -> None:
    _, client = published_once
    nulls = pa.record_batch(
        {"k": pa.array([100, None], pa.int64()), "tag": ["y", "y"]},
        schema=SCHEMA.set(0, SCHEMA.field("k").with_nullable(True)),
    )
    good = epoch_batches(1)
    client.stage("events", QUERY, 1, 0, 0, good[0], SCHEMA)
    client.stage("events", QUERY, 1, 1, 0, [nulls], nulls.schema)
    with pytest.raises(SchemaMismatchError, match="'k'"):
        client.publish("events", QUERY, 1, [(0, 0, 5), (1, 0, 2)])
    assert client.published("events", QUERY) == 0  # not published: Spark may retry it
    sink = client.sink("events")  # the topic is not ended by it: producers go on
    sink.write(pa.record_batch({"k": [999], "tag": ["plain"]}, schema=SCHEMA))
    sink.flush(timeout=WAIT)
    parts = stage(client, 1, good)  # the retry, with the batch fixed
    assert client.publish("events", QUERY, 1, parts)
    assert stored_ks(client) == [*expected(range(2)), 999]  # the first share once


def test_a_publish_refused_by_max_data_bytes_is_retried_as_it_was_sent(tmp_path: Path) -> None:
    """The refusal leaves the epoch's shares staged: the driver's retry of the same publish
    (nothing staged again) writes the epoch once, when there is room."""
    server = Server(data_dir=tmp_path / "data")
    try:
        client = connect(server.location)
        client.create_topic("events", SCHEMA, durable=True)
        assert client.publish("events", QUERY, 0, stage(client, 0, epoch_batches(0)))
        budget = server._tables._budget  # the data dir's real budget, lowered and raised
        assert budget is not None
        budget.limit = 1  # no room left: the next durable write is refused
        parts = stage(client, 1, epoch_batches(1, rows=50))
        with pytest.raises(ResourceLimitError, match="max_data_bytes"):
            client.publish("events", QUERY, 1, parts, timeout=WAIT)
        assert client.published("events", QUERY) == 0
        assert stored_ks(client) == expected(range(1))
        budget.limit = 2**40  # room again (an operator raised max_data_bytes, or upkeep ran)
        assert client.publish("events", QUERY, 1, parts, timeout=WAIT)  # as it was sent
        assert client.published("events", QUERY) == 1
        assert stored_ks(client) == sorted([*expected(range(1)), *expected(range(1, 2), rows=50)])
    finally:
        server.stop()


def test_a_failed_commit_fails_the_publish_not_the_topic(
    published_once: tuple[Server, Client], tmp_path: Path
) -> None:
    server, client = published_once
    topic = server.table("events")
    assert isinstance(topic, Topic)
    assert topic.durable is not None
    path = tmp_path / "data" / "events.lance"
    moved = break_dataset(path)
    parts = stage(client, 1, epoch_batches(1))
    with pytest.raises(CommitFailedError, match="not acknowledged"):
        client.publish("events", QUERY, 1, parts, timeout=WAIT)
    assert client.published("events", QUERY) == 0
    mend_dataset(path, moved)
    topic.durable.flush(timeout=WAIT)  # the committer's retry stores what was pending
    # Spark's retry of the batch: whatever the committer's retry stored is skipped.
    client.publish("events", QUERY, 1, stage(client, 1, epoch_batches(1)), timeout=WAIT)
    assert client.published("events", QUERY) == 1
    assert not topic.closed
    assert stored_ks(client) == expected(range(2))


def test_a_publish_into_a_closed_table_says_so_and_publishes_nothing() -> None:
    """A Spark sink's live table closed by hand: the next publish names it, not a bare
    SinkClosedError, and the epoch stays unpublished."""
    server = Server()
    try:
        client = connect(server.location)
        client.create_table("events", SCHEMA)
        client.sink("events").close()
        parts = stage(client, 0, epoch_batches(0))
        with pytest.raises(
            SinkClosedError, match=r"live table 'events' is closed \(end of stream\)"
        ):
            client.publish("events", QUERY, 0, parts)
        assert client.published("events", QUERY) == -1
    finally:
        server.stop()


def publish_crash_run(data_dir: Path, port: int, *, epochs: int, rows: int, kill_after: int) -> int:
    """A Spark-like driver process publishes ``epochs`` epochs; SIGKILL the server once it
    reported ``kill_after`` publishes (whatever it is doing then: staging, publishing, or
    waiting for a commit); check every epoch it saw published is stored; restart; let it
    finish; every epoch's rows exactly once. Returns the epochs published before the kill."""
    server = Serve(data_dir, port)
    driver = None
    try:
        connect(server.location).create_topic("events", DRIVER_SCHEMA, durable=True)
        driver = subprocess.Popen(
            [sys.executable, DRIVER, server.location, str(epochs), str(rows)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        assert driver.stdout is not None
        published = -1
        for line in driver.stdout:  # bounded: the driver gives up after 60 s without a server
            if line.startswith("published "):
                published = int(line.split()[1])
            if published + 1 >= kill_after or line.strip() == "done":
                break
        server.kill()
        at_kill = published
        stored_now = lance.dataset(str(data_dir / "events.lance")).to_table(columns=["epoch"])
        have = set(stored_now.column("epoch").to_pylist())
        assert set(range(at_kill + 1)) <= have, "an epoch that answered published is lost"
        server = Serve(data_dir, port)
        out, err = driver.communicate(timeout=120)
        assert driver.returncode == 0, err
        assert "done" in out
        table = lance.dataset(str(data_dir / "events.lance")).to_table(columns=["k"])
        ks = sorted(table.column("k").to_pylist())
        assert ks == list(range(epochs * 2 * rows)), "every epoch's rows exactly once"
        return at_kill + 1
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        server.stop()


def test_a_publishing_driver_rides_out_a_sigkill_exactly_once(tmp_path: Path) -> None:
    assert publish_crash_run(tmp_path / "data", free_port(), epochs=12, rows=50, kill_after=4) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("run", range(30))
def test_publish_crash_sweep_kill_at_random_points(tmp_path: Path, run: int) -> None:
    """Kill while a driver stages and publishes, at a random point (seeded per run), 30 runs:
    0 lost, 0 duplicated."""
    rng = random.Random(run)
    publish_crash_run(
        tmp_path / "data",
        free_port(),
        epochs=rng.randint(5, 25),
        rows=rng.choice([1, 50, 3000]),
        kill_after=rng.randint(0, 5),
    )
