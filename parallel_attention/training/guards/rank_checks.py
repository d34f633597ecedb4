"""Run guards that every rank checks together, so that a misconfigured run stops at once and loudly.

Config agreement: right after the process group exists, the ranks compare the resolved config, the
package version and the layout. A rank launched with another `--training.seed` would otherwise train
on other batches than its tensor-parallel peers, with exit 0; another `--training.max_steps` would
hang at the first collective the others no longer issue.

Replica audit (`check_replicas`): every `training.audit_interval` steps and before each checkpoint,
the parameters that must be identical across ranks are compared (`tensor_parallel.audit`): a silent
divergence of replicas (a bad GPU, a missed all-reduce) stops the run naming the parameters and ranks.
The divergence guard (non-finite losses and gradients) is `divergence`.
"""

from __future__ import annotations

from ...checkpointing.compatibility import flatten_dict
from ...tensor_parallel import parallel_state as ps
from ...tensor_parallel.audit import replica_mismatches
from ...launch.agreement import disagreements
from ...tensor_parallel.collectives import raise_together
from ...version import __version__
from ..config.schema import ConfigError, PretrainConfig


class ConfigMismatchError(ConfigError):
    """The ranks of one job run different configs (or package versions, or layouts)."""


def config_fingerprint(cfg: PretrainConfig) -> dict[str, object]:
    """Dotted key -> value of everything the ranks must agree on."""
    flat = flatten_dict(cfg.to_dict())
    flat["package.version"] = __version__
    flat["layout.world_size"] = ps.get_world_size()
    flat["layout.tensor_parallel_size"] = ps.get_tensor_model_parallel_world_size()
    return flat


def check_config_agreement(cfg: PretrainConfig) -> None:
    """Raise ConfigMismatchError on every rank, naming each differing key with its value per rank."""
    lines = disagreements(config_fingerprint(cfg))
    if lines:
        raise ConfigMismatchError("config differs across ranks:\n" + "\n".join(lines)
                                  + "\nlaunch every rank with the same config file and overrides.")


class GuardError(RuntimeError):
    """A run guard stopped training (raised on every rank); the message names the step and the fix."""


class ReplicaMismatchError(GuardError):
    """Parameters that must be identical across ranks differ."""


def check_replicas(model, step: int) -> None:
    """Audit the replicated parameters; raise ReplicaMismatchError on every rank, naming parameters and ranks."""
    local = replica_mismatches(model, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
    raise_together(local or None, lambda found: _replica_mismatch(step, found))


def _replica_mismatch(step: int, found: dict[int, list[str]]) -> ReplicaMismatchError:
    """The error for the mismatches the ranks found (each named once, in rank order)."""
    everywhere = list(dict.fromkeys(m for mismatches in found.values() for m in mismatches))
    shown = "\n".join(f"  {m}" for m in everywhere[:20]) + (f"\n  ... {len(everywhere) - 20} more"
                                                           if len(everywhere) > 20 else "")
    return ReplicaMismatchError(f"step {step}: replicated parameters differ across ranks:\n{shown}\n"
                                "the ranks no longer train one model (faulty device or memory, or a rank that "
                                "skipped a collective); not saving a checkpoint: restart from the newest "
                                "checkpoint with --resume, and check the hardware if it happens again.")
