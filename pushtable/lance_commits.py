"""Stamped Lance commits, used by a durable topic's group commits and a Spark query's epochs.

One mechanism serves both. A writer that must survive a restart without writing twice stamps
each commit (Lance transaction properties) with what it has stored, then on restart walks the
history newest first for its last stamp (Iceberg's approach: no fixed window), with a tag on
that commit so cleanup keeps it. Commits that meet a concurrent writer (compaction, another
query) are retried with backoff; upkeep compacts and removes old versions. With ``sync`` a
commit is on disk before it returns: Lance's local store writes without fsync, so the files a
commit wrote (data files, its transaction, its manifest) and their directories are synced
here.

Example:
    >>> import tempfile, lance, pyarrow as pa
    >>> uri = tempfile.mkdtemp() + "/t.lance"
    >>> ds = lance.write_dataset(pa.table({"v": [1]}), uri)
    >>> frags = lance.fragment.write_fragments(pa.table({"v": [2]}), uri, schema=ds.schema)
    >>> ds = commit(
    ...     ds,
    ...     lambda d: lance.Transaction(
    ...         d.version, lance.LanceOperation.Append(frags), transaction_properties={"me": "1"}
    ...     ),
    ...     sync=True,
    ... )
    >>> newest_stamp(ds, lambda props: "me" in props)
    (2, {'me': '1'})
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import lance
from lance.commit import CommitConflictError

__all__ = [
    "CommitContentionError",
    "commit",
    "is_local",
    "move_tag",
    "newest_stamp",
    "not_found",
    "open_dataset",
    "props_at",
    "read_tag",
    "sync_fragments",
    "upkeep",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: a commit's transaction properties
Props = dict[str, str]


class CommitContentionError(OSError):
    """A commit met concurrent writers after all its retries, or a change no retry can resolve.

    In the second case ``retryable`` is False.
    """

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def not_found(exc: BaseException) -> bool:
    """Whether a Lance error says a version, manifest or tag does not exist.

    Only that may end a history walk or stand for "no tag": any other error (I/O, auth,
    throttling) must propagate, or a fresh process would think a commit missing and write it
    twice. pylance 14 raises ``ValueError("Ref not found ...")`` for a missing tag and
    ``OSError("... was not found: Not found: ...")`` for a missing manifest: it has no
    narrower type for either, so this one function reads the text.
    """
    if isinstance(exc, FileNotFoundError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (OSError, ValueError)) and (
        "not found" in text or "does not exist" in text
    )


def contention(exc: OSError) -> bool:
    """Whether a failed commit met concurrent writers.

    Lance retries compatible conflicts itself and then raises ``CommitConflictError``, or a
    plain OSError when it gives up ("Too many concurrent writers", "Commit conflict for
    version N ... after 20 retries").
    """
    if isinstance(exc, CommitConflictError):
        return True
    text = str(exc).lower()
    return "too many concurrent writers" in text or "commit conflict" in text


def open_dataset(
    uri: str, storage_options: dict[str, str] | None = None, version: int | None = None
) -> lance.LanceDataset | None:
    """The dataset at ``uri``, or None when there is none yet (any other error propagates)."""
    try:
        return lance.dataset(uri, version=version, storage_options=storage_options)
    except (OSError, ValueError) as exc:
        if not_found(exc):
            return None
        raise


# -- history ----------------------------------------------------------------------------


def newest_stamp(
    ds: lance.LanceDataset, match: Callable[[Props], bool], stop: int = 0
) -> tuple[int, Props] | None:
    """The newest commit above version ``stop`` whose properties ``match``: (version, props).

    None when history down to ``stop`` (or down to what cleanup removed) has none.

    Newest first, in growing pages: a steady writer finds itself in the first page.
    """
    page, seen = 8, 0
    while ds.version - seen > stop:
        want = min(page, ds.version - stop)
        try:
            txs = ds.get_transactions(want)
        except (OSError, ValueError) as exc:
            if not not_found(exc):
                raise  # I/O, auth, throttling: never taken for "no stamp"
            return None  # a cleaned-up version: the walk ends here
        for i in range(seen, len(txs)):
            tx = txs[i]
            if tx is None:  # cleaned up: what is older is gone too
                return None
            props = dict(tx.transaction_properties or {})
            if match(props):
                return ds.version - i, props
        if len(txs) < want:
            return None
        seen, page = want, page * 4
    return None


def props_at(ds: lance.LanceDataset, version: int) -> Props | None:
    """The properties of the commit that made ``version`` (None: it was cleaned up)."""
    try:
        tx = ds.read_transaction(version)
    except (OSError, ValueError) as exc:
        if not not_found(exc):
            raise
        return None
    return None if tx is None else dict(tx.transaction_properties or {})


def read_tag(ds: lance.LanceDataset, tag: str) -> int | None:
    """The version ``tag`` points at (None: no such tag)."""
    try:
        return int(ds.tags.get_version(tag))
    except (OSError, ValueError) as exc:
        if not not_found(exc):
            raise
        return None


def move_tag(ds: lance.LanceDataset, tag: str, version: int) -> None:
    """Point ``tag`` at ``version`` (creating it): cleanup keeps a tagged version."""
    try:
        ds.tags.update(tag, version)
    except (OSError, ValueError) as exc:
        if not not_found(exc):
            raise
        ds.tags.create(tag, version)


# -- committing -------------------------------------------------------------------------


def commit(
    ds: lance.LanceDataset,
    transaction: Callable[[lance.LanceDataset], lance.Transaction],
    *,
    storage_options: dict[str, str] | None = None,
    retries: int = 8,
    backoff: float = 0.01,
    recheck: Callable[[lance.LanceDataset], T | None] | None = None,
    on_conflict: Callable[[OSError], None] | None = None,
    sync: bool = False,
    lance_retries: int | None = None,
) -> lance.LanceDataset | T:
    """Commit ``transaction(ds)``; when it meets a concurrent writer, read again and retry.

    The dataset is read again and the commit retried with a growing backoff. ``recheck`` runs
    on each re-read version first: what it returns (not None) ends the attempt instead (an
    epoch another process committed). With ``sync`` the commit's files are on disk when this
    returns (:func:`sync_commit`).

    ``lance_retries`` bounds Lance's own retries of a lost race for the manifest (its
    default: 20): 0 makes every lost race come back here, so ``recheck`` sees the version
    that won before anything is tried again (a fenced store: see
    :mod:`pushtable.durable.fence`).

    Raises :class:`CommitContentionError` when the conflicts outlast ``retries`` or cannot
    be retried; any other error as Lance raised it.
    """
    for attempt in range(retries + 1):
        if attempt:
            ds = open_dataset(ds.uri, storage_options) or ds
            if recheck is not None and (settled := recheck(ds)) is not None:
                return settled
        started = time.time_ns() - 1_000_000  # mtimes can trail the clock slightly
        tx = transaction(ds)
        try:
            new = lance.LanceDataset.commit(
                ds,
                tx,
                storage_options=storage_options,
                max_retries=20 if lance_retries is None else lance_retries,  # 20: Lance's own
            )
        except OSError as exc:
            if not contention(exc):
                raise  # storage trouble, not contention
            if on_conflict is not None:
                on_conflict(exc)
            retryable = not isinstance(exc, CommitConflictError) or bool(exc.retryable)
            if not retryable or attempt == retries:
                why = "cannot be retried" if not retryable else f"after {retries} retries"
                raise CommitContentionError(
                    f"commit to {ds.uri} conflicts with a concurrent change ({why}): {exc}",
                    retryable,
                ) from exc
            time.sleep(backoff * 2**attempt)
            continue
        if sync:
            sync_commit(new, started, f"{tx.read_version}-")
        return new
    raise AssertionError("unreachable")


# -- durability -------------------------------------------------------------------------


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a local path (an object store's put is durable when it returns)."""
    return "://" not in uri or uri.startswith("file://")


def _path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_fragments(uri: str, fragments: Iterable[Any]) -> None:
    """Sync (fsync) the data files of ``fragments`` and the data directory, before their commit.

    ``fragments`` are Lance ``FragmentMetadata``. Syncing before the commit means a stored
    manifest never names data still in memory.
    """
    if not is_local(uri):
        return
    data = _path(uri) / "data"
    for fragment in fragments:
        for file in fragment.files:
            _fsync(data / file.path)
        if fragment.deletion_file is not None:
            _fsync(_path(uri) / "_deletions")
    if data.exists():
        _fsync(data, directory=True)


def remove_data_files(ds: lance.LanceDataset, names: Iterable[str]) -> None:
    """Remove the data files ``names`` of dataset ``ds``: ones no commit references.

    Through Lance's file session, so on a local disk and on an object store alike (with the
    dataset's storage options). Best effort: a failure is logged, and Lance's sweep of
    unreferenced files (cleanup of files older than its 7-day window) removes the file later.
    """
    session = None
    for name in names:
        try:
            if is_local(ds.uri):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(_path(ds.uri) / "data" / name)
                continue
            if session is None:
                session = ds.new_file_session()  # type: ignore[no-untyped-call]
            session.delete_file(f"data/{name}")
        except Exception as exc:  # noqa: BLE001 - best effort: the sweep removes it later
            log.info("could not remove the uncommitted data file %s of %s: %s", name, ds.uri, exc)


def sync_commit(ds: lance.LanceDataset, since_ns: int = 0, prefix: str | None = None) -> None:
    """Sync (fsync) what the commit of ``ds.version`` wrote, and the directories holding it.

    That is its manifest, its transaction file (Lance names it ``<read version>-<uuid>.txn``:
    ``prefix``; without one, or when no file has it, every transaction file written since
    ``since_ns``), and their directories (a new file is durable only once its directory
    entry is).
    """
    if not is_local(ds.uri):
        return
    root = _path(ds.uri)
    versions = root / "_versions"
    for name in (f"{(1 << 64) - 1 - ds.version:020d}.manifest", f"{ds.version}.manifest"):
        with contextlib.suppress(FileNotFoundError):
            _fsync(versions / name)
    txs = root / "_transactions"
    if txs.exists():
        # Listing names is cheap; a stat of each (thousands, with ten minutes of versions
        # kept) is not, on the acknowledgement path: only without a match are mtimes read.
        names = os.listdir(txs)
        mine = [n for n in names if prefix is not None and n.startswith(prefix)]
        for name in mine or names:
            with contextlib.suppress(FileNotFoundError):  # removed by a cleanup meanwhile
                path = txs / name
                if mine or path.stat().st_mtime_ns >= since_ns:
                    _fsync(path)
        _fsync(txs, directory=True)
    _fsync(versions, directory=True)
    _fsync(root, directory=True)


# -- upkeep -----------------------------------------------------------------------------


def upkeep(
    uri: str,
    *,
    keep: dict[str, int] | None = None,
    older_than: timedelta | None = None,
    compact: bool = True,
    exclude: Callable[[lance.LanceDataset], list[int]] | None = None,
    floor: int | None = None,
    storage_options: dict[str, str] | None = None,
    check: Callable[[lance.LanceDataset], None] | None = None,
) -> None:
    """Compact small fragments, move the tags of ``keep``, then remove old versions and files.

    Compaction runs if ``compact``; each tag of ``keep`` moves to its version; then versions
    older than ``older_than`` (never a tagged one, nor one at or above ``floor``: a reader
    holds it) and the files no version needs are removed. Commits may run meanwhile: Lance
    rebases them over the compaction; a compaction that meets one it cannot rebase over (a
    deletion of the same fragments) is dropped, and cleanup still runs. ``exclude`` names
    fragments compaction must leave alone (those a retention delete may take meanwhile: the
    files of a compaction that lost to it would stay on disk until Lance's 7-day sweep of
    unreferenced files). ``check`` runs on each version read before it is acted on (a
    fenced store's owner, see :mod:`pushtable.durable.fence`: it raises once another owns
    the dataset); compaction commits over that version, so a fence after it conflicts.
    """
    ds = open_dataset(uri, storage_options)
    if ds is None:
        return
    if check is not None:
        check(ds)
    if compact:
        try:
            ds.optimize.compact_files(
                excluded_fragment_ids=None if exclude is None else exclude(ds)
            )
        except OSError as exc:
            if not contention(exc) and "preempted" not in str(exc).lower():
                raise
            log.info("compaction of %s gave way to a concurrent commit: %s", uri, exc)
    ds = open_dataset(uri, storage_options) or ds
    if check is not None:
        check(ds)  # again: no tag moved, no version removed, once another owns it
    for tag, version in (keep or {}).items():
        move_tag(ds, tag, version)
    if older_than is None:
        return
    if floor is None:
        ds.cleanup_old_versions(older_than=older_than, error_if_tagged_old_versions=False)
    else:
        held = floor
        cutoff = datetime.now() - older_than  # Lance lists naive local times
        old = [
            int(v["version"])
            for v in ds.versions()
            if int(v["version"]) < held and _naive(v["timestamp"]) < cutoff
        ]
        if old:
            ds.cleanup_old_versions(versions=old, error_if_tagged_old_versions=False)


def _naive(when: Any) -> datetime:
    """A version's ``timestamp`` as Lance lists it (a naive local time), naive and local."""
    assert isinstance(when, datetime), when
    return when if when.tzinfo is None else when.astimezone().replace(tzinfo=None)
