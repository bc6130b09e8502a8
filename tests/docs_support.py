"""The docs as tests: every Python block and shell command in README.md and docs/*.md runs,
through Sybil, so a snippet that stops working fails the build.

A document's blocks run in order in one namespace, in a temporary working directory (files a
snippet writes land there), with what a reader of the docs has already: ``$SECRET`` in the
environment (the token they chose) and, for docs/spark.md, a Spark session as ``spark``.
Glue a reader writes themselves (their data) is in the docs as visible code, or in an
``<!-- invisible-code-block: python -->`` comment beside the block where it would distract.

Shell blocks (``bash``, ``console``) run each command with ``bash``: ``pushtable serve``
starts in the background (stopped when the document ends) and the next block waits until it
listens; any other command must exit 0 within :data:`COMMAND_TIMEOUT`. A block the suite
cannot run (``make test`` would run the suite inside itself) carries a ``<!-- skip: next
"..." -->`` comment saying which test or CI step runs it instead.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

__all__ = ["DOCS", "in_document_order"]

#: seconds a shell command of the docs may take
COMMAND_TIMEOUT = 120.0
#: the token ``$SECRET`` stands for in the docs' commands and code
SECRET = "docs-s3cret"
ROOT = Path(__file__).resolve().parents[1]


def _setup(namespace: dict[str, Any]) -> None:
    work = tempfile.mkdtemp(prefix="pushtable-docs-")
    namespace["_docs"] = {"cwd": os.getcwd(), "work": work, "servers": [], "env": {}}
    namespace["_docs"]["env"] = {"SECRET": os.environ.get("SECRET")}
    os.environ["SECRET"] = SECRET
    namespace["SECRET"] = SECRET
    os.chdir(work)


def _teardown(namespace: dict[str, Any]) -> None:
    state = namespace["_docs"]
    spark = namespace.get("spark")
    if spark is not None:
        for query in spark.streams.active:  # a snippet's streaming query that still runs
            query.stop()
    for name in list(namespace):  # servers and clients a snippet started in this process
        value = namespace[name]
        if type(value).__name__ in ("Server", "Client") and hasattr(value, "stop"):
            value.stop()
        elif type(value).__name__ == "Client" and hasattr(value, "close"):
            value.close()
    for child in state["servers"]:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)
    os.chdir(state["cwd"])
    if state["env"]["SECRET"] is None:
        os.environ.pop("SECRET", None)
    else:
        os.environ["SECRET"] = state["env"]["SECRET"]


def _shell(example: Example) -> None:
    """Run a shell block's commands, one logical line at a time."""
    state = example.namespace["_docs"]
    text = str(example.parsed).replace("\\\n", " ")
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        if line.startswith("pushtable serve"):
            state["servers"].append(_serve(line, state["work"], env))
            continue
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=state["work"],
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
        assert done.returncode == 0, f"{line!r} exited {done.returncode}: {done.stderr[-2000:]}"


def _serve(line: str, cwd: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``pushtable serve ...`` in the background; return once it takes connections."""
    words = shlex.split(re.sub(r"\s+#.*$", "", line))
    port = int(words[words.index("--port") + 1]) if "--port" in words else 8815
    log = open(Path(cwd) / f"serve-{port}.log", "wb")  # noqa: SIM115 -- the child keeps it
    child = subprocess.Popen(
        ["bash", "-c", "exec " + line], cwd=cwd, env=env, stdout=log, stderr=log
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"{line!r} exited {child.returncode}: {_tail(log.name)}")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return child
        time.sleep(0.1)
    child.kill()
    raise AssertionError(f"{line!r} did not listen on port {port} within 60 s: {_tail(log.name)}")


def _tail(path: str) -> str:
    return Path(path).read_text(errors="replace")[-2000:]


def _spark_setup(namespace: dict[str, Any]) -> None:
    from pushtable.spark import local_spark

    _setup(namespace)
    namespace["spark"] = local_spark("pushtable-docs")


DOCS = [
    Sybil(
        parsers=[
            PythonCodeBlockParser(),
            CodeBlockParser("bash", _shell),
            CodeBlockParser("console", _shell),
            SkipParser(),
        ],
        patterns=["README.md", "docs/*.md"],
        excludes=["docs/spark.md"],
        path=str(ROOT),
        setup=_setup,
        teardown=_teardown,
        name="docs",
    ),
    Sybil(
        parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", _shell), SkipParser()],
        patterns=["docs/spark.md"],
        path=str(ROOT),
        setup=_spark_setup,
        teardown=_teardown,
        name="spark-docs",
    ),
]


def in_document_order(items: list[pytest.Item]) -> None:
    """Run each document's examples together and in their order, where its first one stands
    (pytest-randomly shuffles items, and a document's blocks build on each other)."""
    by_file: dict[Any, list[pytest.Item]] = {}
    for item in items:
        if hasattr(item, "example"):
            by_file.setdefault(item.parent, []).append(item)
    ordered: list[pytest.Item] = []
    for item in items:
        if not hasattr(item, "example"):
            ordered.append(item)
        elif (document := by_file.pop(item.parent, None)) is not None:
            ordered.extend(sorted(document, key=lambda it: it.example.start))  # type: ignore[attr-defined]
    items[:] = ordered
