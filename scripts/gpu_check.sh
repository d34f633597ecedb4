#!/usr/bin/env bash
# GPU readiness in one command, at most 8 minutes; runs from a fresh clone with the machine's python3 (this checkout
# is put on PYTHONPATH here: nothing needs installing but torch, numpy, pyyaml, safetensors, tokenizers and tqdm).
#
#   scripts/gpu_check.sh [--dry-run] [--gpus N] [OUT.json]
#
# Writes two files, nothing in the checkout: OUT.json (default ${TMPDIR:-/tmp}/gpu_check.json), the summary, with
# the reason and the last 30 lines of the log of every step that failed, timed out or was skipped; and
# OUT_logs.tar.gz (under 4 MiB), every step's log, junit XML, metrics and JSON, without checkpoints or prepared data
# (benchmarks/_gpu_check_archive.py; worked on in a temporary directory, removed at exit).
# PYTHON=... picks the interpreter (default python3). The first lines name torch, CUDA, NCCL, the driver and the GPU.
#
# One GPU (the default), each step under its own limit and all of them under the 8 minutes (a step that would
# overrun them gets less; every step is interrupted with SIGINT first and given GRACE s to write its own report):
#   cuda_tests       the tests that run only where CUDA is present (the files that mention cuda, -k cuda); skipped,
#                    saying so, where pytest is not installed (the only step that needs it)
#   probe            what the CPU suite could only read (benchmarks/_gpu_check_probe.py): q, k, v reach the fused
#                    kernels in bf16 under bf16 autocast (after the head norm); the installed varlen_attn takes grouped
#                    k/v as they are, equal to the repeated call forward and backward; the dropout hash's masks on the
#                    device equal the CPU's bit for bit
#   pretrain_bf16    NCCL pretraining at p = 1 under bf16 autocast: finite losses that fall
#   pretrain_fp16    the same in fp16 with the dynamic loss scaler: the checkpoint's scale is > 1 (losses were
#                    scaled) and the first finite gradient norm is within 2x of bf16's (gradients were unscaled)
#   flash_sdpa       our model's forward + backward in bf16 with SDPA restricted to the flash kernel, and a
#                    flash kernel seen in the profile
#   kernels          the ring's pair kernels on CUDA (bf16, fp16) against MathBlocks in float32, forward and
#                    backward: causal diagonals, full pairs, GQA, documents; varlen_attn against one SDPA call per
#                    document, forward and backward, bf16, odd and single-token documents (one process)
#   fp8              torch._scaled_mm against the CPU's emulation; bf16 and FP8 linear times (_gpu_check_fp8.py)
#   moe              an MoE layer's bf16 grouped-matmul experts against the CPU's float32 layer, forward and
#                    backward (within 2e-2); its tokens/s at Qwen3-30B-A3B's shape (benchmarks/_gpu_check_moe.py)
#   attention_block  the attention block's forward + backward TFLOP/s, h 4096, 32 / 8 heads, s 4096, b 2, bf16,
#                    p = 1, against the device's dense bf16 peak (target >= 50 %)
#   bench_attention  benchmarks/benchmark_attention.py on its CUDA preset (p = 1)
#   train_1b         a training step of configs/llama_1b_tp8.yaml's shape at p = 1, 8 of its 22 layers, s 2048,
#                    b 4, bf16, no recomputation, with its MFU (target >= 40 %)
#   train_1b_fp8     the same step with training.fp8 tensorwise: its MFU (against the bf16 peak) and its speed-up
#                    over train_1b's step (the summary's "fp8_step_speedup")
# --gpus N (N >= 2 GPUs of one machine), instead:
#   ring_cp          a cp = N ring (NCCL, bf16) with k/v blocks of 64 MiB each against one flash SDPA call over the
#                    whole sequence, forward and backward (benchmarks/_gpu_check_ring.py)
#   selfcheck_tp     the cluster self-check at tp = N (python -m parallel_attention.check: float64 references)
#   selfcheck_cp     the self-check at tp = 1, cp = N (both context-parallel kinds, with and without documents)
#   selfcheck_pp     the self-check at tp = 1, pp = N (every pipeline schedule against the whole model on one rank,
#                    the batched exchanges between stages counted)
#   hang_named       under the collective guard, an all-reduce one rank never joins ends rank 0 within the 20 s
#                    timeout with CollectiveTimeoutError naming it and its group (benchmarks/_gpu_check_hang.py)
# Targets are reported in the summary's "targets", met or not; they do not fail the check.
# --dry-run checks the plumbing on any machine, CUDA or not: every step's program resolves and the Python files it
# names import (benchmarks/_gpu_check_plumbing.py, one interpreter for all steps); nothing runs, and each step that
# would start is recorded as dry_run. Exit status: 0 when
# no step failed (a skipped step says why), 1 otherwise, 2 without CUDA (outside --dry-run) or without torch.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
DRY_RUN=0 GPUS=0
while (( $# )); do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --gpus) GPUS="${2:-}"; shift 2 || { echo "gpu_check.sh: --gpus needs a number" >&2; exit 2; } ;;
        *) break ;;
    esac
done
if [[ "$GPUS" != 0 ]] && ! [[ "$GPUS" =~ ^[0-9]+$ && "$GPUS" -ge 2 ]]; then
    echo "gpu_check.sh: --gpus $GPUS: give the number of GPUs of this machine, 2 or more" >&2
    exit 2
fi
OUT="${1:-${TMPDIR:-/tmp}/gpu_check.json}"
[[ "$OUT" == *.json ]] || { echo "gpu_check.sh: OUT must end in .json, got $OUT" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")" && OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=4
BUDGET=480 RESERVE=20 GRACE=15  # seconds: all of it; kept for the summary and tarball; a step's report after SIGINT

LOGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
trap 'rm -rf "$LOGS"' EXIT
"$PYTHON" benchmarks/_gpu_check_versions.py --json "$LOGS/versions.json" || exit 2
if (( ! DRY_RUN )) && ! "$PYTHON" -c "import sys, torch; sys.exit(torch.cuda.device_count() < max(1, $GPUS))"; then
    echo "gpu_check.sh: torch sees fewer than $(( GPUS > 1 ? GPUS : 1 )) CUDA device(s): run it on a machine with" \
         "NVIDIA GPUs and a CUDA build of torch." >&2
    exit 2
fi
: > "$LOGS/steps.tsv"

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout` (--dry-run: check that it would start), log to
# $LOGS/NAME.log, record the outcome; the limit shrinks to what the budget has left
step() {
    local name="$1" limit="$2" started=$SECONDS status left rc
    shift 2
    if (( DRY_RUN )); then  # checked all at once at the end, in one interpreter
        printf '%s\n' "$@" > "$LOGS/$name.cmd"
        echo "$name" >> "$LOGS/steps.order"
        return
    fi
    left=$(( BUDGET - RESERVE - GRACE - SECONDS ))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        echo "not run: no time left of the ${BUDGET}s" > "$LOGS/$name.log"
        printf '%s\ttimeout(no time left of the %ss)\t0\n' "$name" "$BUDGET" >> "$LOGS/steps.tsv"
        return
    fi
    echo "== $name (limit ${limit}s)" >&2
    timeout --signal=INT --kill-after="$GRACE" "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=passed ;; 124|137) status="timeout(${limit}s)" ;; *) status="failed($rc)" ;; esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$LOGS/steps.tsv"
    echo "   $status" >&2
}

# skip NAME WHY: a step that cannot run here, recorded with the reason
skip() {
    echo "skipped: $2" > "$LOGS/$1.log"
    printf '%s\tskipped(%s)\t0\n' "$1" "$2" >> "$LOGS/steps.tsv"
    echo "== $1: skipped: $2" >&2
}

one_gpu() {
    local torchrun=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1)
    local tiny=(--config configs/gpt_tiny.yaml --parallel.tensor_parallel_size=1 --parallel.distributed_backend=nccl
        --data.data_dir="$LOGS/data_tiny" --training.max_steps=60 --training.eval_interval=60
        --checkpoint.interval=60 --logging.log_interval=1 --logging.progress_bar=false --logging.tensorboard=false
        --checkpoint.resume=none)
    # the 1B step: configs/llama_1b_tp8.yaml's shape at p = 1 (8 of 22 layers; its vocabulary, on byte tokens)
    local one_b=(--config configs/llama_1b_tp8.yaml --parallel.tensor_parallel_size=1 --parallel.sequence_parallel=false
        --model.num_layers=8 --model.recompute_activations=false --data.tokenizer=byte --data.data_dir="$LOGS/data_1b"
        --data.max_bytes=2000000 --training.global_batch_size=4 --training.micro_batch_size=4)
    local cuda_test_files
    mapfile -t cuda_test_files < <(grep -l -i cuda tests/test_*.py)
    if jq_false pytest; then
        skip cuda_tests "pytest is not installed for $PYTHON: pip install pytest"
    else  # pytest.ini's addopts without -n: pytest-xdist (and pytest-timeout) need not be installed
        step cuda_tests 120 "$PYTHON" -m pytest -q -o "addopts=-m 'not slow and not bench'" -p no:cacheprovider \
            -k cuda --junitxml="$LOGS/cuda_tests.xml" "${cuda_test_files[@]}"
    fi
    step probe 30 "$PYTHON" benchmarks/_gpu_check_probe.py
    step pretrain_bf16 40 "${torchrun[@]}" scripts/pretrain.py "${tiny[@]}" \
        --training.dtype=bfloat16 --logging.run_dir="$LOGS/run_bf16"
    step pretrain_fp16 35 "${torchrun[@]}" scripts/pretrain.py "${tiny[@]}" \
        --training.dtype=float16 --logging.run_dir="$LOGS/run_fp16"
    step flash_sdpa 25 "$PYTHON" benchmarks/_gpu_check_flash.py
    step kernels 60 "$PYTHON" benchmarks/_gpu_check_kernels.py
    # the checks first, the timings after: a budget spent early cuts a timing, not a check
    step fp8 30 "$PYTHON" benchmarks/_gpu_check_fp8.py  # _scaled_mm vs the emulation; bf16/FP8 linear times
    step moe 40 "$PYTHON" benchmarks/_gpu_check_moe.py  # bf16 grouped-matmul experts vs float32 CPU; tokens/s
    step attention_block 40 "$PYTHON" benchmarks/_gpu_check_attention.py --iters 10 --warmup 3
    step bench_attention 45 "${torchrun[@]}" benchmarks/benchmark_attention.py --sizes cuda \
        --iters 3 --warmup 1 --out "$LOGS/bench_attention.json"
    step train_1b 80 "${torchrun[@]}" benchmarks/benchmark_training.py "${one_b[@]}" --no-baselines --no-variants \
        --iters 5 --warmup 2 --out "$LOGS/train_1b.json"
    step train_1b_fp8 80 "${torchrun[@]}" benchmarks/benchmark_training.py "${one_b[@]}" --no-baselines \
        --no-variants --iters 5 --warmup 2 --out "$LOGS/train_1b_fp8.json" --training.fp8=tensorwise
}

many_gpus() {
    local torchrun=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS")
    step ring_cp 150 "${torchrun[@]}" benchmarks/_gpu_check_ring.py --kv-mib 64
    step selfcheck_tp 120 "${torchrun[@]}" -m parallel_attention.check --tp "$GPUS" --timeout 90
    step selfcheck_cp 120 "${torchrun[@]}" -m parallel_attention.check --tp 1 --cp "$GPUS" --timeout 90
    step selfcheck_pp 90 "${torchrun[@]}" -m parallel_attention.check --tp 1 --pp "$GPUS" --pp-message-mib 64 --timeout 60
    step hang_named 60 "${torchrun[@]}" benchmarks/_gpu_check_hang.py --timeout-s 20
}

# jq_false KEY: whether versions.json says KEY is false
jq_false() { grep -q "\"$1\": false" "$LOGS/versions.json"; }

if (( GPUS )); then many_gpus; else one_gpu; fi

DRY=()
if (( DRY_RUN )); then
    DRY=(--dry-run)
    [[ -f "$LOGS/steps.order" ]] && "$PYTHON" benchmarks/_gpu_check_plumbing.py --logs "$LOGS"
fi
"$PYTHON" benchmarks/_gpu_check_summary.py "${DRY[@]}" "$LOGS" "$OUT"
status=$?
"$PYTHON" benchmarks/_gpu_check_archive.py "$LOGS" "${OUT%.json}_logs.tar.gz" \
    && echo "gpu_check: logs in ${OUT%.json}_logs.tar.gz" >&2
exit $status
