"""What every sample of a step read, without training: the code path of training itself, so it cannot disagree.

`open_run_data(cfg)` opens the run's blend and builds its sampler exactly as the trainer does (the same functions,
the sampling a resumed run keeps included); `step_records` lists, for each row of a step's global batch, the source
(its data.blend path as written), the source's document its first token belongs to, and the offset of that token
in the source's training token stream, with the tokens and their text when asked.
"""

from __future__ import annotations

from .batches import GlobalBatchSampler, read_rows, run_sampler
from ..config.schema import PretrainConfig
from .agreement import open_run_blend
from .blend import blend_entries, prepared_tokenizer
from ..run.resume import keep_previous_sampling
from .tokenizer import get_tokenizer

__all__ = ["blend_names", "open_run_data", "step_records"]


def open_run_data(cfg: PretrainConfig, resume: str | None = None) -> tuple[GlobalBatchSampler, object]:
    """(the run's sampler, its tokenizer) for data already prepared; nothing is prepared or written."""
    keep_previous_sampling(cfg, resume or cfg.checkpoint.resume)
    sources, weights = open_run_blend(cfg)  # what the trainer opens, its vocabulary check included
    path = prepared_tokenizer(sources, cfg.data.tokenizer)
    tokenizer = get_tokenizer(str(path) if path is not None else cfg.data.tokenizer)
    return run_sampler(cfg, sources, weights), tokenizer


def step_records(sampler: GlobalBatchSampler, step: int, names: list[str], *, tokens: bool = False,
                 tokenizer=None) -> list[dict]:
    """One record per row of the global batch of `step`; `names` are the blend's paths as the config writes them.
    With `tokens`, each record holds its seq_len + 1 tokens; with `tokenizer`, their text too."""
    rows = sampler.rows(step)
    records = []
    windows = read_rows(sampler.streams, rows, sampler.seq_len + 1, False)[0] if tokens or tokenizer else None
    for row in range(len(rows.source)):
        stream = sampler.streams[rows.source[row]]
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

