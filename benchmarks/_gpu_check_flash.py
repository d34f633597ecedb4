"""gpu_check.sh's flash step: our model's attention runs on the flash SDPA kernel (bf16, one GPU, p = 1).

SDPA is restricted to FLASH_ATTENTION, so PyTorch raises if our call cannot use it (an explicit mask, a
layout flash refuses); the CUDA profile must also show a flash kernel. Prints one JSON line.
"""

from __future__ import annotations

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from parallel_attention.transformer.model import GPTModel
from parallel_attention.transformer.model_config import ModelConfig


def main() -> None:
    cfg = ModelConfig(vocab_size=256, hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=2, max_seq_len=1024,
                      position_embedding="rotary", activation="swiglu", norm="rmsnorm", attention_kernel="sdpa")
    model = GPTModel(cfg, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 1024), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss = model(tokens, tokens)
        loss.backward()
        torch.cuda.synchronize()
    flash = sorted({e.key for e in prof.key_averages() if "flash" in e.key.lower()})
    if not flash:
        raise SystemExit("no flash kernel in the CUDA profile of our attention's forward and backward")
    print(json.dumps({"flash_kernels": flash[:6], "loss": loss.item(), "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
