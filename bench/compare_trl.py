"""Our scripts against TRL 1.16 at equal settings, side by side on this machine.

    python -m venv --system-site-packages .venv-bench && .venv-bench/bin/pip install -r bench/requirements.txt
    .venv-bench/bin/python bench/compare_trl.py --out runs/bench --algos sft reward dpo grpo --repeats 2 \
        --ours default no_reshard --trl equal checkpointing
    .venv-bench/bin/python bench/compare_trl.py --out runs/bench_gsm8k --data gsm8k --shape 6l --algos sft reward dpo \
        --ours default padded --trl equal padding_free

Offline: the toy task's data and byte-level tokenizer (examples/toy_task.py), and a ~27M-parameter Qwen2-family model
with random weights (hidden 512, 8 layers). --data gsm8k: GSM8K's 1,319 test rows (tests/data/gsm8k), question ->
answer, a pair's rejected answer the next row's; one token a byte, 240 + 293 tokens on average, at most 848 + 1,070.
Both sides run with torchrun on --nproc processes, the same per-device batch, steps, lengths and number of
generations, alternating ours, TRL, ours, TRL (each variant of each side once per repeat, see VARIANTS). TRL
1.16's configs turn gradient checkpointing on by default and ours do not, so the equal-settings TRL run is "equal",
with it off; "checkpointing" is TRL as it comes. Seconds per optimizer step: the median gap between the ends of
consecutive steps after the first --skip (ours: when each metrics.jsonl row appears, logged
every step; TRL: a callback at each step's end). Memory: the peak resident set of the busiest process, as both print it.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


# model shapes (Qwen2 family, random weights, the toy tokenizer): 27m for CPU; 6l (5M) for GSM8K's lengths on CPU;
# qwen2.5-0.5b, the real model's shape and vocabulary size (the toy tokenizer uses 258 of its ids), for a GPU; tiny,
# bench/gpu.py's dry run
SHAPES = {
    "27m": dict(vocab_size=258, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=8, max_position_embeddings=512),
    "6l": dict(vocab_size=258, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=4096),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768),
    "tiny": dict(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
}


def make_model(out, shape):
    """A Qwen2-shaped model with random weights and the toy byte tokenizer (EOS is rare: completions run long)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    import torch

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "toy", "model"))
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(os.path.join(out, f"model_{shape}"))
    tokenizer.save_pretrained(os.path.join(out, f"model_{shape}"))
    return sum(p.numel() for p in model.parameters())


def run(command, step_file=None, metrics_file=None, timeout=None, log_file=None):
    """Run a torchrun command; return the end time of every step and the printed peak memory (GiB): GPU allocations
    on a GPU, else the resident set. log_file: where its output goes as well."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    arrivals, done = [], threading.Event()

    def watch():  # our scripts: the time each metrics.jsonl row appears
        seen = 0
        while not done.is_set():
            if os.path.exists(metrics_file):
                rows = open(metrics_file).read().count("\n")
                arrivals.extend([time.time()] * (rows - seen))
                seen = rows
            time.sleep(0.01)

    watcher = threading.Thread(target=watch) if metrics_file else None
    if watcher:
        watcher.start()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        done.set()
        if watcher:
            watcher.join()
    if log_file:
        with open(log_file, "w") as f:
            f.write(" ".join(command) + "\n" + result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(" ".join(command) + "\n" + result.stdout[-3000:] + result.stderr[-5000:])
    times = arrivals if metrics_file else [float(t.split()[0]) for t in open(step_file)]
    peak = float(re.search(r"peak (?:GPU|CPU RSS) memory per process ([\d.]+) GiB", result.stdout).group(1))
    return times, peak


# extra flags per named variant: for our script, and for bench/trl_equivalent.py
VARIANTS = {
    "ours": {"default": [], "no_reshard": ["--no-reshard_after_forward"], "replicated": ["--shard_degree", "1"],
             "padded": ["--no-padding_free"], "before": []},
    "trl": {"equal": [], "checkpointing": ["--gradient_checkpointing"], "padding_free": ["--padding_free"]},
}


def write_gsm8k(out):
    """GSM8K's test rows as sft rows and preference pairs (the next row's answer rejected), in a random order."""
    import random

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "tests", "data", "gsm8k", "test.jsonl"))]
    random.Random(0).shuffle(rows)
    for data, make in (("sft", lambda r, n: dict(completion=" " + r["answer"])),
                       ("preference", lambda r, n: dict(chosen=" " + r["answer"], rejected=" " + n["answer"]))):
        os.makedirs(os.path.join(out, data), exist_ok=True)
        with open(os.path.join(out, data, "train.jsonl"), "w") as f:
            for row, after in zip(rows, rows[1:] + rows[:1]):
                f.write(json.dumps(dict(prompt=row["question"], **make(row, after))) + "\n")


def seconds_per_step(times, skip=3):
    gaps = [b - a for a, b in zip(times, times[1:])][skip:]
    return statistics.median(gaps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--algos", nargs="+", default=["sft", "reward", "dpo", "grpo"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shape", default="27m", choices=list(SHAPES))
    parser.add_argument("--data", default="toy", choices=["toy", "gsm8k"])
    parser.add_argument("--before", help="ours 'before': the scripts of this folder (an earlier revision's)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the median: the first ones warm up")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ours", nargs="+", default=["default"], choices=list(VARIANTS["ours"]))
    parser.add_argument("--trl", nargs="+", default=["equal"], choices=list(VARIANTS["trl"]))
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    if not os.path.exists(os.path.join(out, "toy")):
        from toy_task import write_toy_task

        write_toy_task(os.path.join(out, "toy"))
    if args.data == "gsm8k" and not os.path.exists(os.path.join(out, "gsm8k")):
        write_gsm8k(os.path.join(out, "gsm8k"))
    model, toy = os.path.join(out, f"model_{args.shape}"), os.path.join(out, args.data)
    # gsm8k: lengths above its longest prompt and completion, so that no row is dropped or cut on either side
    ours_lengths, trl_lengths = (["--max_prompt_length", 128], []) if args.data == "toy" else (
        ["--max_prompt_length", 1024, "--max_completion_length", 1152], ["--max_length", 2176])
    if not os.path.exists(model):
        print(f"model: {make_model(out, args.shape) / 1e6:.1f}M parameters")
    # per algorithm: (our script, data, our extra args, per-device batch); grpo: 16 completions per process per step =
    # 2 processes x 16 = 8 prompts x 4 generations, 32 new tokens at most, one iteration
    settings = {
        "sft": ("sft.py", "sft", [], 8),
        "reward": ("reward.py", "preference", ["--no-normalize_reward"], 8),  # no pass over the data at the end
        "dpo": ("dpo.py", "preference", ["--beta", 0.1, "--no-precompute-ref-logps"], 8),
        "grpo": ("grpo.py", "prompts", ["--num_generations", 4, "--max_completion_length", 32, "--temperature", 1.0,
                                         "--beta", 0.04, "--num_iterations", 1, "--num_mini_batches", 1,
                                         "--local_rollout_forward_batch_size", 16], 16),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    python = os.environ.get("BENCH_TRL_PYTHON", sys.executable)  # the interpreter with trl installed
    trl_run = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    table = {}
    for algo in args.algos:
        script, data, extra, batch = settings[algo]
        data_file = os.path.join(toy, data, "train.jsonl")
        results = {(side, name): [] for side in ("ours", "trl") for name in getattr(args, side)
                   if algo == "sft" or name != "padding_free"}  # TRL's padding_free: SFT only
        for repeat in range(args.repeats):
            for i in range(max(len(args.ours), len(args.trl))):  # ours, TRL, ours, TRL, ...
                for side in ("ours", "trl"):
                    name = getattr(args, side)[i] if i < len(getattr(args, side)) else None
                    if (side, name) not in results:
                        continue
                    run_dir = os.path.join(out, f"{algo}_{side}_{name}_{repeat}")
                    subprocess.run(["rm", "-rf", run_dir])
                    if side == "ours":
                        path = os.path.join(args.before, script) if name == "before" else script
                        command = torchrun + [path, "--model_name_or_path", model, "--dataset_name", data_file,
                                              "--output_dir", run_dir, "--max_steps", args.steps,
                                              "--per_device_train_batch_size", batch, "--learning_rate", 1e-5,
                                              "--lr_scheduler_type", "constant", "--log_every", 1,
                                              *ours_lengths, *extra, *VARIANTS[side][name]]
                        metrics = os.path.join(run_dir, "metrics.jsonl")
                        times, peak = run([str(a) for a in command], metrics_file=metrics)
                    else:
                        command = trl_run + ["bench/trl_equivalent.py", algo, "--model", model, "--data", data_file,
                                             "--output_dir", run_dir, "--steps", args.steps, "--batch", batch,
                                             *trl_lengths, *VARIANTS[side][name]]
                        times, peak = run([str(a) for a in command], step_file=os.path.join(run_dir, "step_times.txt"))
                    results[(side, name)].append((seconds_per_step(times, args.skip), peak))
                    seconds, peak = results[(side, name)][-1]
                    print(algo, repeat, side, name, f"{seconds:.3f} s/step, {peak:.2f} GiB", flush=True)
        rows = {f"{side} {name}": (statistics.median(s for s, _ in r), max(m for _, m in r),
                                   min(s for s, _ in r), max(s for s, _ in r)) for (side, name), r in results.items()}
        table[algo] = rows
        equal = rows.get("trl equal", next(v for k, v in rows.items() if k.startswith("trl")))  # checkpointing off
        for name, (seconds, peak, low, high) in rows.items():
            print(f"{algo} | {name} | {seconds:.3f} s/step ({low:.3f}-{high:.3f}) | {peak:.2f} GiB | ratio to TRL "
                  f"equal {seconds / equal[0]:.2f} (time), {peak / equal[1]:.2f} (memory)", flush=True)
    json.dump(table, open(os.path.join(out, "compare_trl.json"), "w"), indent=1)
