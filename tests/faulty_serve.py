"""``pushtable serve`` whose Lance commits sometimes land and then raise (for the crash sweeps).

    python tests/faulty_serve.py SEED RATE [COUNT_FILE] -- <python> -m pushtable serve ...

Each manifest commit, and each sync after one, raises ``OSError(EIO)`` *after* the real call
with probability ``RATE`` (seeded): a late fsync error, an object store's lost reply. The
server must take such a commit for what it is (stored) and never append its offsets again.
Each injection appends a line to ``COUNT_FILE`` (when given), so a sweep can show they fired.
Run by ``tests/test_durable_crash.py``'s slow sweep, which also kills the process.
"""

from __future__ import annotations

import random
import sys
from typing import Any


def main() -> int:
    seed, rate = int(sys.argv[1]), float(sys.argv[2])
    counts = sys.argv[3] if sys.argv[3] != "--" else None
    argv = sys.argv[sys.argv.index("serve") :]  # what follows ``-m pushtable``
    rng = random.Random(seed)

    import lance

    from pushtable import cli, lance_commits

    def landing_then_raising(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            if rng.random() < rate:
                if counts is not None:
                    with open(counts, "a") as out:
                        out.write(f"{getattr(real, '__name__', real)}\n")
                raise OSError(5, "Input/output error (injected after the call landed)")
            return result

        return call

    real_commit = lance.LanceDataset.commit
    setattr(lance.LanceDataset, "commit", staticmethod(landing_then_raising(real_commit)))  # noqa: B010
    setattr(lance_commits, "sync_commit", landing_then_raising(lance_commits.sync_commit))  # noqa: B010
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
