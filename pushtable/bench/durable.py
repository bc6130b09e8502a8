"""Durable topics: what storing every batch in Lance costs against a topic in memory.

- ``ingest``: batches of ``k int64, v float64, s string`` (16 distinct batches cycled) into a
  topic with one live ``count/sum`` query, in memory vs durable (``persist=``), timed from
  the first write to the query's answer after ``close`` (which, durable, returns once the
  last commit holds everything); and over Flight, an idempotent producer into a memory vs a
  durable topic on ``pushtable serve``, timed to the last acknowledgement. Alternating runs,
  fsync on (the default). Beside them, the goal's yardstick: Lance's own
  ``write_fragments`` + commit of the same batches in one process, fsync'd the same way.
- ``ack``: per-batch acknowledgement latency of a durable topic written at a steady rate
  (append -> the commit that holds it), and a producer's ``flush()`` over Flight, with fsync
  on and off.
- ``memwal``: Lance's own write-ahead log (``mem_wal_writer``, fsync'd) measured as an
  acknowledgement path: a ``put``'s latency at the same rate, and its ingest rate.
- ``restart``: reopening a topic of 10 M rows (its schema, next offset and producers).
- ``retention``: a steady run with retention by bytes and upkeep (compaction + cleanup):
  disk use sampled over the run (flat once retention and cleanup keep pace), the dataset's
  versions and fragments at the end, and the worst acknowledgement meanwhile.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from pushtable import SessionContext, Topic
from pushtable.bench.lance_flight import append_synced, put_timed
from pushtable.durable.store import STORAGE_VERSION

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64()), ("s", pa.string())])


def batches(rows: int, distinct: int = 16) -> list[pa.RecordBatch]:
    """``distinct`` batches of ``rows`` rows: row numbers ``k``, random ``v``, 64 strings ``s``."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(distinct):
        k = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        words = np.array([f"event-{j:012d}" for j in rng.integers(0, 1 << 30, 64)])
        out.append(
            pa.record_batch(
                [pa.array(k), pa.array(rng.random(rows)), pa.array(words[k % 64])], schema=SCHEMA
            )
        )
    return out


def _local(durable: bool, data: list[pa.RecordBatch], count: int, where: Path) -> float:
    persist = where / f"t{time.monotonic_ns()}.lance" if durable else None
    topic = Topic("t", SCHEMA, persist=persist)
    ctx = SessionContext()
    topic.subscribe(ctx, "live", capacity=64)
    result: list[Any] = []
    reader = threading.Thread(
        target=lambda: result.append(ctx.sql("SELECT count(*), sum(v) FROM live").to_pydict())
    )
    reader.start()
    started = time.perf_counter()
    for i in range(count):
        topic.write(data[i % len(data)])
    topic.close()
    reader.join()
    elapsed = time.perf_counter() - started
    # A subscription answers an aggregate with changes: the last one is the total.
    assert next(iter(result[0].values()))[-1] == count * data[0].num_rows
    return elapsed


def _remote(durable: bool, data: list[pa.RecordBatch], count: int, where: Path) -> float:
    """One producer over Flight into ``pushtable serve``, timed to the last acknowledgement.

    The server runs in a process of its own, as a deployment runs it: client and server do
    not share an interpreter.
    """
    from pushtable.bench.flight import server_process
    from pushtable.flight import connect

    data_dir = str(where / f"d{time.monotonic_ns()}")
    with server_process("pushtable", "serve", "--port", "0", "--data-dir", data_dir) as uri:
        client = connect(uri)
        client.create_topic("t", SCHEMA, durable=durable)
        sink = client.sink("t", producer_id="bench") if durable else client.sink("t")
        started = time.perf_counter()
        for i in range(count):
            sink.write(data[i % len(data)])
        sink.flush()
        elapsed = time.perf_counter() - started
        client.close()
        return elapsed


def _peer(
    data: list[pa.RecordBatch], count: int, where: Path, storage_version: str | None = None
) -> float:
    """The hand-rolled server (:mod:`pushtable.bench.lance_flight`) in its own process.

    One DoPut of the same batches through pyarrow's own client, timed to the last
    acknowledgement.
    """
    from pushtable.bench.flight import server_process

    root = str(where / f"p{time.monotonic_ns()}")
    version = () if storage_version is None else ("--storage-version", storage_version)
    with server_process("pushtable.bench.lance_flight", "--dir", root, *version) as uri:
        return put_timed(uri, SCHEMA, [data[i % len(data)] for i in range(count)])


def _lance(data: list[pa.RecordBatch], count: int, where: Path, stored: bool = False) -> float:
    """Lance's own write of the same batches in one process.

    ``write_fragments`` of all of them, then one commit, each fsync'd as a durable topic's
    commit is, in a dataset of the Lance file version a topic's has (``STORAGE_VERSION``).
    With ``stored``, the batches carry the two columns a topic stores with each row
    (``_offset``, ``_timestamp``), made before the clock starts: the table as stored.
    """
    uri = str(where / f"l{time.monotonic_ns()}.lance")
    given = [data[i % len(data)] for i in range(count)]
    schema = SCHEMA
    if stored:
        schema = SCHEMA.append(pa.field("_offset", pa.int64(), False)).append(
            pa.field("_timestamp", pa.timestamp("us", tz="UTC"), False)
        )
        now = time.time_ns() // 1000
        given = [
            pa.record_batch(
                [
                    *b.columns,
                    pa.array(np.full(b.num_rows, i, np.int64)),
                    pa.array(np.full(b.num_rows, now + i, np.int64), schema.field(-1).type),
                ],
                schema=schema,
            )
            for i, b in enumerate(given)
        ]
    ds = lance.write_dataset(schema.empty_table(), uri, data_storage_version=STORAGE_VERSION)
    started = time.perf_counter()
    append_synced(ds, uri, pa.RecordBatchReader.from_batches(schema, iter(given)))
    return time.perf_counter() - started


def ingest(quick: bool, where: Path) -> list[dict[str, Any]]:
    """Ingest rates of memory and durable topics, in process and over Flight, and yardsticks.

    In process: Lance's own write of the table as stored; over Flight: the hand-rolled Flight
    server appending to Lance. Every side alternates within a round.
    """
    rounds = 2 if quick else 3
    out: list[dict[str, Any]] = []
    for rows in (8_192, 65_536):
        data = batches(rows)
        count = max(16, (4_000_000 if quick else 20_000_000) // rows)
        local: dict[str, list[float]] = {"memory": [], "durable": [], "lance": [], "stored": []}
        remote: dict[str, list[float]] = {"memory": [], "durable": [], "peer": [], "peer21": []}
        for _ in range(rounds):
            local["memory"].append(_local(False, data, count, where))
            local["durable"].append(_local(True, data, count, where))
            local["lance"].append(_lance(data, count, where))
            local["stored"].append(_lance(data, count, where, stored=True))
            remote["memory"].append(_remote(False, data, count, where))
            remote["durable"].append(_remote(True, data, count, where))
            remote["peer"].append(_peer(data, count, where))
            remote["peer21"].append(_peer(data, count, where, STORAGE_VERSION))

        def rate(times: list[float], total: int = count * rows) -> float:
            return total / statistics.median(times) / 1e6

        lance_rate, stored_rate = rate(local["lance"]), rate(local["stored"])
        out.append(
            {
                "path": "in-process",
                "batch_rows": rows,
                "batches": count,
                "memory_m_rows_s": rate(local["memory"]),
                "durable_m_rows_s": rate(local["durable"]),
                "ratio": rate(local["durable"]) / rate(local["memory"]),
                "lance_m_rows_s": lance_rate,
                "lance_stored_m_rows_s": stored_rate,
                "columns_cost": 1 - stored_rate / lance_rate,
                "yardstick_m_rows_s": stored_rate,
                "vs_yardstick": rate(local["durable"]) / stored_rate,
                "goal": 0.8,
            }
        )
        out.append(
            {
                "path": "flight",
                "batch_rows": rows,
                "batches": count,
                "memory_m_rows_s": rate(remote["memory"]),
                "durable_m_rows_s": rate(remote["durable"]),
                "ratio": rate(remote["durable"]) / rate(remote["memory"]),
                "peer_m_rows_s": rate(remote["peer"]),
                "peer_same_format_m_rows_s": rate(remote["peer21"]),
                "vs_peer_same_format": rate(remote["durable"]) / rate(remote["peer21"]),
                "yardstick_m_rows_s": rate(remote["peer"]),
                "vs_yardstick": rate(remote["durable"]) / rate(remote["peer"]),
                "goal": 1.0,
            }
        )
    return out


def ack(quick: bool, where: Path) -> dict[str, Any]:
    """Append -> commit latency at a steady rate and a remote flush's, fsync on and off."""
    return {
        "fsync": _ack(quick, where / "on", fsync=True),
        "no_fsync": _ack(quick, where / "off", fsync=False),
    }


def _ack(quick: bool, where: Path, fsync: bool) -> dict[str, Any]:
    data = batches(8_192)
    topic = Topic("t", SCHEMA, persist=where / "ack.lance", fsync=fsync)
    log = topic.durable
    assert log is not None
    appended: dict[int, float] = {}
    latencies: list[float] = []
    lock = threading.Lock()

    def on_commit(committed: int, failure: BaseException | None) -> None:
        now = time.perf_counter()
        with lock:
            for offset in [o for o in appended if o < committed]:
                latencies.append(now - appended.pop(offset))

    log.listen(on_commit)
    rate = 200.0
    count = 400 if quick else 2_000
    start = time.perf_counter()
    for i in range(count):
        target = start + i / rate
        while (now := time.perf_counter()) < target:
            time.sleep(min(0.002, target - now))
        with lock:  # the offset is known before the append returns: take it under the lock
            offset = log.append(data[i % len(data)])
            appended[offset] = now
    topic.flush()
    topic.close()
    flushes = _remote_flushes(50 if quick else 300, where, fsync)
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "rate_batches_s": rate,
        "batch_rows": 8_192,
        "commit_interval_ms": log.commit_interval * 1e3,
        "samples": len(ms),
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[int(len(ms) * 0.99)],
        "max_ms": ms[-1],
        "flush_p50_ms": flushes[len(flushes) // 2],
        "flush_p99_ms": flushes[int(len(flushes) * 0.99)],
        "flush_samples": len(flushes),
    }


def _remote_flushes(count: int, where: Path, fsync: bool) -> list[float]:
    from pushtable.flight import Server, connect

    data = batches(8_192)
    server = Server(data_dir=where / "flush", fsync=fsync)
    try:
        client = connect(server.location)
        client.create_topic("t", SCHEMA, durable=True)
        sink = client.sink("t", producer_id="p")
        out = []
        for i in range(count):
            started = time.perf_counter()
            sink.write(data[i % len(data)])
            sink.flush()
            out.append((time.perf_counter() - started) * 1e3)
            time.sleep(0.01)
        client.close()
        return sorted(out)
    finally:
        server.stop()


def memwal(quick: bool, where: Path) -> dict[str, Any]:
    """Lance's MemWAL as an acknowledgement path: put latency and ingest rate.

    One unsharded writer, ``durable_write``: a ``put`` returns once its WAL flush is fsync'd.
    Put latency at 200 batches/s of 8,192 rows with a 1 ms and a 10 ms flush interval, and
    the ingest rate of 65,536-row batches.
    """
    import uuid

    def writer(flush_ms: int) -> Any:
        uri = str(where / f"wal{time.monotonic_ns()}.lance")
        lance.write_dataset(SCHEMA.empty_table(), uri)
        ds = lance.dataset(uri)
        ds.initialize_mem_wal(
            unsharded=True, durable_write=True, max_wal_flush_interval_ms=flush_ms
        )
        return lance.dataset(uri).mem_wal_writer(
            str(uuid.uuid4()), durable_write=True, max_wal_flush_interval_ms=flush_ms
        )

    out: dict[str, Any] = {}
    small = batches(8_192)
    count = 400 if quick else 2_000
    for flush_ms in (1, 10):
        w = writer(flush_ms)
        ms = []
        start = time.perf_counter()
        for i in range(count):
            target = start + i / 200.0
            while (now := time.perf_counter()) < target:
                time.sleep(min(0.002, target - now))
            w.put(small[i % len(small)])
            ms.append((time.perf_counter() - now) * 1e3)
        w.close()
        ms.sort()
        out[f"put_{flush_ms}ms"] = {
            "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[int(len(ms) * 0.99)],
            "samples": len(ms),
        }
    big = batches(65_536)
    total = max(16, (4_000_000 if quick else 20_000_000) // 65_536)
    w = writer(10)
    started = time.perf_counter()
    for i in range(total):
        w.put(big[i % len(big)])
    w.close()
    out["ingest_m_rows_s"] = total * 65_536 / (time.perf_counter() - started) / 1e6
    return out


def restart(quick: bool, where: Path) -> dict[str, Any]:
    """Reopen a topic of 10 M rows (1 M with --quick), as a restarted server does."""
    from pushtable.flight import Server

    rows = 1_000_000 if quick else 10_000_000
    data = batches(65_536)
    path = where / "restart" / "big.lance"
    path.parent.mkdir()
    topic = Topic("big", SCHEMA, persist=path, commit_interval=0.05, upkeep_interval=None)
    for i in range(rows // 65_536 + 1):
        topic.write(data[i % len(data)])
    topic.close()
    stored = lance.dataset(str(path)).count_rows()
    started = time.perf_counter()
    again = Topic.reopen(path, upkeep_interval=None)
    reopen = time.perf_counter() - started
    again.close()
    started = time.perf_counter()
    server = Server(data_dir=path.parent)
    server_start = time.perf_counter() - started
    server.stop()
    return {
        "rows": stored,
        "reopen_ms": reopen * 1e3,
        "server_start_ms": server_start * 1e3,
        "versions": len(lance.dataset(str(path)).versions()),
    }


def retention(quick: bool, where: Path) -> dict[str, Any]:
    """Steady ingest into a topic with ``retention_bytes``: does its disk use stay flat?

    10 minutes (60 s with --quick), 8,192-row batches at 100/s, upkeep (compaction and the
    cleanup of versions older than ``keep_versions``, left at its default of 10 minutes) every
    60 s (10 s). Sampled every second: the data dir's bytes on disk and the live history (the
    current version's fragments). Flat means the disk never passes the bound by more than a
    compaction's copy and the few manifests left; the history stays within one commit of it.
    """
    seconds, every = (60.0, 10.0) if quick else (600.0, 60.0)
    keep = 256 * 2**20
    data = batches(8_192)
    path = where / "retention.lance"
    topic = Topic("t", SCHEMA, persist=path, upkeep_interval=every, retention_bytes=keep)
    log = topic.durable
    assert log is not None
    appended: dict[int, float] = {}
    worst = 0.0
    lock = threading.Lock()

    def on_commit(committed: int, failure: BaseException | None) -> None:
        nonlocal worst
        now = time.perf_counter()
        with lock:
            for offset in [o for o in appended if o < committed]:
                worst = max(worst, now - appended.pop(offset))

    log.listen(on_commit)
    samples: list[tuple[float, int, int]] = []
    start = time.perf_counter()
    i = 0
    while (now := time.perf_counter()) - start < seconds:
        if not samples or now - start - samples[-1][0] >= 1.0:
            samples.append((now - start, log.store.disk_bytes(), _history_bytes(path)))
        target = start + i / 100.0
        if now < target:
            time.sleep(min(0.005, target - now))
            continue
        with lock:
            appended[log.append(data[i % len(data)])] = now
        i += 1
    commits = log.commits
    topic.close()
    ds = lance.dataset(str(path))
    disk = [b for _, b, _ in samples]
    history = [h for _, _, h in samples]
    half = [b for t, b, _ in samples if t >= seconds / 2]
    first = [b for t, b, _ in samples if t < seconds / 2]
    return {
        "seconds": seconds,
        "upkeep_every_s": every,
        "retention_bytes": keep,
        "batches": i,
        "commits": commits,
        "commit_mb": i * data[0].nbytes / max(commits, 1) / 1e6,
        "expirations": log.expirations,
        "earliest": log.offsets()["earliest"],
        "versions_kept": len(ds.versions()),
        "fragments": len(ds.get_fragments()),
        "disk_mb_max": max(disk) / 1e6,
        "history_mb_max": max(history) / 1e6,
        "disk_mb_first_half": [min(first) / 1e6, max(first) / 1e6],
        "disk_mb_second_half": [min(half) / 1e6, max(half) / 1e6],
        "disk_mb_samples": [round(b / 1e6, 1) for b in disk],
        "history_mb_samples": [round(h / 1e6, 1) for h in history],
        "worst_ack_ms": worst * 1e3,
    }


def _history_bytes(path: Path) -> int:
    """Bytes of the current version's fragments: the history a reader can read."""
    ds = lance.dataset(str(path))
    return sum(f.file_size_bytes or 0 for fr in ds.get_fragments() for f in fr.metadata.files)


def run(quick: bool) -> dict[str, Any]:
    """Every part of the durable suite, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="pushtable-durable-") as tmp:
        where = Path(tmp)
        return {
            "ingest": ingest(quick, where),
            "ack": ack(quick, where),
            "memwal": memwal(quick, where),
            "restart": restart(quick, where),
            "retention": retention(quick, where),
            "lance": lance.__version__,
        }


def table(result: dict[str, Any]) -> str:
    """The durable suite's results as text."""
    lines = [
        "durable topics (fsync on) vs memory topics and the yardsticks (M rows/s): in process, "
        "Lance's own write of the table as stored (with _offset, _timestamp); over Flight, a "
        "hand-rolled pyarrow Flight server appending to Lance"
    ]
    lines.append(
        f"{'path':<11} {'rows/batch':>10} {'memory':>8} {'durable':>8} {'ratio':>6} "
        f"{'yardstick':>9} {'vs it':>6} {'goal':>5}"
    )
    for r in result["ingest"]:
        lines.append(
            f"{r['path']:<11} {r['batch_rows']:>10,} {r['memory_m_rows_s']:>8.1f} "
            f"{r['durable_m_rows_s']:>8.1f} {r['ratio']:>5.2f}x {r['yardstick_m_rows_s']:>9.1f} "
            f"{r['vs_yardstick']:>5.2f}x {r['goal']:>4.1f}x"
        )
        if r["path"] == "in-process":
            lines.append(
                f"{'':<11} Lance without the two columns {r['lance_m_rows_s']:.1f} M rows/s: "
                f"they cost {r['columns_cost']:.0%} of its rate"
            )
        else:
            lines.append(
                f"{'':<11} the peer with a topic's Lance file version ({STORAGE_VERSION}): "
                f"{r['peer_same_format_m_rows_s']:.1f} M rows/s ({r['vs_peer_same_format']:.2f}x)"
            )
    for mode, a in result["ack"].items():
        lines.append(
            f"ack latency ({mode}) at {a['rate_batches_s']:.0f} batches/s (commit interval "
            f"{a['commit_interval_ms']:.0f} ms): p50 {a['p50_ms']:.1f} ms, p99 "
            f"{a['p99_ms']:.1f} ms, max {a['max_ms']:.1f} ms over {a['samples']}; remote flush "
            f"p50 {a['flush_p50_ms']:.1f} ms, p99 {a['flush_p99_ms']:.1f} ms"
        )
    m = result["memwal"]
    lines.append(
        "Lance MemWAL put (fsync'd) at 200 batches/s: "
        + ", ".join(
            f"flush {k.split('_')[1]}: p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms"
            for k, v in m.items()
            if k.startswith("put_")
        )
        + f"; ingest {m['ingest_m_rows_s']:.1f} M rows/s"
    )
    r = result["restart"]
    lines.append(
        f"restart: reopen a topic of {r['rows']:,} rows in {r['reopen_ms']:.1f} ms; a server "
        f"on its data dir starts in {r['server_start_ms']:.1f} ms"
    )
    u = result["retention"]
    lo1, hi1 = u["disk_mb_first_half"]
    lo2, hi2 = u["disk_mb_second_half"]
    lines.append(
        f"retention: {u['seconds']:.0f} s at 100 batches/s, retention_bytes "
        f"{u['retention_bytes'] / 1e6:.0f} MB: disk {lo1:.0f}-{hi1:.0f} MB in the first half, "
        f"{lo2:.0f}-{hi2:.0f} MB in the second (max {u['disk_mb_max']:.0f} MB), history max "
        f"{u['history_mb_max']:.0f} MB (a commit is {u['commit_mb']:.1f} MB); "
        f"{u['commits']} commits, {u['expirations']} deletions (earliest offset "
        f"{u['earliest']:,}), {u['versions_kept']} versions, {u['fragments']} fragments; "
        f"worst ack {u['worst_ack_ms']:.0f} ms"
    )
    return "\n".join(lines)
