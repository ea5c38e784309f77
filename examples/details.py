"""What each detail changes, measured on the offline toy tasks. Every run is one of the scripts with its own flags:
this file only picks the flags, reads each run's metrics.jsonl, scores the final models and draws.

    python examples/details.py          # about 4 hours on 2 CPU cores: runs/details/*.png and table.md
    FAST=1 python examples/details.py   # 2 steps of each run, one seed, one process (what a test runs)

It starts from the quickstart's SFT and reward models (QS, default runs/quickstart: sft/ and reward/), training them
first with the quickstart's flags when they are missing, and writes the toy task (TOY, default toy) when missing.
OUT (default runs/details) gets one folder and one log per run, a figure per finding and table.md. A run whose folder
holds a finished model of the same command is not run again. NPROC (default 2; FAST: 1) processes per run,
PARALLEL (default 1; 2 when NPROC is 1) runs at a time. ONLY=length_bias,dpo runs and reports those findings alone.
The running-sum findings start from their own SFT model (OUT/sums_sft, 1,500 steps, on the task SUMS, default
sums, written when missing by examples/sum_task.py).
"""

import functools
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart_report import learning_curve  # noqa: E402
from sum_task import COUNTS, count_of, count_scores, last_number, tool_scores, write_sum_task  # noqa: E402
from toy_task import completions_of, demonstrators_mistake, greedy_scores, load_causal_lm, other_mistake  # noqa: E402
from toy_task import write_toy_task  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = os.environ.get("FAST") == "1"
NPROC = int(os.environ.get("NPROC", "1" if FAST else "2"))
PARALLEL = int(os.environ.get("PARALLEL", "2" if NPROC == 1 else "1"))  # runs at a time
OUT, QS, TOY, SUMS = (os.path.abspath(os.environ.get(k, v)) for k, v in
                      (("OUT", "runs/details"), ("QS", "runs/quickstart"), ("TOY", "toy"), ("SUMS", "sums")))
SEEDS = [1] if FAST else [1, 2]
MB = 32 // NPROC  # a global batch of 32 rows whatever the number of processes


def steps(full, fast=2):
    return fast if FAST else full


def run(script, folder, *flags):
    """Run `script` with `flags` into `folder` (its output in folder.log) unless it is there already; its metrics."""
    launcher = ["torchrun", "--standalone", "--nproc_per_node", str(NPROC)] if NPROC > 1 else [sys.executable]
    command = launcher + [script, *map(str, flags), "--output_dir", folder]
    stamp = os.path.join(folder, "command.txt")
    done = os.path.exists(stamp) and open(stamp).read() == shlex.join(command)
    if not (done and os.path.exists(os.path.join(folder, "config.json"))):
        start = time.time()
        shutil.rmtree(folder, ignore_errors=True)  # a run left unfinished, or with other flags
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with open(f"{folder}.log", "w") as log:
            result = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if result.returncode:
            sys.exit(f"{shlex.join(command)} failed: see {folder}.log")
        open(stamp, "w").write(shlex.join(command))
        open(os.path.join(folder, "seconds.txt"), "w").write(f"{time.time() - start:.1f}")
        print(f"{os.path.relpath(folder, OUT)}: {time.time() - start:.0f} s", flush=True)
    return read_rows(folder)


def base_models():
    """The quickstart's SFT model and reward model (its flags, fewer steps with FAST)."""
    if not os.path.exists(os.path.join(TOY, "model")):
        write_toy_task(TOY, num_train=512 if FAST else 4000, num_test=50 if FAST else 200)
    common = f"--warmup_ratio 0.05 --lr_scheduler_type cosine --per_device_train_batch_size {MB}"
    run("sft.py", f"{QS}/sft", *f"--model_name_or_path {TOY}/model --dataset_name {TOY}/sft --learning_rate 2e-3 "
        f"--max_steps {steps(300, 10)} {common}".split())
    run("reward.py", f"{QS}/reward", *f"--model_name_or_path {QS}/sft --dataset_name {TOY}/preference "
        f"--learning_rate 3e-4 --num_train_epochs 2 --max_steps {steps(-1, 5)} {common}".split())
    write_slips()
    if any(WEAK_RM in map(str, runs[0][2]) for _, _, runs, _ in FINDINGS):  # a reward model of 256 pairs (8 steps)
        run("reward.py", WEAK_RM, *f"--model_name_or_path {QS}/sft --dataset_name {TOY}/preference "
            f"--learning_rate 3e-4 --max_steps {steps(8)} {common}".split())
    for data, sft in (("prompts", "sft"), ("tools_prompts", "tools_sft")):  # the running-sum task, its SFT models
        if any(f"{SUMS}/{data}" in runs[0][2] for _, _, runs, _ in FINDINGS):
            if not os.path.exists(os.path.join(SUMS, "tools_sft")):  # written before the calculator: again
                write_sum_task(SUMS, num_train=512 if FAST else 8000, num_test=30 if FAST else 300)
            run("sft.py", f"{OUT}/sums_{sft}", *f"--model_name_or_path {SUMS}/model --dataset_name {SUMS}/{sft} "
                f"--learning_rate 1e-3 --max_steps {steps(1500, 10)} --log_every 250 {common}".split())


def write_slips():
    """TOY/preference_slips: the training prompts, the right answer chosen and, for every prompt, a random slip
    rejected (other_mistake: never the SFT model's own mistake, the dropped leading 0)."""
    rng, rows = random.Random(0), []
    for line in open(os.path.join(TOY, "prompts", "train.jsonl")):
        row = json.loads(line)
        slip = other_mistake(rng, row["answer"])
        while slip in (row["answer"], demonstrators_mistake(row["answer"])):
            slip = other_mistake(rng, row["answer"])
        rows.append({"prompt": row["prompt"], "chosen": " " + row["answer"], "rejected": " " + slip})
    os.makedirs(os.path.join(TOY, "preference_slips"), exist_ok=True)
    with open(os.path.join(TOY, "preference_slips", "train.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def grpo(name, seed, *flags):
    """GRPO from the SFT model with the quickstart's flags (20 steps), evaluated every 5, logged every step."""
    return run("grpo.py", f"{OUT}/{name}_s{seed}", *f"--model_name_or_path {QS}/sft --dataset_name {TOY}/prompts "
               f"--reward_fn exact_match --learning_rate 1e-4 --max_steps {steps(20)} --warmup_ratio 0.1 "
               f"--per_device_train_batch_size {MB} --gradient_accumulation_steps 4 --max_completion_length 10 "
               f"--per_device_eval_batch_size 100 --log_every 1 --eval_every {steps(5, 1)} --seed {seed}".split(),
               *flags)


def dpo(name, seed, *flags):
    """DPO from the SFT model with the quickstart's flags (40 steps), logged every 2."""
    return run("dpo.py", f"{OUT}/{name}_s{seed}", *f"--model_name_or_path {QS}/sft --dataset_name {TOY}/preference "
               f"--max_steps {steps(40)} --warmup_ratio 0.05 --lr_scheduler_type cosine "
               f"--per_device_train_batch_size {MB} --log_every 2 --seed {seed}".split(), *flags)


def ppo(name, seed, *flags):
    """PPO's first 8 steps (2 rollouts) from the SFT and reward models, the quickstart's flags, logged each step."""
    return run("ppo.py", f"{OUT}/{name}_s{seed}", *f"--model_name_or_path {QS}/sft --reward_model_path {QS}/reward "
               f"--dataset_name {TOY}/prompts --adam_epsilon 1e-5 --learning_rate 5e-5 --max_steps {steps(8, 4)} "
               f"--num_ppo_epochs 2 --num_mini_batches 2 --per_device_train_batch_size {MB} "
               "--gradient_accumulation_steps 4 --max_completion_length 10 --local_rollout_forward_batch_size 128 "
               f"--log_every 1 --seed {seed}".split(), *flags)


def read_rows(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


def toy_test_rows():
    return [json.loads(line) for line in open(os.path.join(TOY, "prompts", "test.jsonl"))]


@functools.cache
def sft_scores():
    """The SFT model's greedy scores, where every learning curve starts: computed once."""
    return greedy_scores(*load_causal_lm(f"{QS}/sft"), toy_test_rows())


def exact_match(name, seed):
    """Greedy exact match of a run's final model on the toy test prompts (all, the flawed subset, the others), and
    [(step, exact match of all)] at each of its checkpoints, if any, from the SFT model's at step 0."""
    folder, rows = f"{OUT}/{name}_s{seed}", toy_test_rows()
    model, tok = load_causal_lm(folder)
    final = greedy_scores(model, tok, rows)
    if not os.path.isdir(f"{folder}/checkpoints"):
        return final, []
    return final, [(step, scores["exact_match"]) for step, scores in learning_curve(model, tok, folder, rows,
                                                                                    (0, sft_scores()))]


NUM_SAMPLES = 2 if FAST else 4  # samples a test prompt for the lengths of right and wrong answers


def sums_rows():
    return [json.loads(line) for line in open(os.path.join(SUMS, "prompts", "test.jsonl"))]


@functools.cache
def sums_sft_scores():
    return count_scores(*load_causal_lm(f"{OUT}/sums_sft"), sums_rows(), NUM_SAMPLES)


def sums_curve(name, seed):
    """A running-sum run: its final greedy accuracy by count of numbers, [(step, accuracy)] at each checkpoint from
    the SFT model's, and at the same steps the wrong samples' mean length (T = 1) and how far it passes the right
    working's."""
    folder, rows = f"{OUT}/{name}_s{seed}", sums_rows()
    score = lambda model, tok, rows: count_scores(model, tok, rows, NUM_SAMPLES)
    points = learning_curve(*load_causal_lm(folder), folder, rows, (0, sums_sft_scores()), score)
    last_step = read_rows(folder)[-1]["step"]
    final = points[-1][1] if points[-1][0] == last_step else score(*load_causal_lm(folder), rows)  # scored once
    panels = {title: [(step, s["all"][key]) for step, s in points] for title, key in
              (("wrong samples: mean length (characters)", "wrong_length"),
               ("wrong samples: length past the right working's", "wrong_excess"))}
    panels["greedy accuracy at the last step, by count"] = [(c, final[c]["greedy"]) for c in COUNTS]
    return {str(c): final[c]["greedy"] for c in COUNTS}, [(step, s["all"]["greedy"]) for step, s in points], panels


def tools_curve(name, seed, with_tools):
    """A calculator run: its final greedy accuracy by count (grpo.py's tool loop, with the tool or without), [(step,
    accuracy)] at each checkpoint from the SFT model's, and tool calls a completion at them and by count at the end."""
    folder, rows = f"{OUT}/{name}_s{seed}", [json.loads(line) for line in open(f"{SUMS}/tools_prompts/test.jsonl")]
    score = lambda model, tok, rows: tool_scores(model, tok, rows, with_tools, steps(64, 16))
    points = learning_curve(*load_causal_lm(folder), folder, rows, (0, score(*load_causal_lm(f"{OUT}/sums_tools_sft"),
                                                                             rows)), score)
    final = points[-1][1]
    panels = {"tool calls a completion (greedy), at checkpoints": [(step, s["all"]["calls"]) for step, s in points],
              "greedy accuracy at the last step, by count": [(c, final[c]["greedy"]) for c in COUNTS],
              "tool calls a completion at the last step, by count": [(c, final[c]["calls"]) for c in COUNTS]}
    return {str(c): final[c]["greedy"] for c in COUNTS}, [(step, s["all"]["greedy"]) for step, s in points], panels


def advantage_by_count(num_generations=8):
    """What group std scaling does to a prompt's weight: the mean |advantage| of the SFT model's completions (G = 8
    samples a test prompt, the first rollout in effect), by count of numbers, divided by the group's std or not."""
    model, tok = load_causal_lm(f"{OUT}/sums_sft")
    rows = sums_rows()
    torch.manual_seed(0)
    texts = completions_of(model, tok, [r["prompt"] for r in rows], num_generations, 1.0, max_new_tokens=64)
    rewards = torch.tensor([float(last_number(t) == r["answer"]) for i, r in enumerate(rows)
                            for t in texts[i * num_generations : (i + 1) * num_generations]]).view(len(rows), -1)
    centred = rewards - rewards.mean(1, keepdim=True)
    weights = {"group std": (centred / (rewards.std(1, keepdim=True) + 1e-4)).abs().mean(1),
               "none": centred.abs().mean(1)}
    counts = torch.tensor([count_of(r["prompt"]) for r in rows])
    return {name: [(c, w[counts == c].mean().item()) for c in COUNTS] for name, w in weights.items()}


def score_run(runner, name, seed, sums, flags=()):
    """A run's final scores, its learning curve and the extra panels of its figure."""
    if f"{SUMS}/tools_prompts" in flags:
        return tools_curve(name, seed, "--tools" in flags)
    if sums:
        return sums_curve(name, seed)
    if runner is ppo and not os.path.isdir(f"{OUT}/{name}_s{seed}/checkpoints"):  # ppo's first steps: no curve
        return None, [], {}
    return (*exact_match(name, seed), {})


def sampled_so_far(rows):
    """{step: completions sampled up to it}: a rollout's completions (episode's step; one step a rollout here) times its
    rounds of dynamic sampling."""
    total, episode, sampled = 0, 0, {}
    for row in rows:
        total += row.get("dynamic_sampling/rounds", 1) * (row["episode"] - episode)
        episode, sampled[row["step"]] = row["episode"], total
    return sampled


def exploits(name, seed, count=3):
    """Up to `count` (prompt, greedy answer) of a run's final model that the verifier calls wrong."""
    model, tok = load_causal_lm(f"{OUT}/{name}_s{seed}")
    rows = toy_test_rows()
    answers = completions_of(model, tok, [r["prompt"] for r in rows])
    return [(r["prompt"], a) for a, r in zip(answers, rows) if a != r["answer"]][:count]


# Each finding: (its name, a title that reads alone, the runs as (label, runner, flags), the metrics to draw, what
# the table reports). The runs share folders by name: "grpo_base" is the quickstart's GRPO at 20 steps. A flag given
# after the runner's own overrides it (the last of a flag wins).
BASE = ("grpo_base", grpo, [])
# 30 steps, a checkpoint every 10 (the table scores each); online DPO: grpo.py's rollouts of 16 prompts x 8, each
# group's best and worst completion a pair, beta and learning rate as the quickstart's DPO
CURVE = ["--max_steps", steps(30), "--save_every", steps(10, 1)]
ONLINE_DPO = ["--policy_loss", "dpo", "--beta", 1.0, "--gradient_accumulation_steps", 1]
ONLINE = [*ONLINE_DPO, *CURVE]
FINDINGS = [
    ("kl_estimator", "GRPO, beta 1: the KL estimator in the loss and KL(pi || pi_ref) (k3, logged)",
     [("k1", grpo, ["--beta", 1.0, "--kl_estimator", "k1"]), ("k2", grpo, ["--beta", 1.0, "--kl_estimator", "k2"]),
      ("k3", grpo, ["--beta", 1.0, "--kl_estimator", "k3"]),
      ("k1_ratio", grpo, ["--beta", 1.0, "--kl_estimator", "k1_ratio"]),
      ("beta 1e-6 (no KL term)", grpo, ["--beta", 1e-6])],
     ["objective/kl", "eval/scores"]),
    ("adam", "PPO's first updates (lr 5e-5, epsilon 1e-5): TF-style Adam against torch's AdamW (weight decay 0)",
     [("adam_tf", ppo, ["--optimizer", "adam_tf"]), ("torch AdamW", ppo, ["--optimizer", "adamw"])],
     ["val/ratio", "policy/clipfrac_avg", "policy/approxkl_avg"]),
    ("loss_type", "GRPO: what the summed loss is divided by, and the completions' length",
     [("token (DAPO)", *BASE[1:]), ("sequence (GRPO paper)", grpo, ["--loss_type", "sequence"]),
      ("constant (Dr. GRPO)", grpo, ["--loss_type", "constant"])],
     ["completions/mean_length", "eval/scores"]),
    ("scale_rewards", "GRPO: advantages divided by the group's std, or not (Dr. GRPO)",
     [("group std", *BASE[1:]), ("none", grpo, ["--scale_rewards", "none"])],
     ["objective/scores", "eval/scores"]),
    ("dpo", "DPO: beta and the learning rate, and the log-probs of the chosen and rejected answers",
     [("beta 1, lr 1e-4", dpo, ["--beta", 1.0, "--learning_rate", 1e-4]),
      ("beta 0.1, lr 1e-4", dpo, ["--beta", 0.1, "--learning_rate", 1e-4]),
      ("beta 0.1, lr 1e-3", dpo, ["--beta", 0.1, "--learning_rate", 1e-3])],
     ["logps/chosen", "logps/rejected", "rewards/accuracies"]),
    ("group_size", "GRPO: the group size G at 128 completions a step (128 / G prompts)",
     [("G 2", grpo, ["--num_generations", 2]), ("G 8", *BASE[1:]), ("G 16", grpo, ["--num_generations", 16])],
     ["frac_reward_zero_std", "eval/scores"]),
    ("rejection_sampling", "GRPO: groups of 4 kept of 16 candidates by rejection sampling (RSO), against plain groups",
     [("G 4", grpo, ["--num_generations", 4]), ("G 16", grpo, ["--num_generations", 16]),
      ("16 -> 4, beta 0.5", grpo, ["--num_generations", 4, "--num_candidates", 16, "--rejection_sampling_beta", 0.5]),
      ("16 -> 4, beta 2", grpo, ["--num_generations", 4, "--num_candidates", 16, "--rejection_sampling_beta", 2.0])],
     ["objective/scores", "eval/scores", "time/rollout"]),
    ("online_dpo", "DPO on the policy's own samples, labelled by the reward model or the verifier (online), against "
     "offline DPO and GRPO",
     [("online DPO, reward model", grpo, [*ONLINE, "--reward_fn", "None", "--reward_model_path", f"{QS}/reward"]),
      ("online DPO, verifier", grpo, ONLINE),
      ("offline DPO, toy/preference", dpo, ["--beta", 1.0, "--learning_rate", 1e-4, *CURVE]),
      ("offline DPO, random slips", dpo, ["--beta", 1.0, "--learning_rate", 1e-4, "--dataset_name",
                                          f"{TOY}/preference_slips", *CURVE]),
      ("GRPO", grpo, CURVE)],
     ["rewards/margins", "logps/chosen", "logps/rejected"]),
]

# reward over-optimisation: GRPO and PPO on a reward model alone (the quickstart's, or WEAK_RM of 256 pairs), 60 steps,
# the verifier's exact match (gold) at a checkpoint every 10 (PPO: 12, a multiple of its 4 steps a rollout) against
# the reward model's score of the same greedy answers (eval/scores, the proxy) and the KL from the SFT model
# (objective/kl; GRPO's beta 1e-6 logs it with no KL term to speak of); PPO also at 6 times the quickstart's learning
# rate (at 5e-5 its 60 steps barely leave the SFT model)
WEAK_RM = f"{OUT}/reward_weak"
GRPO_PROXY = ["--reward_fn", "None", "--max_steps", steps(60), "--save_every", steps(10, 1), "--eval_every",
              steps(10, 1), "--per_device_eval_batch_size", 100]
PPO_PROXY = ["--max_steps", steps(60, 4), "--save_every", steps(12, 4), "--eval_every", steps(12, 4),
             "--per_device_eval_batch_size", 100]
STRONG, WEAK = ["--reward_model_path", f"{QS}/reward"], ["--reward_model_path", WEAK_RM]
FINDINGS += [
    ("overoptimisation", "GRPO and PPO on a reward model alone: its score (proxy) against the verifier's exact match "
     "(gold) and the KL from the SFT model",
     [*[(f"GRPO, weak reward model, beta {beta}", grpo, [*GRPO_PROXY, *WEAK, "--beta", beta])
        for beta in (1e-6, 0.04, 0.2)],
      ("GRPO, weak reward model, beta 0.2, k1", grpo, [*GRPO_PROXY, *WEAK, "--beta", 0.2, "--kl_estimator", "k1"]),
      *[(f"GRPO, quickstart's reward model, beta {beta}", grpo, [*GRPO_PROXY, *STRONG, "--beta", beta])
        for beta in (1e-6, 0.2)],
      *[(f"PPO, weak reward model, kl_coef {c}", ppo, [*PPO_PROXY, *WEAK, "--kl_coef", c]) for c in (0.0, 0.2)],
      ("PPO, quickstart's reward model, kl_coef 0.0", ppo, [*PPO_PROXY, *STRONG, "--kl_coef", 0.0]),
      *[(f"PPO, weak reward model, kl_coef {c}, lr 3e-4", ppo, [*PPO_PROXY, *WEAK, "--kl_coef", c, "--learning_rate",
                                                              3e-4]) for c in (0.0, 0.2)]],
     ["eval/scores", "objective/kl"]),
]

# the running-sum task (examples/sum_task.py): grpo()'s flags but these, from its SFT model, 100 steps, a checkpoint
# every 50 (scored by count of numbers: sums_curve), completions up to 64 tokens (FAST: 16)
SUMS_RUN = ["--model_name_or_path", f"{OUT}/sums_sft", "--dataset_name", f"{SUMS}/prompts", "--reward_fn",
            "last_number", "--max_completion_length", steps(64, 16), "--max_steps", steps(100), "--save_every",
            steps(50, 2), "--eval_every", steps(25, 2)]
SUMS_GRPO = [*SUMS_RUN, "--loss_type", "sequence"]  # the GRPO paper's loss: the runs the findings compare against
SUMS_CUT = [*SUMS_GRPO, "--max_completion_length", steps(40, 12)]  # cuts the longest workings (the last flag wins)
FINDINGS += [
    ("length_bias", "Running sums, GRPO: each completion's mean loss and the group's std (GRPO) against a constant "
     "divisor and no std (Dr. GRPO)",
     [("sequence, group std", grpo, SUMS_GRPO),
      ("constant, none", grpo, [*SUMS_RUN, "--loss_type", "constant", "--scale_rewards", "none"])],
     ["completions/mean_length", "objective/scores", "eval/scores"]),
    ("sums_groups", "Running sums, GRPO (--loss_type sequence): the group size G at 128 completions a step, and "
     "groups of 8 kept of 16 samples by rejection sampling (RSO) against all 16 kept",
     [("G 4", grpo, [*SUMS_GRPO, "--num_generations", 4]),
      ("G 8", grpo, SUMS_GRPO),
      ("G 16", grpo, [*SUMS_GRPO, "--num_generations", 16]),
      ("G 16, 16 prompts (256 a step)", grpo, [*SUMS_GRPO, "--num_generations", 16,
                                               "--gradient_accumulation_steps", steps(8, 4)]),
      *[(f"16 -> 8, beta {beta}", grpo, [*SUMS_GRPO, "--num_candidates", 16,
                                         "--rejection_sampling_beta", beta]) for beta in (0.5, 2.0)]],
     ["frac_reward_zero_std", "objective/scores", "eval/scores", "time/rollout"]),
    ("sums_dpo", "Running sums: online DPO (each group's best and worst sample, the verifier's labels) against offline "
     "DPO (sums/preference) and GRPO",
     [("online DPO", grpo, [*SUMS_RUN, *ONLINE_DPO]),
      ("offline DPO", dpo, ["--model_name_or_path", f"{OUT}/sums_sft", "--dataset_name", f"{SUMS}/preference",
                            "--beta", 1.0, "--learning_rate", 1e-4, "--max_steps", steps(100), "--save_every",
                            steps(50, 2)]),
      ("GRPO (sequence)", grpo, SUMS_GRPO)],
     ["rewards/margins", "logps/chosen", "logps/rejected", "completions/mean_length"]),
    ("dynamic_sampling", "Running sums, GRPO (--loss_type sequence, G 8): DAPO's dynamic sampling (up to 4 rounds a "
     "rollout) against none",
     [("G 8", grpo, SUMS_GRPO), ("dynamic sampling, 4 rounds", grpo, [*SUMS_GRPO, "--dynamic_sampling", 4])],
     ["frac_reward_zero_std", "dynamic_sampling/rounds", "eval/scores", "time/rollout"]),
    ("overlong", "Running sums, GRPO (--loss_type sequence), completions cut at 40 tokens: DAPO's soft overlong "
     "punishment (over the last 8) against masking the truncated completions and against neither",
     [("cut at 40", grpo, SUMS_CUT), ("masked", grpo, [*SUMS_CUT, "--mask_truncated_completions"]),
      ("punished, buffer 8", grpo, [*SUMS_CUT, "--overlong_buffer", steps(8, 4)])],
     ["completions/clipped_ratio", "completions/mean_length", "objective/scores", "eval/scores"]),
]
# a calculator: the running-sum SFT model of a demonstrator that calls it on 30% of the prompts that declare it
# (OUT/sums_tools_sft, sum_task.py's tools_sft), then GRPO with the tool (declared, its calls run: grpo.py --tools) or
# without it, scored greedy through grpo.py's own tool loop
SUMS_TOOLS = [{f"{OUT}/sums_sft": f"{OUT}/sums_tools_sft", f"{SUMS}/prompts": f"{SUMS}/tools_prompts"}.get(f, f)
              for f in SUMS_GRPO]
FINDINGS += [
    ("sums_tools", "Running sums, GRPO (--loss_type sequence) from a demonstrator that calls a calculator on 30% of "
     "the prompts that declare it: with the tool, against without",
     [("with the calculator", grpo, [*SUMS_TOOLS, "--tools", "calculator"]), ("without", grpo, SUMS_TOOLS)],
     ["tools/call_frequency", "tools/failure_frequency", "completions/mean_length", "eval/scores"]),
]
# TRL's entropy techniques on the running sums, whose GRPO runs lose a third of their entropy in 100 steps (0.11 to
# 0.075 nats a token): the policy loss on the top 20% of the tokens by entropy ("Beyond the 80/20 rule"), and
# Skywork-OR1's adaptive entropy bonus holding the SFT model's 0.1 nats
FINDINGS += [
    ("sums_entropy", "Running sums, GRPO (--loss_type sequence, G 8): the policy loss on the top 20% of the tokens by "
     "entropy, and an adaptive entropy bonus (target 0.1 nats), against neither",
     [("G 8", grpo, SUMS_GRPO), ("top 20% by entropy", grpo, [*SUMS_GRPO, "--top_entropy_quantile", 0.2]),
      ("adaptive entropy bonus", grpo, [*SUMS_GRPO, "--use_adaptive_entropy", "--entropy_target", 0.1])],
     ["objective/entropy", "entropy_coef", "objective/scores", "eval/scores"]),
]
ONLY = os.environ.get("ONLY")  # the findings to run, comma-separated (default: all)
UNKNOWN = sorted(set((ONLY or "").split(",")) - {finding[0] for finding in FINDINGS} - {""})
ALL_NAMES = [finding[0] for finding in FINDINGS]
FINDINGS = [finding for finding in FINDINGS if not ONLY or finding[0] in ONLY.split(",")]


def folder_name(runner, flags):
    """A run's folder, named by its script and flags (the same for every finding that shares the run)."""
    return "grpo_base" if (runner, flags) == BASE[1:] else f"{runner.__name__}_" + "_".join(
        os.path.basename(str(f)).lstrip("-") for f in flags)  # a path by its last name


def main():
    problem = f"OUT={OUT} is a file: give a folder" if os.path.exists(OUT) and not os.path.isdir(OUT) else None
    if UNKNOWN:
        problem = f"ONLY={ONLY}: no finding {', '.join(UNKNOWN)}; the findings: {', '.join(ALL_NAMES)}"
    if problem:
        print(f"details.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(OUT, exist_ok=True)
    start = time.time()
    base_models()
    jobs = {(runner, folder_name(runner, flags), seed, tuple(flags))
            for _, _, runs, _ in FINDINGS for _, runner, flags in runs for seed in SEEDS}
    with ThreadPoolExecutor(PARALLEL) as pool:  # each run once, even where findings share it
        list(pool.map(lambda job: job[0](job[1], job[2], *job[3]), sorted(jobs, key=lambda job: job[1:3])))
    results, table = {}, ["# What the details change (examples/details.py)", ""]
    for finding, title, runs, metrics in FINDINGS:
        results[finding], sums = {}, any(f"{SUMS}/{data}" in runs[0][2] for data in ("prompts", "tools_prompts"))
        tools = f"{SUMS}/tools_prompts" in runs[0][2]  # its extra panels: tool calls, not lengths
        scored = ("greedy accuracy by count 2 / 3 / 4 / 5 / 6 | accuracy at checkpoints | " + (
            "greedy tool calls a completion, at checkpoints ; by count" if tools else
            "wrong samples' length ; past the right working, at checkpoints") if sums else
                  "exact match: all / flawed / other | exact match at checkpoints")
        table += [f"## {title}", "", f"| run | seed | {' | '.join(metrics)} (last step) | {scored} | s/step (wall) |",
                  "|---" * (len(metrics) + 5 + sums) + "|"]
        for label, runner, flags in runs:
            name = folder_name(runner, flags)
            for seed in SEEDS:
                rows = runner(name, seed, *flags)
                em, curve, panels = score_run(runner, name, seed, sums, flags)
                if finding == "overoptimisation":  # gold against the KL logged at the same step
                    kl = {0: 0.0} | {r["step"]: r["objective/kl"] for r in rows}
                    panels = {"exact match against objective/kl": [(kl[step], v) for step, v in curve]}
                if finding == "dynamic_sampling":  # accuracy against the completions sampled so far
                    sampled = sampled_so_far(rows)
                    panels["eval/scores against completions sampled"] = [(sampled[r["step"]], r["eval/scores"])
                                                                         for r in rows if "eval/scores" in r]
                results[finding].setdefault(label, []).append({"rows": rows, "exact_match": em, "curve": curve,
                                                               "panels": panels})
                last = " | ".join(f"{rows[-1][m]:.4g}" if m in rows[-1] else "-" for m in metrics)
                scores = " / ".join(f"{v:.3f}" for v in em.values()) if em else ""
                at = [", ".join(f"{step}: {v:.3f}" for step, v in curve) or "-"]
                at += [" ; ".join(", ".join(f"{x}: {y:.2f}" if tools else f"{x}: {y:.1f}" for x, y in points)
                                  for key, points in panels.items() if ("calls" if tools else "length") in key)] * sums
                per_step = float(open(f"{OUT}/{name}_s{seed}/seconds.txt").read()) / rows[-1]["step"]
                table.append(f"| {label} | {seed} | {last} | {scores} | {' | '.join(at)} | {per_step:.2f} |")
        # the weight group std scaling gives a prompt, by difficulty
        weights = advantage_by_count() if finding == "length_bias" else None
        if weights:
            results[f"{finding}/advantage_by_count"] = weights
            by_count = [f"{key} " + " / ".join(f"{w:.2f}" for _, w in points) for key, points in weights.items()]
            table += ["", "Mean |advantage| of the SFT model's 8 samples a test prompt, by count 2 / 3 / 4 / 5 / 6: "
                      + "; ".join(by_count)]
        if finding == "overoptimisation":  # the reward models' quality, and what each policy answers wrong (seed 1)
            accuracy = {path: read_rows(path)[-1].get("eval/accuracy", math.nan) for path in (f"{QS}/reward", WEAK_RM)}
            table += ["", "Test pair accuracy: the quickstart's reward model {:.3f}, the weak one {:.3f}. Wrong greedy "
                      "answers at the last step, seed 1:".format(*accuracy.values()), ""]
            for label, runner, flags in runs:
                wrong = exploits(folder_name(runner, flags), SEEDS[0])
                table.append(f"- {label}: " + ("; ".join(f"{p!r} -> {a!r}" for p, a in wrong) or "none"))
        if finding == "dynamic_sampling":  # what each run sampled, and its accuracy at each evaluation
            table += ["", "Completions sampled in all; eval/scores (greedy accuracy) at each evaluation:", ""]
            for label, by_seed in results[finding].items():
                for seed, result in zip(SEEDS, by_seed):
                    rows = result["rows"]
                    evals = ", ".join(f"{r['step']}: {r['eval/scores']:.3f}" for r in rows if "eval/scores" in r)
                    table.append(f"- {label}, seed {seed}: {sampled_so_far(rows)[rows[-1]['step']]:,.0f} completions; "
                                 f"{evals}")
        table.append("")
        draw(finding, title, results[finding], metrics, sums, weights)
    seconds = time.time() - start
    table.append(f"{NPROC} processes a run; {seconds / 60:.1f} minutes in all (runs already there not rerun).")
    open(os.path.join(OUT, "table.md"), "w").write("\n".join(table) + "\n")
    json.dump(results, open(os.path.join(OUT, "results.json"), "w"))
    print("\n".join(table))


def draw(finding, title, runs, metrics, sums, weights=None):
    """One figure per finding: a panel per metric over the optimizer steps, the accuracy at checkpoints and the runs'
    extra panels (running sums), a colour per run, a line per seed; and `weights`, {scaling: [(count, mean |A|)]}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib is not installed: no figure")
    curve = ("greedy accuracy" if sums else "exact match") + " at checkpoints"
    seeds = [seed for by_seed in runs.values() for seed in by_seed]
    panels = metrics + [curve] * any(seed["curve"] for seed in seeds)
    panels += list(dict.fromkeys(key for seed in seeds for key in seed["panels"]))

    def series(panel):  # (label, seed index, points) of each line
        if panel in metrics:
            points = lambda seed: [(r["step"], r[panel]) for r in seed["rows"] if panel in r]
        else:
            points = lambda seed: seed["curve"] if panel == curve else seed["panels"][panel]
        return [(label, k, points(seed)) for label, by_seed in runs.items() for k, seed in enumerate(by_seed)]

    lines = {panel: series(panel) for panel in panels}
    legend = next((panel for panel in panels if all(points for _, _, points in lines[panel])), panels[0])  # all runs
    if weights:
        lines["mean |advantage| of the SFT model's samples, by count"] = [(k, 0, v) for k, v in weights.items()]
    rows, columns = -(-len(lines) // 4), min(len(lines), 4)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, (panel, panel_lines) in zip(axes.flat, lines.items()):
        colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(label for label, _, _ in panel_lines))}
        for label, k, points in panel_lines:
            ax.plot(*zip(*points), color=colours[label], alpha=0.85 if k == 0 else 0.45, marker="." if len(points) < 8
                    else None, label=label if k == 0 else None)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("numbers in the prompt" if "by count" in panel else "objective/kl" if "against objective/kl" in
                      panel else "completions sampled" if "against completions" in panel else "optimizer step")
        if panel in (legend, *list(lines)[len(panels) :]):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(lines) :]:
        ax.axis("off")
    task = "running-sum" if sums else "toy"
    fig.suptitle(f"{title}\n({task} task, {len(SEEDS)} seed{'s' * (len(SEEDS) > 1)} each: the fainter line is seed 2)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{finding}.png"), dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
