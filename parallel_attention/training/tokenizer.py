"""Tokenizers for pretraining: a dependency-free byte tokenizer, any Hugging Face `tokenizer.json`
(`tokenizers` runs offline: a model's own tokenizer, or a byte-level BPE trained on the corpus), and
GPT-2 BPE through tiktoken where its files are already cached.

All expose `name`, `vocab_size`, `eot_token`, `encode(str) -> list[int]`, `encode_array(str) -> ndarray`
(the fast path data preparation uses) and `decode(list[int]) -> str`. Nothing is downloaded, ever:
the GPT-2 tokenizer refuses to start unless tiktoken and its BPE files are already on this machine,
because a training job that fetches files at run time fails on air-gapped clusters halfway through.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["ByteTokenizer", "Gpt2Tokenizer", "HFTokenizer", "TokenizerFileError", "TokenizerUnavailableError",
           "copy_tokenizer", "get_tokenizer", "tokenizer_file", "tokenizer_vocab_size", "train_bpe"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what travels with a model
BPE_EOS = "<|endoftext|>"  # the end-of-text token of the byte-level BPE that train_bpe writes
BPE_MIN_VOCAB = 257  # its 256 byte symbols and BPE_EOS
# end-of-text spellings of common families, tried when the tokenizer's config names none
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class TokenizerUnavailableError(RuntimeError):
    """The requested tokenizer needs a package or files that are not present on this machine."""


class ByteTokenizer:
    """Token = UTF-8 byte value (vocab 256). Token 0, the NUL byte, separates documents.

    NUL never occurs in real text, so it is free to serve as end-of-text; the corpus reader drops any
    stray NUL so that the separator stays unambiguous.
    """

    name = "byte"
    vocab_size = 256
    eot_token = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(text) for text in texts]

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


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


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from `tokenizer.json` (offline; nothing is fetched).

    `eot_token` is the end-of-sequence id named by the tokenizer_config.json or special_tokens_map.json
    beside it, else the first common end-of-text spelling in the vocabulary, else None.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = tokenizer_file(path)
        self.name = str(self.path)
        self._tokenizer = _read_tokenizer_json(self.path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_token = self._eos_id()

    def _eos_id(self) -> int | None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config = self.path.parent / name
            if config.is_file():
                eos = _read_json_config(config).get("eos_token")
                eos = eos.get("content") if isinstance(eos, dict) else eos
                if isinstance(eos, str) and self._tokenizer.token_to_id(eos) is not None:
                    return self._tokenizer.token_to_id(eos)
        ids = [self._tokenizer.token_to_id(c) for c in _EOS_CANDIDATES]
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        # no special tokens: document boundaries are inserted by the data pipeline, once
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once (the Rust library spreads them over threads)."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, tokens) -> str:
        return self._tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)


class TokenizerFileError(ValueError):
    """A tokenizer.json (or a config beside it) that cannot be read; the message names the file and the fix."""


_REMEDY = ("copy the tokenizer's files again (an interrupted copy or download leaves a truncated file), or give "
           "'byte', 'gpt2', 'bpe' or another tokenizer.json")


def _read_tokenizer_json(path: Path):
    """The `tokenizers` Tokenizer in `path`. Its parser raises a bare Exception (e.g. "EOF while parsing an
    object") with no file name, so every failure becomes a TokenizerFileError naming the file."""
    lib = _tokenizers(f"tokenizer {path}")
    try:
        return lib.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers' errors are plain Exceptions; OSError too: this names the file
        raise TokenizerFileError(f"tokenizer {str(path)!r} cannot be read: it is not a valid tokenizers JSON file "
                                 f"({error}): {_REMEDY}.") from None


def _read_json_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TokenizerFileError(f"tokenizer config {str(path)!r} cannot be read: it is not a valid JSON file "
                                 f"({error}): {_REMEDY}.") from None
    if not isinstance(config, dict):
        raise TokenizerFileError(f"tokenizer config {str(path)!r} holds a {type(config).__name__}, not a JSON "
                                 f"object: {_REMEDY}.")
    return config


def tokenizer_file(path: str | os.PathLike) -> Path:
    """`path` itself if it is a tokenizer.json file, else `path`/tokenizer.json; ValueError naming both."""
    path = Path(path)
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if not candidate.is_file():
        from ..hf.convert import MISSING_TOKENIZER_NOTE, missing_tokenizer_message

        if (path / MISSING_TOKENIZER_NOTE).is_file():  # RUN/tokenizer of a model imported without one
            raise ValueError(f"tokenizer {str(path)!r} holds no tokenizer.json, only the note "
                             f"{path / MISSING_TOKENIZER_NOTE}: {missing_tokenizer_message(path.parent)}; or import "
                             "the model again with convert_hf.py import --tokenizer PATH.")
        raise ValueError(f"tokenizer {str(path)!r} is neither 'byte', 'gpt2', 'bpe' nor a tokenizer.json file or a "
                         "directory holding one (as save_pretrained writes).")
    return candidate


def get_tokenizer(spec: str, data_dir: str | os.PathLike | None = None):
    """The tokenizer `spec` names: "byte", "gpt2", "bpe" (the BPE prepare_data trained into `data_dir`),
    or a path to a tokenizer.json or a directory holding one."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return Gpt2Tokenizer()
    if spec == "bpe":
        if data_dir is None or not (Path(data_dir) / "tokenizer.json").is_file():
            raise TokenizerUnavailableError(f"tokenizer 'bpe': no trained tokenizer.json in data_dir={data_dir!s}; "
                                            "prepare_data trains it (python scripts/prepare_data.py ...).")
        return HFTokenizer(Path(data_dir) / "tokenizer.json")
    return HFTokenizer(spec)


def copy_tokenizer(path: Path, dest: Path) -> None:
    """`path` (a tokenizer.json) as dest/tokenizer.json, with the tokenizer_config.json and special_tokens_map.json
    beside it: what a model directory carries so that generation never depends on where the data lies."""
    from ..checkpointing.tensor_io import write_atomic

    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        source = path if name == "tokenizer.json" else path.parent / name
        if source.is_file():
            write_atomic(dest / name, [source.read_bytes()])


def tokenizer_vocab_size(spec: str, bpe_vocab_size: int) -> int:
    """The vocabulary size `spec` will have, known before any data is prepared: 256 for "byte", 50257 for "gpt2",
    `bpe_vocab_size` for "bpe" (an upper bound: a small corpus may stop the merges earlier), else read from the
    tokenizer.json the path names (ValueError naming the path when there is none)."""
    sizes = {"byte": ByteTokenizer.vocab_size, "gpt2": Gpt2Tokenizer.vocab_size, "bpe": bpe_vocab_size}
    return sizes[spec] if spec in sizes else HFTokenizer(spec).vocab_size


def train_bpe(texts, vocab_size: int, out_path: str | os.PathLike, show_progress: bool = False) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens on the strings of `texts`; save it as `out_path` (a
    tokenizer.json) with a tokenizer_config.json beside it naming its end-of-text token; return it loaded.

    Byte-level: the initial alphabet is the 256 byte symbols, so any text encodes and decodes exactly.
    Token 0 is `<|endoftext|>`, the end-of-text token the data pipeline puts between documents. Same texts,
    same tokenizer: the trainer is deterministic. `show_progress`: the `tokenizers` library's own progress bars
    on stderr (it offers no hook to report progress through: its stages only draw bars, or print JSON lines).
    """
    from ..checkpointing.tensor_io import write_atomic  # training is the top layer: it may read below

    if vocab_size < BPE_MIN_VOCAB:
        raise ValueError(f"bpe vocab_size={vocab_size} is below {BPE_MIN_VOCAB}, the 256 byte symbols plus {BPE_EOS}: "
                         f"set data.bpe_vocab_size >= {BPE_MIN_VOCAB} (8192 to 50000 is usual).")
    lib = _tokenizers("tokenizer 'bpe'")
    tokenizer = lib.Tokenizer(lib.models.BPE())
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=show_progress,
                                      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BPE_EOS, "bos_token": BPE_EOS,
              "add_prefix_space": False}
    write_atomic(out.parent / "tokenizer_config.json", [json.dumps(config, indent=2).encode("utf-8")])
    write_atomic(out, [tokenizer.to_str().encode("utf-8")])
    return HFTokenizer(out)


def _tokenizers(who: str):
    """The `tokenizers` package, imported on first use (`import parallel_attention` must not need it)."""
    try:
        import tokenizers
    except ImportError as error:
        raise TokenizerUnavailableError(f"{who}: the `tokenizers` package is not installed: "
                                        "pip install tokenizers") from error
    return tokenizers
