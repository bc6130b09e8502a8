"""``python -m pushtable`` is the ``pushtable`` command."""

from __future__ import annotations

import sys

from pushtable.cli import main

sys.exit(main())
