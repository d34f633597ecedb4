"""A run continues only on what it was trained with: each checkpoint records the tokenizer and the data, a resume
with another tokenizer is refused, one with other data too unless checkpoint.allow_data_change asks for it, and a
refused resume leaves the run directory byte for byte as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import ROOT, torchrun, train_losses
from parallel_attention.training.data.read.data_identity import DataChangedError, check_identity
from parallel_attention.training.data.indexed_dataset import IndexedDatasetWriter, token_dtype

import numpy as np


def _identity(tokenizer_sha="t1", data_sha="d1", path="data/a", sampling="epochs"):
    return {"tokenizer": {"tokenizer": "bpe", "sha256": tokenizer_sha},
            "sources": [{"path": path, "sha256": data_sha, "weight": 1.0}], "sampling": sampling}


def _manifest(identity):
    return {"path": "runs/x/checkpoints/step_0000010", "extra": {"data_identity": identity}}


def test_another_tokenizer_is_refused_naming_both():
    with pytest.raises(DataChangedError, match=r"trained with the tokenizer bpe \(tokenizer.json sha256 t1\), and "
                                               r"this run's is bpe \(tokenizer.json sha256 t2\).*logging.run_dir"):
        check_identity(_manifest(_identity()), _identity(tokenizer_sha="t2"), allow_data_change=True)


def test_other_data_needs_allow_data_change_and_is_then_said(capfd):
    with pytest.raises(DataChangedError, match="trained on other data .*checkpoint.allow_data_change=true"):
        check_identity(_manifest(_identity()), _identity(data_sha="d2"), allow_data_change=False)
    check_identity(_manifest(_identity()), _identity(data_sha="d2"), allow_data_change=True)
    assert "continuing on other data" in capfd.readouterr().err
    check_identity(_manifest(_identity()), _identity(path="/mnt/copy/of/a"), allow_data_change=False)  # same data
    check_identity({"path": "old", "extra": {}}, _identity(), allow_data_change=False)  # written before the record
    with pytest.raises(DataChangedError):
        check_identity(_manifest(_identity()), _identity(sampling="random_windows"), allow_data_change=False)


def _prefix(root: Path, name: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(root / name, token_dtype(256))
    for _ in range(200):
        writer.add_document(np.append(rng.integers(1, 256, rng.integers(20, 300)), 0))
    writer.finish()
    return str(root / name)


def _args(run_dir, prefix, steps, *extra):
    return ["--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "--model.hidden_size=32", "--model.num_layers=1",
            "--model.max_seq_len=32", "--data.seq_len=32", "--training.global_batch_size=4",
            "--training.micro_batch_size=4", f"--training.max_steps={steps}", "--training.eval_interval=2",
            "--training.eval_batches=1", "--checkpoint.interval=2", "--logging.progress_bar=false",
            "--logging.tensorboard=false", "--parallel.tensor_parallel_size=1", f"--logging.run_dir={run_dir}",
            f"--data.blend=[{{path: '{prefix}', weight: 1}}]", *extra]


def _snapshot(root: Path) -> dict:
    """The run's state: every file but the index caches (built for any source opened, deleted at will)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != "index_cache"}


def test_a_resume_on_other_data_is_refused_before_any_step_and_changes_nothing(tmp_path):
    first, second = _prefix(tmp_path, "web_text_document", 1), _prefix(tmp_path, "code_text_document", 2)
    run = tmp_path / "run"
    torchrun("pretrain.py", 1, _args(run, first, 2))
    manifest = json.loads((run / "checkpoints" / "step_0000002" / "manifest.json").read_text())
    recorded = manifest["extra"]["data_identity"]
    assert recorded["tokenizer"] == {"tokenizer": "byte", "sha256": None}
    assert [s["path"] for s in recorded["sources"]] == [first] and recorded["sampling"] == "epochs"
    before = _snapshot(run)
    refused = torchrun("pretrain.py", 1, _args(run, second, 4), check=False)
    assert refused.returncode != 0 and "trained on other data" in refused.stderr
    assert "checkpoint.allow_data_change=true" in refused.stderr
    assert _snapshot(run) == before  # no config, tokenizer, metrics or checkpoint rewritten
    allowed = torchrun("pretrain.py", 1, _args(run, second, 4, "--checkpoint.allow_data_change=true"))
    assert "continuing on other data" in allowed.stderr
    assert sorted(train_losses(run)) == [1, 2, 3, 4]


def test_generation_refuses_a_tokenizer_other_than_the_checkpoints(tmp_path):
    from parallel_attention.training import ByteTokenizer, train_bpe
    from parallel_attention.training.data.read.data_identity import check_tokenizer
    from parallel_attention.training.tokenizer import TokenizerIdentity

    trained = train_bpe(["tensor parallel attention " * 50], 300, tmp_path / "a" / "tokenizer.json")
    other = train_bpe(["pipeline parallel schedules " * 50], 300, tmp_path / "b" / "tokenizer.json")
    step = tmp_path / "run" / "checkpoints" / "step_0000002"
    step.mkdir(parents=True)
    identity = {"tokenizer": TokenizerIdentity.of_file("bpe", trained.path).record(), "sources": [],
                "sampling": "epochs"}
    (step / "manifest.json").write_text(json.dumps({"extra": {"data_identity": identity}}))
    check_tokenizer(step, trained)
    for wrong in (other, ByteTokenizer()):
        with pytest.raises(ValueError, match=r"is not the one .* was trained with: bpe \(tokenizer.json sha256"):
            check_tokenizer(step, wrong)


def test_a_resharded_run_carries_its_config_and_tokenizer(tmp_path):
    import yaml

    from parallel_attention.training.run.run_dir import carry_model_files

    source, out = tmp_path / "run", tmp_path / "run_tp4"
    (source / "tokenizer").mkdir(parents=True)
    (source / "tokenizer" / "tokenizer.json").write_text("{}")
    (source / "config.yaml").write_text(yaml.safe_dump({"parallel": {"tensor_parallel_size": 2},
                                                        "logging": {"run_dir": str(source)}}))
    layout = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "pipeline_layers": [3, 1]}
    assert carry_model_files(source, out, layout) == ["config.yaml", "tokenizer/tokenizer.json"]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["parallel"] == layout and config["logging"]["run_dir"] == str(out)
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}"
