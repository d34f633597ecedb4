#!/usr/bin/env bash
# GPU readiness in one command, at most 8 minutes on one GPU; writes a JSON summary.
#
#   scripts/gpu_check.sh [--dry-run] [OUT.json]   (default gpu_check.json; logs and run directories in OUT_logs/)
#
# Steps, each under its own time limit (the limits add up to 7.5 minutes) and recorded with its status,
# seconds, log and figures:
#   cuda_tests       the tests that run only where CUDA is present (the files that mention cuda, -k cuda)
#   pretrain_bf16    NCCL pretraining at p = 1 under bf16 autocast: finite losses that fall
#   pretrain_fp16    the same in fp16 with the dynamic loss scaler: the checkpoint's scale is > 1 (losses were
#                    scaled) and the first finite gradient norm is within 2x of bf16's (gradients were unscaled)
#   flash_sdpa       our model's forward + backward in bf16 with SDPA restricted to the flash kernel, and a
#                    flash kernel seen in the profile
#   kernels          the ring's pair kernels on CUDA (bf16, fp16) against MathBlocks in float32, forward and
#                    backward: causal diagonals, full pairs, GQA, documents; varlen_attn against one SDPA call per
#                    document, forward and backward, bf16, odd and single-token documents (one process)
#   attention_block  the attention block's forward + backward TFLOP/s, h 4096, 32 / 8 heads, s 4096, b 2, bf16,
#                    p = 1, against the device's dense bf16 peak (target >= 50 %)
#   bench_attention  benchmarks/benchmark_attention.py on its CUDA preset (p = 1)
#   train_1b         a training step of configs/llama_1b_tp8.yaml's shape at p = 1, 8 of its 22 layers, s 2048,
#                    b 4, bf16, no recomputation, with its MFU (target >= 40 %)
# Targets are reported in the summary's "targets", met or not; they do not fail the check.
# --dry-run checks the plumbing on any machine, CUDA or not: every step's program resolves and the Python files it
# names import (benchmarks/_gpu_check_plumbing.py, one interpreter for all steps); nothing runs. Exit status: 0 when every step passed, 1
# otherwise, 2 without CUDA (outside --dry-run).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
OUT="${1:-gpu_check.json}"
LOGS="${OUT%.json}_logs"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS=4

if (( ! DRY_RUN )) && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: no CUDA device is visible to torch ($("$PYTHON" -c 'import torch; print(torch.__version__)' 2>&1)):" \
         "run it on a machine with an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
rm -rf "$LOGS"
mkdir -p "$LOGS"
: > "$LOGS/steps.tsv"

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout` (--dry-run: check that it would start), log to
# $LOGS/NAME.log, record the outcome
step() {
    local name="$1" limit="$2" started=$SECONDS status
    shift 2
    if (( DRY_RUN )); then  # checked all at once at the end, in one interpreter
        printf '%s\n' "$@" > "$LOGS/$name.cmd"
        echo "$name" >> "$LOGS/steps.order"
        return
    fi
    echo "== $name (limit ${limit}s)" >&2
    if timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1; then status=passed; else status="failed($?)"; fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$LOGS/steps.tsv"
    echo "   $status" >&2
}

TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1)
TINY=(--config configs/gpt_tiny.yaml --parallel.tensor_parallel_size=1 --parallel.distributed_backend=nccl
      --training.max_steps=60 --training.eval_interval=60 --checkpoint.interval=60 --logging.log_interval=1
      --logging.progress_bar=false --logging.tensorboard=false --checkpoint.resume=none)
# the 1B step: configs/llama_1b_tp8.yaml's shape at p = 1 (8 of 22 layers; its vocabulary, on byte tokens)
ONE_B=(--config configs/llama_1b_tp8.yaml --parallel.tensor_parallel_size=1 --parallel.sequence_parallel=false
      --model.num_layers=8 --model.recompute_activations=false --data.tokenizer=byte --data.data_dir="$LOGS/data_1b"
      --data.max_bytes=2000000 --training.global_batch_size=4 --training.micro_batch_size=4)

mapfile -t CUDA_TEST_FILES < <(grep -l -i cuda tests/test_*.py)
step cuda_tests 80 "$PYTHON" -m pytest -q -n 0 -p no:cacheprovider -k cuda --junitxml="$LOGS/cuda_tests.xml" \
    "${CUDA_TEST_FILES[@]}"
step pretrain_bf16 40 "${TORCHRUN[@]}" scripts/pretrain.py "${TINY[@]}" \
    --training.dtype=bfloat16 --logging.run_dir="$LOGS/run_bf16"
step pretrain_fp16 40 "${TORCHRUN[@]}" scripts/pretrain.py "${TINY[@]}" \
    --training.dtype=float16 --logging.run_dir="$LOGS/run_fp16"
step flash_sdpa 30 "$PYTHON" benchmarks/_gpu_check_flash.py
step kernels 75 "$PYTHON" benchmarks/_gpu_check_kernels.py
step attention_block 45 "$PYTHON" benchmarks/_gpu_check_attention.py --iters 10 --warmup 3
step bench_attention 50 "${TORCHRUN[@]}" benchmarks/benchmark_attention.py --sizes cuda \
    --iters 3 --warmup 1 --out "$LOGS/bench_attention.json"
step train_1b 90 "${TORCHRUN[@]}" benchmarks/benchmark_training.py "${ONE_B[@]}" --no-baselines --no-variants \
    --iters 5 --warmup 2 --out "$LOGS/train_1b.json"

DRY=()
if (( DRY_RUN )); then
    DRY=(--dry-run)
    "$PYTHON" benchmarks/_gpu_check_plumbing.py --logs "$LOGS"
fi
"$PYTHON" benchmarks/_gpu_check_summary.py "${DRY[@]}" "$LOGS" "$OUT"
