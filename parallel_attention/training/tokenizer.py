"""Tokenizers for pretraining: a dependency-free byte tokenizer, any Hugging Face `tokenizer.json`
(`tokenizers` runs offline: a model's own tokenizer, or a byte-level BPE trained on the corpus), and
GPT-2 BPE through tiktoken where its files are already cached.

All expose `name`, `vocab_size`, `eot_token`, `encode(str) -> list[int]`, `encode_array(str) -> ndarray`
(the fast path data preparation uses) and `decode(list[int]) -> str`. Nothing is downloaded, ever:
the GPT-2 tokenizer refuses to start unless tiktoken and its BPE files are already on this machine,
because a training job that fetches files at run time fails on air-gapped clusters halfway through.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpointing.tensor_io import file_digest, write_atomic
from .gpt2_tokenizer import Gpt2Tokenizer, TokenizerUnavailableError

__all__ = ["ByteTokenizer", "Gpt2Tokenizer", "HFTokenizer", "TokenizerFileError", "TokenizerIdentity",
           "TokenizerUnavailableError", "copy_tokenizer", "get_tokenizer", "tokenizer_file", "tokenizer_vocab_size",
           "tokenizers_library", "trains_bpe"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what travels with a model
TRAINED_BPE = "bpe"  # the spec of a byte-level BPE trained on the corpus, kept as DATA_DIR/tokenizer.json
KNOWN_BY_NAME = ("byte", "gpt2")  # fixed vocabularies, identified by name: no file to hash
BPE_EOS = "<|endoftext|>"  # the end-of-text token of the byte-level BPE that train_bpe writes
BPE_MIN_VOCAB = 257  # its 256 byte symbols and BPE_EOS
# end-of-text spellings of common families, tried when the tokenizer's config names none
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


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
    lib = tokenizers_library(f"tokenizer {path}")
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


def trains_bpe(spec: str | None) -> bool:
    """Whether `spec` asks the preparation to train a BPE on the corpus (one tokenizer.json per data directory)."""
    return spec == TRAINED_BPE


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer made a set of ids, recorded by meta.json, checked across a blend and kept in checkpoints so
    that ids are never read with another: `name` ("byte", "gpt2", "bpe" or a tokenizer.json's path) and the sha256
    of its tokenizer.json (None for byte and gpt2). On disk it keeps its two spellings byte for byte: meta.json's
    {"tokenizer", "tokenizer_sha256"} (`meta_fields`) and a checkpoint's {"tokenizer", "sha256"} (`record`)."""

    name: str | None
    sha256: str | None

    @classmethod
    def of_spec(cls, spec: str, data_dir: str | os.PathLike | None = None) -> TokenizerIdentity:
        """As meta.json records data.tokenizer=`spec`: byte / gpt2 by name, "bpe" with the sha256 of
        data_dir/tokenizer.json, a path as its tokenizer.json's absolute path (cwd does not matter) and sha256."""
        if spec in KNOWN_BY_NAME:
            return cls(spec, None)
        path = Path(data_dir) / "tokenizer.json" if trains_bpe(spec) else tokenizer_file(spec).resolve()
        return cls(spec if trains_bpe(spec) else str(path), file_digest(path)["sha256"] if path.is_file() else None)

    @classmethod
    def of_file(cls, name: str, tokenizer_json: Path | None) -> TokenizerIdentity:
        """`name` with the sha256 of `tokenizer_json` (None: a tokenizer known by name)."""
        return cls(name, file_digest(tokenizer_json)["sha256"] if tokenizer_json is not None else None)

    @classmethod
    def of_tokenizer(cls, tokenizer) -> TokenizerIdentity:
        """A loaded tokenizer's: an HFTokenizer by its file, byte and gpt2 by name."""
        return cls.of_file(tokenizer.name, getattr(tokenizer, "path", None))

    @classmethod
    def from_meta(cls, meta: dict) -> TokenizerIdentity:
        return cls(meta.get("tokenizer"), meta.get("tokenizer_sha256"))

    def meta_fields(self) -> dict:
        return {"tokenizer": self.name, "tokenizer_sha256": self.sha256}

    def data_dir_files(self) -> dict[str, str]:
        """{file name: sha256} of what the data directory holds of this tokenizer: a trained BPE's tokenizer.json
        (token_files verifies it with the token files), nothing for one known by name or kept elsewhere."""
        return {"tokenizer.json": self.sha256} if trains_bpe(self.name) and self.sha256 else {}

    @classmethod
    def from_record(cls, record: dict) -> TokenizerIdentity:
        return cls(record.get("tokenizer"), record.get("sha256"))

    def record(self) -> dict:
        return {"tokenizer": self.name, "sha256": self.sha256}

    def same_file(self, other: TokenizerIdentity) -> bool:
        """The same tokenizer: by the sha256 of its tokenizer.json, by name where there is no file (byte, gpt2)."""
        return self.sha256 == other.sha256 and (self.sha256 is not None or self.name == other.name)

    def describe(self) -> str:
        return str(self.name) + (f" (tokenizer.json sha256 {self.sha256})" if self.sha256 else "")


def get_tokenizer(spec: str, data_dir: str | os.PathLike | None = None):
    """The tokenizer `spec` names: "byte", "gpt2", "bpe" (the BPE prepare_data trained into `data_dir`),
    or a path to a tokenizer.json or a directory holding one."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return Gpt2Tokenizer()
    if trains_bpe(spec):
        if data_dir is None or not (Path(data_dir) / "tokenizer.json").is_file():
            raise TokenizerUnavailableError(f"tokenizer 'bpe': no trained tokenizer.json in data_dir={data_dir!s}; "
                                            "prepare_data trains it (python scripts/prepare_data.py ...).")
        return HFTokenizer(Path(data_dir) / "tokenizer.json")
    return HFTokenizer(spec)


def copy_tokenizer(path: Path, dest: Path) -> None:
    """`path` (a tokenizer.json) as dest/tokenizer.json, with the tokenizer_config.json and special_tokens_map.json
    beside it: what a model directory carries so that generation never depends on where the data lies."""
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


def tokenizers_library(who: str):
    """The `tokenizers` package, imported on first use (`import parallel_attention` must not need it)."""
    try:
        import tokenizers
    except ImportError as error:
        raise TokenizerUnavailableError(f"{who}: the `tokenizers` package is not installed: "
                                        "pip install tokenizers") from error
    return tokenizers
