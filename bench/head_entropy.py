"""The log-probs through the output head without gradients (score_rollout's, the reference's), with the entropy
computed for every chunk, and without it (only accumulate_gradients logs it; the scripts' way): Qwen2.5-0.5B's head
(896 x 151,936), 2,048 rows, fp32 on CPU, best of 3. Usage: python bench/head_entropy.py [--threads 2]"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sft import HeadLogprobs  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--rows", type=int, default=2048)
args = parser.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
hidden, weight = torch.randn(args.rows, 896), torch.randn(151_936, 896) * 0.02
labels = torch.randint(0, 151_936, (args.rows,))
seconds = {}
for name, with_entropy in (("with the entropy", True), ("without (the scripts)", False)):
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():  # as completion_logprobs: the chunks inside
            HeadLogprobs.apply(hidden, labels, with_entropy, weight)
        times.append(time.perf_counter() - start)
    seconds[name] = min(times)
    print(f"{name}: {seconds[name]:.2f} s")
