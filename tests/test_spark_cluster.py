"""Spark on a real standalone cluster, pushtable serve on an object store.

A master and two workers from pyspark's own ``bin/spark-class`` (executors in JVMs of their
own, Python workers in their own processes), moto's S3 server, and a ``pushtable serve``
process whose data dir is an S3 prefix. A driver in a child process (``tests/cluster_job.py``):
the worker check asks the executors (a worker Python that cannot import pushtable is named,
not patched over with the driver's), ``format("pushtable")`` writes micro-batches with zoned
timestamps and decimals into a durable topic on the store, and the source reads them back on
the executors straight from the topic's dataset on the store (``dataset`` and
``storage_options``) and through the server. Both ``foreachBatch`` bridges run on the same
micro-batches with ``executor_writes``/``push="executors"``: Lance on the store, the server's
durable topic and an in-process live table each hold every row once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from tests.conftest import ObjectStore, wait_until
from tests.spark_cluster import standalone_cluster

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]

EPOCHS, ROWS = 4, 50


def write_epochs(src: Path, epochs: int = EPOCHS) -> list[list[object]]:
    """One JSON file a micro-batch; the rows as ``[id, level, ts ISO (UTC), amount]``."""
    src.mkdir()
    expected: list[list[object]] = []
    for e in range(epochs):
        path = src / f"part-{e:04d}.json"
        with path.open("w") as f:
            for r in range(ROWS):
                i = e * ROWS + r
                ts = datetime(2026, 11, 27, 12, 0, i % 60, tzinfo=timezone.utc)
                amount = Decimal(i) / 8
                f.write(
                    json.dumps(
                        {"id": i, "level": "ab"[i % 2], "ts": ts.isoformat(), "amount": str(amount)}
                    )
                    + "\n"
                )
                expected.append([i, "ab"[i % 2], ts.isoformat(), f"{amount:.4f}"])
        stamp = 1_700_000_000 + e * 10  # epochs follow file order
        os.utime(path, (stamp, stamp))
    return expected


def test_the_sink_and_the_source_on_a_standalone_cluster_with_topics_on_s3(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    from tests.test_object_store import serve

    expected = write_epochs(tmp_path / "src")
    workdir = tmp_path / "server"
    workdir.mkdir()
    with (
        serve(object_store, "cluster", workdir) as (_proc, location, _line),
        standalone_cluster(tmp_path / "cluster") as cluster,
    ):
        from pushtable.flight import connect

        schema = pa.schema(
            [
                ("id", pa.int64()),
                ("level", pa.string()),
                ("ts", pa.timestamp("us", tz="UTC")),
                ("amount", pa.decimal128(18, 4)),
            ]
        )
        with connect(location) as client:
            client.create_topic("ticks", schema, durable=True)
            client.create_topic("bridged", schema, durable=True)
        settings = {
            "master": cluster.url,
            "server": location,
            "dataset": f"s3://{object_store.bucket}/cluster/ticks.lance",
            "storage_options": object_store.options,
            "lance": f"s3://{object_store.bucket}/cluster/lance",
            "src": str(tmp_path / "src"),
            "checkpoints": str(tmp_path / "checkpoints"),
        }
        path = tmp_path / "job.json"
        path.write_text(json.dumps(settings))
        done = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "cluster_job.py"), str(path)],
            capture_output=True,
            text=True,
            timeout=800,
            cwd=tmp_path,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"the driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
        result = json.loads(lines[0].removeprefix("RESULT "))
        with connect(location) as client:
            stored = client.read("ticks", 0, client.offsets("ticks")["next"]).read_all()
            bridged = client.read("bridged", 0, client.offsets("bridged")["next"]).read_all()
            published = client.published("bridged", "cluster-remote")
    assert result["executors"] == 2
    assert result["driver_pid"] not in result["worker_pids"]  # Python ran on the executors
    assert result["bad_worker_python"] is not None
    assert "cannot import pushtable" in result["bad_worker_python"]
    assert "/usr/bin/python3" in result["bad_worker_python"]
    assert result["sink_error"] is None, result["sink_error"]
    assert sorted(stored["id"].to_pylist()) == list(range(EPOCHS * ROWS))  # each row once
    for via in ("dataset", "server"):
        assert result[f"source_{via}_error"] is None, result[f"source_{via}_error"]
        assert result[f"read_back_{via}"] == expected, via
    # Both bridges: every row once in Lance on the store, in the server's topic, live.
    assert result["remote_bridge_error"] is None, result["remote_bridge_error"]
    assert result["local_bridge_error"] is None, result["local_bridge_error"]
    assert rows(bridged) == expected
    assert published == EPOCHS - 1
    for name in ("remote", "local"):
        uri = f"{settings['lance']}/{name}.lance"
        assert rows(lance.dataset(uri, storage_options=object_store.options).to_table()) == expected
    assert result["live"] == expected


def rows(table: pa.Table) -> list[list[object]]:
    """``[id, level, ts ISO (UTC), amount]`` sorted, as :func:`write_epochs` gives them."""
    return sorted(
        [r["id"], r["level"], r["ts"].astimezone(timezone.utc).isoformat(), str(r["amount"])]
        for r in table.select(["id", "level", "ts", "amount"]).to_pylist()
    )


def launch(settings: dict[str, object], folder: Path) -> subprocess.Popen[str]:
    """The sink-only driver of ``tests/cluster_job.py`` in a session of its own (killable with
    its JVM); returns once its session is up (it printed ``STARTED``)."""
    path = folder / "job.json"
    path.write_text(json.dumps({**settings, "mode": "sink"}))
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "cluster_job.py"), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=folder,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("STARTED"):
            return proc
    raise AssertionError(f"the driver did not start ({proc.wait()})")


def finished(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the driver failed ({proc.returncode}):\n{out[-4000:]}"
    return dict(json.loads(lines[0].removeprefix("RESULT ")))


def test_an_executor_and_the_driver_killed_mid_stream_store_every_row_once(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    """On the cluster, with the server's data dir on S3: an executor JVM SIGKILLed while the
    sink runs (Spark retries its tasks elsewhere), then the driver SIGKILLed (its session
    and JVM with it) and started again on its checkpoint: every row in the topic once."""
    from pushtable.flight import connect
    from tests.test_object_store import serve

    many = 12  # micro-batches a run: a kill lands while the stream goes on
    first = write_epochs(tmp_path / "src", many)  # ids 0..599
    second_src = tmp_path / "src2"
    second_src.mkdir()
    for e in range(many):  # ids 600..1199, in a second input
        lines = []
        for r in range(ROWS):
            i = (many + e) * ROWS + r
            ts = datetime(2026, 11, 27, 13, 0, i % 60, tzinfo=timezone.utc).isoformat()
            lines.append(json.dumps({"id": i, "level": "ab"[i % 2], "ts": ts, "amount": "1.5"}))
        path = second_src / f"part-{e:04d}.json"
        path.write_text("\n".join(lines) + "\n")
        os.utime(path, (1_700_000_000 + e * 10, 1_700_000_000 + e * 10))
    workdir = tmp_path / "server"
    workdir.mkdir()
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("level", pa.string()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("amount", pa.decimal128(18, 4)),
        ]
    )
    with (
        serve(object_store, "kills", workdir) as (_proc, location, _line),
        standalone_cluster(tmp_path / "cluster") as cluster,
        connect(location) as client,
    ):
        client.create_topic("ticks", schema, durable=True)
        settings: dict[str, object] = {
            "master": cluster.url,
            "server": location,
            "storage_options": object_store.options,
        }

        def stored() -> int:
            time.sleep(0.05)  # polled by wait_until: a call every 50 ms is plenty
            return int(client.offsets("ticks")["committed"])

        def rows() -> int:
            return int(client.read("ticks", 0, stored()).read_all().num_rows)

        # An executor killed once the sink has stored something.
        job = launch(
            {**settings, "src": str(tmp_path / "src"), "checkpoint": str(tmp_path / "c1")}, tmp_path
        )
        wait_until(lambda: stored() > 0, "the sink's first stored batch", timeout=300)
        executors = cluster.executors()
        assert executors, "no executor JVM found"
        assert rows() < many * ROWS, "the stream had ended"
        os.kill(executors[0], signal.SIGKILL)
        assert finished(job)["sink_error"] is None
        # The driver killed (its process group: the Python driver and its JVM), then again.
        checkpoint = str(tmp_path / "c2")
        job = launch({**settings, "src": str(second_src), "checkpoint": checkpoint}, tmp_path)
        before = stored()
        wait_until(lambda: stored() > before, "the second sink's first stored batch", timeout=300)
        assert rows() < 2 * many * ROWS, "the stream had ended"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(60)
        job = launch({**settings, "src": str(second_src), "checkpoint": checkpoint}, tmp_path)
        assert finished(job)["sink_error"] is None
        ids = client.read("ticks", 0, client.offsets("ticks")["next"]).read_all()["id"].to_pylist()
    assert sorted(ids) == list(range(2 * many * ROWS))  # every row once, across both kills
    assert len(first) == many * ROWS
