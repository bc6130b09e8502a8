"""A durable topic's owner, fenced by the store: a commit lands only under the current epoch.

A data dir's lease (:mod:`pushtable.flight.server.lease`) says which server serves it, but a
check of the lease beside a commit cannot stop a server paused (or cut off from the store)
between the check and the commit: once the pause ends, its commit lands over its successor's.
So the store itself refuses it. Each owner has an *epoch*, the lease dataset's version at
which it took the lease (every take is a commit over the previous version: epochs grow), and
every commit of a topic carries it (``pushtable.epoch`` in its transaction properties).

The successor's first act on each topic is a Lance ``Restore`` of the version it read,
stamped with its epoch (:func:`fence_topic`). Lance refuses an ``Append``, a ``Delete`` or a
``merge_insert`` whose read version precedes a ``Restore`` (``CommitConflictError``, not
retryable; pylance 14.0.2, on a local disk and on S3's conditional PUT alike; see
docs/deployment.md), so every commit the old owner prepared before the fence fails, however
long it was paused. The old owner commits with the version it last read as its read version
and never retries over a newer one without reading its epoch first
(:func:`check_epoch`): a newer epoch means it was fenced, and it tells its producers
(:class:`~pushtable.DataDirInUseError`, nothing acknowledged).

A ``Restore`` is blind: a commit that landed between the successor's read and its fence is
reverted by it. The fence sees that (it did not land at the version after the one it read)
and restores again the newest version it reverted, until one lands right after its read.

Example:
    >>> import tempfile, lance, pyarrow as pa
    >>> uri = tempfile.mkdtemp() + "/t.lance"
    >>> _ = lance.write_dataset(pa.table({"v": [1]}), uri)
    >>> fenced = fence_topic(uri, Fence(7), lambda state: {"k": "v"})
    >>> epoch_of(lance.dataset(uri)), fenced.count_rows()
    (7, 1)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import lance

from pushtable import lance_commits
from pushtable.errors import DataDirInUseError

__all__ = ["EPOCH_KEY", "FENCE_TAG", "Fence", "check_epoch", "epoch_of", "fence_topic", "refence"]

log = logging.getLogger(__name__)

#: the transaction property naming the epoch of the owner that made a commit
EPOCH_KEY = "pushtable.epoch"
#: a fence's transaction property: the version whose state it restored
KEEPS_KEY = "pushtable.fence_keeps"
#: the tag on the newest fence: cleanup keeps it, so Lance still sees it (see :func:`refence`)
FENCE_TAG = "pushtable-fence"
#: how often (at most) an owner fences its topic again, at cleanup
REFENCE_S = 60.0

#: how many times a fence restores again a commit it reverted before giving up
FENCE_ROUNDS = 8


@dataclass(frozen=True)
class Fence:
    """The owner's epoch its commits carry, and whether it may still commit.

    ``current`` (defence in depth, beside the store's fence) answers False once the owner
    knows it lost the data dir (its lease's term ran out without a renewal, or another
    server took it); ``lost`` is told when a commit finds itself fenced, so every topic
    stops at once.
    """

    epoch: int
    current: Callable[[], bool] = field(default=lambda: True, compare=False)
    lost: Callable[[str], None] | None = field(default=None, compare=False)
    #: asked before a topic is created or opened: whether the store still names this owner
    #: (one read; ``current`` runs on this host's clock, which another host's may not match)
    held: Callable[[], bool] = field(default=lambda: True, compare=False)

    def refuse(self, what: str) -> DataDirInUseError:
        """The error for ``what`` (a commit, a topic's creation) once the owner lost the dir."""
        return DataDirInUseError(
            f"{what}: this server no longer holds the data dir's lease (epoch {self.epoch}); "
            "nothing more is stored or acknowledged here"
        )


def epoch_of(ds: lance.LanceDataset) -> int:
    """The epoch of the newest commit of ``ds`` that names one (0: none does).

    The walk back from the newest version stops at a version cleanup removed (a
    compaction's commit names no epoch, and the versions before it may be gone): the newest
    fence is tagged (``FENCE_TAG``) and read then, so cleanup never hides an epoch.
    """
    found = lance_commits.newest_stamp(ds, lambda props: EPOCH_KEY in props)
    if found is not None:
        return int(found[1][EPOCH_KEY])
    tagged = lance_commits.read_tag(ds, FENCE_TAG)
    props = None if tagged is None else lance_commits.props_at(ds, tagged)
    return int(props[EPOCH_KEY]) if props is not None and EPOCH_KEY in props else 0


def check_epoch(ds: lance.LanceDataset, fence: Fence, what: str) -> None:
    """Raise :class:`~pushtable.DataDirInUseError` if a newer owner fenced ``ds``."""
    newer = epoch_of(ds)
    if newer > fence.epoch:
        raise DataDirInUseError(
            f"{what}: another server (epoch {newer}, this one {fence.epoch}) took the data "
            "dir and fenced the topic; nothing more is stored or acknowledged here"
        )


def fence_topic(
    uri: str,
    fence: Fence,
    props: Callable[[lance.LanceDataset], dict[str, str]],
    storage_options: dict[str, str] | None = None,
) -> lance.LanceDataset:
    """Fence the topic at ``uri`` with ``fence``'s epoch: no commit prepared before lands.

    ``props(state)`` are the fence commit's transaction properties besides the epoch: a
    topic's stamp as of ``state``, the version restored, so a restart reads the same stamp.
    Returns the fenced dataset (as it was: a ``Restore`` changes no row). Raises
    :class:`~pushtable.DataDirInUseError` if a newer owner fenced it first.
    """
    what = f"fencing durable topic {uri}"
    ds = _open(uri, storage_options)
    check_epoch(ds, fence, what)
    cut_short = _cut_short(ds)
    if cut_short is not None:  # a fence that reverted commits and stopped before it put
        keep, read = cut_short  # them back (a crash, a store error): put back first
        log.warning("%s: a fence reverted versions up to %d: restoring them", what, keep)
    elif epoch_of(ds) == fence.epoch:
        return ds  # fenced already: this owner opened it before
    else:
        keep = read = ds.version  # the state kept (every commit up to it), the version read
    for _ in range(FENCE_ROUNDS):
        state = ds if keep == ds.version else _open(uri, storage_options, keep)
        tx = lance.Transaction(
            read,
            lance.LanceOperation.Restore(keep),
            transaction_properties={
                **props(state),
                EPOCH_KEY: str(fence.epoch),
                KEEPS_KEY: str(keep),
            },
        )
        try:
            new = _commit(uri, tx, storage_options)
        except OSError as exc:
            if not lance_commits.contention(exc):
                raise
            ds = _open(uri, storage_options)  # another commit took the version: read again
            check_epoch(ds, fence, what)
            keep = read = ds.version
            continue
        if new.version == read + 1:
            lance_commits.move_tag(new, FENCE_TAG, new.version)
            return new
        # Commits landed between the read and the fence, and the Restore reverted them:
        # the newest of them holds them all; it is restored, over the fence, next round.
        reverted = _open(uri, storage_options, new.version - 1)
        if epoch_of(reverted) > fence.epoch:  # a newer owner's fence among them: it stays
            back = lance.Transaction(
                new.version,
                lance.LanceOperation.Restore(reverted.version),
                transaction_properties={
                    **props(reverted),
                    EPOCH_KEY: str(epoch_of(reverted)),
                },
            )
            _commit(uri, back, storage_options, max_retries=20)
            check_epoch(reverted, fence, what)
        ds, keep, read = new, reverted.version, new.version
    raise DataDirInUseError(f"{what}: other commits kept landing beside the fence")


def refence(
    ds: lance.LanceDataset,
    fence: Fence,
    props: dict[str, str],
    storage_options: dict[str, str] | None = None,
) -> lance.LanceDataset:
    """Fence ``ds`` (the newest version, read by its one writer) again, and tag the new fence.

    Lance refuses a commit over an older version only while it can read the ``Restore``
    between: once cleanup removed every version after the old owner's read, its stalled
    commit rebased over the successor's and landed. The newest fence is tagged
    (``FENCE_TAG``), so cleanup keeps it; it pins the files of the version it restored, so
    the owner fences again now and then (at cleanup, every ``REFENCE_S``), and the older
    fence goes with the versions cleanup removes.
    """
    check_epoch(ds, fence, f"fencing durable topic {ds.uri} again")
    tx = lance.Transaction(
        ds.version,
        lance.LanceOperation.Restore(ds.version),
        transaction_properties={
            **props,
            EPOCH_KEY: str(fence.epoch),
            KEEPS_KEY: str(ds.version),
        },
    )
    new = _commit(ds.uri, tx, storage_options)
    if new.version != ds.version + 1:
        # Another writer's commits came between (a successor, while this owner was paused
        # after its check): the Restore reverted them. They are put back, stamped as they
        # were, before this owner stops.
        reverted = _open(ds.uri, storage_options, new.version - 1)
        newer = epoch_of(reverted)
        back = lance.Transaction(
            new.version,
            lance.LanceOperation.Restore(reverted.version),
            transaction_properties={
                **_stamp_props(reverted),
                EPOCH_KEY: str(newer),
                KEEPS_KEY: str(reverted.version),
            },
        )
        _commit(ds.uri, back, storage_options, max_retries=20)
        raise DataDirInUseError(
            f"fencing durable topic {ds.uri} again: another server (epoch {newer}) committed "
            "beside it; its commits are kept, nothing more is stored or acknowledged here"
        )
    lance_commits.move_tag(new, FENCE_TAG, new.version)  # the older fence: cleanup's now
    return new


def _commit(
    uri: str,
    tx: lance.Transaction,
    storage_options: dict[str, str] | None,
    max_retries: int = 0,
) -> lance.LanceDataset:
    """Commit a fence's ``tx`` (by default once: a lost race comes back to the caller).

    A commit can raise after it landed (a late sync, an object store's lost reply): then the
    newest version, read back, is this very transaction (its properties name the epoch and
    the version kept) and is returned; otherwise the error is raised. A contention error is
    raised as it is (nothing landed).
    """
    try:
        return lance.LanceDataset.commit(
            uri, tx, storage_options=storage_options, max_retries=max_retries
        )
    except OSError as exc:
        if lance_commits.contention(exc):
            raise
        newest = lance_commits.open_dataset(uri, storage_options)
        props = tx.transaction_properties or {}
        if (
            newest is not None
            and newest.version > tx.read_version
            and lance_commits.props_at(newest, newest.version) == props
        ):
            log.warning("fencing %s: the commit landed and then raised (%s)", uri, exc)
            return newest
        raise


def _stamp_props(ds: lance.LanceDataset) -> dict[str, str]:
    """The properties of the newest commit of ``ds`` that carries a stamp (or none)."""
    found = lance_commits.newest_stamp(ds, lambda props: "pushtable.next_offset" in props)
    return {} if found is None else dict(found[1])


def _cut_short(ds: lance.LanceDataset) -> tuple[int, int] | None:
    """(keep, read) for the fence to go on with, if the newest one reverted commits for good.

    The newest version is a fence that restored version ``keep`` (its ``KEEPS_KEY``) while
    versions between ``keep`` and it hold commits other than fences: those were reverted,
    and the round that puts them back never landed. None when there is none such.
    """
    props = lance_commits.props_at(ds, ds.version)
    if props is None or KEEPS_KEY not in props:
        return None
    keeps = int(props[KEEPS_KEY])
    for version in range(keeps + 1, ds.version):
        between = lance_commits.props_at(ds, version)
        if between is None or KEEPS_KEY not in between:  # a commit the fence reverted
            return ds.version - 1, ds.version
    return None


def _open(
    uri: str, storage_options: dict[str, str] | None, version: int | None = None
) -> lance.LanceDataset:
    ds = lance_commits.open_dataset(uri, storage_options, version)
    if ds is None:
        raise FileNotFoundError(f"no dataset at {uri}")
    return ds
