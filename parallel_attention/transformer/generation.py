"""Sampling from a GPTModel with a key/value cache: greedy, temperature and top-k.

Every rank of the tensor-parallel group runs the same loop; the full-vocabulary logits of the
last position are gathered on every rank, and the sampling generator is seeded identically on
all of them, so every rank picks the same token without a broadcast.
"""

from __future__ import annotations

import torch

from .model import GPTModel


@torch.no_grad()
def generate(model: GPTModel, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> torch.Tensor:
    """prompt [b, s0] -> [b, s0 + max_new_tokens]. temperature 0 is greedy decoding."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be a positive integer or None.")
    total = prompt.shape[1] + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt of {prompt.shape[1]} + {max_new_tokens} new tokens exceeds "
                         f"model.max_seq_len={model.config.max_seq_len}: ask for fewer tokens.")
    model.eval()
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    cache = model.new_kv_cache(prompt.shape[0], total) if use_cache else None
    tokens, new = prompt, prompt
    for _ in range(max_new_tokens):
        logits = model.decode(new, cache) if use_cache else model.next_token_logits(tokens)
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
        new = next_token
    return tokens
