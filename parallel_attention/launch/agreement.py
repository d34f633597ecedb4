"""Do all ranks of the job run with the same settings? One all_gather of a flat fingerprint.

Every torchrun entry point (pretraining, generation, the self-check) compares its resolved settings
right after the process group exists: a rank launched with other arguments would otherwise compute
on other data than its peers, or hang at the first collective the others never issue.
"""

from __future__ import annotations

from ..tensor_parallel.collectives import all_gather_objects


def disagreements(fingerprint: dict[str, object]) -> list[str]:
    """One line per key whose value differs across the world's ranks: `key: rank 0: a, rank 1: b`."""
    everyone = all_gather_objects({key: repr(value) for key, value in fingerprint.items()})
    keys = sorted(set().union(*everyone))
    differing = [k for k in keys if len({f.get(k, "<absent>") for f in everyone}) > 1]
    return [f"  {key}: " + ", ".join(f"rank {rank}: {f.get(key, '<absent>')}" for rank, f in enumerate(everyone))
            for key in differing]
