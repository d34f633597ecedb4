"""FP8 all-gather under FSDP2 (zero_stage 3, tensorwise): a column- and a row-parallel linear at TP 2 x DP 2 whose
weights FSDP2 gathers in e4m3 give the numbers of gathering in float32 and quantizing after, bit for bit; the
collective log shows the layer's all-gather at one byte per weight element; the weights' global scale takes one MAX
all-reduce over dp and one over tp, and skipping either breaks the equality. Through the trainer, zero_stage 3 at
dp 2 gathers in FP8 and trains as gathering in float32 does (bit-identical losses and norms).

The weight blocks each rank holds (tp splits the column's rows and the row's columns, FSDP2 the rows of each tp
shard) are set 16x apart, so that a scale taken over fewer ranks than the weight spans is another power of two:
the whole gathered weight is then read at that wrong scale, far outside float32's rounding.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from test_data_parallel import build_run, data_dir, overrides  # noqa: F401  (data_dir is a fixture)
from test_fp8_layouts import skipping_max_all_reduce
from test_fp8_training import TENSORWISE

from parallel_attention.checkpointing.tensor_io import read_safetensors
from parallel_attention.tensor_parallel import parallel_state as ps
from parallel_attention.tensor_parallel.collective_log import active_log, disable_collective_log, enable_collective_log
from parallel_attention.tensor_parallel.fp8_all_gather import Fp8WeightGather
from parallel_attention.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel_attention.tensor_parallel.linear_precision import fp8_linears
from parallel_attention.training import trainer
from parallel_attention.training.fsdp import mesh_of, shard_fully

H, F, S, B = 16, 32, 6, 2
SPREAD = 64.0  # between the blocks of a weight that different ranks hold
DIFFERENT = 1e-2  # a weight read at a scale 64x off moves the outputs by far more


class _Layer(torch.nn.Module):
    def __init__(self, tp_group) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(H, F, tp_group=tp_group)
        self.fc_out = RowParallelLinear(F, H, input_is_parallel=True, tp_group=tp_group)

    def forward(self, x):
        return self.fc_out(self.fc_in(x))


class _Model(torch.nn.Module):
    """One layer (FSDP2's group of the two FP8 weights and their biases) and a root holding nothing else."""

    def __init__(self, tp_group) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(tp_group)])

    def forward(self, x):
        return self.layers[0](x)


def _blocks(t: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
    """t with block (i along dims[0], j along dims[1]) of its 2 x 2 blocks times SPREAD^(2 j + i)."""
    rows = [torch.cat([b * SPREAD ** (2 * j + i) for j, b in enumerate(r.chunk(2, dims[1]))], dims[1])
            for i, r in enumerate(t.chunk(2, dims[0]))]
    return torch.cat(rows, dims[0])


def _model(gather_in_fp8: bool):
    """The model on this rank's tp shard of the blocked weights, sharded by FSDP2 over dp (its weights made to
    gather in FP8 first, or not), and its Fp8WeightGather (None)."""
    tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_context_parallel_group()
    p, r = ps.group_size(tp_group), ps.group_rank(tp_group)
    model = _Model(tp_group)
    g = torch.Generator().manual_seed(5)
    weights = {"fc_in": _blocks(torch.randn(F, H, generator=g) * 0.1, (1, 0)).chunk(p, 0)[r],  # dp rows, tp rows
               "fc_out": _blocks(torch.randn(H, F, generator=g) * 0.1, (0, 1)).chunk(p, 1)[r]}  # dp rows, tp columns
    for name, weight in weights.items():
        getattr(model.layers[0], name).weight.data.copy_(weight)
    gather = Fp8WeightGather(model, dp_group) if gather_in_fp8 else None
    return shard_fully(model, mesh_of(dp_group)), gather


def _step(gather_in_fp8: bool, skip=None):
    """(Y, dX, the local shards of dW) of one forward and backward in tensorwise FP8; the MAX all-reduces of the
    scales (`skip`: the one left out), the layer's parameter all-gathers (dtype, elements), from the log, and the MAX
    all-reduces of the forward and backward."""
    model, gather = _model(gather_in_fp8)
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(S, B, H, generator=g).requires_grad_(), torch.randn(S, B, H, generator=g)
    with skipping_max_all_reduce(skip) as seen:
        weights = gather.refresh() if gather is not None else None
    enable_collective_log()
    try:
        with fp8_linears("tensorwise", "cpu", **({"weights": weights} if weights is not None else {})), \
                skipping_max_all_reduce(None) as in_step:
            y = model(x)
            y.backward(dy)
        gathers = [(c.dtype, c.shape[0]) for c in active_log().calls if c.op == "FSDP2's parameter all_gather"]
    finally:
        disable_collective_log()
    grads = [p.grad.to_local() for p in model.parameters()]
    return (y.detach(), x.grad, *grads), seen[0], gathers, in_step[0]


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _outside_the_policy(refresh: bool) -> str:
    """The error of a forward outside the FP8 policy: before any scale was computed, or after."""
    model, gather = _model(True)
    if refresh:
        gather.refresh()
    try:
        model(torch.zeros(S, B, H))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _worker():
    errors = [_outside_the_policy(refresh) for refresh in (False, True)]
    high, _, high_gathers, high_in_step = _step(False)
    low, reductions, low_gathers, low_in_step = _step(True)
    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    weights, biases = (2 * H * F) // (tp * dp), (F // tp + H) // dp  # this rank's elements of the layer
    skipped = [max(_relative(a, b) for a, b in zip(_step(True, skip)[0], high)) for skip in range(reductions)]
    return {"equal": all(torch.equal(a, b) for a, b in zip(low, high)), "reductions": reductions,
            "skipped": skipped, "high": set(high_gathers), "low": set(low_gathers),
            "in_step": (high_in_step, low_in_step),
            "expected_high": ("float32", weights + biases), "expected_low": ("uint8", weights + 4 * biases),
            "errors": errors}


def test_fsdp2_gathers_fp8_weights_with_the_numbers_of_gathering_then_quantizing():
    ranks = run_distributed(_worker, 4, 2, timeout=120)
    for rank in ranks:
        assert rank["equal"]  # bit for bit: quantizing is elementwise, the scale the same global one
        assert rank["high"] == {rank["expected_high"]} and rank["low"] == {rank["expected_low"]}, rank
        assert rank["reductions"] == 2  # the scales: one MAX all-reduce over dp, one over tp, for both weights
        # over tp: the column's forward (W's rows split; none when W came with its global scale, X being whole),
        # the column's dX (dY's features split) and the row's forward (X's and W's features split)
        assert rank["in_step"] == (3, 2), rank["in_step"]
        assert "scale was never computed: enter the step's FP8 policy" in rank["errors"][0], rank["errors"]
        assert "gathered in FP8 (zero_stage 3 with training.fp8=tensorwise): only the FP8 linears" in rank["errors"][1]
    # without the tp one, the ranks holding the larger tp half still have the global scale: the others break
    skipped = [max(errors) for errors in zip(*(rank["skipped"] for rank in ranks))]
    assert min(skipped) >= DIFFERENT, skipped


class _Narrow(torch.nn.Module):
    """One FP8 linear of 3 output rows: over 4 ranks FSDP2 leaves the last one's shard of its weight empty."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([ColumnParallelLinear(H, 3)])

    def forward(self, x):
        return self.layers[0](x)


def _narrow_step(gather_in_fp8: bool):
    dp_group = ps.get_data_context_parallel_group()
    torch.manual_seed(7)
    model = _Narrow()
    gather = Fp8WeightGather(model, dp_group) if gather_in_fp8 else None
    shard_fully(model, mesh_of(dp_group))
    weights = {"weights": gather.refresh()} if gather is not None else {}
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(8)).requires_grad_()
    with fp8_linears("tensorwise", "cpu", **weights):
        y = model(x)
        y.sum().backward()
    return y.detach(), x.grad, tuple(model.layers[0].weight.to_local().shape)


def _empty_shard_worker():
    (y, dx, shape), (y_high, dx_high, _) = _narrow_step(True), _narrow_step(False)
    return {"equal": torch.equal(y, y_high) and torch.equal(dx, dx_high), "shape": shape}


def test_a_rank_whose_shard_is_empty_scales_and_gathers_like_the_others():
    """Its amax counts as 0 in the MAX over the shard group (no rank stops short of the all-reduce)."""
    ranks = run_distributed(_empty_shard_worker, 4, 1, timeout=120)
    assert [rank["shape"][0] for rank in ranks] == [1, 1, 1, 0]
    assert all(rank["equal"] for rank in ranks)


def _build(args, gather_in_fp8: bool):
    """The trainer's run; gather_in_fp8 False: its weights left to gather in float32 (as before FP8 all-gather)."""
    build_gather = trainer.fp8_weight_gather
    trainer.fp8_weight_gather = build_gather if gather_in_fp8 else (lambda *a: None)
    try:
        return build_run(args)
    finally:
        trainer.fp8_weight_gather = build_gather


def _trainer_worker(args, gather_in_fp8: bool) -> dict:
    """3 steps with a checkpoint after the second, and the third again, resumed from it."""
    run = _build(args, gather_in_fp8)
    records = [trainer.train_step(run) for _ in range(2)]
    trainer.checkpoint(run)
    records.append(trainer.train_step(run))
    kinds = {type(p.to_local()).__name__ for p in run.model.parameters()}
    resumed = _build(args, gather_in_fp8)
    trainer.resume_run(resumed, "auto")
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "kinds": kinds,
            "resumed": trainer.train_step(resumed)["loss"]}


def test_zero3_trains_in_fp8_all_gather_as_gathering_in_float32(data_dir, tmp_path):
    """Bit-identical losses, norms and checkpoint files (float32 master weights and AdamW state), and an exact
    resume."""
    zero3 = ("--training.max_steps=3", "--training.micro_batch_size=4", "--parallel.zero_stage=3",
             *TENSORWISE)
    low, high = (run_distributed(_trainer_worker, 2, 1, overrides(data_dir, tmp_path / name, 1, *zero3), fp8)[0]
                 for name, fp8 in (("fp8", True), ("float32", False)))
    assert low["kinds"] == {"Tensor", "Fp8ShardedWeight"} and high["kinds"] == {"Tensor"}
    assert (low["losses"], low["norms"]) == (high["losses"], high["norms"])
    assert low["resumed"] == low["losses"][2]
    for name in ("model_tp00.safetensors", "optim_tp00.safetensors"):
        mine, theirs = (read_safetensors(tmp_path / run / "checkpoints" / "step_0000002" / name)[0]
                        for run in ("fp8", "float32"))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs), name
        assert {t.dtype for t in mine.values()} <= {torch.float32, torch.int64}, name
