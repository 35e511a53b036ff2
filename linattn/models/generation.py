"""Sampling from a :class:`~linattn.models.HybridLM` with a cache: one chunked prefill, then one token per step.

The cache holds a fixed-size state per GDN layer and at most ``window − 1`` keys per sliding-window layer, so a
step costs the same at token 10 and at token 100 000 (full-attention layers, if any, still grow).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row of ``logits [B, vocab]``: greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p (the most likely token always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def stream_generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: Optional[int] = None, top_p: Optional[float] = None, eos_token_id: Optional[int] = None,
                    generator: Optional[torch.Generator] = None) -> Iterator[torch.Tensor]:
    """Yield the next token ``[B]`` of each sequence, one step at a time (for streaming to a terminal or a socket).

    Args:
        model: a :class:`~linattn.models.HybridLM` (put in eval mode for the duration).
        input_ids: ``[B, T]`` prompts of equal length (T ≥ 1).
        max_new_tokens: tokens to produce at most.
        temperature, top_k, top_p: sampling (temperature 0 is greedy).
        eos_token_id: stop once every sequence has produced it.
        generator: a ``torch.Generator`` for reproducible sampling.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids, use_cache=True)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            tok = sample_next(out.logits[:, -1], temperature, top_k, top_p, generator)
            yield tok
            if eos_token_id is not None:
                done |= tok == eos_token_id
                if bool(done.all()):
                    return
            out = model(tok[:, None], cache=out.cache, use_cache=True)
    finally:
        model.train(was_training)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The prompts followed by the generated tokens, ``[B, T + n]``; keyword arguments as :func:`stream_generate`."""
    toks = list(stream_generate(model, input_ids, max_new_tokens, **kwargs))
    if not toks:
        return input_ids
    return torch.cat([input_ids, torch.stack(toks, 1).to(input_ids.dtype)], 1)
