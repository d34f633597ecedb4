"""Every rank reads the same bytes: at start, the ranks compare what identifies each source's content.

Nodes often hold their own copy of the data (a local NVMe, a copy per node). A copy altered on one node would train
silently beside the others: each rank verifies its own files against its own record, and a resume compares only
rank 0's against the checkpoint. So, once every rank has opened its sources, one gather shares each rank's
recorded hashes of every source (a prepared directory's meta.json, which records every shard's hashes; a
Megatron-LM prefix's .idx and the hashes of its .bin's chunks, from that node's index cache), and where two ranks
differ, every rank refuses the run before its first step, naming the nodes on each side and the file.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ....tensor_parallel.collectives import all_gather_objects
from .data_identity import source_sha256
from .source_index import chunks_digest
from .token_source import TokenSource
from ..token_files import DataFileError

__all__ = ["check_same_copies", "copy_hashes", "node_name"]


def copy_hashes(source: TokenSource) -> list[tuple[str, str]]:
    """(file, sha256) pairs that identify the bytes this rank reads of `source`."""
    if source.meta is not None:
        return [(str(Path(source.name) / "meta.json"), source_sha256(source))]
    return [(f"{source.name}.idx", source_sha256(source)), (f"{source.name}.bin", chunks_digest(source.index))]


def node_name() -> str:
    """This process's node as a report names it: torchrun's node rank (GROUP_RANK) and its host."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group} on {socket.gethostname()}" if group is not None else socket.gethostname()


def check_same_copies(sources: list[TokenSource]) -> None:
    """DataFileError on every rank when the ranks' copies of a source differ (one gather of their hashes)."""
    everyone = all_gather_objects((node_name(), [copy_hashes(source) for source in sources]))
    for j in range(len(sources)):
        for k, (file, _) in enumerate(everyone[0][1][j]):
            seen: dict[str, dict[str, list[int]]] = {}  # sha256 -> node -> its ranks
            for rank, (node, hashes) in enumerate(everyone):
                seen.setdefault(hashes[j][k][1], {}).setdefault(node, []).append(rank)
            if len(seen) > 1:
                sides = "; ".join(f"sha256 {sha[:16]} on " + ", ".join(f"{node} (ranks {_ranks(ranks)})"
                                                                      for node, ranks in nodes.items())
                                  for sha, nodes in seen.items())
                raise DataFileError(
                    f"the ranks read different copies of {file}: {sides}. Every rank must train on the same bytes: "
                    f"copy the data to every node again from one source (or put it on a filesystem they share), "
                    f"then relaunch.")


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ", ".join(map(str, ranks))
