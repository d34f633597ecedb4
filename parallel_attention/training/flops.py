"""Model FLOPs per token, the device's peak rate, and the two figures a step reports from them.

Model FLOPs per token are counted in `transformer/model_flops.py` (the pipeline split weighs stages by
the same count).

On a CPU, MFU is reported only against `logging.peak_tflops`: a GEMM probe at start read 0.016-0.035 TFLOP/s
on one host between runs, which moved MFU between 23 % and 93 %, so without the key there is no peak and no
`mfu` (the run summary says why). On a known GPU the peak is its data sheet's; on an unknown one, a GEMM rate
probed at start (the best of many short trials, the highest over the ranks).

MFU is never above 1, because a step cannot beat the device's true peak: a step that runs faster than the
peak in use proves that peak wrong. A probe can under-measure on a busy host; a configured figure may simply
be too low. Either way the peak
is then raised to the fastest step rate seen (a measured lower bound of the real peak), rank 0 warns once,
and each metrics row carries the `peak_tflops` its `mfu` was computed against, so mfu = tflops / peak_tflops
holds in every row. The raise is per process, with no collective per step: only global rank 0 logs metrics.
"""

from __future__ import annotations

import functools
import time
import warnings

import torch

from ..tensor_parallel import parallel_state as ps
from ..launch.rank_zero import is_rank_zero
from ..tensor_parallel.collectives import all_gather_objects
from ..transformer.model_flops import flops_per_token
from .config.schema import PretrainConfig

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets; the first name
# contained in torch.cuda.get_device_name() wins, so the more specific names come first.
GPU_BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
    ("A10G", 70.0), ("A10", 125.0),
)


def gpu_table_peak(name: str) -> float | None:
    """The dense bf16 peak of a known GPU by its name, else None."""
    return next((peak for key, peak in GPU_BF16_PEAK_TFLOPS if key in name), None)


def measured_gemm_tflops(device: torch.device, seconds: float = 0.5) -> float:
    """The best rate of repeated square GEMMs over about `seconds` (float32 on CPU, bf16 on GPUs).

    On CPU the matrices are 1024 wide (one GEMM is ~2 GFLOP, about the size of the step's largest) and the
    best of many short trials is kept: a short probe at one noisy moment used to read well below the rate the
    step sustains, which put MFU above 100 %."""
    cuda = device.type == "cuda"
    n, dtype, reps = (4096, torch.bfloat16, 20) if cuda else (1024, torch.float32, 2)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    torch.matmul(a, b)  # first call: library initialisation, not timed
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = max(best, reps * 2 * n ** 3 / (time.perf_counter() - start) / 1e12)
    return best


_AGREED: dict[torch.device, float] = {}  # device -> the peak every rank of this job uses (agree_peak_tflops)
_RAISED: dict[tuple, float] = {}  # (device, configured) -> the fastest step rate of this process, above the peak


@functools.lru_cache(maxsize=None)
def _auto_peak(device_type: str, index: int | None) -> float | None:
    """A known GPU's data-sheet peak, else an unknown GPU's probed rate; None on a CPU (no reference there)."""
    device = torch.device(device_type, index)
    if device.type != "cuda":
        return None
    known = gpu_table_peak(torch.cuda.get_device_name(device))
    if known is not None:
        return known
    with torch.random.fork_rng(devices=[device]):  # leave the seeded stream alone
        return measured_gemm_tflops(device)


def agree_peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """The peak every rank reports MFU against (a collective on a GPU: call it on every rank, before training);
    None on a CPU without `configured`.

    On an unknown GPU every rank measures at once, under the same load as the ranks' training, and all take the
    highest rate: one rank's noisy probe no longer gives it its own, lower peak."""
    if configured is not None or device.type != "cuda":
        return configured
    measured = _auto_peak(device.type, device.index)
    _AGREED[device] = max(all_gather_objects(measured))  # [measured] outside torch.distributed
    return _AGREED[device]


def peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """`logging.peak_tflops` if set; else the job's agreed peak (agree_peak_tflops), or the table's bf16 peak of
    a known GPU, or a bf16 GEMM rate measured once per process on an unknown GPU; None on a CPU. Raised to the
    fastest step rate of this process where a step beat it (`reported_peak`)."""
    base = configured if configured is not None else _AGREED.get(device) or _auto_peak(device.type, device.index)
    return None if base is None else max(base, _RAISED.get((device, configured), 0.0))


def peak_source(configured: float | None, device: torch.device) -> str:
    """Where the peak comes from, as the run summary and the warning name it."""
    if configured is not None:
        return "logging.peak_tflops"
    if device.type != "cuda":
        return ("none on a CPU without logging.peak_tflops (a GEMM probe varies 2x between runs): set it to the "
                "CPU's peak to report MFU")
    known = gpu_table_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return "the data sheet's dense bf16 peak" if known is not None else "a GEMM rate measured at start"


def reported_peak(achieved: float, configured: float | None, device: torch.device) -> float | None:
    """The peak a step's `achieved` TFLOP/s is reported against: `peak_tflops` (None: no MFU), raised to
    `achieved` when the step beat it (warned once, on global rank 0), so that MFU never exceeds 1."""
    peak = peak_tflops(configured, device)
    if peak is None or achieved <= peak:
        return peak
    key = (device, configured)
    if key not in _RAISED and is_rank_zero():
        warnings.warn(_too_fast(achieved, peak, configured, device), RuntimeWarning, stacklevel=3)
    _RAISED[key] = achieved
    return achieved


def _too_fast(achieved: float, peak: float, configured: float | None, device: torch.device) -> str:
    seen = f"a step ran at {achieved:.4g} model TFLOP/s per device, above the peak of {peak:.4g} TFLOP/s"
    if configured is not None:
        why = (f"logging.peak_tflops={configured:g} is too low for {device}: set it to the device's real peak for "
               "the training dtype")
    else:
        why = (f"{peak_source(None, device)} on {device} is below it (a probe under-measures on a busy host): set "
               "logging.peak_tflops to the device's real peak to compare MFU across runs")
    return f"{seen}: {why}. MFU is reported against the fastest step rate seen from now on, so it stays <= 1."


def flops_per_device(cfg: PretrainConfig, tokens_per_step: int) -> float:
    """The model FLOPs of one step that each device is credited with: the step's FLOPs over every device of the job.
    All pp x dp x cp x tp devices share them (a pipeline stage runs only its own layers, so pp divides them like
    the others); seq_len is the full sequence's (CP splits it, its attention FLOPs do not shrink)."""
    return flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step / ps.get_world_size()


def step_rates(cfg: PretrainConfig, device: torch.device, tokens_per_step: int, seconds: float) -> dict:
    """tokens/s of the whole job, achieved model TFLOP/s per device, MFU, and the peak MFU was computed against
    (`reported_peak`), for a step's metrics record; without a peak (a CPU without logging.peak_tflops) no MFU."""
    tflops = flops_per_device(cfg, tokens_per_step) / seconds / 1e12
    peak = reported_peak(tflops, cfg.logging.peak_tflops, device)
    rates = {"tokens_per_s": tokens_per_step / seconds, "tflops": tflops}
    return rates if peak is None else {**rates, "mfu": tflops / peak, "peak_tflops": peak}
