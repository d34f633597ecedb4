"""A blend of Megatron-LM indexed datasets trains end to end: the same losses at every data-parallel size and on a
resume at another one, epochs and data waits in the metrics, the blend in the summary, and inspect_data.py naming
exactly the tokens each row read."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from blend_runs import blend_args
from launch import ROOT, environment, metrics, run_command, torchrun, train_losses
from parallel_attention.training.data.document_split import validation_mask
from parallel_attention.training.data.indexed_dataset import IndexedDatasetWriter, IndexedTokens, token_dtype

VAL_FRACTION = 0.05


def _write_prefix(prefix, seed: int, num_documents: int) -> str:
    """Byte-token documents (ids 1..255) each ending in end-of-text 0, as the byte tokenizer writes them."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix, token_dtype(256))
    for _ in range(num_documents):
        text = rng.choice(np.frombuffer(b"abcdefgh ijklmnop\n", dtype=np.uint8), rng.integers(20, 400))
        writer.add_document(np.append(text, 0))
    writer.finish()
    return str(prefix)


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    return [(_write_prefix(root / "web_text_document", 1, 400), 0.7),
            (_write_prefix(root / "code_text_document", 2, 200), 0.3)]


def _args(blend, run_dir, steps, *extra):
    return blend_args(blend, run_dir, steps, f"--data.val_fraction={VAL_FRACTION}", *extra)


def test_a_blend_trains_alike_at_every_data_parallel_size_and_across_a_resume(blend, tmp_path):
    """A dp = 2 run of 6 steps; its step-3 checkpoint resumed at dp = 1 trains steps 4-6 to the same losses."""
    whole = torchrun("pretrain.py", 2, _args(blend, tmp_path / "two", 6))  # dp 2, checkpoints at steps 3 and 6
    resumed = tmp_path / "one"
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step_0000003", resumed / "checkpoints" / "step_0000003")
    torchrun("pretrain.py", 1, _args(blend, resumed, 6))  # resumed at dp 1 (checkpoint.resume: auto)
    two, one = train_losses(tmp_path / "two"), train_losses(resumed)
    assert sorted(two) == list(range(1, 7)) and sorted(one) == [4, 5, 6]
    for step in one:  # float32: dp 2 means the two halves' losses, dp 1 the whole; the batches are the same
        assert one[step] == pytest.approx(two[step], rel=1e-4), step
    rows = [r for r in metrics(tmp_path / "two") if "loss" in r]
    names = [path for path, _ in blend]
    assert all(set(r["epochs"]) == set(names) and r["data_wait_s"] >= 0 for r in rows)
    assert rows[-1]["epochs"][names[0]] > rows[0]["epochs"][names[0]] > 0
    summary = whole.stderr
    assert "blend" in summary and all(f"{name} weight" in summary for name in names)
    assert "epochs sampling" in summary
    evaluated = [r for r in metrics(tmp_path / "two") if "val_loss" in r]  # steps 0, 3, 6: a loss per source too
    assert [r["step"] for r in evaluated] == [0, 3, 6]
    assert all({"val_loss/web_text_document", "val_loss/code_text_document"} <= set(r) for r in evaluated)
    assert all(min(r["val_loss/web_text_document"], r["val_loss/code_text_document"]) <= r["val_loss"] <=
               max(r["val_loss/web_text_document"], r["val_loss/code_text_document"]) for r in evaluated)
    recorded = (tmp_path / "two" / "config.yaml").read_text()
    assert "stdlib" not in recorded and "source:" not in recorded  # a blend run claims no data.source


def _train_stream(prefix: str) -> np.ndarray:
    """The source's training tokens read independently: every document but the held-out ones, in order."""
    data = IndexedTokens(prefix)
    raw = np.fromfile(f"{prefix}.bin", dtype="<u2")
    held = validation_mask(data.num_documents, VAL_FRACTION)
    starts = data.document_starts
    return np.concatenate([raw[starts[i]:starts[i + 1]] for i in range(data.num_documents) if not held[i]])


def test_inspect_data_names_the_tokens_every_row_read(blend, tmp_path):
    out = run_command([sys.executable, str(ROOT / "scripts" / "inspect_data.py"),
                       *_args(blend, tmp_path / "run", 6), "--steps", "2:4", "--json", "--tokens"],
                      cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["step"], r["row"]) for r in records] == [(s, r) for s in (2, 3) for r in range(8)]
    streams = {path: _train_stream(path) for path, _ in blend}
    for record in records:
        assert set(record) == {"step", "row", "source", "document", "offset", "tokens"}
        stream = streams[record["source"]]
        assert record["tokens"] == stream[record["offset"]:record["offset"] + 33].tolist()
    assert {r["source"] for r in records} == set(streams)


def test_a_blend_trains_and_evaluates_at_pp_2_as_one_process(blend, tmp_path):
    """With the default eval_batches (4), a blend's validation micro-batches are split per source and differ in
    rows: the forward-only schedule gives each its own shape, and pp 2 gives one process's numbers."""
    def run(name: str, world: int, *extra: str) -> list[dict]:
        torchrun("pretrain.py", world, _args(blend, tmp_path / name, 3, "--training.eval_batches=4", *extra))
        return [r for r in metrics(tmp_path / name) if "loss" in r or "val_loss" in r]

    one, two = run("pp1", 1), run("pp2", 2, "--parallel.pipeline_parallel_size=2")
    assert [r["step"] for r in two] == [r["step"] for r in one] and any("val_loss" in r for r in two)
    for got, want in zip(two, one):  # float32: the same products, summed in other orders across the stages
        for key in [k for k in want if k == "loss" or k.startswith("val_loss")]:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)


@pytest.mark.parametrize("layout", [("--parallel.expert_parallel_size=2",), ("--parallel.zero_stage=3",)],
                         ids=["ep2", "zero3"])
def test_two_ranks_whose_forwards_pair_up_train_and_evaluate_a_blend_as_one_process(blend, tmp_path, layout):
    """ep 2 (the experts split over the two data-parallel ranks: each MoE layer's all-to-alls) and ZeRO-3 (FSDP2's
    parameter all-gathers) join the two ranks' forwards. On a blend with one-row micro-batches a validation batch is
    one rank's part of one source, so the other rank pads its forward; the losses, per source too, are one
    process's (before the padding, ZeRO-3 hung here and ep 1 at ZeRO-0 died of an IndexError)."""
    moe = ("--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_ffn_hidden_size=32",
           "--model.moe_aux_loss_coeff=0.01", "--training.eval_batches=4")

    def run(name: str, world: int, *extra: str) -> list[dict]:
        torchrun("pretrain.py", world, blend_args(blend, tmp_path / name, 3, f"--data.val_fraction={VAL_FRACTION}",
                                                  *moe, *extra, micro_batch_size=1))
        return [r for r in metrics(tmp_path / name) if "loss" in r or "val_loss" in r]

    one, two = run("one", 1), run("two", 2, *layout)
    assert [r["step"] for r in two] == [r["step"] for r in one] and any("val_loss/web_text_document" in r for r in two)
    for got, want in zip(two, one):
        for key in [k for k in want if k in ("loss", "moe_aux_loss") or k.startswith("val_loss")]:
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
