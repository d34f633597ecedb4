"""Run guards that every rank checks together, so that a misconfigured run stops at once and loudly.

Config agreement: right after the process group exists, the ranks compare the resolved config, the
package version and the layout. A rank launched with another `--training.seed` would otherwise train
on other batches than its tensor-parallel peers, with exit 0; another `--training.max_steps` would
hang at the first collective the others no longer issue.
"""

from __future__ import annotations

from ..checkpointing.compatibility import flatten_dict
from ..tensor_parallel import parallel_state as ps
from ..tensor_parallel.collectives import all_gather_objects
from ..version import __version__
from .config import ConfigError, PretrainConfig


class ConfigMismatchError(ConfigError):
    """The ranks of one job run different configs (or package versions, or layouts)."""


def config_fingerprint(cfg: PretrainConfig) -> dict[str, object]:
    """Dotted key -> value of everything the ranks must agree on."""
    flat = flatten_dict(cfg.to_dict())
    flat["package.version"] = __version__
    flat["layout.world_size"] = ps.get_world_size()
    flat["layout.tensor_parallel_size"] = ps.get_tensor_model_parallel_world_size()
    return {key: repr(value) for key, value in flat.items()}


def check_config_agreement(cfg: PretrainConfig) -> None:
    """Raise ConfigMismatchError on every rank, naming each differing key with its value per rank."""
    fingerprints = all_gather_objects(config_fingerprint(cfg))
    keys = sorted(set().union(*fingerprints))
    differing = [k for k in keys if len({f.get(k, "<absent>") for f in fingerprints}) > 1]
    if not differing:
        return
    lines = [f"  {key}: " + ", ".join(f"rank {rank}: {f.get(key, '<absent>')}" for rank, f in enumerate(fingerprints))
             for key in differing]
    raise ConfigMismatchError("config differs across ranks:\n" + "\n".join(lines)
                              + "\nlaunch every rank with the same config file and overrides.")
