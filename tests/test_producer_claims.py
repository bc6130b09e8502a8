"""Every producer id is someone's: a Spark query's ids are the server's own, a sequence reused
with other rows is refused after a restart too, a replayed epoch must be the stored one, and
the ids bound to tokens are bounded and go with their producers.

Against a real in-process ``Server`` with a data dir (stopped and started again on it for a
restart), and the durable log itself on a local disk and moto's S3.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pushtable import PermissionDeniedError, SequenceError
from pushtable.durable import DurableLog
from pushtable.flight import Client, Grant, Server, connect, protocol
from pushtable.flight.server import ingest
from tests.conftest import WAIT, Place

SCHEMA = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        ("ts", pa.timestamp("us", tz="America/New_York")),
        ("d", pa.decimal128(18, 4)),
    ]
)
ADMIN, INGEST = "admin-s3cret", "ingest-s3cret"
TOKENS = {
    ADMIN: Grant("ops", roles={"admin"}),
    INGEST: Grant("other-team", roles={"write"}, tables=("events*",)),
}
QUERY = "q1"


def rows(*keys: int) -> pa.RecordBatch:
    """One row per key (a null ``d`` for odd keys)."""
    return pa.record_batch(
        [
            pa.array(keys, pa.int64()),
            pa.array([k * 1_000_000 for k in keys], SCHEMA.field("ts").type),
            pa.array([None if k % 2 else k for k in keys], SCHEMA.field("d").type),
        ],
        SCHEMA,
    )


def as_(server: Server, token: str) -> Client:
    return connect(server.location, token=token, timeout=WAIT)


def stored(client: Client) -> list[int]:
    end = client.offsets("events")["committed"]
    return sorted(client.read("events", 0, end).read_all()["k"].to_pylist())


def publish(client: Client, epoch: int, shares: list[list[int]]) -> bool:
    """Stage each share of keys as partition p, attempt 0, then publish the epoch."""
    for p, keys in enumerate(shares):
        client.stage("events", QUERY, epoch, p, 0, [rows(*keys)], SCHEMA)
    parts = [(p, 0, len(keys)) for p, keys in enumerate(shares)]
    return client.publish("events", QUERY, epoch, parts, timeout=WAIT)


def test_a_stream_under_a_spark_querys_id_is_refused_and_its_epochs_are_stored_whole(
    tmp_path: Path,
) -> None:
    """Another team's token wrote under ``spark:q1`` before the query published: the query's
    next epoch lost its first batches while ``publish`` answered True (stored
    ``[(-1,'other-team'), (-2,'other-team'), (102,'spark')]``). The id is the server's own:
    the stream is refused by name, and every epoch is stored whole."""
    server = Server(data_dir=tmp_path / "data", tokens=TOKENS)
    try:
        with as_(server, ADMIN) as admin:
            admin.create_topic("events", SCHEMA, durable=True)
        with as_(server, INGEST) as other:
            for producer_id in (f"spark:{QUERY}", "spark:"):
                sink = other.sink("events", producer_id=producer_id)
                with pytest.raises(PermissionDeniedError, match=r"reserved for Spark"):
                    sink.write(rows(-1, -2), timeout=WAIT)
                    sink.flush(timeout=WAIT)
        with as_(server, ADMIN) as admin:
            assert publish(admin, 0, [[100], [101, 102]])
            assert publish(admin, 1, [[103]])
            assert stored(admin) == [100, 101, 102, 103]
            assert admin.published("events", QUERY) == 1
    finally:
        server.stop()


def test_a_replayed_epoch_with_other_rows_is_refused_after_a_restart(tmp_path: Path) -> None:
    """A replay of the newest stored epoch was skipped whatever it held. Its rows are counted
    against the stored epoch's (kept in the commit, so a restart keeps it too): other rows
    are refused by name, the same rows split otherwise answer "published already"."""
    server = Server(data_dir=tmp_path / "data")
    try:
        with as_(server, ADMIN) as client:
            client.create_topic("events", SCHEMA, durable=True)
            assert publish(client, 0, [[0, 1], [2]])
    finally:
        server.stop()
    server = Server(data_dir=tmp_path / "data")
    try:
        with as_(server, ADMIN) as client:
            with pytest.raises(SequenceError, match=r"replayed with 2 rows, but 3 are stored"):
                publish(client, 0, [[0], [1]])
            assert not publish(client, 0, [[0], [1], [2]])  # the same rows, split otherwise
            assert publish(client, 1, [[3]])
            assert stored(client) == [0, 1, 2, 3]
    finally:
        server.stop()


def _log(place: Place, uri: str) -> DurableLog:
    return DurableLog(
        "t",
        SCHEMA,
        uri,
        lambda batch, at: None,
        commit_interval=0.05,
        upkeep_interval=None,
        storage_options=place.options,
    )


def test_a_reused_sequence_with_other_rows_is_refused_after_a_restart(place: Place) -> None:
    """Two producers misconfigured with one id: before a restart the second's batch under a
    stored sequence is refused (its fingerprint differs); after one it was acknowledged and
    dropped, as the fingerprints lived in memory only. The newest are stored with each
    commit: refused after a restart too, and a true resend is still acknowledged."""
    uri = place.uri("t.lance")
    first = _log(place, uri)
    for k in range(4):
        first.append(rows(k), producer="p", sequence=k)
    first.flush(timeout=WAIT)
    with pytest.raises(SequenceError, match="other rows"):
        first.append(rows(99), producer="p", sequence=2)
    first.close(timeout=WAIT)
    again = _log(place, uri)
    try:
        for sequence in (3, 2):
            with pytest.raises(SequenceError, match="other rows"):
                again.append(rows(99), producer="p", sequence=sequence)
        assert again.append(rows(3), producer="p", sequence=3) == -1  # a resend: stored
        again.append(rows(4), producer="p", sequence=4)
        again.flush(timeout=WAIT)
    finally:
        again.close(timeout=WAIT)
    got = place.dataset(uri).to_table(columns=["_offset", "k"]).to_pylist()
    assert sorted((r["_offset"], r["k"]) for r in got) == [(k, k) for k in range(5)]


def test_producer_bindings_are_bounded_and_go_with_their_producers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 empty streams under new ids left 3,000 bindings (the topic keeps none of those
    producers). Past the bound, the bindings of producers the topic does not know and no
    stream holds go; those of producers it stores stay and keep refusing other tokens."""
    monkeypatch.setattr(ingest, "MAX_PRODUCERS", 4)
    server = Server(data_dir=tmp_path / "data", tokens=TOKENS)
    try:
        with as_(server, ADMIN) as admin:
            admin.create_topic("events", SCHEMA, durable=True)
            kept = admin.sink("events", producer_id="kept")
            kept.write(rows(1), timeout=WAIT)
            kept.flush(timeout=WAIT)
        raw = flight.connect(server.location)
        options = flight.FlightCallOptions(
            headers=[(b"authorization", f"Bearer {INGEST}".encode())]
        )
        for i in range(40):  # each opens, sends no batch, ends
            path = ["events", protocol.PRODUCER, f"empty-{i}", "0"]
            writer, _ = raw.do_put(flight.FlightDescriptor.for_path(*path), SCHEMA, options)
            writer.close()
        raw.close()
        assert server._ingest.bindings("events") <= 4 + 1, server._ingest.bindings("events")
        with as_(server, INGEST) as other:
            thief = other.sink("events", producer_id="kept")
            with pytest.raises(PermissionDeniedError, match=r"belongs to token 'ops'"):
                thief.write(rows(2), timeout=WAIT)
                thief.flush(timeout=WAIT)
    finally:
        server.stop()


def test_a_unit_is_never_stored_in_part_over_another_writers_sequence(place: Place) -> None:
    """A unit's batches are stored whole or not at all, so a replay finds all of its
    sequences stored or none. A sequence stored inside a unit's range (another writer's, as
    the other team's batches under Spark's id were) made its first batches skip silently: the
    unit is refused by name, and nothing of it is appended."""
    from pushtable.durable.log import epoch_sequence

    uri = place.uri("t.lance")
    log = _log(place, uri)
    try:
        for i in range(2):  # an idempotent producer's sequences 0 and 1 under the id
            log.append(rows(-1 - i), producer="spark:q", sequence=epoch_sequence(0, i, last=False))
        sequences = [epoch_sequence(0, i, last=i == 2) for i in range(3)]
        with pytest.raises(SequenceError, match="falls inside the unit"):
            log.append_unit(
                [rows(100), rows(101), rows(102)], sequences, "spark:q", 0.1, lambda: True
            )
        log.flush(timeout=WAIT)
        assert log.offsets()["next"] == 2
    finally:
        log.close(timeout=WAIT)
