"""The data verdict every rank shares: a problem with the token files found on any rank refuses the run on all.

Global rank 0 prepares the data while the others wait for it on the filesystem (no collective: preparing may take
longer than parallel.timeout_s), then every rank opens and verifies the files. A rank that raised on its own would
leave the others waiting in their next collective until the timeout, and torchrun's report would name whichever
rank failed first. So each step gathers every rank's verdict (a barrier too) and all ranks
raise the same DataFileError, a ConfigError: pretrain.py says `config error: ...` once and every rank exits 2.
The same holds after the start: once the sources are open, the ranks compare the hashes that identify their
copies (check_same_copies: nodes with different copies are refused before step 1), and each step's read (and the
validation set's) is agreed (read_agreed: one small all-reduce), so a chunk refused on one rank ends every rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Callable, TypeVar

from ....tensor_parallel.collectives import all_gather_objects, any_rank, raise_together
from ....tensor_parallel.mesh_groups import device_type
from ....tensor_parallel import parallel_state as ps
from .batches import GlobalBatchSampler, open_run_blend, run_sampler
from ...config.schema import PretrainConfig
from ..prepare.run_data_dir import ensure_prepared
from .index_cache import wait_for
from ..token_files import REFUSALS, DataFileError, meta_and_reason, refusal_message

__all__ = ["agreed", "build_data", "check_same_copies", "node_name", "open_run_sampler", "prepare_run_data",
           "read_agreed"]

T = TypeVar("T")


def agreed(check: Callable[[], T], data_dir) -> T:
    """check()'s result on this rank, once every rank has run its own; DataFileError on every rank, with the
    lowest refusing rank's message, if `check` raised one of token_files.REFUSALS on any rank."""
    refusal, result = None, None
    try:
        result = check()
    except REFUSALS as error:
        refusal = refusal_message(error, data_dir)
    raise_together(refusal, lambda refusals: DataFileError(next(iter(refusals.values()))))
    return result


def read_agreed(read: Callable[[], T]) -> T:
    """read()'s result, once every rank has read its own; DataFileError on every rank, with the lowest faulting
    rank's message, if any rank's read raised one of token_files.REFUSALS (a chunk that fails its hash, an id
    outside the vocabulary, a file gone). Without it, the faulting rank would stop alone and the others would
    wait in their next collective, to end with a backend's traceback ("Connection closed by peer") or a timeout.
    Costs one small all-reduce when no rank faults; every rank must call it, in the training thread."""
    fault, result = None, None
    try:
        result = read()
    except REFUSALS as error:
        fault = error
    if ps.is_distributed() and any_rank(fault is not None, device_type()):
        said = None if fault is None else str(fault) if isinstance(fault, ValueError) else \
            f"a data file cannot be read ({type(fault).__name__}: {fault}): check the storage the run's data is on"
        raise_together(said, _fault_of_rank, cause=fault)
    if fault is not None:  # one process
        raise fault
    return result


def _fault_of_rank(faults: dict[int, str]) -> DataFileError:
    rank, message = next(iter(faults.items()))
    return DataFileError(message if rank == 0 else f"{message} (found by global rank {rank})")


def check_same_copies(sources: list) -> None:
    """DataFileError on every rank, naming the nodes on each side and the file, when the ranks' copies of a source
    differ (one gather of each rank's `TokenSource.copies`). Nodes often hold their own copy of the data; one copy
    altered would train silently beside the others, as each rank verifies its files against its own record."""
    everyone = all_gather_objects((node_name(), [dict(source.copies) for source in sources]))
    for j, source in enumerate(sources):
        for file, _ in source.copies:
            seen: dict[str, dict[str, list[int]]] = {}  # sha256 -> node -> its ranks
            for rank, (node, copies) in enumerate(everyone):
                seen.setdefault(copies[j].get(file, "(none)"), {}).setdefault(node, []).append(rank)
            if len(seen) > 1:
                sides = "; ".join(f"sha256 {sha[:16]} on " + ", ".join(f"{node} (ranks {_ranks(ranks)})"
                                                                      for node, ranks in nodes.items())
                                  for sha, nodes in seen.items())
                raise DataFileError(
                    f"the ranks read different copies of {file}: {sides}. Every rank must train on the same bytes: "
                    f"copy the data to every node again from one source (or put it on a filesystem they share), "
                    f"then relaunch.")


def node_name() -> str:
    """This process's node as a report names it: torchrun's node rank (GROUP_RANK) and its host."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group} on {socket.gethostname()}" if group is not None else socket.gethostname()


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ", ".join(map(str, ranks))


def _prepared_by_rank_0(cfg: PretrainConfig) -> None:
    """Global rank 0 prepares data.data_dir; the others wait for it on the filesystem, not in a collective
    (preparing a corpus may take hours, the collective timeout minutes): for its complete meta.json, or for the
    verdict file rank 0 leaves beside it when it refuses. Then every rank shares rank 0's verdict (the barrier: no
    rank opens the files before rank 0 has prepared them)."""
    data_dir, rank_0 = Path(cfg.data.data_dir), ps.get_global_rank() == 0
    nonce = all_gather_objects(secrets.token_hex(8) if rank_0 else None)[0]  # this start's, not an older one's
    verdict = data_dir.parent / f".{data_dir.name}.refused-{nonce}"
    refusal = None
    if rank_0:
        try:
            ensure_prepared(cfg.data)
        except REFUSALS as error:
            refusal = error
            with contextlib.suppress(OSError):  # a read-only parent: the data is there, the others do not wait
                verdict.write_text(refusal_message(error, data_dir), encoding="utf-8")
    else:
        wait_for(lambda: verdict.is_file() or meta_and_reason(data_dir)[0] is not None,
                 f"global rank 0 to prepare {data_dir}")
    try:
        agreed(lambda: _raise(refusal), data_dir)
    finally:
        if rank_0:
            verdict.unlink(missing_ok=True)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def prepare_run_data(cfg: PretrainConfig) -> None:
    """Prepare data.data_dir once (global rank 0) unless a blend names the sources; a refusal on any rank is every
    rank's. It makes sure the directory exists and is the one the config asks for: it reads no batch."""
    if not cfg.data.blend:
        _prepared_by_rank_0(cfg)


def open_run_sampler(cfg: PretrainConfig) -> tuple[GlobalBatchSampler, list]:
    """Open every source on every rank, checked against its meta.json's sha256 (a refusal on any rank is every
    rank's), and every rank's copy against the others' (check_same_copies). Returns the sampler and the blend's
    sources."""
    sources, weights = agreed(lambda: open_run_blend(cfg), cfg.data.data_dir)
    check_same_copies(sources)
    return run_sampler(cfg, sources, weights), sources


def build_data(cfg: PretrainConfig) -> tuple[GlobalBatchSampler, list]:
    """prepare_run_data, then open_run_sampler. Nothing is written into the run directory here
    (data_identity.keep_run_tokenizer copies the tokenizer there once the run has resumed)."""
    prepare_run_data(cfg)
    return open_run_sampler(cfg)
