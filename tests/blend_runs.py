"""The command line of a tiny run on a blend, shared by the end-to-end blend tests (gpt_tiny shrunk, tp 1, a
checkpoint every 3 steps, every step logged)."""

from __future__ import annotations

from launch import ROOT


def blend_args(blend, run_dir, steps: int, *extra: str, micro_batch_size: int = 2, eval_interval: int = 3) -> list[str]:
    """pretrain.py / inspect_data.py arguments for `blend` [(path, weight)], `steps` steps into `run_dir`."""
    entries = ", ".join(f"{{path: '{path}', weight: {weight}}}" for path, weight in blend)
    return ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=2",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=8",
            f"--training.micro_batch_size={micro_batch_size}", f"--training.max_steps={steps}",
            f"--training.eval_interval={eval_interval}", "--training.eval_batches=1", "--schedule.warmup_steps=2",
            "--logging.log_interval=1", "--logging.progress_bar=false", "--logging.tensorboard=false",
            f"--data.blend=[{entries}]", "--parallel.tensor_parallel_size=1", "--checkpoint.interval=3",
            f"--logging.run_dir={run_dir}", *extra]
