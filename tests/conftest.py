"""Shared helpers: a query running in a background thread, and small batches."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings

from pushtable import SessionContext, TableSink
from pushtable.flight import Client, Server, connect

SCHEMA = pa.schema([("k", pa.int32()), ("v", pa.float64())])
WAIT = 30.0  # upper bound for any wait in a test; reaching it is a failure, not a pass


def fixed_draws(examples: int) -> settings:
    """Hypothesis settings for a sweep that draws the same ``examples`` cases every run (no
    deadline, no example database: the tallies a sweep asserts are the same each time)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def batch(n: int, start: int = 0) -> pa.RecordBatch:
    """``n`` rows with k = start.. and v = k / 10."""
    ks = pa.array(range(start, start + n), pa.int32())
    vs = pa.array([k / 10 for k in range(start, start + n)], pa.float64())
    return pa.record_batch([ks, vs], schema=SCHEMA)


def full_table(ctx: SessionContext) -> TableSink:
    """A table ``t`` whose queue (capacity 1) holds a batch nobody reads: a write blocks."""
    sink = ctx.register_streaming_table("t", SCHEMA, capacity=1)
    sink.write(batch(1))
    return sink


class Background:
    """Runs ``fn`` in a daemon thread and hands back its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            self.error = exc
        finally:
            self.done.set()

    def join(self, timeout: float = WAIT) -> Any:
        """The function's result; re-raises its exception; fails the test if it hangs."""
        if not self.done.wait(timeout):
            pytest.fail(f"background call did not finish within {timeout}s")
        if self.error is not None:
            raise self.error
        return self.result

    def join_error(self, timeout: float = WAIT) -> BaseException:
        """The exception the function raised (fails the test if it returned)."""
        if not self.done.wait(timeout):
            pytest.fail(f"background call did not finish within {timeout}s")
        assert self.error is not None, f"expected an error, got result {self.result!r}"
        return self.error


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] Spark for the whole run (started on first use)."""
    from tests.spark_support import spark_session

    session = spark_session()
    yield session
    session.stop()


@pytest.fixture
def ctx() -> SessionContext:
    return SessionContext()


def write_many(sink: TableSink, b: pa.RecordBatch, times: int) -> None:
    """Write ``b`` ``times`` times, each write bounded by WAIT."""
    for _ in range(times):
        sink.write(b, timeout=WAIT)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Poll ``condition()`` until true; fail the test after ``timeout`` (WAIT) seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.001)


def query(ctx: SessionContext, sql: str) -> Background:
    """Start ``sql`` in the background and collect it into a pydict."""
    return Background(lambda: ctx.sql(sql).to_arrow_table().to_pydict())


@pytest.fixture
def server() -> Iterator[Server]:
    """A ``pushtable serve`` server on a free loopback port, stopped after the test."""
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    """A client of :func:`server`."""
    with connect(server.location) as c:
        yield c


@contextlib.contextmanager
def serve_process(
    config: dict[str, Any], directory: Path, *args: str, port: int = 0
) -> Iterator[tuple[Any, str]]:
    """``pushtable serve --config`` (and ``args``) in a child process on ``port`` (0: any
    free one); yields (process, location)."""
    path = directory / "serve.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "pushtable", "serve", "--port", str(port), "--config", str(path)),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("pushtable serve: listening on grpc://127.0.0.1:"), line
        yield proc, line.split("listening on ")[1].split()[0]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()


def aio_threads(prefix: str = "pushtable-aio") -> list[threading.Thread]:
    """The threads of pushtable's asyncio face (readers, writers, calls) still running."""
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


async def no_aio_threads(prefix: str = "pushtable-aio") -> None:
    """Every thread of the asyncio face ends (on its own, never joined), within the bound."""
    for _ in range(int(WAIT / 0.05)):
        if not aio_threads(prefix):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"threads left: {aio_threads(prefix)}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Print the random order's seed even with ``-q`` (pytest-randomly puts it in the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(
            f"random order seed: {seed} (rerun this order: -p randomly --randomly-seed={seed})"
        )


@dataclass(frozen=True)
class ObjectStore:
    """An S3-compatible store on loopback (moto's server, in this process) and one bucket."""

    server: Any  # moto's ThreadedMotoServer: stop() and start() it for an outage
    endpoint: str
    bucket: str

    @property
    def options(self) -> dict[str, str]:
        """Lance's storage options to reach it (test credentials moto accepts)."""
        return {
            "aws_endpoint": self.endpoint,
            "aws_access_key_id": "test-key",
            "aws_secret_access_key": "test-secret-never-printed",
            "aws_region": "us-east-1",
            "allow_http": "true",
        }


@pytest.fixture(scope="module")
def object_store() -> Iterator[ObjectStore]:
    """moto's S3 server on a free loopback port, with bucket ``lake``; stopped after the module."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test-key",
            aws_secret_access_key="test-secret-never-printed",
            region_name="us-east-1",
        ).create_bucket(Bucket="lake")
        yield ObjectStore(server, endpoint, "lake")
    finally:
        server.stop()


class Place:
    """Where a test's topic lives: a local directory, or a prefix on moto's S3 server."""

    def __init__(self, root: str, store: ObjectStore | None) -> None:
        self.root, self.store = root, store
        self.options = None if store is None else store.options

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def dataset(self, uri: str) -> lance.LanceDataset:
        return lance.dataset(uri, storage_options=self.options)

    def data_files(self, uri: str) -> set[str]:
        """The names of the files in the dataset's ``data/``, as the disk or the store lists."""
        if self.store is None:
            return {p.name for p in (Path(uri) / "data").iterdir()}
        import boto3

        bucket, _, key = uri.removeprefix("s3://").partition("/")
        s3 = boto3.client(
            "s3",
            endpoint_url=self.store.endpoint,
            aws_access_key_id=self.store.options["aws_access_key_id"],
            aws_secret_access_key=self.store.options["aws_secret_access_key"],
            region_name="us-east-1",
        )
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{key}/data/").get("Contents", [])
        return {Path(o["Key"]).name for o in listed}


@pytest.fixture(params=["local", "s3"])
def place(request: Any, tmp_path: Path) -> Place:
    """A durable topic's place: a local directory, and a prefix on moto's S3 server (the
    durable log's paths, run on both)."""
    if request.param == "local":
        return Place(str(tmp_path), None)
    store: ObjectStore = request.getfixturevalue("object_store")
    return Place(f"s3://{store.bucket}/{request.node.name.replace('[', '-').rstrip(']')}", store)
