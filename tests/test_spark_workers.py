"""Spark's Python workers find pushtable's interpreter however the session was built: a
classic session created *before* ``import pushtable.spark``, outside an activated venv, whose
workers would start ``python3`` from ``PATH`` (no pushtable there), gets this interpreter for
its workers from ``register(spark)``; a ``PYSPARK_PYTHON`` the user set that cannot import
pushtable is refused on the driver, before any task, saying what to set. Real local Spark in
a child process whose ``PATH`` starts with a bare venv the test makes (never the image's own
``python3``, which may or may not have pushtable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import sys
    from pyspark.sql import SparkSession  # the session first, as a notebook would make it

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    before = spark.sparkContext.pythonExec
    from pushtable.spark import WorkerPythonError, register

    try:
        register(spark)
    except WorkerPythonError as exc:
        print("refused:", exc, flush=True)
        sys.exit(0)

    def probe(batches):
        import pyarrow as pa

        import pushtable  # noqa: F401 -- what a pushtable task imports on a worker

        for _ in batches:
            pass
        yield pa.record_batch({"ok": [True]})

    ok = spark.range(1, numPartitions=1).mapInArrow(probe, "ok boolean").collect()[0].ok
    print("before:", before, "after:", spark.sparkContext.pythonExec, "ok:", ok, flush=True)
    """
)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python3`` that cannot import pushtable: a new venv of the base interpreter (no
    site-packages of ours), made here so the tests never depend on what the image has."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python3"
    probe = subprocess.run([str(python), "-c", "import pushtable"], capture_output=True)
    assert probe.returncode != 0, "the bare venv can import pushtable"
    return python


def run_child(bare: Path, extra_env: dict[str, str]) -> str:
    java = shutil.which("java")
    assert java is not None, "Java 17 runs Spark"
    # No venv of ours on PATH: Spark's default worker `python3` is the bare one.
    env = {
        "HOME": os.environ.get("HOME", "/tmp"),
        "PATH": f"{bare.parent}:{Path(java).parent}:/usr/bin:/bin",
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        **extra_env,
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.spark
@pytest.mark.timeout(330)
def test_a_session_made_before_the_import_gets_pushtables_interpreter_for_its_workers(
    bare_python: Path,
) -> None:
    said = run_child(bare_python, {})
    assert f"before: python3 after: {sys.executable} ok: True" in said, said


@pytest.mark.spark
@pytest.mark.timeout(330)
def test_a_worker_python_the_user_set_without_pushtable_is_refused_before_any_task(
    bare_python: Path,
) -> None:
    """Real Spark: ``PYSPARK_PYTHON`` set by the user to an interpreter that cannot import
    pushtable; ``register(spark)`` refuses on the driver, saying what to set."""
    said = run_child(bare_python, {"PYSPARK_PYTHON": str(bare_python)})
    assert said.startswith(f"refused: Spark's Python workers run {bare_python}"), said
    assert f"Set PYSPARK_PYTHON={sys.executable}" in said, said


class _Context:
    """A SparkContext's one attribute :func:`ensure_worker_python` reads and sets."""

    def __init__(self, python: str) -> None:
        self.pythonExec = python


class _Session:
    def __init__(self, python: str) -> None:
        self._sc = _Context(python)


def test_the_worker_python_decision_of_our_own_logic(
    monkeypatch: pytest.MonkeyPatch, bare_python: Path
) -> None:
    """Our decision alone (a unit test with a stand-in session; the real-Spark tests above
    cover the session): the interpreter is asked for real; one the user set that cannot
    import pushtable is refused saying what to set, one they did not set is replaced, and one
    that can is kept."""
    from pushtable.spark import WorkerPythonError, session

    bare = str(bare_python)
    monkeypatch.setattr(session, "_USER_PYTHON", bare)
    chosen = _Session(bare)
    with pytest.raises(WorkerPythonError, match=f"Spark's Python workers run {bare}") as info:
        session.ensure_worker_python(chosen)  # type: ignore[arg-type]
    assert f"Set PYSPARK_PYTHON={sys.executable}" in str(info.value)
    assert "cannot import pushtable: ModuleNotFoundError: No module named" in str(info.value)
    assert chosen._sc.pythonExec == bare  # left as the user set it
    monkeypatch.setattr(session, "_USER_PYTHON", None)
    defaulted = _Session(bare)
    session.ensure_worker_python(defaulted)  # type: ignore[arg-type]
    assert defaulted._sc.pythonExec == sys.executable
    fine = _Session(sys.executable)
    session.ensure_worker_python(fine)  # type: ignore[arg-type]
    assert fine._sc.pythonExec == sys.executable
