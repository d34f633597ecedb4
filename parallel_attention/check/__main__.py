"""`torchrun --nproc-per-node N -m parallel_attention.check [--tp P]`: the cluster self-check.

Sets up the groups (NCCL with CUDA, else gloo), runs every check on every rank, agrees on the
verdicts with one all_gather and prints the report on global rank 0 (format: the package docstring).
Exit status 0 when every check passed on every rank, else 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from .. import __version__
from ..launch.agreement import disagreements
from ..launch.launcher_watch import stop_with_launcher
from ..launch.rank_zero import is_rank_zero
from ..launch.report_once import record_errors
from ..launch.warning_lines import one_line_warnings
from ..tensor_parallel import get_data_parallel_group, get_tensor_model_parallel_group, init_distributed
from ..tensor_parallel.mesh_groups import new_groups
from ..tensor_parallel.parallel_state import (destroy_model_parallel, group_rank, initialize_model_parallel,
                                              shutdown_distributed)
from ..transformer import active_paths
from ..transformer.dropout import dropout_paths
from ..transformer.moe.experts import expert_paths
from .collectives_check import check_collectives
from .context import CheckContext
from .context_parallel_check import check_context_parallel
from .counts import check_collective_count
from .equivalence import check_attention, check_model
from .expert_parallel_check import check_expert_parallel
from .pipeline_check import check_pipeline, message_bytes
from .replicas import check_init, check_replicas
from .report import Result, agree, report_lines, run_guarded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m parallel_attention.check", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: also check CP attention of both kinds on (dp, cp, tp) groups")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel size: also check every pipeline schedule on (pp, dp) groups")
    parser.add_argument("--pp-message-mib", type=float, default=None,
                        help="size of each message between stages in the --pp check (default: 64 MiB on GPU, beyond "
                             "NCCL's buffering, where a send waits for its receive; the smallest, 4 KiB, on CPU)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size: also check an MoE layer with its experts split over ep ranks")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="parameter dtype of the checked modules (the reference is always float64 on CPU)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bandwidth-mib", type=float, default=None,
                        help="all-reduce size for the bandwidth figure (default: 4 MiB on CPU, 256 MiB on GPU)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a hung collective fails")
    parser.add_argument("--inject-fault", choices=("replica", "layout"), default=None,
                        help=argparse.SUPPRESS)  # for testing this tool: a perturbed replica, a mis-sharded weight
    return parser.parse_args(argv)


def _solo_group():
    """A group of this rank alone, for the p = 1 reference models (group creation is collective: every rank takes
    part in every rank's group; one split where torch can, `new_groups`). No collective ever runs on it."""
    return new_groups(torch.arange(dist.get_world_size()).view(-1, 1), None, "solo")


def build_context(args: argparse.Namespace, device: torch.device) -> CheckContext:
    tp_group = get_tensor_model_parallel_group()
    return CheckContext(device=device, dtype=DTYPES[args.dtype], tp_size=dist.get_world_size(tp_group),
                        tp_rank=group_rank(tp_group), tp_group=tp_group, dp_group=get_data_parallel_group(),
                        solo_group=_solo_group(), global_rank=dist.get_rank(), world_size=dist.get_world_size(),
                        seed=args.seed, fault=args.inject_fault)


def run_checks(ctx: CheckContext, bandwidth_bytes: int) -> list[Result]:
    return [run_guarded("collectives", check_collectives, ctx, bandwidth_bytes),
            run_guarded("attention", check_attention, ctx),
            run_guarded("model", check_model, ctx),
            run_guarded("init", check_init, ctx),
            run_guarded("replicas", check_replicas, ctx),
            run_guarded("collective-count", check_collective_count, ctx)]


def _header(ctx: CheckContext, args: argparse.Namespace) -> list[str]:
    cp = f", cp {args.cp} (its own check, last)" if args.cp > 1 else ""
    cp += f", pp {args.pp} (its own check, last)" if args.pp > 1 else ""
    cp += f", ep {args.ep} (its own check, last)" if args.ep > 1 else ""
    lines = [f"# parallel_attention {__version__} self-check: world {ctx.world_size}, tp {ctx.tp_size}, "
             f"dp {ctx.world_size // ctx.tp_size}{cp}, backend {dist.get_backend()}, device {ctx.device.type}, "
             f"dtype {args.dtype}, torch {torch.__version__}"]
    paths = {**active_paths(), **dropout_paths(), **expert_paths()}
    lines += [f"# path: {family}: {path}" for family, path in paths.items()]
    return lines + ([f"# injected fault: {args.inject_fault}"] if args.inject_fault else [])


def _setup_failure(error: Exception) -> int:
    if is_rank_zero():
        print(f"[FAIL] setup: {error}\ncheck: FAIL setup", flush=True)
    return 1


@record_errors  # an error no refusal caught: torchrun's root cause is its one line
def main(argv: list[str] | None = None) -> int:
    stop_with_launcher()  # under torchrun: a worker whose launcher dies stops at once
    one_line_warnings()
    args = parse_args(argv)
    start = time.perf_counter()
    tp = args.tp if args.tp is not None else int(os.environ.get("WORLD_SIZE", "1")) // max(args.cp, 1)
    try:
        return _check(args, tp, start)
    finally:
        shutdown_distributed()  # on every way out: a live gloo group at exit can abort with SIGABRT


def _check(args: argparse.Namespace, tp: int, start: float) -> int:
    """Join the groups, agree on the arguments, run the checks, report on rank 0; the exit status."""
    try:
        device = init_distributed(tp, timeout=args.timeout)
    except ValueError as error:  # a --tp that does not fit the world: say so in the report format
        return _setup_failure(error)
    differing = disagreements(vars(args))
    if differing:  # every rank must run the same checks, or the first differing collective hangs
        return _setup_failure(ValueError("arguments differ across ranks: " + "; ".join(d.strip() for d in differing)))
    ctx = build_context(args, device)
    default_mib = 256 if device.type == "cuda" else 4
    results = run_checks(ctx, int((args.bandwidth_mib or default_mib) * 2**20))
    if args.cp > 1:  # after the others, which build their blocks on the default groups at cp = 1
        destroy_model_parallel()
        initialize_model_parallel(tp, timeout=args.timeout, context_parallel_size=args.cp)
        results.append(run_guarded("context-parallel", check_context_parallel, build_context(args, device)))
    if args.pp > 1:  # its own (pp, dp) groups, tp 1: each stage against the whole model on its rank
        destroy_model_parallel()
        initialize_model_parallel(1, timeout=args.timeout, pipeline_model_parallel_size=args.pp)
        results.append(run_guarded("pipeline", check_pipeline, build_context(args, device),
                                   message_bytes(args.pp_message_mib, device)))
    if args.ep > 1:  # its own (dp, ep) groups, tp 1: the layer against the whole layer on each rank
        destroy_model_parallel()
        initialize_model_parallel(1, timeout=args.timeout, expert_model_parallel_size=args.ep)
        results.append(run_guarded("expert-parallel", check_expert_parallel, build_context(args, device)))
    results = agree(results)
    if ctx.global_rank == 0:
        lines = _header(ctx, args) + [f"# done in {time.perf_counter() - start:.1f} s"] + report_lines(results)
        print("\n".join(lines), flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
