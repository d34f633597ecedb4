"""What a run shows: the tqdm bar on a terminal, plain `step N/M loss X` lines elsewhere, metrics.jsonl,
TensorBoard scalars (read back from the event file) and the one-screen run summary."""

from __future__ import annotations

import io
import json
import math
import re
import sys

import pytest

from launch import ROOT, train_losses
from parallel_attention import load_config
from parallel_attention.training.metrics import MetricsLogger, PlainLines, TqdmBar, plot_loss
from parallel_attention.training.run.summary import run_summary
from parallel_attention.transformer.model import GPTModel

# what CI and scripts parse from stderr
PLAIN_LINE = re.compile(r"step (\d+)/(\d+) loss (\d+\.\d{4}) (\d+) tok/s ETA +\d+s")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _records(steps: int, mfu: bool = False) -> list[dict]:
    records = [{"step": 0, "val_loss": 5.5}]
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1234.0}
        records.append({**record, "mfu": 0.125} if mfu else record)
    records[-1]["val_loss"] = 2.25
    return records


def _log_all(tmp_path, monkeypatch, stream, progress_bar: bool, records: list[dict]) -> MetricsLogger:
    monkeypatch.setattr(sys, "stderr", stream)
    logger = MetricsLogger(tmp_path, max_steps=len(records) - 1, start_step=0, progress_bar=progress_bar,
                           tensorboard=False)
    for record in records:
        logger.log(dict(record))
    logger.close()
    return logger


@pytest.mark.parametrize("progress_bar, stream", [(False, FakeTerminal()), (True, io.StringIO())],
                         ids=["progress_bar_false", "not_a_terminal"])
def test_plain_lines_one_per_logged_step(tmp_path, monkeypatch, progress_bar, stream):
    records = _records(3)
    logger = _log_all(tmp_path, monkeypatch, stream, progress_bar, records)
    assert isinstance(logger.display, PlainLines)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 4
    assert lines[0] == "step 0: val loss 5.5000"
    parsed = [PLAIN_LINE.search(line).groups() for line in lines[1:]]
    assert parsed == [(str(s), "3", f"{5.0 / s:.4f}", "1234") for s in (1, 2, 3)]
    assert lines[-1].endswith(" val 2.2500")
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:  # the file format is unchanged
        assert [json.loads(line) for line in f] == records


def test_plain_lines_show_mfu_when_records_carry_it(tmp_path, monkeypatch):
    stream = io.StringIO()
    _log_all(tmp_path, monkeypatch, stream, False, _records(2, mfu=True))
    last = stream.getvalue().splitlines()[-1]
    assert PLAIN_LINE.search(last) and last.endswith(" mfu 12.5% val 2.2500")


def test_tqdm_bar_on_a_terminal(tmp_path, monkeypatch):
    stream = FakeTerminal()
    logger = _log_all(tmp_path, monkeypatch, stream, True, _records(4, mfu=True))
    assert isinstance(logger.display, TqdmBar)
    text = stream.getvalue()
    assert "step 0: val loss 5.5000\n" in text  # written above the bar, not into it
    assert not any(PLAIN_LINE.search(line) for line in text.splitlines())
    final = text.split("\r")[-1]  # the bar as last drawn
    assert "4/4" in final and "loss 1.2500" in final and "1234 tok/s" in final and "mfu 12.5%" in final
    assert "val 2.2500" in final and re.search(r"\d\d:\d\d<\d\d:\d\d", final)  # elapsed<ETA
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_tqdm_bar_of_a_resumed_run_starts_at_its_step(monkeypatch):
    stream = FakeTerminal()
    bar = TqdmBar(max_steps=10, start_step=6, stream=stream)
    bar.show({"step": 7, "loss": 1.0, "tokens_per_s": 10.0})
    bar.close()
    assert "7/10" in stream.getvalue().split("\r")[-1] and "mfu" not in stream.getvalue()


def test_run_summary_fits_one_screen_and_names_the_run():
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", ["--parallel.tensor_parallel_size=1",
                                                            "--parallel.sequence_parallel=true",
                                                            "--logging.run_dir=/shared/runs/tiny"])
    model = GPTModel(cfg.model, sequence_parallel=False)
    text = run_summary(cfg, model, world_size=2)
    lines = text.splitlines()
    assert len(lines) <= 24 and max(map(len, lines)) <= 160, text
    total = sum(p.numel() for p in model.parameters())  # p=1 and vocab 256: no padding, no sharding
    assert f"{total / 1e6:.2f}M parameters, {total / 1e6:.2f}M on each rank" in text
    assert "4 layers, hidden 128, 4 heads (4 k/v, head dim 32)" in text
    assert "world 2 = tensor parallel 1 x data parallel 2 + sequence parallel" in text
    assert "global 16 sequences = micro 8 x data parallel 2 x 1 accumulation step(s)" in text
    assert "2,048 per step" in text and "819,200 in 400 steps" in text
    assert "stdlib in data/stdlib_byte, byte tokenizer, epochs sampling" in text
    assert "/shared/runs/tiny/checkpoints every 100 steps" in text and "float32 on cpu" in text


@pytest.mark.parametrize("model", [[], ["--model.activation=swiglu", "--model.norm=rmsnorm", "--model.qk_norm=true",
                                   "--model.tie_embeddings=false", "--model.num_kv_heads=2", "--model.mlp_bias=true"]])
def test_a_pipeline_runs_summary_gives_the_total_size_and_each_stages_cost(model):
    """At pp 2 stage 0 holds part of the model: the model row still gives the whole model's size (every stage's,
    a tied table once), and each stage's row its layers, parameters and estimated cost."""
    from parallel_attention.pipeline.layout import rank_stage

    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", ["--parallel.tensor_parallel_size=1",
                                                            "--parallel.pipeline_parallel_size=2", *model])
    cfg.validate(2)
    whole = sum(math.prod(s) for s in GPTModel(cfg.model).canonical_shapes().values())
    stage0 = GPTModel(cfg.model, stage=rank_stage(4, 2, 1, None, 0))
    text = run_summary(cfg, stage0, world_size=2)
    assert f"  model        {whole / 1e6:.2f}M parameters, " in text, text
    assert "on pipeline stage 0" in text
    stages = next(line for line in text.splitlines() if line.startswith("  stages")).split("; ")
    assert stages[0].startswith("  stages       stage 0: layers 0-") and "+ embedding" in stages[0]
    assert stages[1].startswith("stage 1: layers ") and stages[1].count("+ output layer and loss") == 1
    shares = [int(re.search(r"\(([0-9]+) % of the step\)", s).group(1)) for s in stages]
    assert all("FLOP a token" in s for s in stages) and 99 <= sum(shares) <= 101


def test_run_summary_names_the_peak_and_where_it_comes_from():
    cfg = load_config(ROOT / "configs" / "gpt_tiny.yaml", ["--logging.peak_tflops=0.5"])
    text = run_summary(cfg, GPTModel(cfg.model, sequence_parallel=False), world_size=2)
    assert "  peak         0.5 TFLOP/s per device (logging.peak_tflops): MFU's denominator" in text.splitlines()


def test_pretraining_writes_tensorboard_scalars_equal_to_metrics_jsonl(reference_run):
    """The reference run (p = 2, 6 steps, TensorBoard on; tests/tiny_run.py): its summary, one plain line per
    step, and event files that hold the same losses as metrics.jsonl."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run, stderr = reference_run.run, reference_run.stderr
    assert "run summary" in stderr and "world 2 = tensor parallel 2 x data parallel 1" in stderr
    assert [int(m.group(1)) for m in PLAIN_LINE.finditer(stderr)] == [1, 2, 3, 4, 5, 6]

    events = accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={accumulator.SCALARS: 0})
    events.Reload()
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(events.Tags()["scalars"])
    logged = {e.step: e.value for e in events.Scalars("loss")}
    losses = train_losses(run)
    assert sorted(logged) == sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step, loss in losses.items():  # TensorBoard stores float32: equal to the JSON float rounded once
        assert logged[step] == pytest.approx(loss, rel=1e-6), f"step {step}"


def test_without_matplotlib_the_run_keeps_its_outputs_and_says_why_there_is_no_plot(tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_loss(tmp_path) is None and not (tmp_path / "loss.png").exists()
    assert capsys.readouterr().err == (f"no loss.png in {tmp_path}: matplotlib is not installed "
                                       "(pip install matplotlib)\n")
