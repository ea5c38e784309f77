"""The training log-probs through the output head, forward and backward: the scripts' HeadLogprobs (an autograd
Function whose backward recomputes the softmax, as many logits at a time as a chunk of rows has, a vocabulary slice for
all rows, and forms the logits' gradient from it) at 512, 1,024 and 2,048 rows a chunk, a backward by chunks of rows
with each chunk's passes compiled (torch.compile: a candidate for fewer passes over the logits), against autograd
through checkpointed chunks of 512 rows (log_softmax then gather) and, on a GPU, TRL's ChunkedLogProbFunction (Triton
kernels). Qwen2.5-0.5B's head (896 x 151,936), best of --repeats:
seconds, peak memory above the inputs, and each gradient's largest error against the same computed in float32.
Usage: python bench/head_backward.py [--device cuda --dtype bfloat16 --rows 16384] [--threads 2] [--temperature 1.0]"""
import argparse
import os
import sys
import time

import torch
from torch.nn.functional import linear
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sft  # noqa: E402
from sft import HEAD_ROWS, HeadLogprobs  # noqa: E402


def checkpointed_chunks(hidden, weight, labels, temperature, rows=512):
    """Autograd through log_softmax(logits.float() / T) and gather, a chunk of rows at a time, each recomputed in
    the backward (torch.utils.checkpoint)."""
    def chunk(h, label):
        return (linear(h, weight).float() / temperature).log_softmax(-1).gather(1, label[:, None])[:, 0]
    return torch.cat([checkpoint(chunk, h, label, use_reentrant=False, preserve_rng_state=False)
                      for h, label in zip(hidden.split(rows), labels.split(rows))])


def scripts_head(rows):
    """completion_logprobs' use of HeadLogprobs with HEAD_ROWS = `rows`: hidden / T, the chunks inside."""
    def head(hidden, weight, labels, temperature):
        sft.HEAD_ROWS = rows  # read by the forward and the backward
        return HeadLogprobs.apply(hidden / temperature, labels, False, weight)[0]
    return head


@torch.compile
def chunk_logprobs(hidden, weight, labels):
    log_p = torch.nn.functional.linear(hidden, weight).log_softmax(-1, dtype=torch.float32)
    return log_p.gather(1, labels[:, None])[:, 0]


@torch.compile
def chunk_gradients(hidden, weight, labels, logprobs, grad):
    """A chunk of rows' backward, for inductor to fuse the softmax, the one-hot and the scaling."""
    probs = torch.nn.functional.linear(hidden, weight).softmax(-1)
    probs = probs.scatter(1, labels[:, None], (logprobs[:, None].exp() - 1).to(probs.dtype))
    return (probs @ weight * grad).to(hidden.dtype), probs.T @ (hidden * grad).to(probs.dtype)


class CompiledChunks(torch.autograd.Function):
    """HeadLogprobs' forward (no bias, no entropy); the backward by chunks of rows, each chunk's passes compiled, the
    head's gradient summed in fp32."""

    @staticmethod
    def forward(ctx, hidden, labels, weight):
        logprobs = torch.cat([chunk_logprobs(h, weight, y) for h, y in zip(hidden.split(HEAD_ROWS),
                                                                             labels.split(HEAD_ROWS))])
        ctx.save_for_backward(hidden, labels, logprobs, weight)
        return logprobs

    @staticmethod
    def backward(ctx, grad):
        hidden, labels, logprobs, weight = ctx.saved_tensors
        parts, grad_weight = [], torch.zeros_like(weight, dtype=torch.float32)
        for h, y, lp, g in zip(*(t.split(HEAD_ROWS) for t in (hidden, labels, logprobs, -grad[:, None]))):
            grad_hidden, chunk_weight = chunk_gradients(h, weight, y, lp, g)
            parts.append(grad_hidden)
            grad_weight += chunk_weight
        return torch.cat(parts), None, grad_weight


def compiled_head(hidden, weight, labels, temperature):
    return CompiledChunks.apply(hidden / temperature, labels, weight)


def trl_function(hidden, weight, labels, temperature):
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, weight, None, labels, temperature, 32768, None, 1.0, ())[0]


def timed(head, hidden, weight, labels, temperature, repeats, sync):
    times, memory, grads = [], 0, None
    for _ in range(repeats + 1):  # the first: a warm-up
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if sync:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        logprobs = head(h, w, labels, temperature)
        (logprobs * torch.linspace(-1, 1, len(labels), device=h.device)).sum().backward()
        if sync:
            torch.cuda.synchronize()
            memory = (torch.cuda.max_memory_allocated() - base) / 2**30
        times.append(time.perf_counter() - start)
        grads = (h.grad, w.grad)
    return min(times[1:] or times), memory, grads


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype, gpu = torch.device(args.device), getattr(torch, args.dtype), args.device.startswith("cuda")
    hidden = torch.randn(args.rows, 896, device=device).to(dtype)
    weight = (torch.randn(151_936, 896, device=device) * 0.02).to(dtype)
    labels = torch.randint(0, 151_936, (args.rows,), device=device)
    ways = {"autograd, checkpointed chunks of 512 rows (log_softmax then gather)": checkpointed_chunks}
    for rows in (512, 1024, 2048):
        ways[f"HeadLogprobs, {rows} rows a chunk"] = scripts_head(rows)
    ways[f"HeadLogprobs' chunks of {HEAD_ROWS} rows, their passes compiled"] = compiled_head
    if gpu:
        ways["TRL 1.16 ChunkedLogProbFunction"] = trl_function
    results = {}
    for name, head in ways.items():
        try:
            results[name] = timed(head, hidden, weight, labels, args.temperature, args.repeats, gpu)
        except Exception as e:  # noqa: BLE001 (one way failing does not stop the others)
            print(f"{name}: failed: {e!r}"[:300])
    scripts = ways[f"HeadLogprobs, {HEAD_ROWS} rows a chunk"]
    exact = timed(scripts, hidden.float(), weight.float(), labels, args.temperature, 0, False)[2]
    print(f"{args.rows} rows, {args.dtype}, {args.device}, T {args.temperature}")
    for name, (seconds, memory, grads) in results.items():
        errors = [((grad.float() - want).abs().max() / want.abs().max()).item() for grad, want in zip(grads, exact)]
        print(f"{name}: {seconds * 1e3:.1f} ms forward + backward, peak {memory:.2f} GiB above the inputs; largest "
              f"error against float32 over the largest gradient: hidden {errors[0]:.1e}, weight {errors[1]:.1e}")
