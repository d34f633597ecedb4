"""Make a transformers model tensor parallel: a tiny Llama built here (nothing is downloaded), split across the
launched ranks by `parallel_attention.parallelize`, one AdamW step clipped with `parallel_attention.clip_grad_norm_`.
Each rank prints its loss and gradient norm next to the unsharded model's, and exits 1 if they differ.

    torchrun --standalone --nproc-per-node 2 scripts/examples/parallelize_llama.py
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import parallel_attention as pa


def train_step(model, tokens, clip) -> tuple[float, float]:
    """One foreach-AdamW step; (loss before it, the gradient norm before clipping)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    loss = model(tokens, labels=tokens).loss  # transformers' loss on the full-vocabulary logits
    loss.backward()
    norm = clip(model, 1.0)
    optimizer.step()
    return loss.item(), norm.item()


dist.init_process_group("gloo")  # GPUs: "nccl", after torch.cuda.set_device(LOCAL_RANK)
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))  # yours: mesh["tp"] of a 2-D one
torch.manual_seed(0)  # the same weights and tokens on every rank
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16})
model = LlamaForCausalLM(config)
reference = copy.deepcopy(model)  # unsharded, for the check
tokens = torch.randint(0, config.vocab_size, (2, 32))

pa.parallelize(model, tp_group=mesh)  # in place: this rank's heads, MLP columns and vocabulary rows
loss, norm = train_step(model, tokens, pa.clip_grad_norm_)
ref_loss, ref_norm = train_step(reference, tokens, lambda m, c: torch.nn.utils.clip_grad_norm_(m.parameters(), c))
with torch.no_grad():
    after, ref_after = model(tokens, labels=tokens).loss.item(), reference(tokens, labels=tokens).loss.item()
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: loss {loss:.5f} (unsharded {ref_loss:.5f}), grad norm "
      f"{norm:.5f} ({ref_norm:.5f}), after the step {after:.5f} ({ref_after:.5f})")
same = abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-4 and abs(after - ref_after) < 1e-4
dist.barrier()  # no rank tears gloo down while another still talks to it
del mesh
dist.destroy_process_group()
sys.exit(0 if same else 1)
