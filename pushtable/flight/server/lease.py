"""One server at a time serves a data dir: a lease renewed by compare-and-swap on the store.

Two ``pushtable serve`` processes on the same data dir (a directory, or an object store prefix a
restarted server reaches from another machine) would both append to the same durable topics
and interleave their offsets. The lease is a one-row Lance dataset beside the topics,
``<root>/.pushtable-owner.lance`` (``owner``, ``expires`` in wall-clock seconds): a server takes
it only when it is absent, lapsed or its own, and keeps it by committing a new version every
third of its term with the version it last wrote as its read version — Lance refuses a commit
whose read version another commit overtook (``CommitConflictError``), so of two servers racing
for it, one wins. A server whose renewal is overtaken has lost it: its durable topics are
failed at once (it acknowledges nothing more). A server that dies holds it one term at most
(``PUSHTABLE_LEASE_S``, 30 s by default); one started again on the same host takes it at once
when the holder's process is gone (the row names its host and pid).

The lease says who may serve; the store enforces it per commit. The version at which a
server took the lease is its *epoch*: every commit of its durable topics carries it, and a
successor's first act on each topic fences out every commit prepared under an older one
(:mod:`pushtable.durable.fence`), so a server paused longer than a term (SIGSTOP, a frozen
VM) lands nothing once it resumes. Beside it, a server whose term ran out without a renewal
stops committing at once (:meth:`Lease.current`).

Example:
    >>> import tempfile
    >>> from pushtable.flight.server.data_dir import DataDir
    >>> root = DataDir(tempfile.mkdtemp())
    >>> first = Lease(root, "server-a")
    >>> first.acquire()
    >>> try:
    ...     Lease(root, "server-b").acquire()
    ... except DataDirInUseError as exc:
    ...     print(str(exc).split(" until")[0])
    data dir ... is served by server-a (its lease is renewed every 10s)
    >>> first.release()
    >>> Lease(root, "server-b").acquire()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa

from pushtable.errors import DataDirInUseError
from pushtable.flight.server.data_dir import DataDir
from pushtable.lance_commits import open_dataset

__all__ = ["LEASE_NAME", "Lease", "lease_term"]

log = logging.getLogger(__name__)

#: the lease's dataset under the data dir (a name no durable topic can have)
LEASE_NAME = ".pushtable-owner.lance"
_SCHEMA = pa.schema(
    [
        ("owner", pa.string()),
        ("host", pa.string()),
        ("pid", pa.int64()),
        ("expires", pa.float64()),
        # the holder's PID namespace: a pid names a process only within one (containers
        # with host networking share a hostname, not their pids)
        ("pidns", pa.string()),
    ]
)


def _pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"; "" where there is none to read)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def lease_term() -> float:
    """Seconds a lease lasts unless renewed: ``PUSHTABLE_LEASE_S``, 30 by default."""
    return float(os.environ.get("PUSHTABLE_LEASE_S", "30"))


def _dead_here(holder: dict[str, Any]) -> bool:
    """Whether the holder ran on this host, in this PID namespace, and its process is gone.

    Then its lease need not lapse: a server killed and started again on the same machine
    takes over at once. A holder in another PID namespace (another container on the same
    host), or one whose row does not name its namespace, waits for the lease to lapse: its
    pid means nothing here.
    """
    host, pid = holder.get("host"), holder.get("pid")
    if host != socket.gethostname() or holder.get("pidns") != _pid_namespace():
        return False
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    try:  # a killed process its parent has not reaped yet (Linux: state Z) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class Lease:
    """The lease of ``data_dir`` for ``owner`` (a name saying which server, on which host)."""

    def __init__(
        self,
        data_dir: DataDir,
        owner: str,
        term: float | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.uri = f"{data_dir.root}/{LEASE_NAME}"
        self.where = str(data_dir)
        self.options = data_dir.storage_options
        self.owner = owner
        self.term = lease_term() if term is None else term
        self._on_lost = on_lost  # told (once) when another server overtook the lease
        self._version: int | None = None
        #: the lease dataset's version at which this owner took it: its commits' epoch
        #: (every take commits over the version before: a later owner's is greater)
        self.epoch: int | None = None
        #: monotonic time its term runs out unless renewed (from when the last renewal that
        #: landed started): past it, this owner commits nothing (see :meth:`current`)
        self._until = 0.0
        self._lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewals = 0

    def _row(self, expires: float) -> pa.Table:
        return pa.table(
            {
                "owner": [self.owner],
                "host": [socket.gethostname()],
                "pid": [os.getpid()],
                "expires": [expires],
                "pidns": [_pid_namespace()],
            },
            schema=_SCHEMA,
        )

    def _refused(self, holder: str, expires: float) -> DataDirInUseError:
        until = datetime.fromtimestamp(expires, timezone.utc).isoformat(timespec="seconds")
        return DataDirInUseError(
            f"data dir {self.where} is served by {holder} (its lease is renewed every "
            f"{self.term / 3:g}s) until {until} at least: two servers would interleave the "
            "offsets of its durable topics. Stop that server, or wait for its lease to lapse "
            "if it died"
        )

    def acquire(self) -> None:
        """Take the lease, or raise :class:`DataDirInUseError` naming who holds it."""
        ds = open_dataset(self.uri, self.options)
        started = time.monotonic()
        row = self._row(time.time() + self.term)
        if ds is None:
            try:
                ds = lance.write_dataset(
                    row,
                    self.uri,
                    mode="create",
                    storage_options=self.options,
                    enable_v2_manifest_paths=True,  # as every commit below names its manifest
                )
            except (OSError, ValueError) as exc:  # another server created it meanwhile
                raise DataDirInUseError(
                    f"data dir {self.where}: another server took its lease meanwhile ({exc})"
                ) from exc
        else:
            # every row, whatever columns its writer's version had: an older server's row
            # (no namespace) is a holder too
            for holder in ds.to_table().to_pylist()[:1]:
                mine = holder.get("owner") == self.owner
                lapsed = float(holder.get("expires") or 0.0) <= time.time()
                if not (mine or lapsed or _dead_here(holder)):
                    raise self._refused(str(holder.get("owner")), float(holder["expires"]))
            ds = self._taken(ds.version, row)
            if ds is None:
                now = open_dataset(self.uri, self.options)
                taken = now.to_table().to_pylist()[0] if now is not None else {}
                raise self._refused(taken.get("owner", "another server"), taken.get("expires", 0))
        self._version = self.epoch = ds.version
        self._until = started + self.term
        self._thread = threading.Thread(target=self._keep, name="pushtable-lease", daemon=True)
        self._thread.start()

    def held(self) -> bool:
        """Whether the lease's newest row is still this owner's (one read of the store).

        Beside :meth:`current`, which runs on this host's clock: a successor whose clock is
        ahead may take a lease this owner still counts as current. Asked before a durable
        topic is created or opened (its commits are fenced by the store; a topic nobody
        else has opened has no fence yet).
        """
        if not self.current():
            return False
        ds = open_dataset(self.uri, self.options)
        rows = [] if ds is None else ds.to_table().to_pylist()
        return bool(rows) and rows[0].get("owner") == self.owner

    def current(self) -> bool:
        """Whether this owner holds the lease now: taken, not lost, its term not run out.

        Defence in depth beside the store's fence (:mod:`pushtable.durable.fence`): a server
        that knows its term ran out without a renewal stops committing at once, without
        waiting for a successor's fence to refuse it.
        """
        return self.epoch is not None and not self._lost and time.monotonic() < self._until

    def _swap(self, read_version: int, row: pa.Table) -> lance.LanceDataset | None:
        """Commit ``row`` over ``read_version``; None when another commit overtook it."""
        fragments = lance.fragment.write_fragments(
            row,
            self.uri,
            schema=_SCHEMA,
            storage_options=self.options,
            mode="overwrite",  # its own schema: a row an older server wrote may lack a column
        )
        try:
            return lance.LanceDataset.commit(
                self.uri,
                lance.LanceOperation.Overwrite(_SCHEMA, fragments),
                read_version=read_version,
                storage_options=self.options,
                # one naming of manifests for every version: mixed, an object store's listing
                # found the newest version as the first one written
                enable_v2_manifest_paths=True,
            )
        except Exception as exc:
            if type(exc).__name__ == "CommitConflictError":
                return None
            raise

    def _taken(self, read_version: int, row: pa.Table) -> lance.LanceDataset | None:
        """``row`` committed over ``read_version``, also when the commit raised after it landed.

        (An object store's lost reply: the newest version then holds this owner's row.) None
        when another server's commit overtook it; any other failure is raised.
        """
        try:
            ds = self._swap(read_version, row)
        except Exception:
            ds = None
            mine = self._mine(read_version, row)
            if mine is None:
                raise
            return mine
        return ds if ds is not None else self._mine(read_version, row)

    def _mine(self, read_version: int, row: pa.Table) -> lance.LanceDataset | None:
        """The newest version, if it is ``row``'s commit over ``read_version`` that landed.

        Not merely a row of this owner: its previous row (a renewal that wrote nothing) is
        not a renewal.
        """
        ds = open_dataset(self.uri, self.options)
        if ds is None or ds.version <= read_version:
            return None
        rows = ds.to_table().to_pylist()
        want = row.to_pylist()[0]
        found = rows[0] if rows else {}
        landed = found.get("owner") == want["owner"] and found.get("expires") == want["expires"]
        return ds if landed else None

    def renew(self) -> bool:
        """Extend the lease by a term; False when another server overtook it (it is lost)."""
        assert self._version is not None
        started = time.monotonic()
        ds = self._taken(self._version, self._row(time.time() + self.term))
        if ds is None:
            self._lost = True
            return False
        self._version = ds.version
        self._until = started + self.term
        self._renewals += 1
        if self._renewals % 30 == 0:  # its own history: a version every third of a term
            ds.cleanup_old_versions(older_than=timedelta(seconds=self.term))
        return True

    def _keep(self) -> None:
        while not self._stop.wait(max(0.0, min(self.term / 3, self._until - time.monotonic()))):
            if not self.current():  # the term ran out, the renewals failing: it is over
                self._lose(
                    f"the lease of data dir {self.where} ran out ({self.term:g}s) without a "
                    "renewal: the store could not be reached, or this server was paused"
                )
                return
            try:
                kept = self.renew()
            except Exception as exc:  # noqa: BLE001 - the store is away: try again, in term
                log.warning("could not renew the lease of data dir %s: %s", self.where, exc)
                continue
            if not kept:
                self._lose(f"another server took the lease of data dir {self.where}")
                return

    def _lose(self, why: str) -> None:
        self._lost = True
        log.error("data dir %s: %s", self.where, why)
        if self._on_lost is not None:
            self._on_lost(why)

    def release(self) -> None:
        """Stop renewing and let the lease lapse now (best effort: else it lapses in a term)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.term)
        if self._version is not None:
            try:
                self._swap(self._version, self._row(0.0))
            except Exception as exc:  # noqa: BLE001 - it lapses by itself
                log.info("could not release the lease of data dir %s: %s", self.where, exc)
            self._version = None
