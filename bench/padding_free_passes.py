"""The RL scripts' training passes over a rollout, padded against padding-free: grpo.py's policy pass (forward and
backward of the completions' log-probs) and its no-gradient pass (the reference's, the old policy's; ppo.py's passes
are the same calls) on GSM8K's lengths: prompts its questions, completions its answers (240 + 293 tokens on average,
one token a byte). Three layouts of the same micro-batch: "before", [left-padded prompts | right-padded completions]
with an attention mask (grpo.py of --before, an earlier revision); "padded", a sequence a row (--no-padding_free);
"padding-free", packed best fit (the default). One process, the model of bench/compare_trl.py --shape (random
weights), micro-batches drawn at random, the layouts alternating; the median seconds a pass and the range.

    python bench/padding_free_passes.py --before c15e198 --out runs/passes
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def load_before(revision, out):
    """grpo.py (and adam_tf.py) of `revision`, imported as a module."""
    folder = os.path.join(out, f"before_{revision}")
    os.makedirs(folder, exist_ok=True)
    for name in ("grpo.py", "adam_tf.py"):
        text = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        open(os.path.join(folder, name), "w").write(text)
    sys.path.insert(0, folder)
    import importlib

    module = importlib.import_module("grpo")
    sys.path.remove(folder)
    sys.modules.pop("grpo")
    return module


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="the revision whose grpo.py is 'before'")
    parser.add_argument("--out", default="runs/passes")
    parser.add_argument("--shape", default="6l")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16], help="sequences a micro-batch")
    parser.add_argument("--batches", type=int, default=3, help="micro-batches drawn, each timed once a repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = os.path.abspath(args.out)
    before = load_before(args.before, out)
    import grpo  # noqa: E402
    from compare_trl import make_model

    if not os.path.exists(os.path.join(out, f"model_{args.shape}")):
        from toy_task import write_toy_task

        write_toy_task(os.path.join(out, "toy"))
        make_model(out, args.shape)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"model_{args.shape}"))
    pad_id, eos_id = model.config.pad_token_id, model.config.eos_token_id
    data = [json.loads(line) for line in open(os.path.join(ROOT, "tests", "data", "gsm8k", "test.jsonl"))]
    rng = random.Random(0)

    def run(layout, prompts, completions, grad):
        """Seconds of one pass, and the log-probs and gradient (to check that the layouts agree)."""
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            if layout == "before":
                ids, mask, completion_mask = before.make_batch(prompts, completions, pad_id)
                logps = before.completion_logprobs(model, ids, mask, completion_mask.shape[1]) * completion_mask
            else:
                batch = grpo.make_batch("cpu", prompts, completions, range(len(prompts)),
                                        types.SimpleNamespace(padding_free=layout == "padding-free"))
                logps = grpo.completion_logprobs(model, batch)
            if grad:
                logps.sum().backward()
        seconds = time.perf_counter() - start
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()]) if grad else torch.zeros(1)
        model.zero_grad(set_to_none=True)
        return seconds, (logps.detach(), gradient)

    layouts, results = ["before", "padded", "padding-free"], {}
    for rows in args.rows:
        batches = []
        for _ in range(args.batches):
            picked = rng.sample(data, rows)
            batches.append(([list(r["question"].encode()) for r in picked],
                            [list((" " + r["answer"]).encode()) + [eos_id] for r in picked]))
        tokens = statistics.mean(sum(len(p) + len(c) for p, c in zip(*b)) for b in batches)
        for grad in (True, False):
            times, reference = {layout: [] for layout in layouts}, None
            for repeat in range(args.repeats):
                for layout in layouts if repeat % 2 == 0 else layouts[::-1]:  # alternating
                    seconds, logps = zip(*(run(layout, *b, grad) for b in batches))
                    times[layout].append(sum(seconds) / len(batches))
                    if repeat == 0:  # the same log-probs and gradients in every layout, to float order
                        reference = logps if layout == "before" else reference
                        gap = max((a - b).abs().max().item() for (a, _), (b, _) in zip(logps, reference))
                        grads = max(((a - b).abs().max() / b.abs().max()).item()
                                    for (_, a), (_, b) in zip(logps, reference)) if grad else 0.0
                        print(f"{rows} rows, {layout}: largest difference from 'before': log-prob {gap:.1e}, "
                              f"gradient {grads:.1e} of the largest")
            for layout in layouts:
                median = statistics.median(times[layout])
                results[f"{rows} {'policy' if grad else 'no-grad'} {layout}"] = dict(
                    seconds=median, low=min(times[layout]), high=max(times[layout]),
                    over_before=median / statistics.median(times["before"]))
                print(f"{rows} rows ({tokens:.0f} tokens), {'policy pass' if grad else 'no-grad pass'}, {layout}: "
                      f"{median:.3f} s ({min(times[layout]):.3f}-{max(times[layout]):.3f}), "
                      f"{median / statistics.median(times['before']):.2f} of before", flush=True)
    json.dump(results, open(os.path.join(out, "passes.json"), "w"), indent=1)
