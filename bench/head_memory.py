"""Peak memory of sft, dpo and grpo with bf16 compute on a CPU, at a shape where the output head matters: Qwen2.5-0.5B's
hidden size, heads and 151,936-token vocabulary with 4 decoder layers (195.8M parameters, random weights). It compares
two git revisions of the scripts (and TRL 1.16 if BENCH_TRL_PYTHON names a Python that has it). Written for the
chunked head of completion_logprobs (bench/RESULTS.md); GPU figures come from bench/gpu.sh.

    python bench/head_memory.py --out runs/head_memory --revisions da2f1e2 HEAD --batches 2 4
    BENCH_TRL_PYTHON=/tmp/trlenv/bin/python python bench/head_memory.py --out runs/head_memory --revisions HEAD --trl

Each run is one process under torchrun, 4 optimizer steps, 128-token prompts and 384-token completions (grpo: 4
prompts x 8 completions of up to 128 tokens a step, micro-batch 16). Memory: the peak resident set, with
MALLOC_MMAP_THRESHOLD_ set so that glibc gives every large freed block back at once and the resident set follows the
live tensors. Two edits make the copies measure what a GPU would (they are written under OUT, the scripts are
untouched): bf16 compute (the scripts use it on CUDA only), and a contiguous input to the model's own head in no-grad
forwards, because a bf16 matmul on CPU copies the weight once per row when that input is a strided view (8 GB for 32
rows of this vocabulary; fp32 does not).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

# (pattern, replacement) in the scripts of da2f1e2 or of today: bf16 compute on CPU, and the model's own head given an
# index tensor (a copy) instead of a strided slice
BF16_EDITS = [('bf16 = args.bf16 and device.type == "cuda"', "bf16 = args.bf16"),
              ('if args.bf16 and device.type == "cuda" else {}', "if args.bf16 else {}")]
HEAD_EDITS = [("logits_to_keep=completion_width + 1)", "logits_to_keep=torch.arange(-completion_width - 1, 0))"),
              ("output_hidden_states=True, logits_to_keep=1)",
               "output_hidden_states=True, logits_to_keep=torch.tensor([-1]))"),
              ("logits_to_keep=1).logits", "logits_to_keep=torch.tensor([-1])).logits")]
RUNS = {  # algo: (data file, our arguments, TRL's arguments beyond batch and steps)
    "sft": ("sft", ["--max_prompt_length", "128", "--max_completion_length", "384"], ["--max_length", "512"]),
    "dpo": ("preference", ["--max_prompt_length", "128", "--max_completion_length", "384", "--beta", "0.1",
                           "--no-precompute-ref-logps"], ["--max_length", "512"]),
    "grpo": ("prompts", "--max_prompt_length 128 --max_completion_length 128 --num_generations 8 "
             "--gradient_accumulation_steps 2 --local_rollout_forward_batch_size 32 --temperature 1.0 --beta 0.04 "
             "--reward_fn exact_match".split(),
             ["--num_generations", "8", "--max_completion_length", "128", "--gradient_accumulation_steps", "2"]),
}
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def copy_scripts(revision, folder):
    """The revision's scripts with the edits applied: a bf16 edit and a head edit must each apply somewhere."""
    os.makedirs(folder, exist_ok=True)
    used = set()
    for name in ("sft.py", "dpo.py", "grpo.py", "adam_tf.py"):
        git = ["git", "show", f"{revision}:{name}"]
        source = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for pattern, replacement in BF16_EDITS + HEAD_EDITS:
            if pattern in source:
                source, used = source.replace(pattern, replacement), used | {pattern}
        open(os.path.join(folder, name), "w").write(source)
    if not used & {p for p, _ in BF16_EDITS} or not used & {p for p, _ in HEAD_EDITS}:
        raise SystemExit(f"{revision}: the edits found nothing to change in the bf16 line or the head's call")


def peak_gib(command, log):
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True)
    open(log, "w").write(" ".join(command) + "\n" + result.stdout + result.stderr)
    found = re.search(r"peak CPU RSS memory per process ([\d.]+) GiB", result.stdout)
    if result.returncode != 0 or not found:
        raise SystemExit(f"failed, see {log}")
    return float(found.group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--revisions", nargs="+", default=["HEAD"])
    parser.add_argument("--algos", nargs="+", default=["sft", "dpo", "grpo"])
    parser.add_argument("--batches", nargs="+", type=int, default=[2, 4], help="sft rows / dpo pairs per step")
    parser.add_argument("--trl", action="store_true", help="also TRL 1.16 (bench/trl_equivalent.py), bf16 autocast")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    import compare_trl
    import gpu
    from toy_task import write_toy_task

    compare_trl.SHAPES["0.5b-vocab-4-layers"] = dict(compare_trl.SHAPES["qwen2.5-0.5b"], num_hidden_layers=4)
    model, data = os.path.join(out, "model_0.5b-vocab-4-layers"), os.path.join(out, "data")
    if not os.path.exists(model):
        write_toy_task(os.path.join(out, "toy"), num_train=16, num_test=4)  # for its tokenizer
        compare_trl.make_model(out, "0.5b-vocab-4-layers")
        os.makedirs(data, exist_ok=True)
        gpu.write_synthetic_data(data, dict(prompt=128, completion=384), rows=64)
    for revision in args.revisions:
        copy_scripts(revision, os.path.join(out, f"ours_{revision}"))
    rows = []
    for algo in args.algos:
        file, ours, theirs = RUNS[algo]
        for batch in [16] if algo == "grpo" else args.batches:
            common = ["--per_device_train_batch_size", str(batch), "--max_steps", "4"]
            for revision in args.revisions:
                run_dir = os.path.join(out, "runs", f"{algo}_{revision}_{batch}")
                shutil.rmtree(run_dir, ignore_errors=True)
                command = ["torchrun", "--nproc_per_node", "1", os.path.join(out, f"ours_{revision}", f"{algo}.py"),
                           "--model_name_or_path", model, "--dataset_name", f"{data}/{file}.jsonl", "--output_dir",
                           run_dir, "--learning_rate", "1e-5", "--lr_scheduler_type", "constant", *common, *ours]
                rows.append((algo, batch, f"ours {revision}", peak_gib(command, run_dir + ".log")))
                print(*rows[-1], flush=True)
            if args.trl:
                trl_dir = os.path.join(out, "runs", f"{algo}_trl_{batch}")
                command = [os.environ.get("BENCH_TRL_PYTHON", sys.executable), "bench/trl_equivalent.py", algo,
                           "--model", model, "--data", f"{data}/{file}.jsonl", "--output_dir", trl_dir, "--batch",
                           str(batch), "--steps", "4", "--bf16", *theirs]
                rows.append((algo, batch, "TRL", peak_gib(command, trl_dir + ".log")))
                print(*rows[-1], flush=True)
    print("| script | batch | run | peak GiB |\n|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {:.2f} |".format(*row))


if __name__ == "__main__":
    main()
