"""What every sample of a step read, without training: the code path of training itself, so it cannot disagree.

`open_run_data(cfg)` opens the run's blend and builds its sampler exactly as the trainer does (the same functions,
the sampling a resumed run keeps included); `step_records` lists, for each row of a step's global batch, the source
(its data.blend path as written), the source's document its first token belongs to, and the offset of that token
in the source's training token stream, with the tokens and their text when asked.
"""

from __future__ import annotations

from functools import partial

from .batches import GlobalBatchSampler, open_run_blend, read_rows, run_sampler
from ...config.schema import PretrainConfig
from .token_source import blend_entries, prepared_tokenizer
from .blend_history import continue_blend, read_history
from .data_identity import data_identity, source_sha256
from ...run.resume import keep_previous_sampling, resume_manifest
from ..token_files import DataFileError
from .token_source import open_source
from ...tokenizer import get_tokenizer, tokenizer_vocab_size

__all__ = ["blend_names", "open_run_data", "step_records"]


def open_run_data(cfg: PretrainConfig, resume: str | None = None) -> tuple[GlobalBatchSampler, object]:
    """(the run's sampler, its tokenizer) for data already prepared; nothing is prepared or written. The sampler
    continues the history of blends its checkpoint records (steps of an earlier blend open its sources when
    asked), as a resume of the run with this config would."""
    cfg = keep_previous_sampling(cfg, resume or cfg.checkpoint.resume)
    sources, weights = open_run_blend(cfg)  # what the trainer opens, its vocabulary check included
    path = prepared_tokenizer(sources, cfg.data.tokenizer)
    tokenizer = get_tokenizer(str(path) if path is not None else cfg.data.tokenizer)
    sampler = run_sampler(cfg, sources, weights)
    history = read_history(resume_manifest(cfg, resume or cfg.checkpoint.resume), data_identity(cfg, sources),
                           cfg.training.global_batch_size)
    continue_blend(sampler, history, partial(_open_phase, cfg))
    return sampler, tokenizer


def _open_phase(cfg: PretrainConfig, phase: dict) -> GlobalBatchSampler:
    """The sampler of an earlier blend of the run, its sources opened and checked against the history."""
    vocab = tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.bpe_vocab_size)
    sources = [open_source(s["path"], cfg.data.val_fraction, (vocab, cfg.data.tokenizer)) for s in phase["sources"]]
    for source, recorded in zip(sources, phase["sources"]):
        if source_sha256(source) != recorded["sha256"]:
            raise DataFileError(f"{source.name} is not the data this run read from step {phase['step']} (its "
                                f"checkpoint records sha256 {recorded['sha256']}): the source changed since.")
    return GlobalBatchSampler(sources, [s["weight"] for s in phase["sources"]], cfg.data.seq_len,
                              phase["global_batch_size"], cfg.training.seed, cfg.data.document_masking, "epochs")


def step_records(sampler: GlobalBatchSampler, step: int, names: list[str], *, tokens: bool = False,
                 tokenizer=None) -> list[dict]:
    """One record per row of the global batch of `step`; `names` are the blend's paths as the config writes them.
    With `tokens`, each record holds its seq_len + 1 tokens; with `tokenizer`, their text too."""
    phase = sampler.phase_at(step)  # the blend that read this step (an earlier one's sources by their paths)
    names = names if phase is sampler else [source.name for source in phase.sources]
    rows = phase.rows(step)
    records = []
    windows = read_rows(phase.streams, rows, sampler.seq_len + 1, False)[0] if tokens or tokenizer else None
    for row in range(len(rows.source)):
        stream = phase.streams[rows.source[row]]
        record = {"step": step, "row": row, "source": names[rows.source[row]],
                  "document": int(stream.window_documents([rows.offset[row]], 1)[0, 0]),
                  "offset": int(rows.offset[row])}
        if tokens:
            record["tokens"] = windows[row].tolist()
        if tokenizer is not None:
            record["text"] = tokenizer.decode(windows[row].tolist())
        records.append(record)
    return records


def blend_names(cfg: PretrainConfig) -> list[str]:
    """The blend's paths as the config writes them (data.data_dir for a blend of one)."""
    return [entry.path for entry in blend_entries(cfg.data)]

