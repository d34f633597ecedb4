"""Checkpoints: the on-disk format, atomic sharded save, verified load with fallback, resharding.

Owns the format (`format`: names, manifest, discovery, commit and retention), the encoding of
optimizer and RNG state as tensors (`state_encoding`), the one tensor-I/O module (`tensor_io`:
read a safetensors shard, atomic write with sha256, fsync), the collective save/load protocol
(`checkpoint`), the compatibility check a resume makes (`compatibility`), and resharding through
the canonical state dict (`reshard`). May import `tensor_parallel` and `transformer`.
"""

from .checkpoint import load_checkpoint, load_latest_valid, resolve_step_dir, save_checkpoint
from .format import CheckpointCorruptError, CheckpointError, latest_checkpoint, list_checkpoints, read_manifest
from .reshard import load_resharded, read_canonical_checkpoint, reshard_checkpoint, write_canonical_checkpoint
