"""The training log-probs through the output head, forward and backward: the scripts' head_logprobs (chunks through
autograd, each recomputed under torch.utils.checkpoint) against a custom autograd Function that computes the
gradient as (softmax - one-hot) / temperature directly, as TRL's ChunkedLogProbFunction does. Qwen2.5-0.5B's head
(896 x 151,936), fp32 on CPU, best of 3; also the largest difference between the two gradients.
Usage: python bench/head_backward.py [--threads 2] [--rows 2048] [--temperature 1.0]"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sft import head_logprobs  # noqa: E402


class HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T / temperature) at `labels`, `rows` at a time; the backward recomputes each
    chunk's logits and forms softmax - one-hot in place (no autograd through (rows, vocabulary) tensors)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, rows=512):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.rows = temperature, rows
        parts = []
        for h, label in zip(hidden.split(rows), labels.split(rows)):
            logits = (h @ weight.T).float().div_(temperature)
            parts.append(logits.gather(1, label[:, None])[:, 0] - logits.logsumexp(-1))
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for h, label, g, gh in zip(*(t.split(ctx.rows) for t in (hidden, labels, grad, grad_hidden))):
            probs = (h @ weight.T).float().div_(ctx.temperature).softmax(-1)
            probs[torch.arange(len(label)), label] -= 1  # d log p(label) / d logit = one-hot - softmax
            grad_logits = probs.mul_(-g[:, None] / ctx.temperature).to(h.dtype)
            gh.copy_(grad_logits @ weight)
            grad_weight += grad_logits.T @ h
        return grad_hidden, grad_weight, None, None, None


def timed(function, hidden, weight, labels, temperature):
    times, grads = [], None
    for _ in range(3):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        start = time.perf_counter()
        logprobs = function(h, w, labels, temperature)
        (logprobs * torch.linspace(-1, 1, len(labels))).sum().backward()
        times.append(time.perf_counter() - start)
        grads = (h.grad, w.grad)
    return min(times), grads


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden, weight = torch.randn(args.rows, 896), torch.randn(151_936, 896) * 0.02
    labels = torch.randint(0, 151_936, (args.rows,))
    scripts = lambda h, w, y, t: head_logprobs(h, w, None, y, t)[0]  # noqa: E731
    results = {"the scripts' head_logprobs": timed(scripts, hidden, weight, labels, args.temperature),
               "HeadLogprobs (softmax - one-hot)": timed(HeadLogprobs.apply, hidden, weight, labels, args.temperature)}
    for name, (seconds, _) in results.items():
        print(f"{name}: {seconds:.2f} s forward + backward")
    (_, (a_h, a_w)), (_, (b_h, b_w)) = results.values()
    print(f"largest gradient difference: hidden {(a_h - b_h).abs().max():.2e}, weight {(a_w - b_w).abs().max():.2e}")
