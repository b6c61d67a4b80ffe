"""Whether this process can change a store. One that it cannot (a read-only filesystem, no write
permission) is still read: its catalog opened immutable (catalog.py), no lock file created, run
records kept by the caller elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

from .format import CATALOG_FILE


def writable(path: Path) -> bool:
    """Whether this process can create files in the store directory ``path`` and write its catalog
    (os.access says no on a read-only filesystem, even to root)."""
    return os.access(path, os.W_OK) and os.access(path / CATALOG_FILE, os.W_OK)


def cannot_write(path: Path) -> str:
    """Why the store at ``path`` cannot be changed, in words."""
    return f"{path} cannot be written (a read-only filesystem, or no write permission)"
