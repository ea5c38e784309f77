"""Short 2-process runs in a loop, counting the ones that fail after training (torchrun's exit status, and an abort
at exit such as "terminate called without an active exception"). Usage:
    python bench/exit_loop.py --toy toy --runs 50 --out runs/exit_loop"""
import argparse
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--toy", default="toy")
parser.add_argument("--runs", type=int, default=50)
parser.add_argument("--out", default="runs/exit_loop")
args = parser.parse_args()
env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
failures, start = [], time.time()
for run in range(args.runs):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "sft.py",
               "--model_name_or_path", f"{args.toy}/model", "--dataset_name", f"{args.toy}/sft", "--max_steps", "2",
               "--output_dir", args.out, "--overwrite_output_dir", "--save_every", "2", "--seed", str(run)]
    result = subprocess.run(command, capture_output=True, text=True)
    output = result.stdout + result.stderr
    if result.returncode != 0 or "terminate called" in output:
        failures.append((run, result.returncode, output[-2000:]))
    print(f"run {run}: exit {result.returncode}", flush=True)
print(f"{args.runs} runs, {len(failures)} failed, {time.time() - start:.0f} s")
for run, code, tail in failures:
    print(f"--- run {run} (exit {code})\n{tail}")
