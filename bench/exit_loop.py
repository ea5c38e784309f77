"""Short 2-process runs in a loop, sft and grpo in turn, counting the ones that fail after training (torchrun's exit
status, and an abort at exit such as "terminate called without an active exception"). Usage:
    python bench/exit_loop.py --toy toy --runs 50 --out runs/exit_loop"""
import argparse
import os
import shutil
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--toy", default="toy")
parser.add_argument("--runs", type=int, default=50)
parser.add_argument("--out", default="runs/exit_loop")
args = parser.parse_args()
env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONFAULTHANDLER": "1"}
scripts = {"sft.py": ["--dataset_name", f"{args.toy}/sft"],
           "grpo.py": ["--dataset_name", f"{args.toy}/prompts", "--num_generations", "4", "--max_completion_length",
                       "6", "--per_device_train_batch_size", "4", "--local_rollout_forward_batch_size", "8"]}
failures, start = [], time.time()
for run in range(args.runs):
    script = list(scripts)[run % len(scripts)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
               "--model_name_or_path", f"{args.toy}/model", "--max_steps", "2", "--output_dir", args.out,
               "--save_every", "2", "--seed", str(run), *scripts[script]]
    shutil.rmtree(args.out, ignore_errors=True)  # the last run's
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    output = result.stdout + result.stderr
    if result.returncode != 0 or "terminate called" in output:
        failures.append((run, script, result.returncode, output[-3000:]))
    print(f"run {run} {script}: exit {result.returncode}", flush=True)
print(f"{args.runs} runs, {len(failures)} failed, {time.time() - start:.0f} s")
for run, script, code, tail in failures:
    print(f"--- run {run} {script} (exit {code})\n{tail}")
