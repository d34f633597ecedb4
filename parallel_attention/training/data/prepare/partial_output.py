"""Where a preparation works until it is whole: `.NAME.partial/` beside the output directory `NAME`.

A preparation writes its shards there, one after the other. After each shard's files are renamed into place,
progress.json (written atomically) records the shard (counts and sha256 of both files), where the corpus's next
document starts (`next_input`: the file, its byte offset or row, and the counts so far: corpus.py's mark) and the
settings the work was done with. A killed preparation leaves the finished shards and progress.json; the same
command then resumes: it starts reading the corpus at `next_input`, never reading the finished shards' documents
again (a progress.json without it, from an older release, makes it read and skip them), and writes the next shard,
so the result is byte-identical to a run that never stopped. Other settings, or a corpus whose files changed, start over.

Only a complete preparation replaces `NAME` (one rename), so an existing dataset stays as it was until the new one
is whole. Two preparations of one `NAME` exclude each other with an flock on `.NAME.lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from ....checkpointing.tensor_io import file_digest, replace_directory, write_atomic
from ..chunk_hashes import CHUNK_BYTES, file_and_chunk_sha256
from ..indexed_dataset import IndexedDatasetWriter
from ..token_files import META, index_bytes

__all__ = ["PartialPreparation", "PreparationInUseError"]

PROGRESS = "progress.json"
_KEEP = {PROGRESS, "tokenizer.json", "tokenizer_config.json"}  # besides the recorded shards


class PreparationInUseError(ValueError):
    """Another live preparation writes the same output directory."""


class PartialPreparation:
    """The unfinished preparation of `final` with `settings` (a JSON-able dict): use as a context manager."""

    def __init__(self, final, settings: dict) -> None:
        self.final = Path(final)
        self.path = self.final.parent / f".{self.final.name}.partial"
        self.lock_path = self.final.parent / f".{self.final.name}.lock"
        self.settings, self.shards = settings, []
        self.next_input: dict | None = None  # where the corpus's next document starts (corpus.py's mark)
        self._itemsize: int | None = None  # of the shards' tokens, known once one is written
        self._lock_fd: int | None = None

    @property
    def documents_done(self) -> int:
        """Corpus documents that the finished shards hold: a resume skips them."""
        return sum(shard["num_documents"] for shard in self.shards)

    @property
    def next_prefix(self) -> Path:
        return self.path / f"shard_{len(self.shards):05d}"

    def __enter__(self) -> "PartialPreparation":
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._resume_or_start()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if error is not None and self.path.is_dir():
                self._keep_or_drop()
        finally:
            self._unlock()

    def finish_shard(self, writer: IndexedDatasetWriter, next_input: dict | None = None) -> None:
        """Close `writer`'s shard and record it with where the corpus's next document starts (after its files
        are in place: a kill between the two only loses that shard)."""
        self.next_input = next_input
        writer.finish()
        prefix, self._itemsize = writer.prefix.name, writer.dtype.itemsize
        bin_sha256, chunks = file_and_chunk_sha256(self.path / f"{prefix}.bin", CHUNK_BYTES)
        self.shards.append({"prefix": prefix, "num_documents": len(writer.lengths), "num_tokens": writer.num_tokens,
                            "bin_sha256": bin_sha256, "idx_sha256": file_digest(self.path / f"{prefix}.idx")["sha256"],
                            "chunk_bytes": CHUNK_BYTES, "bin_chunk_sha256": chunks})
        self._write_progress()

    def complete(self, meta: dict) -> None:
        """Write meta.json, then make the whole directory `final`, retiring what was there."""
        write_atomic(self.path / META, [json.dumps(meta, indent=2).encode("utf-8")])
        (self.path / PROGRESS).unlink()
        replace_directory(self.path, self.final, secrets.token_hex(6))

    def _resume_or_start(self) -> None:
        recorded = _read_json(self.path / PROGRESS)
        if recorded.get("settings") == self.settings and self._shards_intact(recorded):
            self.shards, self._itemsize = recorded["shards"], recorded["itemsize"]
            self.next_input = recorded.get("next_input")
            for path in self.path.iterdir():  # a shard killed half-written, or renamed but not yet recorded
                if path.name not in _KEEP and path.name.rsplit(".", 1)[0] not in {s["prefix"] for s in self.shards}:
                    path.unlink()
            if self.shards:
                print(f"resuming the preparation of {self.final} from its {len(self.shards)} finished shards "
                      f"({self.documents_done} documents) in {self.path}", file=sys.stderr, flush=True)
            return
        if self.path.exists():
            print(f"starting the preparation of {self.final} over: {self.path} was left by a preparation with other "
                  "settings or another corpus", file=sys.stderr, flush=True)
            shutil.rmtree(self.path)
        self.path.mkdir()
        self._write_progress()

    def _shards_intact(self, recorded: dict) -> bool:
        """Each recorded shard's files are there with their sizes (their hashes are checked when read)."""
        for shard in recorded["shards"]:
            sizes = {"bin": shard["num_tokens"] * recorded["itemsize"], "idx": index_bytes(shard["num_documents"])}
            for kind, size in sizes.items():
                path = self.path / f"{shard['prefix']}.{kind}"
                if not path.is_file() or path.stat().st_size != size:
                    return False
        return True

    def _write_progress(self) -> None:
        write_atomic(self.path / PROGRESS, [json.dumps({"settings": self.settings, "itemsize": self._itemsize,
                                                        "shards": self.shards, "next_input": self.next_input},
                                                       indent=1).encode("utf-8")])

    def _keep_or_drop(self) -> None:
        """After a failure: keep finished work (shards, a trained BPE) for a resume, else leave nothing behind."""
        if self.shards or (self.path / "tokenizer.json").is_file():
            print(f"kept {len(self.shards)} finished shards in {self.path}: run the same command again to resume "
                  f"(delete it to start over)", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)

    def _lock(self) -> None:
        """flock `.NAME.lock`, held until the end; the file is removed while held, so a waiter that opened it
        before checks that the name still means the file it locked, and tries again if not."""
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode("utf-8", errors="replace").strip() or "another process"
                os.close(fd)
                raise PreparationInUseError(
                    f"{self.final} is being prepared by {holder} (it holds {self.lock_path}): wait for it to end, "
                    "or give this preparation another output directory.") from None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            self.lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
