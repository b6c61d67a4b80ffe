"""What is in a store's ``segments/`` folder, the clean-up of segments a crash left behind, and
the full check of a store (``lazyrag check``).

A directory there is this store's segment only if the catalog names it, or if its name has
the store's segment pattern and it carries the store's marker (written before any data). An
orphan (marked, not in the catalog: a crash between the data and the catalog commit) may be
deleted, and so may a segment-named directory that holds no data, only a torn marker or nothing
(a crash between its mkdir and its marker), and a half-written copy of the folder's own
zarr.json (zarr rewrites it through a temporary file each time a segment's array is created);
anything else is left where it is, with a warning.
Symbolic links are never followed: a store deletes nothing outside its own directory.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .catalog import Catalog
from .format import SEGMENT_MARKER, SEGMENT_NAME, SEGMENTS, ChunkReadError
from .segments import SegmentReader, marked_by

Warn = Callable[[str], None]
MARKER_MAX_BYTES = 1024  # a marker is a line of JSON; anything larger is not one being written
TORN_ZARR_JSON = re.compile(r"zarr\.[0-9a-f]{32}\.partial")  # zarr's temporary file for a zarr.json


def warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


@dataclass
class SegmentsScan:
    """The entries of ``segments/`` the catalog does not name."""

    orphans: list[Path] = field(default_factory=list)  # this store's, safe to delete (a torn zarr.json: a file)
    unrecognised: list[str] = field(default_factory=list)  # why each other entry is left alone
    missing: list[str] = field(default_factory=list)  # segments the catalog names that are not there


def scan_segments(root: Path, store_id: str | None, known: set[str]) -> SegmentsScan:
    scan = SegmentsScan()
    seg_dir = root / SEGMENTS
    if seg_dir.is_symlink():
        scan.unrecognised.append(f"{seg_dir} is a symbolic link; segments outside the store are never deleted")
        return scan
    if not seg_dir.is_dir():
        scan.missing = sorted(known)
        return scan
    present = set()
    for child in sorted(seg_dir.iterdir()):
        if child.name in known and child.is_dir() and not child.is_symlink():
            present.add(child.name)
        elif child.name == "zarr.json" and child.is_file() and not child.is_symlink():
            pass  # the segments group's own metadata
        elif TORN_ZARR_JSON.fullmatch(child.name) and child.is_file() and not child.is_symlink():
            scan.orphans.append(child)
        elif child.is_symlink():
            scan.unrecognised.append(f"{child} is a symbolic link, not a segment of this store; left in place")
        elif (child.is_dir() and SEGMENT_NAME.fullmatch(child.name) and store_id is not None
              and (marked_by(child) == store_id or never_marked(child))):
            scan.orphans.append(child)
        else:
            scan.unrecognised.append(f"{child} is not a segment of this store; left in place")
    scan.missing = sorted(known - present)
    return scan


def never_marked(segment_dir: Path) -> bool:
    """Whether ``segment_dir`` holds nothing but, at most, a marker too short or broken to read: a
    segment whose writer stopped before its marker was whole, so it holds no data to lose."""
    try:
        entries = list(segment_dir.iterdir())
        if not entries:
            return True
        marker = entries[0]
        return (len(entries) == 1 and marker.name == SEGMENT_MARKER and marker.is_file() and not marker.is_symlink()
                and marker.stat().st_size < MARKER_MAX_BYTES and marked_by(segment_dir) is None)
    except OSError:  # unreadable: not ours to judge
        return False


def delete_orphans(root: Path, store_id: str | None, known: set[str], warn: Warn = warn_stderr) -> int:
    """Delete the orphan segments of the store at ``root``; warn about anything else unknown."""
    scan = scan_segments(root, store_id, known)
    for orphan in scan.orphans:
        shutil.rmtree(orphan) if orphan.is_dir() else orphan.unlink()
    for message in scan.unrecognised:
        warn(message)
    return len(scan.orphans)


@dataclass
class CheckReport:
    """What ``lazyrag check`` found. ``corrupt`` and ``missing``: chunks whose data does not read
    back as stored (checksum mismatch; segment gone or truncated), each {chunk, segment, reason};
    ``dangling``: document references to chunks the catalog lacks, each {document, chunk}."""

    chunks: int = 0
    segments: int = 0
    corrupt: list[dict] = field(default_factory=list)
    missing: list[dict] = field(default_factory=list)
    dangling: list[dict] = field(default_factory=list)
    missing_segments: list[str] = field(default_factory=list)
    orphan_segments: list[str] = field(default_factory=list)
    unrecognised: list[str] = field(default_factory=list)  # left alone; not counted as damage
    unreferenced_chunks: int = 0  # dead chunks, reclaimed by `lazyrag compact`; not damage
    retrieval_index: str | None = None  # why the saved BM25 index is damaged (lazyrag/retrieve.py)

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.missing or self.dangling or self.missing_segments or self.orphan_segments
                    or self.retrieval_index)

    @property
    def damaged_chunk_ids(self) -> set[str]:
        """Chunks whose stored data must be written again."""
        return {r["chunk"] for r in self.corrupt + self.missing}

    def to_json(self) -> dict:
        return {"ok": self.ok, **asdict(self)}


def unreadable_segment_chunks(report: CheckReport, in_use: dict[str, list[str]]) -> list[dict]:
    """A row for each chunk of a missing segment not reported yet: a segment replaced by a symbolic
    link may still read through it, but it is not the store's, so its chunks are encoded again."""
    reported = report.damaged_chunk_ids
    return [{"chunk": c, "segment": name, "reason": f"segment {name} is missing (or not the store's own directory)"}
            for name in report.missing_segments for c in in_use[name] if c not in reported]


def check_store(catalog: Catalog, reader: SegmentReader, scan: Callable[[set[str]], SegmentsScan],
                verify: bool = True) -> CheckReport:
    """Compare the catalog with the disk and, with ``verify``, read every stored chunk back
    against its checksum; without it only each segment's presence and size are checked.
    ``scan``: what is in the store's segments folder, given the segment names the catalog knows."""
    report = CheckReport()
    segments = catalog.segments()
    report.segments = len(segments)
    in_use: dict[str, list[str]] = {}  # segment -> the chunks stored in it
    for chunk in catalog.iter_chunks(everything=True):
        report.chunks += 1
        in_use.setdefault(chunk.segment, []).append(chunk.chunk_id)
        try:
            if verify:
                reader.read_kv(chunk)
            else:
                reader.check_structure(chunk)
        except ChunkReadError as e:
            row = {"chunk": chunk.chunk_id, "segment": chunk.segment, "reason": str(e)}
            (report.corrupt if e.corrupt else report.missing).append(row)
    report.dangling = [{"document": d, "chunk": c} for d, c in catalog.dangling_references()]
    found = scan({s.name for s in segments})
    # a segment whose chunks were all encoded again elsewhere holds nothing: compaction forgets it
    report.missing_segments = [name for name in found.missing if name in in_use]
    report.missing += unreadable_segment_chunks(report, in_use)
    report.orphan_segments = [str(p) for p in found.orphans]
    report.unrecognised = found.unrecognised
    report.unreferenced_chunks = catalog.counts()["unreferenced_chunks"]
    return report
