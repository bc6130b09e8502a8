"""A local Spark session for the demo, tests and benchmarks: quiet, on loopback, logged aside.

What the JVM prints goes to a log file per process (:func:`spark_log_path`), not the terminal;
logs of processes that exited are pruned when the next local session starts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pushtable.errors import WorkerPythonError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = [
    "WorkerPythonError",
    "check_connect_workers",
    "ensure_worker_python",
    "local_spark",
    "local_spark_connect",
    "prune_spark_logs",
    "quiet_spark_start",
    "spark_log_path",
]

log = logging.getLogger(__name__)

#: PYSPARK_PYTHON as the user set it (None: not set), before the line below sets a default
_USER_PYTHON = os.environ.get("PYSPARK_PYTHON")
# Spark starts workers with whatever `python3` is on PATH unless told otherwise; outside an
# activated venv that interpreter lacks pyarrow ("No module named 'pyarrow'").
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


#: interpreters already asked whether they import pushtable: path -> the error, or None
_probed: dict[str, str | None] = {}


def ensure_worker_python(spark: SparkSession) -> None:
    """Make sure the Python workers of ``spark`` (a classic session) can import pushtable.

    A classic session fixes its workers' interpreter when it is created (``PYSPARK_PYTHON``,
    else ``python3`` from ``PATH``). Created before ``import pushtable.spark`` outside an
    activated venv, it would start workers that fail with ``ModuleNotFoundError`` in the
    first task. Here the workers' interpreter is asked once whether it imports pushtable; if
    not, and the user did not choose it, the session's workers use this interpreter
    (``sys.executable``); if the user chose it, :class:`WorkerPythonError` says what to set.
    On a cluster (a master that is not ``local``), the executors run elsewhere: they are
    asked with one small job instead, and a problem is raised, never patched over with this
    machine's interpreter. A Spark Connect session's workers run on its server: see
    :func:`check_connect_workers`.
    """
    context = getattr(spark, "_sc", None)  # a classic session's SparkContext
    exe = getattr(context, "pythonExec", None)
    if context is None or exe is None:
        return
    if not str(getattr(context, "master", "local")).startswith("local"):
        _check_cluster_workers(spark, context, exe)
        return
    if exe == sys.executable:
        return
    problem = _import_problem(exe)
    if problem is None:
        return
    if _USER_PYTHON is None or exe != _USER_PYTHON:
        log.info("Spark's Python workers run %s (%s cannot import pushtable)", sys.executable, exe)
        context.pythonExec = sys.executable
        return
    raise WorkerPythonError(
        f"Spark's Python workers run {exe} (PYSPARK_PYTHON), which cannot import pushtable: "
        f"{problem}. Set PYSPARK_PYTHON={sys.executable} (the interpreter running pushtable) "
        "before the SparkSession is created, or install pushtable into that interpreter"
    )


#: SparkContexts (by application id) whose executors' Python was found to import pushtable
_clusters_checked: set[str] = set()


def _check_cluster_workers(spark: SparkSession, context: object, exe: str) -> None:
    """On a cluster, ask the executors (one small job), not this machine.

    Executors run on other hosts with Python of their own: running ``exe`` here says nothing
    of them, and this interpreter's path may not exist there. So nothing is changed; a
    problem is raised, saying what to set.
    """
    app = str(getattr(context, "applicationId", id(context)))
    if app in _clusters_checked:
        return
    problem = _probe_workers(spark)
    if problem is not None:
        raise WorkerPythonError(
            f"the Python workers of Spark's executors ({exe}) cannot import pushtable: "
            f"{problem}. Install pushtable on every worker host and set spark.pyspark.python "
            "(or PYSPARK_PYTHON) to that interpreter, or ship a packed environment with "
            "spark.archives (docs/deployment.md, 'Shipping pushtable to the executors')"
        )
    _clusters_checked.add(app)


def check_connect_workers(spark: SparkSession) -> None:
    """Check, with one small job, that a Spark Connect server's Python workers import pushtable.

    If they do not, raise :class:`WorkerPythonError` saying what to set.
    """
    problem = _probe_workers(spark)
    if problem is not None:
        raise WorkerPythonError(
            f"the Spark Connect server's Python workers cannot import pushtable: {problem}. "
            "Start the server with PYSPARK_PYTHON (or spark.pyspark.python) naming an "
            "interpreter that has pushtable installed"
        )


def _probe_workers(spark: SparkSession) -> str | None:
    """One small job: why the workers' Python cannot import pushtable, or None if it can."""
    import pyarrow as pa

    def probe(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in batches:
            pass
        try:
            import pushtable.spark  # noqa: F401
        except Exception as exc:  # noqa: BLE001 -- report whatever stops the import
            yield pa.record_batch({"problem": [f"{type(exc).__name__}: {exc}"]})
        else:
            yield pa.record_batch({"problem": pa.array([None], pa.string())})

    try:
        rows = spark.range(1, numPartitions=1).mapInArrow(probe, "problem string").collect()
    except Exception as exc:  # noqa: BLE001 -- a worker that cannot start at all
        return str(exc).strip().splitlines()[0]
    return next((r["problem"] for r in rows if r["problem"]), None)


def _import_problem(exe: str) -> str | None:
    """Why ``exe`` cannot import pushtable (its last error line), or None when it can."""
    if exe not in _probed:
        try:
            done = subprocess.run(  # not from this directory: a worker does not start here
                [exe, "-c", "import pushtable.spark"],
                cwd=tempfile.gettempdir(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            lines = done.stderr.strip().splitlines()
            _probed[exe] = None if done.returncode == 0 else (lines[-1] if lines else "failed")
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probed[exe] = f"{type(exc).__name__}: {exc}"
    return _probed[exe]


def quiet_spark_start() -> None:
    """Bind a local Spark to loopback before its JVM starts, unless the caller chose an address.

    Then Spark does not warn that the machine's hostname resolves to a loopback address.
    """
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
    """A Spark Connect session on a local Spark Connect server, as quiet as :func:`local_spark`.

    The server is ``remote("local[2]")``; its JVM, and the Python workers it starts (the
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
    """Launch this process's Spark JVM with its output in :func:`spark_log_path`, unless one runs.

    With ``context``, also create the SparkContext on it (a classic session).
    """
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
