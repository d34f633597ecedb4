"""GPT-2's BPE through tiktoken, only from files already cached on this machine: nothing is downloaded, ever,
because a training job that fetches files at run time fails on air-gapped clusters halfway through."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["Gpt2Tokenizer", "TokenizerUnavailableError", "tiktoken_cache_dir"]


class TokenizerUnavailableError(RuntimeError):
    """The requested tokenizer needs a package or files that are not present on this machine."""


# The files tiktoken's "gpt2" encoding reads, with their sha256 (tiktoken_ext/openai_public.py). tiktoken
# caches each under sha1(url) and re-downloads a missing or mismatching one, so both are checked first.
_GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe":
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json":
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken looks for cached files (same rule as tiktoken.load); None if caching is disabled."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var]) if os.environ[var] else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _cached_ok(cache: Path, url: str, sha256: str) -> bool:
    path = cache / hashlib.sha1(url.encode()).hexdigest()
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256


_HOW_TO = (
    "To make it available offline: on a machine with network access run "
    "`pip install tiktoken && python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` with "
    "TIKTOKEN_CACHE_DIR set to a directory, copy that directory here and export TIKTOKEN_CACHE_DIR "
    "pointing to it. Or use data.tokenizer=byte, which needs nothing."
)


class Gpt2Tokenizer:
    """tiktoken's "gpt2" BPE (vocab 50257, end-of-text 50256), only from files already cached locally."""

    name = "gpt2"
    vocab_size = 50257
    eot_token = 50256

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError as exc:
            raise TokenizerUnavailableError(
                f"tokenizer 'gpt2' needs the tiktoken package, which is not installed. {_HOW_TO}"
            ) from exc
        cache = tiktoken_cache_dir()
        if cache is None:
            raise TokenizerUnavailableError(
                f"tokenizer 'gpt2': TIKTOKEN_CACHE_DIR is set to '', which disables tiktoken's cache and would "
                f"make it download the BPE files. {_HOW_TO}"
            )
        bad = [url.rsplit("/", 1)[1] for url, sha in _GPT2_FILES.items() if not _cached_ok(cache, url, sha)]
        if bad:
            raise TokenizerUnavailableError(
                f"tokenizer 'gpt2': the BPE file(s) {', '.join(bad)} are missing from tiktoken's cache {cache} "
                f"(or do not match their checksum), and nothing is downloaded at run time. {_HOW_TO}"
            )
        self._encoding = tiktoken.get_encoding("gpt2")

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: a literal "<|endoftext|>" in the corpus is text, not a document boundary.
        return self._encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once (tiktoken spreads them over threads)."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self._encoding.encode_ordinary_batch(texts)]

    def decode(self, tokens) -> str:
        return self._encoding.decode([int(t) for t in tokens], errors="replace")
