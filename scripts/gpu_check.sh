#!/usr/bin/env bash
# GPU readiness in one command, at most 8 minutes on one GPU; writes a JSON summary.
#
#   scripts/gpu_check.sh [OUT.json]      (default gpu_check.json; logs and run directories in OUT_logs/)
#
# Steps, each under its own time limit (the limits add up to 7.5 minutes) and recorded with its status,
# seconds and log:
#   cuda_tests       the tests that run only where CUDA is present (the files that mention cuda, -k cuda)
#   pretrain_bf16    NCCL pretraining at p = 1 under bf16 autocast: finite losses that fall
#   pretrain_fp16    the same in fp16 with the dynamic loss scaler: the checkpoint's scale is > 1 (losses were
#                    scaled) and the first finite gradient norm is within 2x of bf16's (gradients were unscaled)
#   flash_sdpa       our model's forward + backward in bf16 with SDPA restricted to the flash kernel, and a
#                    flash kernel seen in the profile
#   bench_attention  benchmarks/benchmark_attention.py on its CUDA preset (p = 1)
#   bench_training   benchmarks/benchmark_training.py on the CUDA preset below (p = 1, transformers baseline)
# Exit status: 0 when every step passed, 1 otherwise, 2 without CUDA.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${1:-gpu_check.json}"
LOGS="${OUT%.json}_logs"
PYTHON="${PYTHON:-python}"
export OMP_NUM_THREADS=4

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: no CUDA device is visible to torch ($("$PYTHON" -c 'import torch; print(torch.__version__)' 2>&1)):" \
         "run it on a machine with an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
rm -rf "$LOGS"
mkdir -p "$LOGS"
: > "$LOGS/steps.tsv"

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout`, log to $LOGS/NAME.log, record the outcome
step() {
    local name="$1" limit="$2" started=$SECONDS status
    shift 2
    echo "== $name (limit ${limit}s)" >&2
    if timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1; then status=passed; else status="failed($?)"; fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$LOGS/steps.tsv"
    echo "   $status" >&2
}

TINY=(--config configs/gpt_tiny.yaml --parallel.tensor_parallel_size=1 --parallel.distributed_backend=nccl
      --training.max_steps=60 --training.eval_interval=60 --checkpoint.interval=60 --logging.log_interval=1
      --logging.progress_bar=false --logging.tensorboard=false --checkpoint.resume=none)
# the training benchmark's CUDA preset: Llama-style, h2048, 8 layers, 16 heads / 4 k/v heads, s2048, b8, bf16
TRAINING_PRESET=(--config configs/gpt_tiny.yaml --parallel.tensor_parallel_size=1 --model.hidden_size=2048
      --model.num_layers=8 --model.num_heads=16 --model.num_kv_heads=4 --model.activation=swiglu
      --model.norm=rmsnorm --model.position_embedding=rotary --model.qkv_bias=false --model.out_bias=false
      --model.mlp_bias=false --model.tie_embeddings=false --model.max_seq_len=2048 --data.seq_len=2048
      --training.global_batch_size=8 --training.micro_batch_size=4 --training.dtype=bfloat16)

mapfile -t CUDA_TEST_FILES < <(grep -l -i cuda tests/test_*.py)
step cuda_tests 120 "$PYTHON" -m pytest -q -n 0 -p no:cacheprovider -k cuda --junitxml="$LOGS/cuda_tests.xml" \
    "${CUDA_TEST_FILES[@]}"
step pretrain_bf16 50 torchrun --standalone --nproc-per-node 1 scripts/pretrain.py "${TINY[@]}" \
    --training.dtype=bfloat16 --logging.run_dir="$LOGS/run_bf16"
step pretrain_fp16 50 torchrun --standalone --nproc-per-node 1 scripts/pretrain.py "${TINY[@]}" \
    --training.dtype=float16 --logging.run_dir="$LOGS/run_fp16"
step flash_sdpa 40 "$PYTHON" benchmarks/_gpu_check_flash.py
step bench_attention 90 torchrun --standalone --nproc-per-node 1 benchmarks/benchmark_attention.py --sizes cuda \
    --iters 5 --warmup 2 --out "$LOGS/bench_attention.json"
step bench_training 100 torchrun --standalone --nproc-per-node 1 benchmarks/benchmark_training.py \
    "${TRAINING_PRESET[@]}" --iters 5 --warmup 2 --out "$LOGS/bench_training.json"

"$PYTHON" benchmarks/_gpu_check_summary.py "$LOGS" "$OUT"
