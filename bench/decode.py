"""A decoding loop of our own, gpt-fast's way, a candidate for grpo.py's and ppo.py's sampling (bench/gpu.py's
generation stage measures it against HF generate): the prompts in one forward over a static KV cache, then one token a
step, each step a forward of fixed shapes that torch.compile (mode "reduce-overhead": CUDA graphs) can capture once.
Tokens from softmax(logits / T) (None: greedy), cut after EOS, as grpo.py's generate_completions."""

import torch
from transformers import StaticCache


def left_padded(prompts, pad_token_id, extra, device):
    """Prompt ids left-padded; an attention mask `extra` columns wider (the new tokens) and the positions it gives."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + extra) for p in prompts], device=device)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def decode(model, prompts, max_new_tokens, temperature, eos_token_id, pad_token_id, compiled=False, scores=None):
    """A completion per prompt; `compiled`: the one-token step through torch.compile (reduce-overhead); `scores`, a
    list: each step's logits / T appended (the exactness check)."""
    device = next(model.parameters()).device
    ids, mask, positions = left_padded(prompts, pad_token_id, max_new_tokens, device)
    width, length = ids.shape[1], ids.shape[1] + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=length)

    def forward(input_ids, cache_position):  # the mask of every position, so every step has the same shapes
        return model(input_ids=input_ids, attention_mask=mask, position_ids=positions[:, cache_position],
                     past_key_values=cache, cache_position=cache_position, use_cache=True).logits[:, -1].float()

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True) if compiled else forward
    logits, tokens = forward(ids, torch.arange(width, device=device)), []
    for t in range(max_new_tokens):
        if temperature is None:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1)[:, 0]
        if scores is not None:
            scores.append(logits / (temperature or 1.0))
        tokens.append(token)
        if t + 1 == max_new_tokens or bool((torch.stack(tokens, 1) == eos_token_id).any(1).all()):
            break
        logits = step(token[:, None], torch.tensor([width + t], device=device)).clone()
    rows = torch.stack(tokens, 1).tolist()
    return [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]
