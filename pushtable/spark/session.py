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

__all__ = ["local_spark", "prune_spark_logs", "quiet_spark_start", "spark_log_path"]

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
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    quiet_spark_start()
    settings = {
        "spark.master": "local[2]",
        "spark.app.name": app,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.host": "127.0.0.1",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.session.timeZone": "UTC",
        **conf,
    }
    spark_conf = SparkConf().setAll(list(settings.items()))
    with warnings.catch_warnings():
        # Starting the JVM forks and at once execs spark-submit: Lance's fork-safety warning
        # (raised before any fork) does not apply to it.
        warnings.filterwarnings("ignore", message="lance is not fork-safe")
        if SparkContext._active_spark_context is None:  # a new JVM: its output to the log
            prune_spark_logs()
            with open(spark_log_path(), "ab") as out:
                gateway = launch_gateway(  # type: ignore[no-untyped-call]
                    spark_conf, popen_kwargs={"stdout": out, "stderr": out}
                )
            SparkContext(conf=spark_conf, gateway=gateway)
        builder = SparkSession.builder
        for key, value in settings.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
