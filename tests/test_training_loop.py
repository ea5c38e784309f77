"""The training-loop invariants of DESIGN.md, for every script (sft.py, reward.py, dpo.py, grpo.py and its online
DPO, ppo.py): the same global batch split three ways gives the same losses and weights (the third also with
--no-reshard_after_forward, --shard_degree 1: replicated, not sharded, and --no-padding_free: a sequence a row where
the others pack them); the LR schedule is exact and ends at the last optimizer step; a run stopped by SIGTERM or
SIGKILL and resumed with --resume_from auto continues bit for bit. grpo.py and ppo.py sample their own data: their
rollouts do not depend on the number of processes (generation chunks are seeded by rollout and chunk), so the same
comparisons hold."""

import concurrent.futures
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, read_metrics, run_script, run_scripts, script_env
from safetensors.torch import load_file
from toy_task import in_flawed_subset

# Three ways to split the same global batch of 8: (processes, micro-batch, accumulation steps). (1, 2, 4), accumulation
# on one process, was dropped for suite time: (2, 1, 4) has both accumulation and two processes
SPLITS = [(1, 8, 1), (2, 4, 1), (2, 1, 4)]
DATA = {"sft.py": "sft", "reward.py": "preference", "dpo.py": "preference", "grpo.py": "prompts", "ppo.py": "prompts"}
# grpo.py: rollouts of 4 prompts x 6 candidates, of which rejection sampling keeps 4 = 16 completions, 3 iterations x
# 2 mini-batches of 8 = 6 optimizer steps each; 12 steps = 2 rollouts, and the checkpoint at step 6 falls between them.
# It starts from the toy SFT model, so that exact-match rewards differ within groups and the policy moves.
GRPO = [
    "--max_steps",
    12,
    "--num_generations",
    4,
    "--num_candidates",
    6,
    "--rejection_sampling_beta",
    0.5,
    "--num_mini_batches",
    2,
    "--num_iterations",
    3,
    "--max_completion_length",
    10,
    "--local_rollout_forward_batch_size",
    4,
    "--beta",
    0.04,
    "--kl_estimator",
    "k3",
]
# ppo.py: rollouts of 16 prompts, 3 epochs x 2 mini-batches of 8 = 6 optimizer steps each; scored by the toy reward
# model
PPO = [
    "--max_steps",
    12,
    "--num_ppo_epochs",
    3,
    "--num_mini_batches",
    2,
    "--max_completion_length",
    10,
    "--local_rollout_forward_batch_size",
    4,
]
RL = {"grpo.py": GRPO, "ppo.py": PPO}
# online DPO in grpo.py: the same rollouts, each group's best and worst completion a pair (8 pairs a rollout), by the
# verifier plus a reward model (its scores shared out over the ranks); a micro-batch holds whole pairs, so (2, 2, 2)
# stands in for (2, 1, 4). With DAPO's dynamic sampling: up to 3 rounds a rollout, until 8 groups have a pair
ONLINE_DPO = "grpo.py --policy_loss dpo --dynamic_sampling 3"
# tool calls in grpo.py: a toy model that calls the calculator (conftest.tool_model) on running sums; the completions
# hold the tools' results (out of the loss), malformed calls among them. Its sums are rarely right: the penalty for a
# completion cut at 48 tokens gives the groups their spread
TOOLS = "grpo.py --tools calculator --reward_fn last_number --max_completion_length 48 --missing_eos_penalty 1"
# TRL's techniques in grpo.py at once (each flag that goes with the clipped loss): two-sided clipping, the KL term x
# the ratio, off-policy sequence masking (pi_old: 3 iterations), the policy loss on the top half of the tokens by
# entropy, an adaptive entropy bonus (that half's mean entropy falls through the target, 0.268 at step 6: the weight
# goes down, then up), the reference pulled toward the policy every 4 steps (state saved at step 6), GDPO's
# normalisation
TECHNIQUES = ("grpo.py --delta 1.5 --use_bias_correction_kl --off_policy_mask_threshold 0.01 "
              "--top_entropy_quantile 0.5 --entropy_coef 0.01 --use_adaptive_entropy --entropy_target 0.27 "
              "--ref_model_sync_steps 4 --ref_model_mixup_alpha 0.5 --multi_objective_aggregation normalize_then_sum "
              "--missing_eos_penalty 0.5")
UNTIMED = lambda rows: [
    {k: v for k, v in r.items() if k != "tokens_per_second" and not k.startswith("time/")} for r in rows
]


def common_args(script, model, data_file, out):
    """12 optimizer steps (2 epochs of 48 rows, global batch 8), TF Adam, warmup + cosine, a checkpoint at step 6."""
    return [
        "--model_name_or_path",
        model,
        "--dataset_name",
        data_file,
        "--output_dir",
        out,
        "--num_train_epochs",
        2,
        "--learning_rate",
        5e-4 if script in RL else 3e-3,
        "--warmup_ratio",
        0.25,
        "--lr_scheduler_type",
        "cosine",
        "--optimizer",
        "adam_tf",
        "--adam_epsilon",
        1e-5,
        "--log_every",
        1,
    ] + RL.get(script, [])


@pytest.fixture(scope="module", params=[*DATA, ONLINE_DPO, TOOLS, TECHNIQUES])
def split_runs(request, toy, tmp_path_factory):
    """The same 12-step run of one script (or online DPO) under each split. Returns the script, the model, the
    folder, the runs by split and the arguments every run of it adds."""
    script, *extra = request.param.split(" ")
    model = request.getfixturevalue("sft_model")[0] if script in RL else toy / "model"
    with_reward_model = script == "ppo.py" or request.param == ONLINE_DPO
    extra += ["--reward_model_path", request.getfixturevalue("reward_model")[0]] if with_reward_model else []
    splits = [(1, 8, 1), (2, 4, 1), (2, 2, 2)] if request.param == ONLINE_DPO else SPLITS
    root = tmp_path_factory.mktemp(script[:-3])
    rows = open(toy / DATA[script] / "train.jsonl").readlines()
    if request.param == TOOLS:  # its own model and prompts (messages)
        model, prompts = request.getfixturevalue("tool_model")
        rows = open(prompts).readlines()
    elif script == "grpo.py":  # the SFT model is right elsewhere every time: groups of equal rewards would not move it
        rows = [row for row in rows if in_flawed_subset(json.loads(row)["prompt"])]
    rows = rows[:48]
    (root / "small.jsonl").write_text("".join(rows))
    runs, launches = {split: root / "x".join(map(str, split)) for split in splits}, []
    for (nproc, mb, ga), out in runs.items():
        args = (
            common_args(script, model, root / "small.jsonl", out)
            + extra
            + ["--per_device_train_batch_size", mb, "--gradient_accumulation_steps", ga, "--save_every", 6]
        )
        if ga > 1:  # parameters kept gathered from forward to backward (and, grpo/ppo, from generation on), the
            # model replicated on both processes (HSDP of 2 groups of 1, DDP's traffic), and a sequence a row where the
            # others pack them (--no-padding_free): the same run
            args += ["--no-reshard_after_forward", "--shard_degree", 1, "--no-padding_free"]
        launches.append((script, args, nproc))
    for result in run_scripts(launches):  # the three at once
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
        assert "eval: no split 'test'" in result.stdout
        # no FSDP2 warning about views (completion_logprobs hooks the decoder instead of output_hidden_states), and no
        # progress bar in a log file (stderr is not a terminal here): the metric lines alone
        assert "can cause backward to fail" not in result.stderr
        assert not re.search(rf"{script[:-3]}: +\d+%\|", result.stderr), result.stderr[-2000:]
        assert "Loading weights" not in result.stderr  # nor the libraries' bars
    return script, model, root, runs, extra


def test_split_invariance(split_runs):
    script, model, _, runs, extra = split_runs
    reference = runs[SPLITS[0]]
    ref_rows, ref_params = read_metrics(reference), load_file(reference / "model.safetensors")
    for split, out in runs.items():
        rows, params = read_metrics(out), load_file(out / "model.safetensors")
        for key in ("step", "episode", "lr", "loss"):
            # float order alone (a normalisation error is O(1)): reward.py's loss differed by 5.07e-5 relative
            rel = 2e-4 if script == "reward.py" else 5e-5
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref_rows], rel=rel, abs=1e-6), (
                script,
                split,
                key,
            )
        # every statistic of the global batch (rewards/*, logps/*, grad_norm): scores of several units drift up to 2e-5
        # relative by step 12 at this learning rate. rewards/accuracies counts signs: not while the margins are float
        # noise (dpo before the policy has moved: step 1 runs at warmup lr 0)
        moved = [abs(r.get("rewards/margins", 1.0)) > 1e-4 for r in ref_rows]
        for key in set(UNTIMED(ref_rows)[0]) - {"step", "episode", "lr", "loss"}:
            got, want = (
                [r[key] for r, m in zip(rows, moved) if m or key != "rewards/accuracies"],
                [r[key] for r, m in zip(ref_rows, moved) if m or key != "rewards/accuracies"],
            )
            # float order's error in a mean scales with the magnitude of what it sums, not with the mean (rewards/
            # rejected is a difference of scores of several units that can be near 0): relative to the metric's
            # largest value over the run. ppo's approxkl and ratio variance square differences of log-probs, and
            # ratio_min/max are one token's ratio (no average to smooth it): 1.4e-4 of their scale by step 11
            rel = 1e-3 if key in ("policy/approxkl_avg", "val/ratio_var", "val/ratio_min", "val/ratio_max") else 1e-4
            scale = max(abs(value) for value in want)
            assert got == pytest.approx(want, rel=0, abs=rel * scale + 1e-6), (script, split, key)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=1e-5, msg=f"{script} {split} {name}")
    # the tools were called, some calls failed, in every run
    if "--tools" in extra:
        assert all(0 < r["tools/failure_frequency"] < 1 and r["tools/call_frequency"] > 0.5 for r in ref_rows), ref_rows
    # the adaptive entropy weight went up and down
    if "--use_adaptive_entropy" in extra:
        steps = [b["entropy_coef"] - a["entropy_coef"] for a, b in zip(ref_rows, ref_rows[1:])]
        assert max(steps) > 0 > min(steps), ref_rows
    # dynamic sampling did sample again (some rounds' groups had no spread) and fill the rollouts
    if "--dynamic_sampling" in extra:
        assert max(r["dynamic_sampling/rounds"] for r in ref_rows) > 1, ref_rows
    # the runs did train: the weights moved far more than the tolerance, so the comparison is not between idle models
    initial = load_file(model / "model.safetensors")
    assert max((ref_params[name] - initial[name]).abs().max().item() for name in initial if name in ref_params) > 1e-3


def test_lr_schedule_is_exact_for_every_split(split_runs):
    script, _, _, runs, _ = split_runs
    # 2 epochs x 48 rows / 8 per step (grpo, ppo: 2 rollouts x 3 iterations/epochs x 2 mini-batches);
    # ceil(0.25 x 12) warmup steps
    total, warmup, peak = 12, 3, 5e-4 if script in RL else 3e-3
    expected = [
        peak * k / warmup if k < warmup else peak * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
        for k in range(total)
    ]
    for split, out in runs.items():
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == list(range(1, total + 1)), (
            script,
            split,
        )  # ends exactly at the last optimizer step
        assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-9, abs=1e-15), (script, split)


def children_of(pid):
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in [entry for entry in os.listdir("/proc") if entry.isdigit()]:
        try:  # /proc/N/stat: "N (name) state ppid ..."
            if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found


def interrupted_run(script, args, nproc, out, stop_after, kill):
    """Start a run, wait until it has logged `stop_after` steps, then SIGTERM it (what a preempted job gets) or
    SIGKILL torchrun and its workers (a lost node: no chance to save). sft.py runs under torchrun, which forwards the
    SIGTERM to every process; the other scripts, whose handler is sft.py's (test_consistency), as forks of the tests'
    launcher, which does the same (about 7 s of start-up less a run). Returns the exit code and the output."""
    logged = lambda: (out / "metrics.jsonl").exists() and len(open(out / "metrics.jsonl").readlines()) >= stop_after
    if script != "sft.py":
        result = run_script(script, args, nproc, terminate_when=logged)
        return result.returncode, result.stdout + result.stderr
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        os.path.join(ROOT, script),
    ]
    log = open(out.parent / f"{out.name}.log", "w+")
    process = subprocess.Popen(
        command + [str(a) for a in args],
        cwd=ROOT,
        env=script_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if logged():
            if kill:  # torchrun starts each worker in a session of its own: they go with it, as on a lost node
                for pid in children_of(process.pid) + [process.pid]:
                    os.kill(pid, signal.SIGKILL)
            else:
                process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    returncode = process.wait(timeout=120)
    log.seek(0)
    return returncode, log.read()


def test_sigterm_or_sigkill_then_resume_auto_continues_the_same_run(split_runs):
    """Stopped at a random step, then the same command with --resume_from auto: the metrics and the final weights are
    those of the uninterrupted run, bit for bit. SIGTERM: a checkpoint at the next optimizer step (grpo and ppo: at the
    end of the rollout's updates). SIGKILL (sft): nothing saved then; the run continues from the latest complete
    checkpoint of --save_every (every 6 steps), recomputing the lost steps. sft also continues a 2-process checkpoint on
    1 process (same global batch), and a replicated run's checkpoint (--shard_degree 1) sharded over 2 processes: the
    same run to the split tolerance."""
    script, model, root, runs, extra = split_runs
    straight = runs[(2, 4, 1)]
    rl = script in RL
    kills = [False, True] if script == "sft.py" else [False]
    # logged steps before the signal (grpo, ppo: within the first rollout)
    stops = {kill: random.randint(1, 5 if rl else 10) for kill in kills}
    outs = {kill: root / f"interrupted_{kill}" for kill in kills}
    args = {
        kill: common_args(script, model, root / "small.jsonl", outs[kill])
        + extra
        + ["--per_device_train_batch_size", 4, "--save_every", 6, "--resume_from", "auto"]
        for kill in kills
    }
    with concurrent.futures.ThreadPoolExecutor(len(kills)) as pool:  # sft: the SIGTERM and the SIGKILL run at once
        stopped = dict(zip(kills, pool.map(lambda k: interrupted_run(script, args[k], 2, outs[k], stops[k], k), kills)))
    for kill, (returncode, output) in stopped.items():
        message = (script, "SIGKILL" if kill else "SIGTERM", stops[kill], output[-3000:])
        if kill:
            assert returncode != 0 and "stopped by" not in output, message
        else:
            saved = re.search(r"stopped by SIGTERM: checkpoint .*step_(\d+);", output)
            assert saved and int(saved.group(1)) >= stops[kill] and (not rl or int(saved.group(1)) % 6 == 0), message
            assert returncode != 0 and not (outs[kill] / "model.safetensors").exists(), message  # not finished
    # the same commands again, and for sft the same run continued on 1 process (micro-batch 8) from the straight run's
    # checkpoint: DCP reshards; equal to the split tolerance
    one_process = common_args(script, model, root / "small.jsonl", root / "one_process")
    one_process += ["--per_device_train_batch_size", 8, "--resume_from", straight / "checkpoints" / "step_6"]
    # and the replicated run's checkpoint (--shard_degree 1) continued sharded over the 2 processes (the default)
    resharded = common_args(script, model, root / "small.jsonl", root / "resharded")
    replicated = runs.get((2, 1, 4), root) / "checkpoints" / "step_6"  # sft's
    resharded += ["--per_device_train_batch_size", 4, "--resume_from", replicated]
    launches = [(script, args[kill], 2) for kill in kills]
    launches += [(script, one_process, 1), (script, resharded, 2)] if script == "sft.py" else []
    results = run_scripts(launches)
    for kill, result in zip(kills, results):
        message = (script, "SIGKILL" if kill else "SIGTERM", stops[kill])
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
        assert UNTIMED(read_metrics(outs[kill])) == UNTIMED(read_metrics(straight)), message
        a, b = load_file(straight / "model.safetensors"), load_file(outs[kill] / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a), message
    for result, out in zip(results[len(kills) :], [root / "one_process", root / "resharded"]):  # sft
        assert result.returncode == 0 and "(written by 2 processes)" in result.stdout, (
            result.stdout[-2000:] + result.stderr[-8000:]
        )
        rows, want = read_metrics(out), read_metrics(straight)[6:]
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in want], rel=1e-4), out
        assert [r["step"] for r in rows] == list(range(7, 13))
        a, b = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=f"{out} {name}")


LOAD_SCRIPT = r"""
import os, sys, types, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import grpo, reward
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

dist.init_process_group("gloo")
args = types.SimpleNamespace(trust_remote_code=False, gradient_checkpointing=False, bf16=False, cpu_offload=False,
                             reshard_after_forward=True, shard_degree=-1, seed=3, model_name_or_path=sys.argv[1])
cpu = dist.init_device_mesh("cpu", (dist.get_world_size(),))  # what setup builds with the default --shard_degree


def compare(name, model, plain):
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = dict(model.named_buffers())
    if dist.get_rank() == 0:
        expected, found = dict(plain.named_parameters()), {**state, **buffers}
        expected |= dict(plain.named_buffers())
        same = all(torch.equal(found[key], value) for key, value in expected.items())
        print(f"{name}: {len(expected)} tensors, bit-identical {same}", flush=True)


causal, scores = AutoModelForCausalLM, AutoModelForSequenceClassification
for name, auto_class, path in [("tied", causal, sys.argv[1]), ("untied", causal, sys.argv[2]),
                               ("gpt2", causal, sys.argv[3]), ("value", scores, sys.argv[4])]:
    compare(name, grpo.load_model(auto_class, path, args, "--flag", cpu), auto_class.from_pretrained(path))
plain = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=1)  # reward.py's new head, by hand
torch.nn.init.normal_(plain.score.weight, std=1 / (plain.score.in_features + 1) ** 0.5,
                      generator=torch.Generator().manual_seed(args.seed))
compare("new score head", reward.shard_model(reward.load_with_score_head(args, 0), args, cpu), plain)
dist.destroy_process_group()
"""


def test_weights_read_by_one_process_load_bit_identical(toy, tmp_path):
    """The first process alone reads a model folder; the other builds the model on the meta device and gets its shard
    from the first. Gathered back, every parameter and buffer equals from_pretrained's, for a tied and an untied head,
    GPT-2's absolute positions, a sequence-classification folder, and reward.py's new score head seeded as on one
    process."""
    from conftest import run_script, tiny_gpt2
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    untied = AutoModelForCausalLM.from_pretrained(toy / "model")
    untied.config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(untied.config).save_pretrained(tmp_path / "untied")
    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    AutoModelForSequenceClassification.from_pretrained(toy / "model", num_labels=1).save_pretrained(tmp_path / "value")
    (tmp_path / "load.py").write_text(LOAD_SCRIPT)
    folders = [toy / "model", tmp_path / "untied", tmp_path / "gpt2", tmp_path / "value"]
    out = run_script(str(tmp_path / "load.py"), folders, nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("tied", "untied", "gpt2", "value", "new score head"):
        assert re.search(rf"^{name}: \d+ tensors, bit-identical True$", out.stdout, re.M), (name, out.stdout[-3000:])


MESH_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, os.getcwd())
import sft

out, model_dir, degree = sys.argv[1:]  # setup's mesh, then a model sharded over it as sft.py does
args = sft.Args(output_dir=out, model_name_or_path=model_dir, shard_degree=int(degree))
rank, world_size, device, mesh = sft.setup(args)
model = sft.shard_model(sft.load_pretrained(sft.AutoModelForCausalLM, model_dir, args, "--flag")[0], args, mesh)
weight = model.get_decoder().layers[0].mlp.down_proj.weight
print(f"{rank} {tuple(mesh.shape)} {[repr(p) for p in weight.placements]} {len(weight.to_local())} {len(weight)}")
torch.distributed.destroy_process_group()
"""


def test_shard_degree_on_four_processes_builds_one_mesh_of_that_shape(toy, tmp_path):
    """4 processes: --shard_degree 2 shards each model over pairs of processes and replicates it across the two pairs
    (a 2 x 2 mesh: a layer's weight Replicate() then Shard(0), half of its rows on each process); 1 replicates it whole
    on all four (4 x 1); the default -1 shards it over all four on a 1-D mesh (FSDP, no replica dimension). Before,
    no test had both dimensions above 1, and the default built a (1, 4) mesh, FSDP2's HSDP path."""
    (tmp_path / "mesh.py").write_text(MESH_SCRIPT)
    expected = {2: ((2, 2), ["Replicate()", "Shard(dim=0)"], 2), 1: ((4, 1), ["Replicate()", "Shard(dim=0)"], 1),
                -1: ((4,), ["Shard(dim=0)"], 4)}  # degree: mesh, placements, shards of a weight's rows
    results = run_scripts([(str(tmp_path / "mesh.py"), [tmp_path / str(d), toy / "model", d], 4) for d in expected])
    for (degree, (mesh, placements, shards)), result in zip(expected.items(), results):
        assert result.returncode == 0, result.stderr[-3000:]
        lines = sorted(line for line in result.stdout.splitlines() if line[:1].isdigit())
        for rank, line in enumerate(lines):
            rows = int(line.split()[-1])  # the weight's rows; each process holds its share of them
            assert line == f"{rank} {mesh} {placements} {rows // shards} {rows}", (degree, line)
        assert len(lines) == 4, result.stdout[-2000:]


def test_a_2_x_2_mesh_trains_as_4_x_1_and_4(toy, tmp_path):
    """4 processes, the same 3 steps of sft.py on a 2 x 2 mesh (--shard_degree 2: gradients reduce-scattered within
    each pair, then summed across the pairs), replicated 4 x 1 (--shard_degree 1) and sharded over all four (the
    default): the same losses, gradient norms and weights, which moved."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(open(toy / "sft" / "train.jsonl").readlines()[:24]))
    args = ["--model_name_or_path", toy / "model", "--dataset_name", data, "--max_steps", 3, "--learning_rate", 3e-3,
            "--per_device_train_batch_size", 2, "--log_every", 1]
    degrees = (2, 1, -1)
    results = run_scripts([("sft.py", args + ["--shard_degree", d, "--output_dir", tmp_path / str(d)], 4)
                           for d in degrees])
    for result in results:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    ref_rows, ref = read_metrics(tmp_path / "2"), load_file(tmp_path / "2" / "model.safetensors")
    for degree in degrees[1:]:
        rows, params = read_metrics(tmp_path / str(degree)), load_file(tmp_path / str(degree) / "model.safetensors")
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref_rows], rel=1e-5), (degree, key)
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=1e-5, msg=f"{degree} {name}")
    initial = load_file(toy / "model" / "model.safetensors")
    assert max((ref[name] - initial[name]).abs().max().item() for name in initial if name in ref) > 1e-3


def test_two_nodes_share_one_output_dir_or_stop(toy, tmp_path):
    """Two nodes simulated on this machine (torchrun --nnodes 2, one process each, static rendezvous). With a folder
    per node (as on node-local disks) every process stops at start: the second node does not see the first's claim
    in its folder. With one shared folder the run is bit-identical to one node of 2 processes, sharded over both or
    (--shard_degree 1) replicated."""
    from launch import free_port

    data = tmp_path / "small.jsonl"
    data.write_text("".join(open(toy / "sft" / "train.jsonl").readlines()[:32]))
    args = ["sft.py", "--model_name_or_path", toy / "model", "--dataset_name", data, "--max_steps", 2,
            "--per_device_train_batch_size", 4, "--log_every", 1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]

    def two_nodes(out0, out1, *extra):
        port, env = free_port(), script_env()
        command = lambda rank: torchrun + ["1", "--nnodes", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
                                           "--master_port", str(port)] + [str(a) for a in args + [*extra]]
        nodes = [subprocess.Popen(command(rank) + ["--output_dir", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank, out in enumerate((out0, out1))]
        return [(node.wait(timeout=300), node.stdout.read()) for node in nodes]

    (code0, log0), (code1, _) = two_nodes(tmp_path / "node0", tmp_path / "node1")
    assert code0 != 0 and code1 != 0 and "is not the first node's: give a shared folder" in log0, log0[-3000:]
    # sharded over the two nodes (the default), and replicated on each (--shard_degree 1: a node holds a whole model);
    # one node of 2 processes (forks of the tests' launcher, torchrun's variables) for both, at once
    cases = (([], "shared", "one"), (["--shard_degree", 1], "shared_replicated", "one_replicated"))
    one_node = run_scripts([("sft.py", args[1:] + extra + ["--output_dir", tmp_path / one], 2) for extra, _, one in
                            cases])
    for (extra, shared, one), result in zip(cases, one_node):
        assert [code for code, _ in two_nodes(tmp_path / shared, tmp_path / shared, *extra)] == [0, 0]
        assert result.returncode == 0, result.stderr[-3000:]
        assert UNTIMED(read_metrics(tmp_path / shared)) == UNTIMED(read_metrics(tmp_path / one)), extra
        a, b = load_file(tmp_path / shared / "model.safetensors"), load_file(tmp_path / one / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), extra
