"""Where a server's durable topics live: a local directory or a prefix on an object store.

``pushtable serve --data-dir`` takes either: a path (``/var/lib/pushtable``, ``file:///…``)
or a URI Lance opens (``s3://bucket/prefix``, ``gs://…``, ``az://…``). Each durable topic is
one Lance dataset, ``<root>/<name>.lance``. Storage options (credentials, endpoint, region)
are what Lance takes (``aws_access_key_id``, ``aws_endpoint``, …) or Lance's usual environment
variables (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``); they are handed to Lance and never printed,
logged or stored.

Example:
    >>> import tempfile
    >>> root = DataDir(tempfile.mkdtemp())
    >>> root.local is not None, root.names()
    (True, [])
    >>> DataDir("s3://lake/topics").topic_uri("ticks")
    's3://lake/topics/ticks.lance'
"""

from __future__ import annotations

from pathlib import Path

import lance

from pushtable.durable.store import dataset_bytes, directory_bytes
from pushtable.lance_commits import is_local

__all__ = ["DataDir"]


class DataDir:
    """A server's data dir: its root (a path, or an object store URI) and storage options."""

    def __init__(self, root: str | Path, storage_options: dict[str, str] | None = None) -> None:
        text = str(root)
        if text.startswith("file://"):
            text = text.removeprefix("file://")
        #: the directory, for a local data dir (None on an object store)
        self.local: Path | None = Path(text) if is_local(text) else None
        #: the root as Lance opens it (no trailing slash)
        self.root = str(self.local) if self.local is not None else text.rstrip("/")
        #: what Lance takes to reach the store (None: its environment)
        self.storage_options = dict(storage_options) if storage_options else None
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)

    def __str__(self) -> str:
        return self.root  # never the storage options

    def __repr__(self) -> str:
        return f"DataDir({self.root!r})"

    def topic_uri(self, name: str) -> str:
        """The dataset of durable topic ``name``."""
        return f"{self.root}/{name}.lance"

    def names(self) -> list[str]:
        """The durable topics stored here, by name, sorted."""
        if self.local is not None:
            local = [p.name.removesuffix(".lance") for p in self.local.glob("*.lance")]
            return sorted(n for n in local if not n.startswith("."))  # the lease, not a topic
        from lance.namespace import (  # type: ignore[attr-defined]
            DirectoryNamespace,
            ListTablesRequest,
        )

        properties = {"root": self.root, "manifest_enabled": "false", "dir_listing_enabled": "true"}
        for key, value in (self.storage_options or {}).items():
            properties[f"storage.{key}"] = value
        namespace = DirectoryNamespace(**properties)  # type: ignore[no-untyped-call]
        found: list[str] = []
        token: str | None = None
        while True:
            page = namespace.list_tables(ListTablesRequest(id=[], page_token=token))
            found += page.tables
            token = page.page_token
            if not token:
                return sorted(n for n in found if not n.startswith("."))  # the lease

    def bytes(self) -> int:
        """Bytes the durable topics take.

        On a local disk, their files; on an object store, the files of each topic's newest
        version (older versions' files, until upkeep removes them, are not counted: a
        store's listing is slow and billed).
        """
        if self.local is not None:
            return directory_bytes(self.local)
        return sum(
            dataset_bytes(lance.dataset(self.topic_uri(n), storage_options=self.storage_options))
            for n in self.names()
        )
