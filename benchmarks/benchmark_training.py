"""Time one full training step (forward, backward, reductions, optimizer) as pretrain.py runs it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node N benchmarks/benchmark_training.py \
        --config FILE [--section.key=value ...] [--iters 10] [--warmup 3] [--baseline NAME ...] [--no-baselines] \
        [--no-variants] --out OUT.json

The config and overrides are read as pretrain.py reads them, at any (p, dp) the launch allows; the step is the
trainer's own (training/trainer.py: build, then train_step), so what is timed is what training runs. In the
same alternating rounds (each round runs every variant once, rotating the order) it times:
    ours                  the training step
    ours_tp_comm_off      the same step with the tensor-parallel group's collectives made no-ops (p > 1)
    ours_dp_comm_off      the same step without DDP's gradient all-reduce (dp > 1)
    transformers          Hugging Face transformers on the same initial weights (_bench_training_hf.py):
                          single process at p = 1, tp_plan="auto" at p > 1; skipped, with the reason, when
                          transformers is missing, dp > 1, the config has no counterpart or the losses differ
    transformers_p1       (--baseline transformers_p1) the same whole in one process on rank 0, the others idle
    parallelize           (--baseline parallelize) the same made tensor parallel by parallel_attention.parallelize
--baseline NAME (repeatable) picks the baselines (default: transformers; _bench_hf_baselines.py says how each runs).
--no-variants times ours alone (with the baseline unless --no-baselines): benchmark_scaling.py's runs. Another
kernel or layout is another run: e.g. --model.attention_kernel=sdpa (one SDPA call instead of the CPU causal
chunks), --parallel.sequence_parallel=true.
Exposed communication (ms) = the median over rounds of ours - the variant with that group's collectives off (the
two timed in the same round): the time that communication adds to the step, what overlap has not hidden
(_bench_training_timing.py).

JSON (rank 0): step_ms {median, q1, q3, iqr, n} (slowest rank per step), tokens_per_s, tflops (model TFLOP/s
per device; flops.py says what is counted), mfu, exposed_tp_comm_ms, exposed_dp_comm_ms,
parameter_bytes_per_rank, gradient_bytes_per_rank, optimizer_state_bytes_per_rank (each the max over ranks
after the timed steps; FSDP2's DTensors (--parallel.zero_stage=3) count their local shards),
saved_activation_bytes (peak of one step, max over ranks), variants_ms (each variant's summary), rounds_ms (each variant's step per round, in round
order), baselines (per baseline: status, step_ms, ours_over_NAME; parallelize also over_transformers and
over_transformers_p1, as the ratio of medians and the median of per-round ratios), and the resolved config.
logging.run_dir defaults to OUT.json.run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from pathlib import Path

import torch

from _bench_hf_baselines import BASELINES, baselines_report, hf_baselines
from _bench_measure import time_variants
from _bench_training_timing import (collectives_off, data_parallel_off, paired_difference_ms, parameters_restored,
                                    summary_ms)
from parallel_attention import load_config
from parallel_attention.launch.launcher_watch import stop_with_launcher
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.collectives import all_gather_objects
from parallel_attention.training import trainer
from parallel_attention.training.activation_memory import saved_activation_bytes
from parallel_attention.training.flops import flops_per_token, peak_tflops, step_rates
from parallel_attention.training.run.run_dir import release_run_dir
from parallel_attention.training.sharded_optimizer import optimizer_state_bytes, parameter_and_gradient_bytes


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpt_tiny.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--baseline", action="append", choices=BASELINES, dest="baselines",
                        help="a baseline to time next to ours (repeatable; default: transformers)")
    parser.add_argument("--no-baselines", action="store_true", help="time only our step and its variants")
    parser.add_argument("--no-variants", action="store_true", help="time our step without its variants")
    args, overrides = parser.parse_known_args(argv)
    args.baselines = args.baselines or ["transformers"]
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.key=value")
    if args.iters < 1 or args.warmup < 0:
        parser.error(f"--iters={args.iters} must be >= 1 and --warmup={args.warmup} >= 0")
    if not any(o.startswith("--logging.run_dir=") for o in overrides):
        overrides.append(f"--logging.run_dir={args.out}.run")
    return args, [*overrides, "--logging.progress_bar=false", "--logging.tensorboard=false"]


def variants(run, baselines: dict, with_variants: bool = True) -> tuple[dict, dict]:
    """(name -> one step, name -> the context it runs in, where it needs one); `baselines`: name -> step."""
    ours = lambda: trainer.train_step(run)  # noqa: E731
    steps, contexts = {"ours": ours}, {}
    if with_variants:
        _add_variants(run, ours, steps, contexts)
    steps.update(baselines)
    return steps, contexts


def _add_variants(run, ours, steps: dict, contexts: dict) -> None:
    """Our step again with one group's collectives switched off, each in its context: the variants whose
    difference from ours the report reads."""
    if ps.get_tensor_model_parallel_world_size() > 1:
        tp_group = ps.get_tensor_model_parallel_group()
        steps["ours_tp_comm_off"] = ours
        contexts["ours_tp_comm_off"] = lambda: _both(collectives_off(tp_group), parameters_restored(run.model))
    if ps.get_data_parallel_world_size() > 1:
        steps["ours_dp_comm_off"] = ours
        contexts["ours_dp_comm_off"] = lambda: _both(data_parallel_off(run), parameters_restored(run.model))


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def report(run, times: dict, baseline_infos: dict, memory: dict) -> dict:
    cfg = run.cfg
    steps = {name: summary_ms(ms) for name, ms in times.items()}
    rates = step_rates(cfg, run.device, run.tokens_per_step, steps["ours"]["median"] / 1e3)  # as metrics.jsonl
    # mfu and peak_tflops: null on a CPU without logging.peak_tflops (no MFU there: flops.py)
    exposed = {f"exposed_{kind}_comm_ms": paired_difference_ms(times["ours"], times[f"ours_{kind}_comm_off"])
               if f"ours_{kind}_comm_off" in times else 0.0 for kind in ("tp", "dp")}
    return {"tensor_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(), "device": str(run.device),
            "torch": torch.__version__, "host": platform.node(), "tokens_per_step": run.tokens_per_step,
            "step_ms": steps["ours"], "mfu": None, **rates,
            "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
            "peak_tflops": peak_tflops(cfg.logging.peak_tflops, run.device), **exposed, **memory,
            "variants_ms": steps, "rounds_ms": times, "baselines": baselines_report(times, baseline_infos),
            "config": cfg.to_dict()}


def main(argv: list[str]) -> int:
    stop_with_launcher()  # under torchrun: a worker whose launcher dies stops at once
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    try:
        _benchmark(args, cfg)
    finally:  # on every way out, once _benchmark's return has dropped the run (its DDP wrapper, its ZeRO optimizer)
        release_run_dir(cfg)  # its lock and lease: the next benchmark on this run directory finds it free
        ps.shutdown_distributed()  # the groups, then the process group: none of gloo's threads outlives the exit
    return 0


def _benchmark(args: argparse.Namespace, cfg) -> None:
    """Build, time every variant, measure memory; rank 0 writes the JSON and prints the summary line."""
    run = trainer.build(cfg)
    baselines, infos = ({}, {"transformers": {"status": "skipped", "reason": "--no-baselines"}}) \
        if args.no_baselines else hf_baselines(run, Path(cfg.logging.run_dir), args.baselines)  # the same weights
    steps, contexts = variants(run, baselines, not args.no_variants)
    times = time_variants(steps, args.warmup, args.iters, run.device, contexts)
    params, grads = zip(*all_gather_objects(parameter_and_gradient_bytes(run.model)))  # DTensors: local shards
    memory = {"parameter_bytes_per_rank": max(params), "gradient_bytes_per_rank": max(grads),
              "optimizer_state_bytes_per_rank": max(all_gather_objects(optimizer_state_bytes(run.optimizer))),
              "saved_activation_bytes": max(all_gather_objects(
                  saved_activation_bytes(lambda: trainer.train_step(run))))}
    result = report(run, times, infos, memory)
    if ps.get_global_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        others = "; ".join(f"{name}: " + (f"{b['step_ms']['median']:.1f} ms" if "step_ms" in b else b["reason"])
                           for name, b in result["baselines"].items())
        print(f"ours {result['step_ms']['median']:.1f} ms/step (IQR {result['step_ms']['iqr']:.1f}), "
              f"{result['tokens_per_s']:.0f} tok/s, MFU "
              + (f"{result['mfu']:.1%}" if result["mfu"] is not None else "none (no logging.peak_tflops on a CPU)")
              + "; exposed TP "
              f"{result['exposed_tp_comm_ms']:.1f} ms, DP {result['exposed_dp_comm_ms']:.1f} ms; {others}",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
