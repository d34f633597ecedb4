"""Sampling from a GPTModel with a key/value cache: greedy, temperature and top-k, a sliding window
past `max_seq_len`, a stop at the end-of-sequence token, and batches of prompts of any lengths.

Every rank of the tensor-parallel group runs the same loop; the full-vocabulary logits of the
last position are gathered on every rank, and the sampling generator is seeded identically on
all of them, so every rank picks the same token (and stops at the same step) without a broadcast.

Sliding window: each token is predicted from at most the last `max_seq_len` tokens. Once a sequence
is longer than that, the context is cropped to its last `max_seq_len` tokens and, with the cache, the
cache is rebuilt by running that cropped context again (positions restart at 0, as in training), so
any number of new tokens can be asked for. With or without the cache the model sees the same contexts.

Prompts of different lengths (`generate_batch`): the model has no padding mask, so a left-padded row
would attend to its padding. Prompts are therefore grouped by length and each group is one batch.
"""

from __future__ import annotations

import torch

from .model import GPTModel


def _check_arguments(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be a positive integer or None.")


class _SlidingContext:
    """Logits [b, V] of the next token given the last `window` tokens of `tokens`, with or without a cache."""

    def __init__(self, model: GPTModel, batch_size: int, total_len: int, use_cache: bool) -> None:
        self.model, self.window, self.use_cache = model, model.config.max_seq_len, use_cache
        self.cache_len = min(self.window, total_len)  # the cache never holds more than the window
        self.batch_size, self.cache, self.fed = batch_size, None, 0  # fed: tokens of the sequence seen so far

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.use_cache:
            return self.model.next_token_logits(tokens[:, -self.window:])
        new = tokens[:, self.fed:]
        if self.cache is None or self.cache.length + new.shape[1] > self.cache_len:
            self.cache = self.model.new_kv_cache(self.batch_size, self.cache_len)  # crop and rebuild
            new = tokens[:, -self.cache_len:]
        self.fed = tokens.shape[1]
        return self.model.decode(new, self.cache)


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """logits [b, V] -> token ids [b, 1]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: GPTModel, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, use_cache: bool = True,
             eos_token_id: int | None = None) -> torch.Tensor:
    """prompt [b, s0] -> [b, s0 + n]; temperature 0 is greedy decoding.

    n = max_new_tokens, or fewer when every row has produced `eos_token_id`: a row that has finished
    keeps emitting `eos_token_id` (its padding) until the others finish.
    """
    _check_arguments(max_new_tokens, temperature, top_k)
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be [b, s0] token ids with s0 >= 1, got shape {tuple(prompt.shape)}.")
    model.eval()
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    context = _SlidingContext(model, prompt.shape[0], prompt.shape[1] + max_new_tokens, use_cache)
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    tokens = prompt
    for _ in range(max_new_tokens):
        next_token = _sample(context.next_logits(tokens), temperature, top_k, generator)
        if eos_token_id is not None:
            next_token = next_token.masked_fill(finished.unsqueeze(1), eos_token_id)
            finished |= next_token.squeeze(1) == eos_token_id
        tokens = torch.cat([tokens, next_token], dim=1)
        if finished.all():
            break
    return tokens


def cut_at_eos(tokens: list[int], prompt_len: int, eos_token_id: int | None) -> list[int]:
    """The prompt and its new tokens up to and including the first `eos_token_id` among the new ones."""
    if eos_token_id is None or eos_token_id not in tokens[prompt_len:]:
        return tokens
    return tokens[:tokens.index(eos_token_id, prompt_len) + 1]


def generate_batch(model: GPTModel, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                   top_k: int | None = None, seed: int = 0, use_cache: bool = True,
                   eos_token_id: int | None = None, device=None) -> list[list[int]]:
    """Each prompt (a list of token ids, any length >= 1) followed by its new tokens, in prompt order.

    Prompts of the same length run as one batch (seeded with `seed`, so a sampled continuation also
    depends on which prompts share its length); each output stops after its first `eos_token_id`.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (an empty prompt gives the model nothing to continue).")
    outputs: list[list[int]] = [[] for _ in prompts]
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        batch = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=device)
        out = generate(model, batch, max_new_tokens, temperature, top_k, seed, use_cache, eos_token_id)
        for i, row in zip(rows, out.tolist()):
            outputs[i] = cut_at_eos(row, length, eos_token_id)
    return outputs
