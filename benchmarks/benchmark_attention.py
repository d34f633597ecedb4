"""Time ParallelSelfAttention against an unsharded reference, PyTorch's own tensor parallelism and fairscale.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/benchmark_attention.py --out bench_p2.json

Tensor-parallel size p = the number of launched ranks. For each case (causal, [s, b, h] input)
the variants run one forward+backward step each per repetition, in rotating order, with the
same canonical weights and input:
    unsharded       plain nn.Linear + SDPA attention on the full problem, on every rank (what p=1 is)
    torch_tp        the same module sharded by torch.distributed.tensor.parallel (DTensor): q, k, v apart
    torch_tp_fused  DTensor TP of one fused qkv projection, rows in the per-group layout (whole heads per rank)
    fairscale       fairscale 0.4.13's Column/RowParallelLinear, fused qkv (per-group layout), batch-first
    ours            parallel_attention.ParallelSelfAttention, with its defaults
    ours_no_overlap the same with overlap_comm=False (only with --compare-overlap)
    ours_sdpa       the same with attention_kernel='sdpa': one plain SDPA call, where 'auto' takes the chunked
                    causal kernel (on CPU only: transformer/kernels/causal_chunks.py)
A baseline whose package is missing (fairscale: pip install -e '.[bench]') or that cannot split the
case's k/v heads is skipped with the reason. Reported per variant: median ms per step (slowest rank),
ratio ours / variant, collectives and payload MB per step per rank, and peak memory per rank. Outputs
and input gradients are checked against the unsharded reference before anything is timed. Details:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import parallel_attention as pa
from parallel_attention.tensor_parallel.layers import unchanged
from parallel_attention.tensor_parallel.parallel_state import shutdown_distributed
from _bench_fused import FusedPlainAttention, fairscale_attention, torch_tp_fused
from _bench_measure import count_collectives, memory_method, peak_memory_mb, sync, time_variants
from _bench_reference import PlainAttention, torch_tp

VARIANTS = ("unsharded", "torch_tp", "torch_tp_fused", "fairscale", "ours", "ours_no_overlap", "ours_sdpa")
BATCH_FIRST = {"fairscale"}  # fed [b, s, h]; compared with the others after a transpose
FUSED_PEERS = ("fairscale", "torch_tp_fused")  # issue 9's target: ours <= 0.95x the faster of them


@dataclass(frozen=True)
class Case:
    name: str
    s: int
    b: int
    h: int
    nh: int
    nkv: int


# CPU cases finish in a few minutes on 2 cores (OMP_NUM_THREADS=1 per rank); CUDA cases are GPU-sized.
SIZES = {
    "cpu": [Case("small", 256, 2, 512, 8, 8), Case("medium", 512, 2, 1024, 16, 16),
            Case("gqa", 512, 2, 1024, 16, 4)],
    "cuda": [Case("medium", 2048, 4, 2048, 16, 16), Case("large", 4096, 4, 4096, 32, 32),
             Case("gqa", 4096, 4, 4096, 32, 8)],
}


def parse_case(text: str) -> Case:
    try:
        name, dims = text.split("=", 1)
        return Case(name, *map(int, dims.split(",")))
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=S,B,H,NH,NKV, e.g. big=1024,2,2048,16,4")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", choices=("auto", "cpu", "cuda"), default="auto",
                    help="preset of cases; auto: cuda on a GPU, cpu otherwise")
    ap.add_argument("--case", action="append", default=[], type=parse_case, metavar="NAME=S,B,H,NH,NKV",
                    help="a case of your own (repeatable); replaces the preset")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-bias", action="store_true", help="projections without biases (issue 9's config)")
    ap.add_argument("--compare-overlap", action="store_true",
                    help="also time ours with overlap_comm=False (variant ours_no_overlap)")
    ap.add_argument("--out", help="write all figures as JSON here (rank 0)")
    return ap.parse_args()


def cases_from(args, device: torch.device) -> list[Case]:
    if args.case:
        return args.case
    return SIZES[("cuda" if device.type == "cuda" else "cpu") if args.sizes == "auto" else args.sizes]


# ----------------------------------------------------------------------------- variants
def build_variants(case: Case, args, p: int, device: torch.device, dtype) -> tuple[dict, dict]:
    """The modules on the same canonical weights, and {variant: reason} for those skipped."""
    bias = not args.no_bias
    config = pa.AttentionConfig(hidden_size=case.h, num_heads=case.nh, num_kv_heads=case.nkv, causal=True,
                                params_dtype=dtype, qkv_bias=bias, out_bias=bias)
    ours = pa.ParallelSelfAttention(config, device=device)
    weights = ours.canonical_state_dict()
    dims = (case.h, case.nh, case.nkv, config.head_dim, device, dtype, bias)
    modules, skipped = {"unsharded": PlainAttention(*dims), "ours": ours}, {}
    modules["unsharded"].load_state_dict(weights)
    if args.compare_overlap:
        modules["ours_no_overlap"] = pa.ParallelSelfAttention(config, device=device, overlap_comm=False)
        modules["ours_no_overlap"].load_canonical_state_dict(weights)
    if device.type == "cpu":  # on CUDA 'auto' is SDPA already
        modules["ours_sdpa"] = pa.ParallelSelfAttention(replace(config, attention_kernel="sdpa"), device=device)
        modules["ours_sdpa"].load_canonical_state_dict(weights)
    if case.nkv % p == 0:
        plain = PlainAttention(*dims)
        plain.load_state_dict(weights)
        modules["torch_tp"] = torch_tp(plain, device.type, p)
        fused = FusedPlainAttention(weights, case.nh, case.nkv, config.head_dim, bias, device, dtype)
        modules["torch_tp_fused"] = torch_tp_fused(fused, device.type, p)
        fair, reason = fairscale_attention(weights, case.nh, case.nkv, config.head_dim, bias, p, dist.get_rank(),
                                           dtype)
        modules.update({"fairscale": fair} if fair is not None else {})
        skipped.update({"fairscale": reason} if fair is None else {})
    else:
        reason = (f"a column split cannot keep nkv={case.nkv} k/v heads whole over p={p} ranks "
                  "(ours replicates them)")
        skipped.update({v: reason for v in ("torch_tp", "torch_tp_fused", "fairscale")})
    return {v: modules[v] for v in VARIANTS if v in modules}, skipped


class Step:
    """One forward+backward of loss = sum(y * proj), proj a fixed random tensor: gradients reach
    the input and every weight, and the loss reads y, as the next layer would. (torch TP's output
    is an async all-reduce result; a bare y.backward(g) never waits for it, so its forward
    all-reduce would finish outside the timed region.) batch_first: the module takes [b, s, h]; its
    input, proj and output are transposed copies, and `canonical` turns them back to [s, b, h].
    """

    def __init__(self, module, x: torch.Tensor, proj: torch.Tensor, device: torch.device,
                 batch_first: bool = False) -> None:
        self.canonical = _transposed if batch_first else unchanged
        self.x = self.canonical(x).detach().clone(memory_format=torch.contiguous_format).requires_grad_(True)
        self.module, self.proj, self.device = module, self.canonical(proj).contiguous(), device

    def clear(self) -> None:
        """Drop the last step's gradients (outside the timed or measured region)."""
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None

    def forward(self) -> torch.Tensor:
        return self.module(self.x)

    def backward(self, y: torch.Tensor) -> None:
        (y * self.proj).sum().backward()

    def __call__(self) -> None:
        self.backward(self.forward())
        sync(self.device)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)


def check_correct(steps: dict, dtype) -> dict:
    """Output and input gradient of each variant vs the unsharded reference; abort when off."""
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2  # relative to the largest value
    results = {}
    for name, step in steps.items():
        step.clear()
        y = step.forward()
        step.backward(y)
        results[name] = (step.canonical(y.detach()).clone(), step.canonical(step.x.grad).clone())
    ref_y, ref_dx = results["unsharded"]
    errors = {}
    for name, (y, dx) in results.items():
        err = max(((y - ref_y).abs().max() / ref_y.abs().max()).item(),
                  ((dx - ref_dx).abs().max() / ref_dx.abs().max()).item())
        err_t = torch.tensor([err], device=y.device)
        dist.all_reduce(err_t, op=dist.ReduceOp.MAX)  # every rank aborts, or none
        errors[name] = err_t.item()
    bad = {n: e for n, e in errors.items() if e > tol}
    if bad:
        raise SystemExit(f"correctness check failed: relative error vs the unsharded reference {bad} "
                         f"exceeds {tol:g} (output or input gradient); not timing a wrong result.")
    return errors


def bench_case(case: Case, args, p: int, device: torch.device, dtype) -> dict:
    """Build, check, count, time and measure one case; figures per variant."""
    if case.nh % p or case.h % case.nh:
        raise SystemExit(f"case {case}: nh={case.nh} must divide h and be divisible by p={p}.")
    pa.manual_seed(args.seed)  # same weights and inputs on every rank and for every p
    modules, skipped = build_variants(case, args, p, device, dtype)
    x = torch.randn(case.s, case.b, case.h, device=device, dtype=dtype)
    proj = torch.randn_like(x)
    steps = {n: Step(m, x, proj, device, n in BATCH_FIRST) for n, m in modules.items()}
    errors = check_correct(steps, dtype)
    comms = {n: count_collectives(step, p) for n, step in steps.items()}
    if dist.get_rank() == 0:
        print(f"[{case.name}] correct, max rel err {errors}; timing {args.warmup}+{args.iters} reps", flush=True)
    times = time_variants(steps, args.warmup, args.iters, device)
    peaks = torch.tensor([peak_memory_mb(step, device) for step in steps.values()], dtype=torch.float64,
                         device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    variants = {}
    for i, name in enumerate(steps):
        q1, _, q3 = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else times[name] * 3
        median = statistics.median(times[name])
        variants[name] = {"median_ms": median, "iqr_pct": 100 * (q3 - q1) / median,
                          # paired: ours and this variant ran back to back in each repetition
                          "ours_over_this": statistics.median(o / t for o, t in zip(times["ours"], times[name])),
                          "ours_over_this_medians": statistics.median(times["ours"]) / median,
                          "peak_mb": peaks[i].item(), "times_ms": times[name],
                          "max_rel_err": errors[name], **comms[name]}
    return {"case": asdict(case), "variants": variants, "skipped": skipped}


# ----------------------------------------------------------------------------- report
def table(results: list[dict], env: dict) -> str:
    lines = [f"p={env['p']}  backend={env['backend']}  device={env['device']}  threads/rank={env['threads']}  "
             f"dtype={env['dtype']}  torch {env['torch']}  reps {env['warmup']}+{env['iters']}  "
             f"bias={env['bias']}  fairscale {env['fairscale']}",
             "ms: median per fwd+bwd step (slowest rank); ours/x: median of per-repetition ratios (<1: ours "
             "faster); coll: collectives per rank fwd+bwd; MB: their payload per step",
             f"peak MB (max over ranks): {env['memory_method']}",
             f"{'case':<8}{'s,b,h,nh/nkv':<20}{'variant':<16}{'ms':>9}{'IQR %':>7}{'ours/x':>8}"
             f"{'coll':>7}{'MB':>8}{'peak MB':>9}"]
    for r in results:
        c = r["case"]
        shape = f"{c['s']},{c['b']},{c['h']},{c['nh']}/{c['nkv']}"
        for name in (n for n in VARIANTS if n in r["variants"] or n in r["skipped"]):
            if name in r["skipped"]:
                lines.append(f"{c['name']:<8}{shape:<20}{name:<16}  skipped: {r['skipped'][name]}")
                continue
            v = r["variants"][name]
            lines.append(f"{c['name']:<8}{shape:<20}{name:<16}{v['median_ms']:>9.1f}{v['iqr_pct']:>7.1f}"
                         f"{v['ours_over_this']:>8.3f}{v['fwd']:>4}+{v['bwd']:<2}{v['mb_per_step']:>8.2f}"
                         f"{v['peak_mb']:>9.1f}")
        peers = [r["variants"][n] | {"name": n} for n in FUSED_PEERS if n in r["variants"]]
        if peers:
            best = min(peers, key=lambda v: v["median_ms"])
            lines.append(f"{c['name']:<8}ours / best fused peer ({best['name']}): {best['ours_over_this']:.3f}")
    return "\n".join(lines)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    args = parse_args()
    p = int(os.environ.get("WORLD_SIZE", "1"))
    device = pa.init_distributed(tensor_model_parallel_size=p)
    env = {"torch": torch.__version__, "backend": dist.get_backend(), "device": str(device), "p": p,
           "threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
           "cpu_count": os.cpu_count(), "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup,
           "python": platform.python_version(), "memory_method": memory_method(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "loadavg_start": os.getloadavg(),  # other jobs on the machine show up here
           "bias": not args.no_bias, "fairscale": _version("fairscale")}
    results = [bench_case(case, args, p, device, getattr(torch, args.dtype)) for case in cases_from(args, device)]
    env["loadavg_end"] = os.getloadavg()
    if dist.get_rank() == 0:
        print(table(results, env))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": env, "results": results}, f, indent=1)
            print(f"wrote {args.out}")
    shutdown_distributed()  # the groups, then the process group: none of gloo's threads outlives the exit


if __name__ == "__main__":
    main()
