"""Peak memory of the head's forward and backward (HeadLogprobs) above its inputs, at two revisions of sft.py: the
head's weight gradient summed over chunks of rows in an fp32 copy of the head (4 x vocabulary x hidden bytes), or one
matrix product a vocabulary slice (no such copy). bf16 weights on the CPU, --rows rows, Qwen2.5-0.5B's head (896 x
151,936) and a 7B's (3,584 x 152,064). Each case in a fresh process; memory is the peak resident set above the inputs,
with MALLOC_MMAP_THRESHOLD_ set so that glibc returns every large freed block at once (the resident set follows the
live tensors). Also the gradients' largest difference between the revisions, over the largest gradient.

    python bench/head_grad_memory.py --revisions 59d76cc . --rows 256   # ".": the working tree's sft.py
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"Qwen2.5-0.5B": (896, 151_936), "7B": (3584, 152_064)}
CASE = r"""
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
import sft
torch.set_num_threads(2)
hidden_size, vocab, rows, out = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
hidden = torch.randn(rows, hidden_size).to(torch.bfloat16).requires_grad_()
weight = (torch.randn(vocab, hidden_size) * 0.02).to(torch.bfloat16).requires_grad_()
labels, upstream = torch.randint(0, vocab, (rows,)), torch.randn(rows)
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
logprobs, _ = sft.HeadLogprobs.apply(hidden, labels, False, weight)
(logprobs * upstream).sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
torch.save({"peak": peak - base, "hidden": hidden.grad, "weight": weight.grad}, out)
"""


def run(folder, hidden_size, vocab, rows, out):
    """One case in a fresh process: its peak above the inputs and the two gradients."""
    import torch

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-c", CASE, folder, str(hidden_size), str(vocab), str(rows), out], env=env,
                   check=True)
    return torch.load(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--revisions", nargs=2, default=["59d76cc", "."])
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for revision in args.revisions:
            folders.append(os.path.join(tmp, f"revision_{len(folders)}"))
            os.makedirs(folders[-1])
            for name in ("sft.py", "adam_tf.py"):
                source = open(os.path.join(ROOT, name)).read() if revision == "." else subprocess.run(
                    ["git", "show", f"{revision}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
                open(os.path.join(folders[-1], name), "w").write(source)
        for shape, (hidden_size, vocab) in SHAPES.items():
            chunk, copy = 4 * 1024 * vocab / 2**30, 4 * vocab * hidden_size / 2**30
            print(f"{shape}: a chunk's fp32 logits (1,024 rows) {chunk:.2f} GiB, an fp32 copy of the head "
                  f"{copy:.2f} GiB", flush=True)
            results = [run(f, hidden_size, vocab, args.rows, os.path.join(tmp, "out.pt")) for f in folders]
            for revision, result in zip(args.revisions, results):
                print(f"  {revision}: peak {result['peak'] / 2**30:.2f} GiB above the inputs", flush=True)
            for name in ("hidden", "weight"):
                a, b = (r[name].float() for r in results)
                print(f"  {name} gradient: largest difference {((a - b).abs().max() / b.abs().max()).item():.1e} of "
                      "the largest", flush=True)
