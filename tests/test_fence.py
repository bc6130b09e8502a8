"""Fenced by the store: a durable topic's commit lands only under its newest owner's epoch.

A data dir's lease says which server serves it; the store enforces it per commit
(:mod:`pushtable.durable.fence`). Each shape here is an old owner that does not know it was
replaced — it believes its lease current, as a server paused between a check and its commit
would — on a local disk and on moto's S3: what it prepared before the successor opened the
topic never lands, nothing of it is acknowledged, and no offset holds two writers' batches.
The last tests are the real thing: ``pushtable serve`` paused with SIGSTOP past its lease's
term and resumed, and a holder in another PID namespace on the same host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pushtable.durable import DurableLog
from pushtable.durable.fence import EPOCH_KEY, Fence, epoch_of
from pushtable.durable.store import LogStore, Stamp, StoredBatch
from pushtable.errors import DataDirInUseError
from pushtable.flight import Server, connect
from pushtable.flight.server.data_dir import DataDir
from pushtable.flight.server.lease import Lease
from tests.conftest import WAIT, Place, wait_until

SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("who", pa.string()),
        ("ts", pa.timestamp("us", tz="Europe/Paris")),
        ("d", pa.decimal128(12, 3)),
    ]
)


def rows(k: int, who: str) -> pa.RecordBatch:
    """One row keyed ``k``, written by ``who`` (a null ``d`` for odd keys)."""
    return pa.record_batch(
        [
            pa.array([k]),
            pa.array([who]),
            pa.array([k * 1_000_000], SCHEMA.field("ts").type),
            pa.array([None if k % 2 else k], SCHEMA.field("d").type),
        ],
        SCHEMA,
    )


def writers_by_offset(place: Place, uri: str) -> dict[int, set[str]]:
    """Every offset the topic stores, and the writers whose rows it holds."""
    got = place.dataset(uri).to_table(columns=["_offset", "who"]).to_pylist()
    found: dict[int, set[str]] = {}
    for row in got:
        found.setdefault(row["_offset"], set()).add(row["who"])
    return found


def test_a_commit_prepared_before_a_successors_fence_never_lands(place: Place) -> None:
    """The old owner (epoch 1) wrote its fragments; the successor (epoch 2) opens the topic
    (its fence); the old owner's commit is refused by the store's conflict and names the
    successor; its retry over a fresh read and its read-back of the newest stamp refuse too.
    The successor's commits carry its epoch; each offset holds one writer's rows."""
    uri = place.uri("t.lance")
    old = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(1))
    old.append([StoredBatch(0, 0, rows(0, "old"))], Stamp(1, {}, {}, 0))
    written = old.write([StoredBatch(1, 0, rows(1, "old"))])  # prepared, not committed
    new = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(2))
    assert epoch_of(place.dataset(uri)) == 2
    with pytest.raises(DataDirInUseError, match=r"epoch 2, this one 1"):
        old.commit_written(written, Stamp(2, {}, {}, 0))
    with pytest.raises(DataDirInUseError):  # read afresh, it sees the fence
        old.append([StoredBatch(1, 0, rows(1, "old"))], Stamp(2, {}, {}, 0))
    with pytest.raises(DataDirInUseError):  # the newest stamp is not its own commit's
        old.landed(1)
    new.append([StoredBatch(1, 0, rows(1, "new"))], Stamp(2, {}, {}, 0))
    assert writers_by_offset(place, uri) == {0: {"old"}, 1: {"new"}}
    assert new.recover().next_offset == 2
    txs = place.dataset(uri).get_transactions(1)
    assert txs[0] is not None
    assert (txs[0].transaction_properties or {})[EPOCH_KEY] == "2"
    with pytest.raises(DataDirInUseError, match="epoch 2"):  # an older owner opening it
        LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(1))


def test_a_fence_keeps_a_commit_that_landed_between_its_read_and_its_restore(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``Restore`` is blind: a commit landing between the successor's read and its fence
    would be reverted. The fence sees it (it did not land right after its read) and restores
    it, so the old owner's acknowledged batch is kept."""
    import lance

    uri = place.uri("t.lance")
    old = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(1))
    old.append([StoredBatch(0, 0, rows(0, "old"))], Stamp(1, {}, {}, 0))
    real = lance.LanceDataset.commit
    slipped = {"n": 0}

    def a_commit_slips_in(base: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(operation, lance.Transaction) and slipped["n"] == 0:
            restore = isinstance(operation.operation, lance.LanceOperation.Restore)
            if restore:  # the old owner's commit lands just before the successor's fence
                slipped["n"] += 1
                old.append([StoredBatch(1, 0, rows(1, "old"))], Stamp(2, {}, {}, 0))
        return real(base, operation, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(a_commit_slips_in))
    new = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(2))
    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(real))
    assert slipped["n"] == 1
    assert writers_by_offset(place, uri) == {0: {"old"}, 1: {"old"}}
    assert new.recover().next_offset == 2  # the stamp of what it kept
    assert epoch_of(place.dataset(uri)) == 2


def test_an_old_owner_with_batches_pending_acknowledges_none_of_them(place: Place) -> None:
    """An old owner's log has a batch pending (its commit interval is long) when the
    successor opens the topic: its flush raises ``DataDirInUseError`` (not acknowledged), its
    listener and its owner hear it once, later writes are refused; the successor's producer
    resends and the topic holds each offset once, from one writer."""
    uri = place.uri("t.lance")
    told: list[str] = []
    heard: list[BaseException | None] = []
    old = DurableLog(
        "t",
        SCHEMA,
        uri,
        lambda batch, at: None,
        commit_interval=3600.0,
        upkeep_interval=None,
        storage_options=place.options,
        fence=Fence(1, lambda: True, told.append),  # it believes its lease is current
    )
    old.listen(lambda committed, failure: heard.append(failure))
    old.append(rows(0, "old"), producer="p", sequence=0)
    old.flush(timeout=WAIT)
    old.append(rows(1, "old"), producer="p", sequence=1)  # pending
    new = DurableLog(
        "t",
        SCHEMA,
        uri,
        lambda batch, at: None,
        upkeep_interval=None,
        storage_options=place.options,
        fence=Fence(2),
    )
    try:
        with pytest.raises(DataDirInUseError):
            old.flush(timeout=WAIT)
        assert len(told) == 1, told
        assert any(isinstance(f, DataDirInUseError) for f in heard), heard
        with pytest.raises(DataDirInUseError):
            old.append(rows(2, "old"), producer="p", sequence=2)
        assert new.last_stored_sequence("p") == 0  # what the fence's stamp says is stored
        new.append(rows(1, "new"), producer="p", sequence=1)  # the producer's retry
        new.flush(timeout=WAIT)
        with pytest.raises(DataDirInUseError):  # its close stores nothing either
            old.close(timeout=WAIT)
    finally:
        new.close(timeout=WAIT)
        old.abandon()
    assert writers_by_offset(place, uri) == {0: {"old"}, 1: {"new"}}


def test_a_renewal_that_wrote_nothing_is_a_failed_renewal(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal whose commit raised without landing found the owner's previous row and took
    it for its own (it answered True): it raises now, and the term is not extended."""
    import lance

    lease = Lease(DataDir(place.uri("d"), place.options), "a server", term=60.0)
    lease.acquire()
    until = lease._until

    def not_landing(*args: object, **kwargs: object) -> object:
        raise OSError(5, "Input/output error (injected: nothing written)")

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(not_landing))
    with pytest.raises(OSError, match="injected"):
        lease.renew()
    assert lease._until == until
    monkeypatch.undo()
    assert lease.renew()
    assert lease._until > until
    lease.release()


def test_a_lease_whose_term_ran_out_stops_every_topic_at_once(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is away for longer than the term (renewals raise): the server stops
    committing at its term's end, fails all its durable topics together, and creates none."""
    import lance

    monkeypatch.setenv("PUSHTABLE_LEASE_S", "4")
    server = Server(data_dir=place.uri("away"), storage_options=place.options)
    try:
        topics = [server.create_table(f"t{i}", SCHEMA, topic=True, durable=True) for i in range(3)]
        for topic in topics:
            topic.write(rows(0, "server"))
            topic.flush(timeout=WAIT)  # type: ignore[union-attr]
        real = lance.LanceDataset.commit
        away = threading.Event()

        def unreachable(base: Any, *args: Any, **kwargs: Any) -> Any:
            if away.is_set() and ".pushtable-owner" in str(getattr(base, "uri", base)):
                raise OSError(101, "Network is unreachable (injected)")
            return real(base, *args, **kwargs)

        monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(unreachable))
        away.set()
        lease = server._lease
        assert lease is not None
        wait_until(lambda: not lease.current(), "the term to run out")

        def all_refused() -> bool:
            for topic in topics:
                try:
                    topic.write(rows(1, "server"))
                except DataDirInUseError:
                    continue
                return False
            return True

        wait_until(all_refused, "every durable topic to refuse writes")
        with pytest.raises(DataDirInUseError, match="no longer holds"):
            server.create_table("later", SCHEMA, topic=True, durable=True)
    finally:
        server.stop()


def _serve(root: str, tmp_path: Path, options: dict[str, str] | None, *prefix: str) -> Any:
    config = tmp_path / f"serve-{len(list(tmp_path.iterdir()))}.json"
    config.write_text(json.dumps({"storage_options": options or {}}))
    proc = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            *("-m", "pushtable", "serve", "--port", "0", "--data-dir", root),
            *("--config", str(config)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PUSHTABLE_LEASE_S": "2", "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    listening = proc.stdout.readline()
    assert "listening on" in listening, listening
    return proc, listening.split("listening on ")[1].split()[0]


def test_a_server_paused_past_its_term_lands_nothing_once_resumed(
    place: Place, tmp_path: Path
) -> None:
    """``pushtable serve`` A holds a batch pending when it is paused (SIGSTOP) past its
    lease's term; B takes the data dir and stores its own batch; A resumes (SIGCONT): A's
    producer hears ``DataDirInUseError`` (nothing acknowledged) and no offset holds both
    servers' batches. (On 72863b6 A landed its pending batch under B's offsets.)"""
    root = place.uri("paused")
    a, a_location = _serve(root, tmp_path, place.options)
    b = None
    try:
        with connect(a_location, timeout=WAIT) as client:
            client.create_topic("t", SCHEMA, durable=True, commit_interval=4.0)
            a_sink = client.sink("t")
            a_sink.write(rows(0, "a"), timeout=WAIT)
            wait_until(lambda: client.stats("t").get("pending_batches") == 1, "A to hold the batch")
            os.kill(a.pid, signal.SIGSTOP)
            try:
                started: list[Any] = []

                def takes_it() -> bool:
                    try:
                        started.append(_serve(root, tmp_path, place.options))
                    except AssertionError:  # refused: A's lease has not lapsed yet
                        return False
                    return True

                wait_until(takes_it, "A's lease to lapse")
                b, b_location = started[0]
                with connect(b_location, timeout=WAIT) as other:
                    b_sink = other.sink("t")
                    b_sink.write(rows(0, "b"), timeout=WAIT)
                    b_sink.flush(timeout=WAIT)
            finally:
                os.kill(a.pid, signal.SIGCONT)
            with pytest.raises(DataDirInUseError):
                a_sink.flush(timeout=WAIT)
        b.terminate()
        b.wait(WAIT)
        b = None
        found = writers_by_offset(place, place.uri("paused/t.lance"))
        assert found == {0: {"b"}}, found
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_a_holder_in_another_pid_namespace_is_waited_out(tmp_path: Path) -> None:
    """A server in another PID namespace on the same host (a container with host networking)
    holds the lease while it serves: a second server is refused naming it. Its pid
    (77777 inside) names no process here, which read as "dead here" and took it at once."""
    if not Path("/proc/self/ns/pid").exists():
        pytest.skip("no PID namespaces here")
    root = str(tmp_path / "dir")
    inner = (
        "echo 77776 > /proc/sys/kernel/ns_last_pid && "  # its child is 77777
        f"{sys.executable} -m pushtable serve --port 0 --data-dir {root}"
    )
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", inner],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        assert "listening on" in listening, listening
        assert not Path("/proc/77777").exists()  # the holder's pid names nothing here
        with pytest.raises(DataDirInUseError, match="is served by"):
            Server(data_dir=root)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT)


def _log(name: str, place: Place, uri: str, fence: Fence, **options: Any) -> DurableLog:
    """A durable log of ``uri`` owned under ``fence``, committing every 50 ms, no upkeep."""
    return DurableLog(
        name,
        SCHEMA,
        uri,
        lambda batch, at: None,
        commit_interval=0.05,
        upkeep_interval=None,
        storage_options=place.options,
        fence=fence,
        **options,
    )


def test_a_commit_stalled_past_the_successors_cleanup_never_lands(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old owner's commit stalls inside Lance (a paused process, a partition) while the
    successor opens the topic, stores the producer's retry and more, and its retention's
    cleanup removes every version after the old owner's read: Lance then rebased the stalled
    commit over the successor's and it landed, acknowledged, under the successor's offsets.
    The newest fence is tagged, so cleanup keeps it and Lance still refuses the commit; the
    old owner's flush raises ``DataDirInUseError`` and each offset holds one writer's rows."""
    import lance

    uri = place.uri("t.lance")
    real = lance.LanceDataset.commit
    stall, go = threading.Event(), threading.Event()

    def stalled(base: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
        mine = threading.current_thread().name.startswith("pushtable-commit-old")
        if mine and stall.is_set() and isinstance(operation, lance.Transaction):
            stall.clear()
            go.wait(WAIT)
        return real(base, operation, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(stalled))
    old = _log("old", place, uri, Fence(1))
    old.append(rows(0, "old"), producer="p", sequence=0)
    old.flush(timeout=WAIT)
    stall.set()
    old.append(rows(1, "old"), producer="p", sequence=1)
    wait_until(lambda: not stall.is_set(), "the old owner's commit to stall")
    # retention: a commit past it deletes the oldest fragments, then cleans up
    new = _log("new", place, uri, Fence(2), retention_bytes=6000)
    try:
        for k in range(1, 5):
            new.append(rows(k, "new"), producer="p", sequence=k)
            new.flush(timeout=WAIT)
        go.set()
        with pytest.raises(DataDirInUseError):
            old.flush(timeout=WAIT)
        new.append(rows(5, "new"), producer="p", sequence=5)
        new.flush(timeout=WAIT)
    finally:
        go.set()
        new.close(timeout=WAIT)
        old.abandon()
    found = writers_by_offset(place, uri)
    assert 5 in found, found
    assert all(len(who) == 1 for who in found.values()), found
    assert all(who == {"new"} for at, who in found.items() if at > 0), found


def test_a_fence_cut_short_after_it_reverted_a_commit_puts_it_back_at_the_next_open(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence's first ``Restore`` reverted a commit that slipped in before it, and the
    fence stopped before its next round (a store error; a crash): the commit was lost for
    good, as the next open returned "fenced already". The next open, of this owner or a
    later one, puts it back first."""
    import lance

    from pushtable.durable import fence as fence_room

    uri = place.uri("t.lance")
    old = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(1))
    old.append([StoredBatch(0, 0, rows(0, "old"))], Stamp(1, {"p": 0}, {}, 0))
    real_commit, real_open = lance.LanceDataset.commit, fence_room._open
    state = {"restores": 0}

    def slipping(base: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
        restore = isinstance(operation, lance.Transaction) and isinstance(
            operation.operation, lance.LanceOperation.Restore
        )
        if restore:
            state["restores"] += 1
            if state["restores"] == 1:  # the old owner's commit lands just before the fence
                old.append([StoredBatch(1, 0, rows(1, "old"))], Stamp(2, {"p": 1}, {}, 0))
        return real_commit(base, operation, *args, **kwargs)

    def failing_after_the_first(uri_: str, options: Any, version: int | None = None) -> Any:
        if version is not None and state["restores"] == 1:
            raise OSError("HTTP 503 Slow Down (injected between the fence's rounds)")
        return real_open(uri_, options, version)

    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(slipping))
    monkeypatch.setattr(fence_room, "_open", failing_after_the_first)
    with pytest.raises(OSError, match="injected"):
        LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(2))
    monkeypatch.undo()
    assert writers_by_offset(place, uri) == {0: {"old"}}  # reverted, for now
    again = LogStore(uri, SCHEMA, storage_options=place.options, fence=Fence(2))
    assert writers_by_offset(place, uri) == {0: {"old"}, 1: {"old"}}
    assert again.recover().next_offset == 2
    assert again.recover().producers == {"p": 1}


def test_commits_that_land_then_raise_are_stored_once_under_a_fence(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Lance commit (the fence's ``Restore`` and each group commit) lands and then
    raises, as a late fsync error or an object store's lost reply would: the topic still
    opens (its fence read back and adopted), each batch is acknowledged and stored once
    (a fenced commit that raised was committed again over its own landed version, storing
    it twice: CI's land-then-raise crash sweep, 10 of 10)."""
    import lance

    uri = place.uri("t.lance")
    real = lance.LanceDataset.commit
    raised = {"n": 0}

    def landing_then_raising(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raised["n"] += 1
        raise OSError(5, "Input/output error (injected after the call landed)")

    LogStore(uri, SCHEMA, storage_options=place.options)  # created unfenced, as on upgrade
    monkeypatch.setattr(lance.LanceDataset, "commit", staticmethod(landing_then_raising))
    log = _log("owner", place, uri, Fence(3))
    try:
        for k in range(4):
            log.append(rows(k, "owner"), producer="p", sequence=k)
            log.flush(timeout=WAIT)
    finally:
        log.close(timeout=WAIT)
    monkeypatch.undo()
    assert raised["n"] >= 5, raised  # the fence and four group commits each raised
    found = place.dataset(uri).to_table(columns=["_offset", "k"]).to_pylist()
    assert sorted((r["_offset"], r["k"]) for r in found) == [(k, k) for k in range(4)]
    assert epoch_of(place.dataset(uri)) == 3
