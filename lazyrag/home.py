"""Where lazyrag keeps what it downloads and derives: below the settings and the store, which both use it."""

from __future__ import annotations

import os
from pathlib import Path


def lazyrag_home() -> Path:
    """$LAZYRAG_HOME (default ~/.cache/lazyrag): models, catalogs of remote stores."""
    return Path(os.environ.get("LAZYRAG_HOME", "~/.cache/lazyrag")).expanduser()
