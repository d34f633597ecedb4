"""gpu_check.sh's logs archive: what a reader needs to decide the next fix, small enough for any artifact store.

    python benchmarks/_gpu_check_archive.py LOGS ARCHIVE.tar.gz

Packs the text a run wrote under LOGS (step logs, junit XML, metrics, JSON, configs, the step table) and nothing
else: no checkpoints, no prepared data (the tiny run's two checkpoints and data alone are about 20 MiB, mostly
incompressible float32). A file over PER_FILE keeps its last PER_FILE bytes (a log's end is where a failure is),
and files stop being added at TOTAL bytes, the rest named in left_out.txt: the archive stays under LIMIT.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

LIMIT = 4 * 2**20  # what the archive must stay under (an artifact store's per-file limit)
PER_FILE, TOTAL = 512 * 2**10, 3 * 2**20  # raw bytes: gzip cannot grow text past LIMIT from TOTAL
TEXT = {".log", ".xml", ".json", ".jsonl", ".tsv", ".cmd", ".order", ".txt", ".yaml", ".csv"}


def wanted(relative: Path) -> bool:
    """Text a run wrote, outside checkpoints and prepared data."""
    parts = relative.parts
    return (relative.suffix in TEXT and "checkpoints" not in parts
            and not any(part.startswith("data_") for part in parts[:-1]))


def _content(path: Path) -> bytes:
    size = path.stat().st_size
    if size <= PER_FILE:
        return path.read_bytes()
    with open(path, "rb") as f:
        f.seek(size - PER_FILE)
        return f"[the first {size - PER_FILE} bytes left out]\n".encode() + f.read()


def pack(logs: Path, archive: Path) -> list[str]:
    """Write the archive; returns what was left out (each with why)."""
    left_out, total = [], 0
    files = sorted((p for p in logs.rglob("*") if p.is_file()), key=lambda p: (p.stat().st_size, str(p)))
    with tarfile.open(archive, "w:gz") as tar:
        for path in files:
            relative = path.relative_to(logs)
            if not wanted(relative):
                left_out.append(f"{relative} (not a log, metrics or report)")
                continue
            data = _content(path)
            if total + len(data) > TOTAL:
                left_out.append(f"{relative} (the archive's {TOTAL} bytes were used up)")
                continue
            total += len(data)
            _add(tar, str(relative), data)
        _add(tar, "left_out.txt", "".join(f"{line}\n" for line in left_out).encode())
    return left_out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    pack(Path(sys.argv[1]), Path(sys.argv[2]))
