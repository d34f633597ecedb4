"""model.compile: each transformer layer compiled with inductor trains to the same losses as eager (float32,
within 1e-5), with dropout, activation recompute and the tensor-parallel collectives in the graph, and a
compiled run resumes a checkpoint that an eager run wrote (compile is a runtime-only setting)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_distributed
from parallel_attention import load_config
from parallel_attention.checkpointing.compatibility import model_shape_config
from parallel_attention.training import ConfigError
from parallel_attention.transformer.model_config import ModelConfig
from test_data_parallel import build_run
from test_pretrain import data_dir, tiny_args  # noqa: F401 (data_dir is a fixture)

# float32 on CPU: inductor fuses elementwise ops and may reorder a reduction, which moves a loss by ~1e-7;
# 1e-5 leaves room for that over the steps of the test, and is far below a wrong mask or a missed gradient.
TOLERANCE = 1e-5


def _steps(data: Path, run_dir: Path, tp: int, steps: int, compile_: bool, extra: tuple[str, ...],
           checkpoint_at: int = 0, resume: str = "none") -> list[float]:
    """Build a run the trainer's way (at tp, in this rank's process group), then take `steps` train steps."""
    from parallel_attention.training import trainer

    # tiny_args' --config is configs/gpt_tiny.yaml, which build_run reads: pass the overrides after it
    run = build_run(tiny_args(data, run_dir, tp, steps, f"--model.compile={compile_}", *extra)[2:])
    trainer.resume_run(run, resume)
    losses = []
    while run.step < steps:
        losses.append(trainer.train_step(run)["loss"])
        if run.step == checkpoint_at:
            trainer.checkpoint(run)
    if run.logger is not None:
        run.logger.close()
    return losses


def _eager_then_compiled(data: Path, run_dir: Path, tp: int, steps: int, extra: tuple[str, ...]) -> dict:
    eager = _steps(data, run_dir, tp, steps, False, extra, checkpoint_at=steps - 1)
    compiled = _steps(data, run_dir, tp, steps, True, extra)
    resumed = _steps(data, run_dir, tp, steps, True, extra, resume="auto")  # the eager run's checkpoint
    return {"eager": eager, "compiled": compiled, "resumed": resumed}


DROPOUT_AND_RECOMPUTE = ("--model.hidden_dropout=0.1", "--model.attention_dropout=0.1",
                         "--model.recompute_activations=true")


def _check(result: dict, steps: int) -> None:
    assert len(result["eager"]) == len(result["compiled"]) == steps and len(result["resumed"]) == 1
    assert result["compiled"] == pytest.approx(result["eager"], abs=TOLERANCE)
    assert result["resumed"][0] == pytest.approx(result["eager"][-1], abs=TOLERANCE)


@pytest.mark.parametrize("world", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_compiled_layers_train_like_eager(data_dir, tmp_path, world):  # noqa: F811
    """1 layer, 3 steps, dropout and recompute on; at p = 2 the layer's collectives run between compiled graphs.
    CI runs p = 2 only: inductor's first compile costs about a minute on two cores."""
    extra = ("--model.num_layers=1", *DROPOUT_AND_RECOMPUTE)
    results = run_distributed(_eager_then_compiled, world, world, data_dir, tmp_path, world, 3, extra)
    _check(results[0], 3)
    assert all(r == results[0] for r in results)  # every rank logs the same, data-parallel-reduced losses


@pytest.mark.slow
def test_compiled_layers_train_like_eager_for_20_steps(data_dir, tmp_path):  # noqa: F811
    """The issue's check: 20 steps, p = 2 with sequence parallelism, two layers, dropout and recompute."""
    extra = ("--parallel.sequence_parallel=true", *DROPOUT_AND_RECOMPUTE)
    _check(run_distributed(_eager_then_compiled, 2, 2, data_dir, tmp_path, 2, 20, extra)[0], 20)


def test_compile_is_a_runtime_setting():
    """A checkpoint written with compile off fits a run with it on, and old manifests (no key) still load."""
    assert model_shape_config(ModelConfig(compile=True)) == model_shape_config(ModelConfig())
    old = {k: v for k, v in model_shape_config(ModelConfig()).items() if k != "compile"}
    assert ModelConfig.from_dict(old).compile is False


def test_compile_refuses_layout_invariant_dropout():
    """Inductor overflows on the 64-bit mask hash: refused at validation, naming the three ways out."""
    cfg = load_config(None, ["--model.compile=true", "--model.dropout_rng=layout_invariant",
                             "--model.hidden_dropout=0.1"])
    with pytest.raises(ConfigError, match="model.compile=true cannot compile .*--model.dropout_rng=per_rank"):
        cfg.validate(1)


def _compiled_from_seed_0(cfg):
    """GPTModel(cfg) drawn from seed 0, each layer compiled with aot_eager (the traced graph run by eager kernels:
    eager's arithmetic), with dynamo's caches and counters cleared."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from parallel_attention.transformer.model import GPTModel

    torch.manual_seed(0)
    model = GPTModel(cfg)
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    return model


def test_one_compilation_serves_every_layer_step_and_micro_batch_with_layout_invariant_dropout():
    """The layer index, the (seed, step) key and the micro-batch's first sample reach the hash as tensors: dynamo
    compiles a layer's forward once for 12 layers, 2 steps and 2 micro-batches (it guarded on the layer index before:
    one compilation per layer until the recompile limit, eager after it), and the losses are eager's exactly
    (aot_eager runs the traced graph with eager kernels: the same masks, the same arithmetic)."""
    import torch
    from torch._dynamo.utils import counters

    from parallel_attention.tensor_parallel.rng import dropout_coordinates
    from parallel_attention.transformer.model import GPTModel

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=12, num_heads=4, num_kv_heads=2, head_dim=8,
                      ffn_hidden_size=64, max_seq_len=16, hidden_dropout=0.1, attention_dropout=0.1,
                      dropout_rng="layout_invariant")
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def losses(model) -> list[float]:
        found = []
        for step in range(2):
            for first in (0, 2):  # two micro-batches of 2 rows
                with dropout_coordinates(7, step, first):
                    loss = model(tokens[first:first + 2], tokens[first:first + 2])
                    loss.backward()
                    found.append(loss.item())
        return found

    torch.manual_seed(0)
    eager = losses(GPTModel(cfg))
    model = _compiled_from_seed_0(cfg)
    assert losses(model) == eager
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["frames"])


@pytest.mark.slow
def test_compiled_fp8_layers_train_like_eager(data_dir, tmp_path):  # noqa: F811
    """training.fp8 (tensorwise) with compiled layers: the FP8 linears' amax all-reduces and emulated GEMMs run
    between or inside the compiled graphs, with the same losses as eager FP8 (docs/fp8.md)."""
    extra = ("--model.num_layers=1", "--parallel.sequence_parallel=true", "--training.fp8=tensorwise")
    _check(run_distributed(_eager_then_compiled, 2, 2, data_dir, tmp_path, 2, 3, extra)[0], 3)


def test_a_compiled_moe_model_compiles_once_for_every_step():
    """Each step's auxiliary-loss record and loss scale are new objects: traced, they made dynamo recompile every MoE
    layer on every step (0.44 s a step of this model instead of 0.01 s) until its recompile limit left the layer
    eager. eager_attach_aux_loss() runs it eagerly between the compiled pieces: after the first step nothing compiles, and
    the losses and aux losses are eager's."""
    import torch
    from torch._dynamo.utils import counters

    from parallel_attention.transformer.model import GPTModel
    from parallel_attention.transformer.moe.losses import moe_step

    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, activation="swiglu", norm="rmsnorm",
                      position_embedding="rotary", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                      moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, max_seq_len=16)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def steps(model, after_first=None) -> list[float]:
        found = []
        for step in range(3):
            with moe_step(0.5 + step) as record:
                loss = model(tokens, tokens)
                loss.backward()
            found += [loss.item(), record.metrics(cfg)["moe_aux_loss"]]
            if after_first is not None and step == 0:
                after_first.update(counters["frames"])
        return found

    torch.manual_seed(0)
    eager = steps(GPTModel(cfg))
    model = _compiled_from_seed_0(cfg)
    first: dict = {}
    assert steps(model, first) == pytest.approx(eager, rel=1e-6)
    assert first["total"] > 0 and dict(counters["frames"]) == first, (first, dict(counters["frames"]))
