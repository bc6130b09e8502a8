"""Durable topics on an object store (moto's S3 server on loopback, a real HTTP endpoint).

- ``pushtable serve --data-dir s3://lake/<prefix>`` keeps its durable topics on the store, with
  the storage options of its config file (a secret read from the environment), never printed;
  nothing lands in its working directory.
- Restart anywhere: the server SIGKILLed and started again in another, empty working directory
  on the same prefix serves every acknowledged batch exactly once, and an idempotent producer
  goes on without a duplicate.
- ``Topic(persist="s3://…", storage_options=...)`` in process, and the store going away for a
  while under a producer: nothing acknowledged is lost or stored twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import lance
import pyarrow as pa

from pushtable import Topic
from pushtable.flight import Server, connect
from tests.conftest import WAIT, ObjectStore, wait_until

SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("ts", pa.timestamp("us", tz="Europe/Paris")),
        ("amount", pa.decimal128(12, 2)),
        ("tags", pa.list_(pa.string())),
    ]
)


def rows(start: int, n: int = 3) -> pa.RecordBatch:
    keys = list(range(start, start + n))
    return pa.record_batch(
        [
            pa.array(keys, pa.int64()),
            pa.array([1_700_000_000_000_000 + k for k in keys], SCHEMA.field("ts").type),
            pa.array([Decimal(k) / 4 if k % 3 else None for k in keys], pa.decimal128(12, 2)),
            pa.array([["x", None] if k % 2 else [] for k in keys], pa.list_(pa.string())),
        ],
        schema=SCHEMA,
    )


@contextmanager
def serve(
    store: ObjectStore, prefix: str, workdir: Path
) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """``pushtable serve --data-dir s3://lake/<prefix>`` run in ``workdir``, its secret in the
    environment; yields (process, location, the data dir line it printed)."""
    options = dict(store.options)
    secret = options.pop("aws_secret_access_key")
    config = workdir / "serve.json"
    config.write_text(
        json.dumps(
            {
                "storage_options": options,
                "storage_options_env": {"aws_secret_access_key": "LAKE_SECRET"},
            }
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "pushtable", "serve", "--port", "0", "--config", str(config)),
            *("--data-dir", f"s3://{store.bucket}/{prefix}"),
        ],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "LAKE_SECRET": secret, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        assert "listening on grpc://" in listening, listening
        data_line = proc.stdout.readline()
        yield proc, listening.split("listening on ")[1].split()[0], data_line
    finally:
        if proc.poll() is None:
            proc.kill()
        rest, _ = proc.communicate(timeout=WAIT)
        assert secret not in rest  # never printed, whatever happened


def test_a_server_keeps_durable_topics_on_an_object_store_and_restarts_anywhere(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    first, second = tmp_path / "host-a", tmp_path / "host-b"
    first.mkdir()
    second.mkdir()
    secret = object_store.options["aws_secret_access_key"]
    with serve(object_store, "restart", first) as (proc, location, data_line):
        assert data_line.startswith("pushtable serve: data dir s3://lake/restart ("), data_line
        assert secret not in data_line
        with connect(location, timeout=WAIT) as client:
            client.create_topic("ticks", SCHEMA, durable=True)
            sink = client.sink("ticks", producer_id="feed")
            for i in range(10):
                sink.write(rows(3 * i), timeout=WAIT)
            sink.flush(timeout=WAIT)  # acknowledged: committed on the store
            assert client.offsets("ticks")["next"] == 10
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    assert sorted(p.name for p in first.iterdir()) == ["serve.json"]  # nothing local
    dataset = lance.dataset("s3://lake/restart/ticks.lance", storage_options=object_store.options)
    assert dataset.count_rows() == 30
    # Another machine, in effect: an empty working directory, the same prefix.
    with serve(object_store, "restart", second) as (_, location, data_line):
        assert "(1 durable topic(s)" in data_line, data_line
        with connect(location, timeout=WAIT) as client:
            assert client.offsets("ticks") == {"earliest": 0, "committed": 10, "next": 10}
            sink = client.sink("ticks", producer_id="feed")  # resumes after sequence 9
            for i in range(10, 12):
                sink.write(rows(3 * i), timeout=WAIT)
            sink.flush(timeout=WAIT)
            got = client.read("ticks", 0, 12).read_all()
    assert got["k"].to_pylist() == list(range(36))  # every batch once, in order
    assert got.schema.field("ts").type == SCHEMA.field("ts").type
    assert got["amount"].to_pylist()[1] == Decimal("0.25")


def test_a_topic_persisted_on_an_object_store_rides_out_the_store_going_away(
    object_store: ObjectStore,
) -> None:
    """``Topic(persist="s3://…")`` with storage options; the store stopped while batches are
    written, until a commit has failed (the batches kept), then started again: every batch is
    stored once, in order."""
    uri = f"s3://{object_store.bucket}/outage/ev.lance"
    topic = Topic(
        "ev", SCHEMA, persist=uri, storage_options=object_store.options, commit_interval=0.05
    )
    try:
        for i in range(5):
            topic.write(rows(3 * i), timeout=WAIT)
        topic.flush(timeout=WAIT)
        object_store.server.stop()
        try:
            for i in range(5, 10):
                topic.write(rows(3 * i), timeout=WAIT)  # accepted: pending, not stored yet
            assert topic.durable is not None
            durable = topic.durable
            wait_until(lambda: durable.commit_failures > 0, "a commit to fail on the store")
        finally:
            object_store.server.start()
        topic.flush(timeout=WAIT)
        assert topic.offsets() == {"earliest": 0, "committed": 10, "next": 10}
        stored = topic.read(0, 10).read_all()
    finally:
        topic.close()
    assert stored["k"].to_pylist() == list(range(30))
    again = Topic.reopen(uri, storage_options=object_store.options)
    try:
        assert again.offsets()["next"] == 10
    finally:
        again.close()


def test_an_in_process_server_takes_storage_options_and_lists_what_it_stores(
    object_store: ObjectStore,
) -> None:
    server = Server(
        data_dir=f"s3://{object_store.bucket}/listed", storage_options=object_store.options
    )
    try:
        for name in ("b_topic", "a_topic"):
            server.create_table(name, SCHEMA, topic=True, durable=True)
        assert server.data_dir is not None
        assert server.data_dir.names() == ["a_topic", "b_topic"]
        empty = server.data_dir.bytes()
        topic = server.table("a_topic")
        topic.write(rows(0))
        topic.flush(timeout=WAIT)  # type: ignore[union-attr]
        assert server.data_dir.bytes() > empty  # the budget sees what the store holds
        assert object_store.options["aws_secret_access_key"] not in repr(server.data_dir)
    finally:
        server.stop()
    server = Server(
        data_dir=f"s3://{object_store.bucket}/listed", storage_options=object_store.options
    )
    try:
        assert sorted(n for n, _ in server._tables.all()) == ["a_topic", "b_topic"]
    finally:
        server.stop()


def test_a_servers_producer_rides_out_the_store_going_away(object_store: ObjectStore) -> None:
    """Through a server whose data dir is on the store: the store stopped while an idempotent
    producer writes, until a commit failed; the producer's flush is told its batches are kept
    (``CommitFailedError``, ``kept``) and, once the store is back, stores every batch once."""
    from pushtable.errors import CommitFailedError

    server = Server(
        data_dir=f"s3://{object_store.bucket}/outage-served", storage_options=object_store.options
    )
    try:
        with connect(server.location, timeout=WAIT) as client:
            client.create_topic("ticks", SCHEMA, durable=True, commit_interval=0.05)
            sink = client.sink("ticks", producer_id="feed")
            for i in range(3):
                sink.write(rows(3 * i), timeout=WAIT)
            sink.flush(timeout=WAIT)
            durable = server.table("ticks").durable  # type: ignore[union-attr]
            assert durable is not None
            object_store.server.stop()
            told: list[CommitFailedError] = []
            try:
                for i in range(3, 6):
                    sink.write(rows(3 * i), timeout=WAIT)
                wait_until(lambda: durable.commit_failures > 0, "a commit to fail on the store")
                try:  # told, not acknowledged: a flush that is not times out (WAIT)
                    sink.flush(timeout=WAIT)  # (5 s was too short on a loaded machine)
                except CommitFailedError as exc:
                    told.append(exc)
            finally:
                object_store.server.start()
            sink.flush(timeout=WAIT)
            got = client.read("ticks", 0, client.offsets("ticks")["next"]).read_all()
    finally:
        server.stop()
    assert got["k"].to_pylist() == list(range(18))  # every batch once, in order
    assert len(told) == 1  # the flush while the store was away was told, not acknowledged
    assert getattr(told[0], "kept", False), told[0]  # ... that its batches are kept


def test_a_stop_with_the_store_away_is_bounded_as_a_whole(object_store: ObjectStore) -> None:
    """Four durable topics with batches pending when the store goes away: the stop took
    about 10 s a topic (42 s for 4: each topic's last commit waited in turn before the
    stop's deadline was computed). They wait at once, under one deadline: ``stop(timeout=4)``
    returns within it (plus a margin for the calls' end), and nothing pending is told
    stored."""
    server = Server(
        data_dir=f"s3://{object_store.bucket}/stop-away", storage_options=object_store.options
    )
    names = [f"t{i}" for i in range(4)]
    try:
        with connect(server.location, timeout=WAIT) as client:
            for name in names:
                client.create_topic(name, SCHEMA, durable=True, commit_interval=0.05)
        topics = [server.table(name) for name in names]
        for topic in topics:
            topic.write(rows(0), timeout=WAIT)
            topic.flush(timeout=WAIT)  # type: ignore[union-attr]
        object_store.server.stop()
        for topic in topics:
            topic.write(rows(3), timeout=WAIT)  # pending: the store is away
        started = time.monotonic()
        server.stop(timeout=4.0)
        took = time.monotonic() - started
    finally:
        object_store.server.start()
        server.stop()
    assert took < 4.0 + 1.5, took
    for topic in topics:
        assert isinstance(topic, Topic)
        assert topic.durable is not None
        assert topic.durable.offsets()["committed"] == 1  # the pending batch: not stored


def test_the_start_up_line_says_how_an_object_store_data_dir_is_durable(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    """``pushtable serve --data-dir s3://…`` said "fsync on", where nothing is synced (an
    object store's put is durable once it returns): it says so; a local one says fsync."""
    from pushtable.flight.server.server import serve

    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"storage_options": object_store.options}))
    for data_dir, says in (
        (f"s3://{object_store.bucket}/startup", "on an object store"),
        (str(tmp_path / "local"), "fsync on"),
    ):
        lines: list[str] = []
        server = serve(
            "127.0.0.1", 0, config=config, data_dir=data_dir, block=False, say=lines.append
        )
        try:
            line = next(text for text in lines if "data dir" in text)
            assert says in line, line
            assert ("fsync" in line) == (says == "fsync on"), line
        finally:
            server.stop()
