"""A run's data: the sources of `data.blend` (or `data.data_dir` alone) opened, checked against one tokenizer, and
described for the run summary.

Every source must be tokenized alike: a blend of directories prepared with different tokenizers would train on ids
that mean different things. A prepared directory's meta.json names its tokenizer and the sha256 of its file; a
Megatron-LM prefix names none, so its ids are checked against the run's vocabulary as they are read.
"""

from __future__ import annotations

from pathlib import Path

from ...config.schema import BlendEntry, DataConfig, PretrainConfig
from ...tokenizer import KNOWN_BY_NAME, TokenizerIdentity, tokenizer_vocab_size, trains_bpe
from ..token_files import DataFileError
from .token_source import TokenSource, open_source

__all__ = ["blend_entries", "describe_blend", "index_cache_root", "open_blend", "open_run_blend", "prepared_tokenizer"]


def blend_entries(data: DataConfig) -> list[BlendEntry]:
    """data.blend, or data.data_dir as a blend of one."""
    return list(data.blend) or [BlendEntry(path=data.data_dir, weight=1.0)]


def prepared_tokenizer(sources: list[TokenSource], spec: str) -> Path | None:
    """The tokenizer.json the prepared sources were made with (for data.tokenizer=bpe, the first prepared
    directory's own), after checking every prepared source against `spec`; None for byte / gpt2 or no meta."""
    prepared = [s for s in sources if s.meta is not None]
    if trains_bpe(spec):  # each directory trained its own: the first one's is the run's
        path = Path(prepared[0].name) / "tokenizer.json" if prepared else None
        wanted = TokenizerIdentity(spec, TokenizerIdentity.from_meta(prepared[0].meta).sha256) if prepared else None
    else:  # as meta.json records it: byte / gpt2 by name, a tokenizer.json by its absolute path and sha256
        wanted = TokenizerIdentity.of_spec(spec)
        path = Path(wanted.name) if wanted.sha256 is not None else None
    for source in prepared:
        have = TokenizerIdentity.from_meta(source.meta)
        if wanted is not None and (have.sha256 != wanted.sha256 or (_by_name(spec) and have.name != spec)):
            raise DataFileError(
                f"{source.name} was prepared with the tokenizer {have.name} (sha256 {have.sha256}, its meta.json) but "
                f"this run's data.tokenizer={spec!r} is {wanted.name} (sha256 {wanted.sha256}): every source of a run "
                "must use one tokenizer; set data.tokenizer to the one the data was prepared with, or prepare the "
                "source again with this one (scripts/prepare_data.py --tokenizer ...).")
    return path


def _by_name(spec: str) -> bool:
    """Whether meta.json records `spec` under its own name (byte, gpt2, bpe), not as a path that differs by machine."""
    return spec in KNOWN_BY_NAME or trains_bpe(spec)


def open_blend(data: DataConfig, tokenizer_vocab: int, index_cache: Path | None = None) -> tuple[list[TokenSource],
                                                                                              list[float]]:
    """The blend's sources, each verified against its meta.json, and their weights; `index_cache`: the root of
    the index caches of Megatron-LM prefixes (token_source.open_source)."""
    paths = [e.path for e in data.blend] or [data.data_dir]  # blend_entries, without building a BlendEntry
    sources = [open_source(path, data.val_fraction, (tokenizer_vocab, data.tokenizer), index_cache=index_cache)
               for path in paths]
    prepared_tokenizer(sources, data.tokenizer)
    return sources, [e.weight for e in data.blend] or [1.0]


def index_cache_root(cfg: PretrainConfig) -> Path:
    """data.index_cache, or RUN/index_cache when it is null."""
    return Path(cfg.data.index_cache if cfg.data.index_cache is not None else Path(cfg.logging.run_dir) / "index_cache")


def open_run_blend(cfg: PretrainConfig) -> tuple[list[TokenSource], list[float]]:
    """The blend's sources, each verified, their vocabulary checked against the model's."""
    data = cfg.data
    sources, weights = open_blend(data, tokenizer_vocab_size(data.tokenizer, data.bpe_vocab_size),
                                  index_cache_root(cfg))
    for source in sources:
        if source.vocab_size > cfg.model.vocab_size:
            tokenizer = source.meta["tokenizer"] if source.meta else data.tokenizer
            raise DataFileError(f"the data in {source.name} was prepared with the tokenizer {tokenizer} of "
                                f"{source.vocab_size} tokens (its meta.json) but model.vocab_size="
                                f"{cfg.model.vocab_size}: set model.vocab_size >= {source.vocab_size}, or prepare the "
                                "data with another tokenizer.")
    return sources, weights


def describe_blend(sampler, max_steps: int) -> str:
    """One line per source of a GlobalBatchSampler: its path, normalised weight, training tokens, and the epochs of
    it that `max_steps` steps read (the sampler's own count)."""
    share = sampler.weights / sampler.weights.sum()
    epochs = sampler.epochs(max_steps)
    return "; ".join(f"{s.name} weight {w:.3g}, {s.train.num_tokens:,} train tokens, {epochs[s.name]:.2f} epochs"
                     for s, w in zip(sampler.sources, share))
