"""One server at a time serves a data dir (a directory, or a prefix on moto's S3 server).

A second server on the same data dir is refused naming the first; a server killed with
SIGKILL holds the lease one term at most; a server whose lease another took fails its durable
topics at once (it acknowledges nothing more): never two writers interleaving offsets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pushtable.errors import DataDirInUseError
from pushtable.flight import Server
from pushtable.flight.server.data_dir import DataDir
from pushtable.flight.server.lease import Lease
from tests.conftest import WAIT, Place, wait_until

SCHEMA = pa.schema([("k", pa.int64()), ("ts", pa.timestamp("ms", tz="Asia/Kolkata"))])


def rows(k: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array([k]), pa.array([k * 1000], SCHEMA.field("ts").type)], SCHEMA)


def test_a_second_server_on_the_same_data_dir_is_refused_naming_the_first(place: Place) -> None:
    root = place.uri("served")
    first = Server(data_dir=root, storage_options=place.options)
    try:
        first.create_table("ticks", SCHEMA, topic=True, durable=True)
        with pytest.raises(
            DataDirInUseError, match=rf"is served by pushtable serve \(pid {os.getpid()}"
        ):
            Server(data_dir=root, storage_options=place.options)
        assert first.data_dir is not None
        assert first.data_dir.names() == ["ticks"]  # the lease is not a topic
    finally:
        first.stop()
    second = Server(data_dir=root, storage_options=place.options)  # released by the stop
    try:
        assert [name for name, _ in second._tables.all()] == ["ticks"]
    finally:
        second.stop()


def test_a_killed_server_is_replaced_at_once_here_and_after_one_term_elsewhere(
    place: Place, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pushtable serve`` SIGKILLed: a server started again on the same host takes the data dir
    at once (the lease names the dead process), with every acknowledged batch. A lease held
    from another host is waited out: refused naming it while it runs (3 s here), then taken."""
    root = place.uri("killed")
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"storage_options": place.options or {}}))
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "pushtable", "serve", "--port", "0", "--data-dir", root),
            *("--config", str(config)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    listening = proc.stdout.readline()
    assert "listening on" in listening, listening
    from pushtable.flight import connect

    with connect(listening.split("listening on ")[1].split()[0], timeout=WAIT) as client:
        client.create_topic("ticks", SCHEMA, durable=True)
        sink = client.sink("ticks", producer_id="p")
        sink.write(rows(7), timeout=WAIT)
        sink.flush(timeout=WAIT)
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT)
    again = Server(data_dir=root, storage_options=place.options)  # at once: its pid is gone
    try:
        topic = again.table("ticks")
        assert topic.read(0, 1).read_all()["k"].to_pylist() == [7]  # type: ignore[union-attr]
    finally:
        again.stop()
    # Held from another host (a row as that server would have written it): waited out.
    monkeypatch.setenv("PUSHTABLE_LEASE_S", "3")
    elsewhere = Lease(DataDir(root, place.options), "pushtable serve on another host")
    held = pa.table(
        {
            "owner": [elsewhere.owner],
            "host": ["another-host"],
            "pid": [1],
            "expires": [0.0],
            "pidns": [""],
        },
        schema=elsewhere._row(0.0).schema,
    )
    held = held.set_column(3, "expires", pa.array([time.time() + 3.0]))
    latest = place.dataset(elsewhere.uri).version
    assert elsewhere._swap(latest, held) is not None
    with pytest.raises(DataDirInUseError, match="pushtable serve on another host"):
        Server(data_dir=root, storage_options=place.options)
    started: list[Server] = []

    def takes_it() -> bool:
        try:
            started.append(Server(data_dir=root, storage_options=place.options))
        except DataDirInUseError:
            return False
        return True

    wait_until(takes_it, "the other host's lease to lapse")
    started[0].stop()


def test_a_server_whose_lease_was_taken_fails_its_durable_topics(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server overtook the lease (here: a commit over it, as one that found it lapsed
    would make): the first fails its durable topics at its next renewal, and its producers
    hear why; nothing more is acknowledged by it."""
    monkeypatch.setenv("PUSHTABLE_LEASE_S", "0.6")  # renewed every 0.2 s
    root = place.uri("taken")
    server = Server(data_dir=root, storage_options=place.options)
    try:
        topic = server.create_table("ticks", SCHEMA, topic=True, durable=True)
        topic.write(rows(0))
        topic.flush(timeout=WAIT)  # type: ignore[union-attr]
        intruder = Lease(DataDir(root, place.options), "an intruder")

        def overtaken() -> bool:  # the server renews meanwhile: a lost race is tried again
            latest = place.dataset(intruder.uri).version
            return intruder._swap(latest, intruder._row(2e9)) is not None

        wait_until(overtaken, "a commit over the server's lease")

        def refused() -> bool:
            try:
                topic.write(rows(1))
            except DataDirInUseError as exc:  # overtaken; or, on a loaded machine, its
                # 0.6 s term ran out first while a renewal was slow: lost either way
                return "another server took the lease" in str(exc) or "ran out" in str(exc)
            return False

        wait_until(refused, "the server to give up its durable topics")
    finally:
        server.stop()


def test_a_lease_commit_that_lands_then_raises_is_kept(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease's own commit landed and then raised (an object store's lost reply): the
    server sees its own row as the newest and keeps the lease, at start and at a renewal (it
    used to fail to start, and a renewal would have read the next conflict as a loss)."""
    import lance

    root = place.uri("lost-reply")
    Server(data_dir=root, storage_options=place.options).stop()  # the lease dataset exists
    real = lance.LanceDataset.commit
    calls = {"n": 0}

    def landing_then_raising(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # type: ignore[arg-type]
        calls["n"] += 1
        raise OSError(5, "Input/output error (injected after the commit landed)")

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(landing_then_raising))
    lease = Lease(DataDir(root, place.options), "a server whose replies are lost", term=60.0)
    lease.acquire()  # the row landed: it is this lease's
    assert calls["n"] == 1
    assert lease.renew()  # landed again, raised again: still its own
    assert calls["n"] == 2
    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(real))
    with pytest.raises(DataDirInUseError, match="a server whose replies are lost"):
        Server(data_dir=root, storage_options=place.options)
    lease.release()
