"""A real Spark standalone cluster on loopback: a master and workers from pyspark's own
``bin/spark-class`` (executors in JVMs of their own, Python workers in their processes).

Started in new sessions, stopped by process group (workers first), logs kept aside.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

#: seconds the master and each worker get to start (measured: ~8 s and ~5 s on 2 cores)
START_WAIT = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{what} did not start ({text!r} not in its log):\n{tail}")


@dataclass(frozen=True)
class Cluster:
    """A running cluster: the master's URL and each worker's process id."""

    url: str
    workers: list[int]

    def executors(self) -> list[int]:
        """The process ids of the executor JVMs the workers launched (children of a worker)."""
        import psutil

        found = []
        for pid in self.workers:
            for child in psutil.Process(pid).children():
                with contextlib.suppress(psutil.Error):
                    if "CoarseGrainedExecutorBackend" in " ".join(child.cmdline()):
                        found.append(child.pid)
        return found


@contextmanager
def standalone_cluster(folder: Path, workers: int = 2) -> Iterator[Cluster]:
    """A master and ``workers`` workers (1 core, 1 GiB each), running."""
    home = Path(pyspark.__file__).parent
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_WORKER_DIR": str(folder / "work"),
    }
    spark_class = str(home / "bin" / "spark-class")
    folder.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port = _free_port()
        log = folder / "master.log"
        master = subprocess.Popen(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--webui-port", str(_free_port())),
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        procs.append(master)
        _wait_for(log, "I have been elected leader", master, "the master")
        url = f"spark://127.0.0.1:{port}"
        for i in range(workers):
            wlog = folder / f"worker-{i}.log"
            worker = subprocess.Popen(
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    url,
                    *("--cores", "1", "--memory", "1g"),
                    *("--webui-port", str(_free_port())),
                ],
                stdout=wlog.open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            procs.append(worker)
            _wait_for(wlog, "Successfully registered with master", worker, f"worker {i}")
        yield Cluster(url, [p.pid for p in procs[1:]])
    finally:
        for proc in reversed(procs):  # workers first, then the master
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
