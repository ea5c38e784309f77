"""One command that proves and measures every script on a GPU, under 9 minutes on one H100 or H200.

    bash bench/gpu_wheels.sh               # on the CPU machine, once: what the GPU machine lacks, as wheels in .whl/
    bash bench/gpu.sh --out runs/gpu       # on the GPU machine: installs .whl/ if needed, then runs this file
    bash bench/gpu.sh --sizes users        # the speed and generation stages at the shape users train (SIZES)
    bash bench/gpu.sh --dry-run            # the same steps at toy size on CPU (tests/test_gpu_bench.py runs it),
                                           # without sft_again and the static-cache runs, each as `python script.py`

Stages (a failed check is named in the results and the summary; a failed stage does not stop the next one):
  env          machine, versions, the measured bf16 matrix-product rate, the dense bf16 peak that MFU is taken against
  correctness  each script for a few steps on the toy task, bf16, one process (torchrun, nccl): exit 0, finite numbers
               in metrics.jsonl, a saved folder that loads and gives finite outputs; grpo and ppo sample under FSDP2;
               sft stopped at a checkpoint and resumed ends with the weights of the straight run (compared with the
               difference between two straight runs: the GPU's own run-to-run noise)
  speed        Qwen2.5-0.5B's shape with random weights, bf16, one GPU: sft tokens/s and MFU, dpo s/step, a grpo step
               by part (bench/profile_rl.py), peak GPU memory of each; TRL's SFTTrainer, DPOTrainer and GRPOTrainer on
               the same shapes, batch sizes and lengths (bench/trl_equivalent.py); sft on GSM8K's lengths, ours
               padding-free (the default) and padded (--no-padding_free), TRL's padding_free. The runs alternate
               ours and TRL's, `repeats` rounds (SIZES): the median seconds a step and the range of each side, the
               ratio of the medians with its range, and a verdict: faster or slower only where the two ranges do
               not overlap, else within noise
  generation   at the grpo shape: HF generate with its dynamic cache (what grpo.py and ppo.py call), a static cache with
               torch.compile (grpo.py/ppo.py --cache_implementation static), and continuous batching (generate_batch):
               samples/s, and whether each samples from exactly softmax(logits / T) (fp32, against a teacher-forced
               forward)
Writes OUT/results.json (after every stage) and OUT/summary.md, and prints the summary last.
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # grpo.py's generation and log-prob helpers, for the generation stage
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the toy task
sys.path.insert(0, os.path.join(ROOT, "bench"))  # compare_trl's model shapes and its timed runner

from compare_trl import make_model, run, seconds_per_step, write_gsm8k  # noqa: E402

# What each run measures, on a GPU and in the CPU dry run. Lengths in tokens (the toy tokenizer: one token per byte).
SIZES = {
    "gpu": dict(shape="qwen2.5-0.5b", prompt=128, completion=384, sft_batch=8, dpo_batch=8, steps=14, skip=4,
                grpo_prompts=8, grpo_generations=8, grpo_completion=256, grpo_micro=16, grpo_steps=4, grpo_skip=1,
                repeats=3, toy_steps=4, gen_repeats=1, gen_batches=(64, 256), check_prompts=8, check_tokens=16,
                run_timeout=240),
    "dry": dict(shape="tiny", prompt=16, completion=16, sft_batch=4, dpo_batch=4, steps=5, skip=1, grpo_prompts=2,
                grpo_generations=4, grpo_completion=8, grpo_micro=4, grpo_steps=3, grpo_skip=1, repeats=2, toy_steps=2,
                gen_repeats=1, gen_batches=(8,), check_prompts=4, check_tokens=6, run_timeout=300),
    # the shape users train at: sft 16 x 1024 tokens a step, dpo 8 pairs x 1024, grpo 64 completions of 512 new tokens
    "users": dict(shape="qwen2.5-0.5b", prompt=256, completion=768, sft_batch=16, dpo_batch=8, steps=10, skip=2,
                  grpo_prompts=8, grpo_generations=8, grpo_completion=512, grpo_micro=16, grpo_steps=3, grpo_skip=1,
                  repeats=3, toy_steps=4, gen_repeats=1, gen_batches=(64, 256), check_prompts=8, check_tokens=16,
                run_timeout=240),
}
# dense bf16 matrix rate from the data sheets (FLOP/s), what MFU is taken against; the measured rate is also reported
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
CHECK_TOLERANCE = 1e-3  # fp32 log-probs of the same tokens, KV-cached decoding vs one teacher-forced forward


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: checks that the command runs")
    parser.add_argument("--stages", nargs="+", default=["env", "correctness", "speed", "generation"])
    parser.add_argument("--no-trl", action="store_true", help="skip TRL's side of the speed stage")
    parser.add_argument("--algos", nargs="+", default=["sft", "dpo", "grpo", "grpo_static", "sft_gsm8k",
                                                       "sft_gsm8k_padded"], help="the speed runs")
    parser.add_argument("--sizes", default="gpu", choices=["gpu", "users"], help="SIZES on a GPU")
    parser.add_argument("--budget", type=float, default=520, help="seconds; a stage that would start later is skipped")
    args = parser.parse_args()
    sizes = SIZES["dry" if args.dry_run else args.sizes]
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("no CUDA device: bench/gpu.py measures a GPU (use --dry-run on CPU)")
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run, "sizes": sizes, "stages": {}}
    begin = time.time()
    args.deadline = begin + args.budget  # the speed stage starts no run past it
    from toy_task import write_toy_task

    if not os.path.exists(os.path.join(out, "toy", "model")):  # a few steps a run: 512 training rows are plenty
        write_toy_task(os.path.join(out, "toy"), num_train=512, num_test=64)
    stages = {"env": env_stage, "correctness": correctness_stage, "speed": speed_stage, "generation": generation_stage}
    for name in args.stages:
        if time.time() - begin > args.budget:
            results["stages"][name] = {"failures": [f"skipped: past the time budget of {args.budget:.0f} s"]}
            continue
        start = time.time()
        print(f"== {name}", flush=True)
        try:
            results["stages"][name] = stages[name](out, sizes, args)
        except Exception:
            results["stages"][name] = {"failures": [f"stage raised:\n{traceback.format_exc()[-3000:]}"]}
        results["stages"][name]["seconds"] = round(time.time() - start, 1)
        json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    results["seconds"] = round(time.time() - begin, 1)
    json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    summary = summarise(results)
    open(os.path.join(out, "summary.md"), "w").write(summary)
    print(summary)
    failed = [name for name, stage in results["stages"].items() if stage.get("failures")]
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)


# ---------------------------------------------------------------------------------------------------------------------
# env: the machine and the two numbers everything is compared with
def env_stage(out, sizes, args):
    import importlib.metadata

    versions = {}
    for package in ("torch", "transformers", "datasets", "tyro", "trl", "accelerate", "pyarrow", "fsspec"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    result = {"python": platform.python_version(), "versions": versions, "failures": []}
    if torch.cuda.is_available():
        result.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                      memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                      nccl=".".join(map(str, torch.cuda.nccl.version())))
        size, dtype = 8192, torch.bfloat16
    else:
        result.update(device=f"CPU ({os.cpu_count()} cores)", cuda=None)
        size, dtype = 512, torch.float32
    result["peak_bf16_tflops"] = peak_tflops()
    a, b = (torch.randn(size, size, device=device(), dtype=dtype) for _ in range(2))
    times = []
    for _ in range(13):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    result["matmul_tflops"] = round(2 * size**3 / statistics.median(times[3:]) / 1e12, 1)
    result["matmul"] = f"{size}x{size}x{size} {str(dtype).removeprefix('torch.')}, median of 10 after 3 warm-ups"
    print(json.dumps(result), flush=True)
    return result


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_tflops():
    """The data sheet's dense bf16 rate of this GPU (None: no GPU, or one not in PEAK_BF16)."""
    if not torch.cuda.is_available():
        return None
    return next((v / 1e12 for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)


# ---------------------------------------------------------------------------------------------------------------------
# correctness: every script on the toy task, one process, bf16 on the GPU
def torchrun(script, arguments):
    """One process: torchrun on a GPU, as users launch there. On CPU (the dry run) `python script.py`, the scripts'
    one-process path without the launcher's own interpreter (measured: 1.7 of a 2-step sft run's 7.9 CPU-seconds)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    return (launcher if torch.cuda.is_available() else [sys.executable]) + [script] + [str(a) for a in arguments]


def launch_all(runs, out, timeout):
    """Start every (name, command) at once (the toy model is tiny: they share the GPU), wait for all; returns
    name -> (exit code, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    processes = {}
    for name, command in runs.items():
        log = open(os.path.join(out, "logs", f"{name}.log"), "w")
        log.write(" ".join(command) + "\n")
        log.flush()
        processes[name] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    deadline, finished = time.time() + timeout, {}
    for name, (process, log) in processes.items():
        try:
            code = process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = f"killed after {timeout} s"
        log.close()
        finished[name] = (code, open(os.path.join(out, "logs", f"{name}.log")).read())
    return finished


def check_run(name, code, output, output_dir, model_kind, failures):
    """Exit 0, metrics.jsonl with finite numbers and a loss, ran on the GPU if there is one, and a saved folder that
    loads and gives finite outputs. Appends what failed to `failures`; returns the last metrics row."""
    if code != 0:
        failures.append(f"{name}: exit {code}: ...{output[-1500:]}")
        return None
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    if not rows:
        failures.append(f"{name}: no rows in {metrics_path}")
        return None
    bad = sorted({k for row in rows for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)})
    if bad or not any("loss" in row for row in rows):
        failures.append(f"{name}: metrics.jsonl: non-finite {bad}" if bad else f"{name}: metrics.jsonl has no loss")
    if torch.cuda.is_available() and "peak GPU memory" not in output:
        failures.append(f"{name}: did not report GPU memory: it did not run on the GPU")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    try:
        auto = AutoModelForSequenceClassification if model_kind == "reward" else AutoModelForCausalLM
        model = auto.from_pretrained(output_dir, dtype=torch.float32).to(device())
        ids = AutoTokenizer.from_pretrained(output_dir)("sort: 31415 -> 11345", return_tensors="pt")["input_ids"]
        if not torch.isfinite(model(input_ids=ids.to(model.device)).logits).all():
            failures.append(f"{name}: the saved model gives non-finite outputs")
    except Exception as e:
        failures.append(f"{name}: the saved folder {output_dir} does not load: {e!r}")
    return rows[-1]


def max_difference(folder_a, folder_b):
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(folder, "model.safetensors")) for folder in (folder_a, folder_b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def elsewhere(command, output_dir, *extra):
    """The same run into another --output_dir, with extra arguments."""
    i = command.index("--output_dir")
    return command[: i + 1] + [output_dir] + command[i + 2 :] + list(extra)


def correctness_stage(out, sizes, args):
    toy, runs, steps = os.path.join(out, "toy"), os.path.join(out, "correctness"), sizes["toy_steps"]
    shutil.rmtree(runs, ignore_errors=True)  # the scripts refuse an output_dir that holds an earlier run
    common = ["--learning_rate", 1e-4, *"--log_every 1 --per_device_train_batch_size 16 --max_steps".split()]
    model = ["--model_name_or_path", f"{toy}/model"]
    sft = ["sft.py", *model, "--dataset_name", f"{toy}/sft", "--save_every", steps // 2, *common, steps]
    rl = [*model, "--dataset_name", f"{toy}/prompts", "--max_completion_length", 12]
    rl += ["--per_device_eval_batch_size", 100]
    first_wave = {
        "sft": sft + ["--output_dir", f"{runs}/sft"],
        "sft_again": sft + ["--output_dir", f"{runs}/sft_again"],  # the run-to-run noise of the GPU (not on CPU)
        "reward": ["reward.py", *model, "--dataset_name", f"{toy}/preference", "--output_dir", f"{runs}/reward",
                   *common, steps],
        "dpo": ["dpo.py", *model, "--dataset_name", f"{toy}/preference", "--output_dir", f"{runs}/dpo", *common, steps],
        "grpo": ["grpo.py", *rl, "--output_dir", f"{runs}/grpo", "--reward_fn", "exact_match", "--num_generations", 4,
                 *common, steps],
    }
    first_wave["grpo_static"] = elsewhere(first_wave["grpo"], f"{runs}/grpo_static", "--cache_implementation", "static")
    first_wave["grpo_online_dpo"] = elsewhere(first_wave["grpo"], f"{runs}/grpo_online_dpo", "--policy_loss", "dpo",
                                              "--beta", 0.1)
    second_wave = {  # after the first: ppo scores with the reward model; sft resumes from the first run's checkpoint
        "ppo": ["ppo.py", *rl, "--reward_model_path", f"{runs}/reward", "--output_dir", f"{runs}/ppo",
                "--num_ppo_epochs", 2, "--num_mini_batches", 2, "--local_rollout_forward_batch_size", 32, *common, 4],
        "sft_resumed": sft + ["--output_dir", f"{runs}/sft_resumed", "--resume_from",
                              f"{runs}/sft/checkpoints/step_{steps // 2}"],
    }
    second_wave["ppo_static"] = elsewhere(second_wave["ppo"], f"{runs}/ppo_static", "--cache_implementation", "static")
    if not torch.cuda.is_available():  # the dry run: no noise to measure on CPU, where the static cache is not
        for wave in (first_wave, second_wave):  # compiled (tests/test_grpo.py checks it there, in process)
            for name in ("sft_again", "grpo_static", "ppo_static", "grpo_online_dpo"):
                wave.pop(name, None)
    result, failures = {"runs": {}}, []
    keys = ("loss", "objective/scores", "completions/mean_length", "eval/scores", "val/num_eos_tokens",
            "tokens_per_second")
    for wave in (first_wave, second_wave):
        finished = launch_all({name: torchrun(cmd[0], cmd[1:]) for name, cmd in wave.items()}, out,
                              sizes["run_timeout"])
        for name, (code, output) in finished.items():
            kind = "reward" if name == "reward" else "causal"
            last = check_run(name, code, output, f"{runs}/{name}", kind, failures)
            result["runs"][name] = {"exit": code, "last_metrics": {k: last[k] for k in keys if last and k in last}}
    if all(os.path.exists(f"{runs}/{name}/model.safetensors") for name in ("sft", "sft_resumed")):
        resumed = max_difference(f"{runs}/sft", f"{runs}/sft_resumed")
        again = f"{runs}/sft_again"  # on CPU (no sft_again) two runs agree to the bit
        noise = max_difference(f"{runs}/sft", again) if os.path.exists(f"{again}/model.safetensors") else 0.0
        result["resume"] = {"max_abs_difference_resumed_vs_straight": resumed,
                            "max_abs_difference_two_straight_runs": noise}
        if resumed > noise:
            failures.append(f"resume: the resumed sft differs from the straight run by {resumed:.3g}, more than two "
                            f"straight runs ({noise:.3g})")
    result["failures"] = failures
    return result


# ---------------------------------------------------------------------------------------------------------------------
# speed: a real model's shape, ours and TRL's, the same data, batch sizes and lengths
def write_synthetic_data(folder, sizes, rows=256, seed=0):
    """Rows of random letters at fixed lengths (one token per byte with the toy tokenizer, EOS added by the scripts):
    every batch has the same number of tokens, so tokens per step are known without padding."""
    rng = random.Random(seed)
    text = lambda n: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
    p, c = sizes["prompt"], sizes["completion"] - 1  # the completion's last token is the EOS
    files = {"sft": [{"prompt": text(p), "completion": text(c)} for _ in range(rows)],
             "preference": [{"prompt": text(p), "chosen": text(c), "rejected": text(c)} for _ in range(rows)],
             "prompts": [{"prompt": text(p), "answer": text(8)} for _ in range(rows)]}
    for name, data in files.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in data)


def flops_per_token(config, sequence_length):
    """Training FLOPs per token, PaLM's convention (arXiv:2204.02311, App. B): 6 N (every parameter, the tied head
    once) + 12 L d T for attention."""
    d, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = d * (d + 2 * kv + d) + 3 * d * config["intermediate_size"]  # q, k, v, o projections; gate, up, down
    n = layers * per_layer + vocab * d
    return 6 * n + 12 * layers * d * sequence_length


def speed_stage(out, sizes, args):
    import importlib.util

    data, model = os.path.join(out, "speed_data"), os.path.join(out, f"model_{sizes['shape']}")
    os.makedirs(data, exist_ok=True)
    write_synthetic_data(data, sizes)
    if not os.path.exists(model):
        make_model(out, sizes["shape"])
    with_trl = not args.no_trl and importlib.util.find_spec("trl") is not None
    runs_dir, timeout = os.path.join(out, "speed"), sizes["run_timeout"]
    shutil.rmtree(runs_dir, ignore_errors=True)  # the scripts refuse an output_dir that holds an earlier run
    os.makedirs(runs_dir)
    steps, skip, length = sizes["steps"], sizes["skip"], sizes["prompt"] + sizes["completion"]
    lengths = ["--max_prompt_length", sizes["prompt"], "--max_completion_length", sizes["completion"]]
    ours = ["--model_name_or_path", model, "--learning_rate", 1e-5, "--lr_scheduler_type", "constant", "--log_every", 1]
    G, micro, new = sizes["grpo_generations"], sizes["grpo_micro"], sizes["grpo_completion"]
    accumulation = sizes["grpo_prompts"] * G // micro
    write_gsm8k(os.path.join(data, "gsm8k"))
    files = {"sft": f"{data}/sft.jsonl", "dpo": f"{data}/preference.jsonl", "grpo": f"{data}/prompts.jsonl",
             "sft_gsm8k": f"{data}/gsm8k/sft/train.jsonl"}
    grpo = ["bench/profile_rl.py", "grpo.py", "--dataset_name", files["grpo"], "--num_generations", G,
            "--max_completion_length", new, "--max_prompt_length", sizes["prompt"], "--per_device_train_batch_size",
            micro, "--gradient_accumulation_steps", accumulation, "--temperature", 1.0, "--beta", 0.04,
            "--local_rollout_forward_batch_size", sizes["grpo_prompts"] * G, "--reward_fn", "exact_match",
            "--max_steps", sizes["grpo_steps"]]
    plan = {  # algo: (our command, TRL's arguments, optimizer steps timed from)
        "sft": (["sft.py", "--dataset_name", files["sft"], "--per_device_train_batch_size", sizes["sft_batch"],
                 "--max_steps", steps, *lengths],
                ["--batch", sizes["sft_batch"], "--max_length", length, "--steps", steps], skip),
        "dpo": (["dpo.py", "--dataset_name", files["dpo"], "--per_device_train_batch_size", sizes["dpo_batch"],
                 "--max_steps", steps, "--beta", 0.1, "--no-precompute-ref-logps", *lengths],
                ["--batch", sizes["dpo_batch"], "--max_length", length, "--steps", steps], skip),
        "grpo": (grpo, ["--batch", micro, "--gradient_accumulation_steps", accumulation, "--num_generations", G,
                        "--max_completion_length", new, "--steps", sizes["grpo_steps"]], sizes["grpo_skip"]),
    }
    # grpo.py with --cache_implementation static, against the same TRL run (TRL's GRPO as it comes: dynamic cache)
    plan["grpo_static"] = (plan["grpo"][0] + ["--cache_implementation", "static"], None, sizes["grpo_skip"])
    # sft on GSM8K's lengths (lengths above its longest, as bench/compare_trl.py --data gsm8k): ours padding-free and
    # padded against TRL's padding_free (a batch in one row)
    plan["sft_gsm8k"] = (["sft.py", "--dataset_name", files["sft_gsm8k"], "--per_device_train_batch_size",
                          sizes["sft_batch"], "--max_steps", steps, "--max_prompt_length", 1024,
                          "--max_completion_length", 1152], ["--batch", sizes["sft_batch"], "--padding_free",
                                                             "--steps", steps], skip)
    plan["sft_gsm8k_padded"] = (plan["sft_gsm8k"][0] + ["--no-padding_free"], None, skip)
    config = json.load(open(os.path.join(model, "config.json")))
    peak = (peak_tflops() or 0) * 1e12
    result, failures = {"model": sizes["shape"], "parameters": sum(parameter_counts(model).values()), "runs": {}}, []
    plan = {algo: row for algo, row in plan.items()
            if algo in args.algos and (algo != "grpo_static" or torch.cuda.is_available())}  # compiled on GPUs only
    times = {algo: {"ours": [], "trl": []} for algo in plan}
    memory, breakdowns = {algo: {"ours": [], "trl": []} for algo in plan}, {}
    for repeat in range(sizes["repeats"]):  # ours, TRL, algorithm after algorithm, then again: drift hits both sides
        for algo, (our_command, trl_arguments, skip) in plan.items():
            sides = {"ours": our_command}
            if with_trl and trl_arguments is not None:  # grpo_static, sft_gsm8k_padded: the TRL runs of another
                sides["trl"] = trl_arguments
            for side, arguments in sides.items():
                if time.time() > args.deadline:
                    failures.append(f"speed {algo} {side}: run {repeat + 1} not started, past the time budget")
                    continue
                try:
                    seconds, gib, profile = timed_run(algo, side, arguments, repeat, skip, out, runs_dir, model,
                                                      files, ours, timeout)
                except Exception as e:
                    failures.append(f"speed {algo} {side} run {repeat + 1}: {str(e)[-2000:]}")
                    continue
                times[algo][side].append(seconds)
                memory[algo][side].append(gib)
                if profile:
                    breakdowns.setdefault(algo, grpo_breakdown(profile))
                print(f"speed {algo} {side} run {repeat + 1}: {seconds:.4f} s/step, {gib:.1f} GiB", flush=True)
                json.dump({"times": times, "memory": memory}, open(os.path.join(out, "speed_partial.json"), "w"))
    for algo, same in (("grpo_static", "grpo"), ("sft_gsm8k_padded", "sft_gsm8k")):  # against the same TRL runs
        if algo in times and same in times:
            times[algo]["trl"], memory[algo]["trl"] = times[same]["trl"], memory[same]["trl"]
    for algo in plan:
        row = {side: spread(values) | {"peak_memory_gib": max(memory[algo][side])}
               for side, values in times[algo].items() if values}
        if "ours" in row and algo in breakdowns:
            row["ours"]["breakdown"] = breakdowns[algo]
        if "ours" in row and "trl" in row:
            row["ours_over_trl"] = ratio(times[algo]["ours"], times[algo]["trl"])
            row["ours_over_trl"]["memory"] = row["ours"]["peak_memory_gib"] / row["trl"]["peak_memory_gib"]
        for side in [side for side in ("ours", "trl") if side in row and algo == "sft"]:
            row[side]["tokens_per_second"] = sizes["sft_batch"] * length / row[side]["seconds_per_step"]
            if peak:
                row[side]["mfu"] = row[side]["tokens_per_second"] * flops_per_token(config, length) / peak
        result["runs"][algo] = row
        print(algo, json.dumps(row), flush=True)
    if not with_trl:
        result["trl"] = "skipped: --no-trl" if args.no_trl else "skipped: trl is not installed"
    result["failures"] = failures
    return result


def timed_run(algo, side, arguments, repeat, skip, out, runs_dir, model, files, ours, timeout):
    """One run of a speed comparison: seconds per optimizer step (the median gap after `skip`), peak memory (GiB),
    and grpo's profile (ours, bench/profile_rl.py)."""
    name = f"{algo}_{side}_{repeat + 1}"
    output_dir, log = os.path.join(runs_dir, name), os.path.join(out, "logs", f"speed_{name}.log")
    if side == "trl":
        command = [sys.executable, "bench/trl_equivalent.py", algo.split("_")[0], "--model", model, "--data",
                   files[algo.removesuffix("_static")], "--output_dir", output_dir, *map(str, arguments)]
        times, gib = run(command, step_file=os.path.join(output_dir, "step_times.txt"), timeout=timeout, log_file=log)
        return seconds_per_step(times, skip), gib, None
    profile = {"PROFILE_JSON": os.path.join(runs_dir, f"{name}_profile.json"), "PROFILE_SKIP": str(skip)}
    profile = profile if "grpo" in algo else {}
    try:
        os.environ.update(profile)
        times, gib = run(torchrun(arguments[0], arguments[1:] + ours + ["--output_dir", output_dir]),
                         metrics_file=os.path.join(output_dir, "metrics.jsonl"), timeout=timeout, log_file=log)
    finally:
        for key in profile:
            os.environ.pop(key, None)
    found = profile and os.path.exists(profile["PROFILE_JSON"])
    return seconds_per_step(times, skip), gib, json.load(open(profile["PROFILE_JSON"])) if found else None


def spread(values):
    """The median of repeated runs' seconds per step, their range, and the runs."""
    return {"seconds_per_step": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def ratio(ours, trl):
    """ours / TRL: the ratio of the medians and its range (the extremes of each side against the other's); measured
    only where the two sides' ranges do not overlap, else within noise (one run a side says nothing either way)."""
    verdict = ("ours faster" if max(ours) < min(trl) else "ours slower" if min(ours) > max(trl) else "within noise")
    return {"time": statistics.median(ours) / statistics.median(trl), "time_range": [min(ours) / max(trl),
            max(ours) / min(trl)], "verdict": verdict if min(len(ours), len(trl)) > 1 else "one run a side"}


def parameter_counts(model_dir):
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}


def grpo_breakdown(profile):
    """profile_rl.py's labels grouped into the parts of a GRPO step (seconds per optimizer step)."""
    parts = {"generation": 0.0, "reference and old log-probs": 0.0, "update": 0.0, "other": 0.0}
    for label, seconds in profile.items():
        if label in ("steps", "seconds_per_step"):
            continue
        if label == "generation":
            parts["generation"] += seconds
        elif label.startswith("forward no_grad"):
            parts["reference and old log-probs"] += seconds
        elif label.startswith(("forward train", "backward", "fsdp", "optimizer", "grad clip")):
            parts["update"] += seconds
        else:
            parts["other"] += seconds  # script all_reduce, data, rewards, statistics
    return {"seconds_per_step": profile["seconds_per_step"], **parts}


# ---------------------------------------------------------------------------------------------------------------------
# generation: the paths transformers offers, their speed, and whether they sample from softmax(logits / T)
def generation_stage(out, sizes, args):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from decode import decode
    from grpo import generate_completions

    model_dir = os.path.join(out, f"model_{sizes['shape']}")
    if not os.path.exists(model_dir):
        make_model(out, sizes["shape"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    rng = random.Random(1)
    prompts = [[rng.randrange(60, 90) for _ in range(sizes["prompt"])] for _ in range(sizes["grpo_prompts"])]
    prompts = [p for p in prompts for _ in range(sizes["grpo_generations"])]  # a rollout: each prompt G times
    new_tokens, temperature = sizes["grpo_completion"], 1.0
    result = {"completions": sizes["gen_batches"], "prompt_tokens": sizes["prompt"], "new_tokens": new_tokens,
              "paths": {}}
    failures = []
    # grpo.py's sampling: every option unset but temperature, top_k off
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad_id)

    def timed(call, repeats, rollout):
        times = []
        for _ in range(1 + repeats):  # the first call pays compilation, graph capture, allocation
            sync()
            start = time.perf_counter()
            completions = call(rollout)
            sync()
            times.append(time.perf_counter() - start)
        tokens, steady = sum(len(c) for c in completions), statistics.median(times[1:] or times)
        bound = bandwidth_bound(model, rollout, new_tokens)
        return {"first_call_s": times[0], "seconds": steady, "samples_per_second": len(rollout) / steady,
                "tokens_per_second": tokens / steady, "bandwidth_bound_s": bound,
                "share_of_bound": bound and bound / steady}

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device()).eval()
    dynamic, static, batch = ("generate (dynamic cache; grpo.py, ppo.py)", "generate, static cache + torch.compile",
                              "generate_batch (continuous batching)")
    own, own_compiled = "own loop, static cache (bench/decode.py)", "own loop, compiled step + CUDA graphs"
    paths = {
        dynamic: lambda rollout: generate_completions(model, rollout, new_tokens, temperature, eos, pad_id),
        static: lambda rollout: generate_completions(model, rollout, new_tokens, temperature, eos, pad_id, "static"),
        batch: lambda rollout: batch_generate(model, rollout, GenerationConfig(**sampling, max_new_tokens=new_tokens)),
        own: lambda rollout: decode(model, rollout, new_tokens, temperature, eos, pad_id),
        own_compiled: lambda rollout: decode(model, rollout, new_tokens, temperature, eos, pad_id, compiled=True),
    }
    if not torch.cuda.is_available():  # compiling pays on a GPU only (reduce-overhead: CUDA graphs)
        paths.pop(own_compiled)
    for size in sizes["gen_batches"]:  # completions a call: 64 (8 prompts x 8) and 256 of the same prompts
        rollout = (prompts * (size // len(prompts) + 1))[:size]
        for name, call in paths.items():
            timings = result["paths"].setdefault(name, {"by_batch": {}})["by_batch"]
            try:  # generate_batch sets up its cache and captures its graphs at every call: one call says it
                timings[size] = timed(call, 0 if name == batch else sizes["gen_repeats"], rollout)
            except Exception as e:
                timings[size] = {"error": repr(e)[-1500:]}
                failures.append(f"generation {name}, {size} completions: {e!r}"[:2000])
            print(name, size, json.dumps(timings[size]), flush=True)
    del model
    # exactness, in fp32 on a small rollout: the log-probs of the sampled tokens (and for generate, the whole processed
    # distribution at every step) against log_softmax(logits / T) of one teacher-forced forward, as the scripts do
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device()).eval()
    small, check = prompts[: sizes["check_prompts"]], GenerationConfig(**sampling, max_new_tokens=sizes["check_tokens"])
    static_check = GenerationConfig(**check.to_diff_dict(), cache_implementation="static")
    checks = {
        dynamic: lambda: scores_check(model, small, check, pad_id, temperature),
        # compiled too, on a GPU (HF compiles the decoding step of a static cache on accelerators only)
        static: lambda: scores_check(model, small, static_check, pad_id, temperature),
        batch: lambda: logprobs_check(model, small, check, temperature),
        own: lambda: own_check(model, small, sizes["check_tokens"], temperature, eos, pad_id, False),
        own_compiled: lambda: own_check(model, small, sizes["check_tokens"], temperature, eos, pad_id, True),
    }
    if not torch.cuda.is_available():
        checks.pop(own_compiled)
    for name, call in checks.items():
        try:
            exact = call()
        except Exception as e:
            exact = {"error": repr(e)[-1500:]}
        difference = exact.get("max_abs_logprob_difference", math.inf)
        exact["samples_softmax_logits_over_T"] = difference < CHECK_TOLERANCE and not exact.get("filtered")
        result["paths"].setdefault(name, {})["exactness"] = exact
        print(name, json.dumps(exact), flush=True)
    if not all(result["paths"][name]["exactness"]["samples_softmax_logits_over_T"] for name in (dynamic, own)):
        failures.append("generation: the scripts' path or our loop does not sample from softmax(logits / T)")
    result["failures"] = failures
    return result


def bandwidth_bound(model, rollout, new_tokens):
    """The seconds a GPU needs to read what decoding must read, at its memory bandwidth (H100/H200 data sheets): the
    weights once a step, and each step the KV cache so far; None on a CPU or another GPU."""
    rate = next((v for k, v in BANDWIDTH.items() if torch.cuda.is_available() and k in torch.cuda.get_device_name()),
                None)
    if rate is None:
        return None
    config, width = model.config, len(rollout[0])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * next(model.parameters()).element_size()  # K and V
    cache = sum(len(rollout) * per_token * (width + t) for t in range(new_tokens))
    return (weights * new_tokens + cache) / rate


BANDWIDTH = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12}  # bytes/s, the data sheets


def own_check(model, prompts, new_tokens, temperature, eos, pad_id, compiled):
    """Our loop's distribution at every step (the logits it sampled from) against the teacher-forced one, as
    scores_check does for generate."""
    from decode import decode

    scores = []
    completions = decode(model, prompts, new_tokens, temperature, eos, pad_id, compiled, scores)
    reference, labels, completion_mask = teacher_forced(model, prompts, completions, temperature)
    sampled_from = torch.log_softmax(torch.stack(scores, 1)[:, : reference.shape[1]].float(), -1)
    chosen = (sampled_from.gather(-1, labels[..., None]) - reference.gather(-1, labels[..., None]))[..., 0]
    distribution = (sampled_from - reference).abs()[completion_mask].max().item()
    return {"max_abs_logprob_difference": chosen.abs()[completion_mask].max().item(),
            "max_abs_distribution_difference": distribution, "filtered": False}


def cut(rows, eos):
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def batch_generate(model, prompts, config, with_logprobs=False):
    """transformers' continuous batching; returns the completions in prompt order (and their log-probs)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    # on a GPU HF sizes the KV cache from the free memory; on CPU it cannot measure memory and its default took 11 of
    # the dry run's seconds to fill: a cache for these prompts only (16 blocks of 256 tokens)
    on_cpu = {} if torch.cuda.is_available() else dict(num_blocks=16, max_batch_tokens=512)
    batching = ContinuousBatchingConfig(return_logprobs=with_logprobs, **on_cpu)
    outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                                   progress_bar=False)
    ordered = sorted(outputs.values(), key=lambda o: int("".join(ch for ch in o.request_id if ch.isdigit()) or 0))
    completions = cut([list(o.generated_tokens) for o in ordered], config.eos_token_id)
    if with_logprobs:
        logprobs = [list(o.logprobs)[: len(c)] for o, c in zip(ordered, completions)]
        return completions, logprobs, [list(o.prompt_ids) for o in ordered]
    return completions


def teacher_forced(model, prompts, completions, temperature):
    """log_softmax(logits / T) at every completion position, from one forward of each sequence in its own right-padded
    row, positions from its start, as grpo.py's make_batch lays them out with --no-padding_free."""
    from types import SimpleNamespace

    from grpo import make_batch

    batch = make_batch(model.device, prompts, completions, range(len(prompts)), SimpleNamespace(padding_free=False))
    at = batch["targets"].clamp(max=batch["input_ids"].numel() - 1)  # past a completion's end: masked below
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    logits = logits.flatten(0, 1)[at - 1]
    return torch.log_softmax(logits.float() / temperature, -1), batch["input_ids"].flatten()[at], \
        batch["completion_mask"].bool()


def scores_check(model, prompts, config, pad_id, temperature):
    """generate with output_scores: the processed scores it sampled from at every step, against the teacher-forced
    distribution. Differences come from KV-cached vs one-pass arithmetic (fp32: ~1e-5); a filter (top-k, top-p,
    repetition penalty) or another temperature would show as -inf entries or differences of order 1."""
    from grpo import pad

    input_ids = pad(prompts, pad_id, "left").to(model.device)
    mask = pad([[1] * len(p) for p in prompts], 0, "left").to(model.device)
    folder_config, model.generation_config = model.generation_config, type(config)()
    try:
        output = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                                output_scores=True, return_dict_in_generate=True)
    finally:
        model.generation_config = folder_config
    completions = cut(output.sequences[:, input_ids.shape[1] :].tolist(), config.eos_token_id)
    reference, labels, completion_mask = teacher_forced(model, prompts, completions, temperature)
    scores = torch.stack(output.scores, 1)[:, : reference.shape[1]].float()
    sampled_from = torch.log_softmax(scores, -1)
    filtered = bool(torch.isinf(scores[completion_mask]).any())
    distribution = (sampled_from - reference).abs()[completion_mask].max().item()
    chosen = (sampled_from.gather(-1, labels[..., None]) - reference.gather(-1, labels[..., None]))[..., 0]
    chosen = chosen.abs()[completion_mask].max().item()
    return {"max_abs_logprob_difference": chosen, "max_abs_distribution_difference": distribution, "filtered": filtered}


def logprobs_check(model, prompts, config, temperature):
    """generate_batch's own log-probs of the tokens it sampled, against the teacher-forced ones."""
    completions, logprobs, prompt_ids = batch_generate(model, prompts, config, with_logprobs=True)
    reference, labels, completion_mask = teacher_forced(model, prompt_ids, completions, temperature)
    reference = reference.gather(-1, labels[..., None])[..., 0]
    theirs = torch.zeros_like(reference)
    for i, row in enumerate(logprobs):
        theirs[i, : len(row)] = torch.tensor(row, dtype=theirs.dtype)
    if any(len(row) != len(c) for row, c in zip(logprobs, completions)):
        return {"error": "generate_batch returned a log-prob count unlike its token count"}
    return {"max_abs_logprob_difference": (theirs - reference).abs()[completion_mask].max().item(), "filtered": None}


# ---------------------------------------------------------------------------------------------------------------------
# the summary
def summarise(results):
    stages, env = results["stages"], results["stages"].get("env", {})
    lines = [f"# bench/gpu.py {'--dry-run ' if results['dry_run'] else ''}{results['date']}, "
             f"{results.get('seconds', '?')} s"]
    if env:
        lines.append(f"{env.get('device')}; torch {env['versions'].get('torch')}, CUDA {env.get('cuda')}, "
                     f"transformers {env['versions'].get('transformers')}, trl {env['versions'].get('trl')}; "
                     f"matmul {env.get('matmul_tflops')} TFLOP/s ({env.get('matmul')}); "
                     f"MFU against {env.get('peak_bf16_tflops')} TFLOP/s dense bf16")
    correctness = stages.get("correctness", {})
    if "runs" in correctness:
        lines += ["", "| toy run (1 process) | exit | last metrics |", "|---|---|---|"]
        for name, run_result in correctness["runs"].items():
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in run_result["last_metrics"].items())
            lines.append(f"| {name} | {run_result['exit']} | {shown} |")
        if "resume" in correctness:
            r = correctness["resume"]
            lines.append(f"resume: max |resumed - straight| {r['max_abs_difference_resumed_vs_straight']:.3g}, "
                         f"two straight runs {r['max_abs_difference_two_straight_runs']:.3g}")
    speed = stages.get("speed", {})
    if "runs" in speed:
        lines += ["", f"speed: {speed['model']} ({speed['parameters'] / 1e6:.1f}M parameters, random weights), one "
                  "process; seconds a step: the median of runs alternating ours and TRL's [their range]",
                  "| script | ours s/step | TRL s/step | time ours/TRL [range] | verdict | ours GiB | TRL GiB | memory "
                  "ours/TRL | notes |", "|---|---|---|---|---|---|---|---|---|"]
        for algo, row in speed["runs"].items():
            ours, trl, ratio, notes = row.get("ours", {}), row.get("trl", {}), row.get("ours_over_trl", {}), []
            if "tokens_per_second" in ours:
                notes.append(f"tokens/s ours {ours['tokens_per_second']:.0f}"
                             + (f", TRL {trl['tokens_per_second']:.0f}" if "tokens_per_second" in trl else ""))
            if "mfu" in ours:
                notes.append(f"MFU ours {ours['mfu']:.3f}" + (f", TRL {trl['mfu']:.3f}" if "mfu" in trl else ""))
            if "breakdown" in ours:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in ours["breakdown"].items() if k != "seconds_per_step")
                notes.append(f"step: {parts} s")
            spans = [f"{fmt(side['seconds_per_step'])} [{fmt(side['min'])}-{fmt(side['max'])}] ({len(side['runs'])} "
                     "runs)" if side else "-" for side in (ours, trl)]
            cells = [*spans, f"{fmt(ratio['time'])} [{fmt(ratio['time_range'][0])}-{fmt(ratio['time_range'][1])}]"
                     if ratio else "-", ratio.get("verdict"), ours.get("peak_memory_gib"), trl.get("peak_memory_gib"),
                     ratio.get("memory")]
            lines.append(f"| {algo} | " + " | ".join(fmt(c) for c in cells) + f" | {'; '.join(notes)} |")
        if "trl" in speed:
            lines.append(f"TRL: {speed['trl']}")
    generation = stages.get("generation", {})
    if "paths" in generation:
        lines += ["", f"generation: {generation['new_tokens']} new tokens after {generation['prompt_tokens']}-token "
                  "prompts",
                  "| path | completions | s | samples/s | of the bandwidth bound | first call s | exact "
                  "softmax(logits/T) | max logprob diff |", "|---|---|---|---|---|---|---|---|"]
        for name, path in generation["paths"].items():
            exact = path.get("exactness", {})
            for size, timing in path.get("by_batch", {}).items():
                cells = [size, timing.get("seconds"), timing.get("samples_per_second"), timing.get("share_of_bound"),
                         timing.get("first_call_s"), exact.get("samples_softmax_logits_over_T"),
                         exact.get("max_abs_logprob_difference")]
                lines.append(f"| {name} | " + " | ".join(fmt(c) for c in cells) + " |")
    lines.append("")
    for name, stage in stages.items():
        lines.append(f"{name}: {'FAILED' if stage.get('failures') else 'passed'} ({stage.get('seconds', '?')} s)")
        lines += [f"  - {failure}" for failure in stage.get("failures", [])]
    return "\n".join(lines) + "\n"


def fmt(value):
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
