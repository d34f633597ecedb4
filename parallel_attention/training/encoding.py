"""Documents to token arrays, in corpus order, with the corpus read while earlier chunks are encoded.

Texts are grouped into chunks of about CHUNK_BYTES. Byte tokens are a copy of the text's bytes, made in line.
Other tokenizers encode a chunk at a time with their own threads (encode_batch releases the GIL) while a reader
thread parses the next chunks. That design was measured against a pool of spawned processes fed a bounded window
of chunks, 16 MB of jsonl with an 8192-token BPE, 2 workers: 1.12 vs 0.78 M tokens/s (no start-up, no pickling of
the arrays back). Whatever the worker count, the arrays come in corpus order: the files are byte-identical.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Iterable, Iterator

import numpy as np

from .tokenizer import get_tokenizer

__all__ = ["CHUNK_BYTES", "encode_documents", "use_threads"]

CHUNK_BYTES = 1 << 20  # text per task of the encoders


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_documents(spec: str, tokenizer_dir, texts: Iterable[str], num_workers: int) -> Iterator[np.ndarray]:
    """The token arrays of `texts`, in order (no end-of-text appended), encoded on `num_workers` threads."""
    tokenizer = get_tokenizer(spec, tokenizer_dir)
    if spec == "byte":
        for chunk in _chunks(texts):
            yield from tokenizer.encode_batch(chunk)
        return
    use_threads(num_workers)
    yield from _encode_while_reading(tokenizer, texts)


def use_threads(num_workers: int) -> None:
    """Let `tokenizers` encode a batch on `num_workers` threads: read by its thread pool when first used in this
    process (training a BPE uses it too: call this before), so a setting of the user's own is kept."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(num_workers))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


_DONE = object()


def _encode_while_reading(tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """encode_batch releases the GIL while its threads encode a chunk; meanwhile a reader thread parses the next
    chunks (a bounded queue: the corpus never sits in memory)."""
    chunks: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for chunk in _chunks(texts):
                if not hand_over(chunk):
                    return
            hand_over(_DONE)
        except BaseException as error:  # raised in the consumer
            hand_over(error)

    reader = threading.Thread(target=read, name="corpus-reader", daemon=True)
    reader.start()
    try:
        while (item := chunks.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield from tokenizer.encode_batch(item)
    finally:
        stop.set()
        reader.join()
