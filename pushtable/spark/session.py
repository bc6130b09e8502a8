"""A local Spark session for the demo, tests and benchmarks: quiet, on loopback, logged aside.

What the JVM prints goes to a log file per process (:func:`spark_log_path`), not the terminal;
logs of processes that exited are pruned when the next local session starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "local_spark",
    "local_spark_connect",
    "prune_spark_logs",
    "quiet_spark_start",
    "spark_log_path",
]

# Spark starts workers with whatever `python3` is on PATH unless told otherwise; outside an
# activated venv that interpreter lacks pyarrow ("No module named 'pyarrow'").
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def quiet_spark_start() -> None:
    """Bind a local Spark to loopback before its JVM starts, so Spark does not warn that the
    machine's hostname resolves to a loopback address (unless the caller chose an address)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


#: How long the log of a process that has exited is kept, for a look after the fact.
SPARK_LOG_KEPT = 3600.0


def spark_log_path() -> Path:
    """Where the JVM of a Spark session started by :func:`local_spark` writes its output."""
    return Path(tempfile.gettempdir()) / f"pushtable-spark-{os.getpid()}.log"


def prune_spark_logs(now: float | None = None) -> int:
    """Delete the JVM logs of processes that exited over :data:`SPARK_LOG_KEPT` seconds ago.

    Every process that starts a local Spark writes one log; without this they pile up in the
    temporary directory. A running process's log is never touched. Returns how many went.
    """
    now = time.time() if now is None else now
    removed = 0
    for path in Path(tempfile.gettempdir()).glob("pushtable-spark-*.log"):
        try:
            pid = int(path.stem.rsplit("-", 1)[1])
            if _alive(pid) or now - path.stat().st_mtime < SPARK_LOG_KEPT:
                continue
            path.unlink()
            removed += 1
        except (ValueError, OSError):  # not ours, or gone meanwhile
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def local_spark(app: str, **conf: str) -> SparkSession:
    """A quiet ``local[2]`` session on loopback with the UI off (demo, tests, benchmarks).

    What the JVM prints (start-up warnings a user can do nothing about, Spark's own log) goes
    to :func:`spark_log_path`, not the terminal; Spark's errors still reach Python as
    exceptions.

    Example: ``spark = local_spark("my-app"); spark.range(3).count()`` gives ``3``; the
    Spark tests run it for real (``tests/spark_support.py``).
    """
    from pyspark.sql import SparkSession

    settings = {"spark.master": "local[2]", "spark.app.name": app, **_QUIET, **conf}
    with warnings.catch_warnings():
        # Starting the JVM forks and at once execs spark-submit: Lance's fork-safety warning
        # (raised before any fork) does not apply to it.
        warnings.filterwarnings("ignore", message="lance is not fork-safe")
        _launch_jvm(settings, context=True)
        builder = SparkSession.builder
        for key, value in settings.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def local_spark_connect(app: str, **conf: str) -> SparkSession:
    """A Spark Connect session on a local Spark Connect server (``remote("local[2]")``), as
    quiet as :func:`local_spark`: the server's JVM, and the Python workers it starts (the
    server-side ``foreachBatch`` among them), write to :func:`spark_log_path`.

    pyspark starts the local server through ``SparkContext.getOrCreate``, which takes a JVM
    gateway launched beforehand: this launches it with its output sent to the log.
    ``SPARK_TESTING=1`` in the environment makes the server take an ephemeral port instead
    of 15002 (Spark's own switch for parallel runs).
    """
    from pyspark.sql import SparkSession

    settings = {"spark.app.name": app, **_QUIET, **conf}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="lance is not fork-safe")
        # Every setting goes to the JVM's launch, where the server's SparkContext reads it as
        # a default; a Connect session may set only runtime SQL settings (others warn).
        _launch_jvm({"spark.master": "local[2]", **settings}, context=False)
        builder = SparkSession.builder.remote("local[2]")
        for key, value in settings.items():
            if key.startswith("spark.sql."):
                builder = builder.config(key, value)
        return builder.getOrCreate()


#: Settings of every local session: loopback, no UI, no progress bars, UTC, 2 shuffle parts.
_QUIET = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    # The JVM's log4j threshold (Spark's WARN lines at start-up go to the log file anyway).
    "spark.log.level": "ERROR",
}


def _launch_jvm(settings: dict[str, str], *, context: bool) -> None:
    """Launch this process's Spark JVM with its output in :func:`spark_log_path`, unless one
    runs; with ``context``, also create the SparkContext on it (a classic session)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    quiet_spark_start()
    if SparkContext._gateway is not None or SparkContext._active_spark_context is not None:
        return
    prune_spark_logs()
    spark_conf = SparkConf().setAll(list(settings.items()))
    with open(spark_log_path(), "ab") as out:
        gateway = launch_gateway(  # type: ignore[no-untyped-call]
            spark_conf, popen_kwargs={"stdout": out, "stderr": out}
        )
    if context:
        SparkContext(conf=spark_conf, gateway=gateway)
    else:  # SparkContext.getOrCreate (pyspark's local Connect server) takes it from here
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm
