"""Where a store is: a local directory, or a prefix on object storage named by a URL (``s3://bucket/prefix``,
``gs://``, ``az://``). ``--store`` is parsed here once, for every command; a ``file://`` URL is a directory.

A store on object storage keeps a local copy of its catalog, rebuilt from the store's manifests, in a cache
directory: ``$LAZYRAG_CACHE_DIR``, else ``$LAZYRAG_HOME/stores`` (``~/.cache/lazyrag/stores``)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lazyrag.home import lazyrag_home

# the schemes obstore opens from a URL (S3, Google Cloud Storage, Azure)
OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl")
CACHE_VAR = "LAZYRAG_CACHE_DIR"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class StoreURL:
    """A store on object storage: ``scheme://bucket[/prefix]``, without a trailing slash."""

    url: str

    def __str__(self) -> str:
        return self.url


def store_location(value: str | Path | StoreURL) -> Path | StoreURL:
    """``--store`` as a location: a URL of a supported scheme, else a local path. ValueError for a URL of
    another scheme or one that names no bucket."""
    if isinstance(value, (Path, StoreURL)):
        return value
    match = _SCHEME.match(value)
    if match is None:
        return Path(value)
    scheme = match.group(1).lower()
    if scheme == "file":
        return Path(unquote(urlsplit(value).path))
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(f"{value}: a store is a directory or a URL on object storage (s3://, gs://, az://), "
                         f"not {scheme}://")
    if not urlsplit(value).netloc:
        raise ValueError(f"{value} names no bucket; write {scheme}://BUCKET/PREFIX")
    return StoreURL(value.rstrip("/"))


def catalog_cache(url: StoreURL, root_metadata: bytes) -> Path:
    """The local directory that holds the catalog of the store at ``url``. Its name hashes the URL and the
    store's zarr.json (which holds the time it was created), so a store made again at the same URL gets a
    fresh catalog instead of the old one's rows."""
    default = lazyrag_home() / "stores"
    base = Path(os.environ[CACHE_VAR]).expanduser() if os.environ.get(CACHE_VAR) else default
    digest = hashlib.sha256(url.url.encode() + b"\0" + root_metadata).hexdigest()[:24]
    return base / digest
