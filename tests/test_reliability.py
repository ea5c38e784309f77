"""Reliability, for every script: bad input stops at once with a message naming the problem and the fix;
a non-finite loss or gradient norm stops the run without touching the model, and so does a first step that gives no
weight a gradient; a checkpoint is used only
when complete and only by the run it belongs to, and loading one runs no code. The kill tests (SIGTERM, SIGKILL, then
--resume_from auto) are in test_training_loop.py, next to the uninterrupted runs they are compared with.
These runs stop before or at their first steps, so they run inside the test process (conftest.run_in_process)."""

import errno
import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, run_in_process, run_script, run_scripts, script_env
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

SCRIPTS = ["sft.py", "reward.py", "dpo.py", "grpo.py", "ppo.py"]
DATA = {"sft.py": "sft", "reward.py": "preference", "dpo.py": "preference", "grpo.py": "prompts", "ppo.py": "prompts"}
ROW = {
    "sft.py": {"prompt": "sort: 21 ->", "completion": " 12"},
    "reward.py": {"prompt": "sort: 21 ->", "chosen": " 12", "rejected": " 21"},
    "grpo.py": {"prompt": "sort: 21 ->", "answer": "12"},
}
ROW.update({"dpo.py": ROW["reward.py"], "ppo.py": ROW["grpo.py"]})


@pytest.fixture(scope="module")
def scored_model(toy, tmp_path_factory):
    """A sequence-classification model of the toy (zero head) for the scripts that need a reward model."""
    out = tmp_path_factory.mktemp("scored")
    model = AutoModelForSequenceClassification.from_pretrained(toy / "model", num_labels=1)
    torch.nn.init.zeros_(model.score.weight)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(toy / "model" / name, out)
    return out


def script_args(script, model, data, out, reward, *extra):
    args = [
        "--model_name_or_path",
        model,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--per_device_train_batch_size",
        4,
        "--max_steps",
        2,
        "--log_every",
        1,
        "--learning_rate",
        1e-3,
    ]
    if script in ("grpo.py", "ppo.py"):
        args += ["--max_completion_length", 6, "--local_rollout_forward_batch_size", 8]
    if script == "grpo.py":
        args += ["--num_generations", 4] + (["--reward_fn", "None", "--reward_model_path", reward] if reward else [])
    if script == "ppo.py":
        args += ["--reward_model_path", reward, "--num_ppo_epochs", 1]
    return args + list(extra)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_names_the_problem_and_the_fix(script, toy, scored_model, tmp_path):
    run = lambda model, data, *extra: run_in_process(
        script, script_args(script, model, data, tmp_path / "out", scored_model, *extra)
    )
    cases = []  # (what, exception, printed, expected text)
    # unknown dataset format; a dataset that is nowhere
    (tmp_path / "rows.txt").write_text("sort: 21 -> 12\n")
    cases.append(
        (
            "format",
            *run(toy / "model", tmp_path / "rows.txt"),
            "unknown format; give a .json, .jsonl, .parquet or .csv file",
        )
    )
    cases.append(
        (
            "nowhere",
            *run(toy / "model", tmp_path / "nowhere"),
            "no such file or folder",
        )
    )
    # a missing column
    missing = {
        "sft.py": "completion",
        "reward.py": "chosen",
        "dpo.py": "chosen",
        "grpo.py": "prompt",
        "ppo.py": "prompt",
    }[script]
    bad_row = {k: v for k, v in ROW[script].items() if k != missing}
    expected = {
        "sft.py": "needs a 'completion' column",
        "reward.py": "needs 'chosen' and 'rejected' columns",
        "grpo.py": "needs a 'prompt' column",
    }
    expected.update({"dpo.py": expected["reward.py"], "ppo.py": expected["grpo.py"]})
    cases.append(("column", *run(toy / "model", write_rows(tmp_path / "column.jsonl", [bad_row])), expected[script]))
    # empty rows and over-long prompts: dropped, counted, and a run they leave without a batch says so
    empty = (
        {k: ("" if k != "answer" else v) for k, v in ROW[script].items()}
        if script in ("grpo.py", "ppo.py")
        else {**ROW[script], **{k: "" for k in ("completion", "chosen") if k in ROW[script]}}
    )
    long = {**ROW[script], "prompt": "sort: " + "1" * 40 + " ->"}
    error, printed = run(
        toy / "model", write_rows(tmp_path / "dropped.jsonl", [empty] * 3 + [long] * 2), "--max_prompt_length", 24
    )
    kind = "prompt" if script in ("grpo.py", "ppo.py") else "completion"
    cases.append(("dropped", error, printed, f"'empty {kind}': 3, 'prompt too long': 2"))
    assert "all 5 training rows were dropped" in str(error), (script, str(error))
    # a tokenizer without EOS
    no_eos = tmp_path / "no_eos"
    shutil.copytree(toy / "model", no_eos)
    config = json.load(open(no_eos / "tokenizer_config.json"))
    config["eos_token"] = None
    json.dump(config, open(no_eos / "tokenizer_config.json", "w"))
    cases.append(("eos", *run(no_eos, toy / DATA[script]), "has no eos_token"))
    # a model folder that does not load: nothing there, or a config without weights
    cases.append(("no model", *run(tmp_path / "missing_model", toy / DATA[script]), "--model_name_or_path"))
    broken = tmp_path / "broken"
    shutil.copytree(toy / "model", broken)
    os.remove(broken / "model.safetensors")
    cases.append(
        ("no weights", *run(broken, toy / DATA[script]), f"--model_name_or_path {str(broken)!r} does not load with")
    )
    # a causal LM given as the reward model: HF would add a random head and only warn
    if script in ("grpo.py", "ppo.py"):
        error, printed = run_in_process(
            script, script_args(script, toy / "model", toy / "prompts", tmp_path / "out", toy / "model")
        )
        cases.append(
            (
                "reward model",
                error,
                printed,
                f"--reward_model_path {str(toy / 'model')!r} has no weights for ['score.weight']",
            )
        )
    # text that looks like a number: a CSV column, or a JSON column that mixes strings and numbers, would turn "0457"
    # into 457 (a right answer then scores 0, or sft fails on an int): refused with the column and a value; in the
    # mixed JSON column datasets decodes every text as JSON (" 39" becomes 39), so the row is found in the file
    column = {"sft.py": "completion", "reward.py": "chosen", "dpo.py": "chosen"}.get(script, "answer")
    other = [k for k in ROW[script] if k != column]
    csv = tmp_path / "numbers.csv"
    csv.write_text(",".join(other + [column]) + "\n" + ",".join([ROW[script][k] for k in other] + ["0457"]) + "\n")
    cases.append(("csv", *run(toy / "model", csv), f"column {column!r}, row 0: 457 was read as a number, not text: "
                  "convert the CSV file to JSON Lines"))
    mixed = write_rows(tmp_path / "mixed.jsonl", [{**ROW[script], column: " 39"}] * 5 + [{**ROW[script], column: 39}])
    cases.append(("mixed", *run(toy / "model", mixed), f"mixed.jsonl' line 6: {column!r} is 39, not text"))
    for what, error, printed, text in cases:
        assert isinstance(error, ValueError) and text in str(error) + printed, (script, what, repr(error)[-600:])


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_batch_sizes_that_do_not_divide(script, toy, scored_model, tmp_path):
    key = "num_iterations" if script == "grpo.py" else "num_ppo_epochs"
    error, _ = run_in_process(
        script,
        script_args(
            script,
            toy / "model",
            toy / "prompts",
            tmp_path / "a",
            scored_model,
            "--num_mini_batches",
            2,
            "--max_steps",
            3,
            f"--{key}",
            1,
        ),
    )
    assert isinstance(error, ValueError), repr(error)
    assert f"--max_steps 3: must be a multiple of a rollout's 2 optimizer steps (--{key} x --num_mini_batches)" in str(
        error
    )
    error, _ = run_in_process(
        script,
        script_args(
            script,
            toy / "model",
            toy / "prompts",
            tmp_path / "b",
            scored_model,
            "--num_mini_batches",
            2,
            "--save_every",
            1,
            f"--{key}",
            1,
        ),
    )
    assert isinstance(error, ValueError), repr(error)
    assert f"--save_every 1: must be a multiple of a rollout's 2 optimizer steps (--{key} x" in str(error)


def test_remote_code_runs_only_with_trust_remote_code(toy, tmp_path):
    """A model folder whose config points at code in the folder: without --trust_remote_code the run stops and the code
    never runs (it would leave a file behind)."""
    folder = tmp_path / "remote"
    shutil.copytree(toy / "model", folder)
    config = json.load(open(folder / "config.json"))
    config["model_type"], config["auto_map"] = (
        "planted",
        {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"},
    )
    json.dump(config, open(folder / "config.json", "w"))
    (folder / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    error, _ = run_in_process("sft.py", script_args("sft.py", folder, toy / "sft", tmp_path / "out", None))
    assert isinstance(error, ValueError) and "trust_remote_code" in str(error) and not (tmp_path / "ran").exists()


def test_a_model_that_reads_across_packed_sequences_is_refused_padding_free(toy, tmp_path):
    """A remote-code model whose forward drops position_ids and attention_mask: packed, its attention runs across a
    row's sequences, so --padding_free is refused in one line before training, naming the model. A sequence a row
    (--no-padding_free: right-padded, and causal attention never reads a later pad) it trains as the plain model."""
    folder = tmp_path / "drops"
    shutil.copytree(toy / "model", folder)
    config = json.load(open(folder / "config.json"))
    config["model_type"] = "drops_positions"
    config["auto_map"] = {"AutoConfig": "drops.DropsConfig", "AutoModelForCausalLM": "drops.DropsPositions"}
    json.dump(config, open(folder / "config.json", "w"))
    (folder / "drops.py").write_text(
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n\n\n"
        "class DropsConfig(Qwen2Config):\n    model_type = 'drops_positions'\n\n\n"
        "class DropsPositions(Qwen2ForCausalLM):\n    config_class = DropsConfig\n\n"
        "    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):\n"
        "        return super().forward(input_ids=input_ids, **kwargs)\n"
    )
    run = lambda model, out, *extra: script_args("sft.py", model, toy / "sft", tmp_path / out, None, *extra)
    error, _ = run_in_process("sft.py", run(folder, "refused", "--trust_remote_code"))
    assert isinstance(error, ValueError) and str(error).startswith(f"--model_name_or_path {str(folder)!r} reads across "
                                                                   "the sequences of a packed row"), repr(error)
    assert str(error).endswith("relative change): use --no-padding_free")
    padded, plain = run_scripts([("sft.py", run(folder, "padded", "--trust_remote_code", "--no-padding_free"), 1),
                                 ("sft.py", run(toy / "model", "plain"), 1)])
    assert padded.returncode == 0 and plain.returncode == 0, padded.stderr[-3000:] + plain.stderr[-3000:]
    losses = [[row["loss"] for row in read_metrics(tmp_path / out)] for out in ("padded", "plain")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def poisoned_copy(source, out, name):
    """A copy of a model folder with one weight set to NaN."""
    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_nan_stops_the_run_before_the_update(script, toy, scored_model, tmp_path):
    """A poisoned policy (its final norm NaN): the first step's loss is NaN, the run stops naming the step, the metric
    and that there is no checkpoint yet, and writes no model. grpo and ppo sample from the policy first, so there the
    reward model's head is poisoned: its scores are NaN, and the run stops before they reach the advantages, naming
    the reward model and how many completions (once: "non-finite loss ... lower --learning_rate", the wrong cause)."""
    if script in ("grpo.py", "ppo.py"):
        model, reward = toy / "model", poisoned_copy(scored_model, tmp_path / "poisoned", "score.weight")
        expected = f"4 of 4 completions got a non-finite reward from --reward_model_path {reward}"
    else:
        model, reward = poisoned_copy(toy / "model", tmp_path / "poisoned", "model.norm.weight"), None
        expected = "step 1: non-finite loss and grad_norm (grad_norm nan), not applied. Last complete checkpoint: none"
    data = write_rows(
        tmp_path / "small.jsonl",
        [json.loads(line) for line in open(toy / DATA[script] / "train.jsonl").readlines()[:16]],
    )
    error, _ = run_in_process(script, script_args(script, model, data, tmp_path / "a", reward))
    assert isinstance(error, ValueError) and expected in str(error), (script, repr(error)[-600:])
    assert not (tmp_path / "a" / "model.safetensors").exists()


def test_nan_rewards_with_rejection_sampling_stop_instead_of_hanging(toy, scored_model, tmp_path):
    """Rejection sampling with a reward model that scores NaN once spun forever on every rank (no candidate is kept
    when the best reward is NaN). The NaN rewards now stop the run before rejection sampling, one line from the first
    process; a subprocess with a timeout, so that a hang fails the test instead of the suite."""
    reward = poisoned_copy(scored_model, tmp_path / "poisoned", "score.weight")
    args = script_args("grpo.py", toy / "model", toy / "prompts", tmp_path / "a", reward, "--num_candidates", 8,
                       "--rejection_sampling_beta", 0.5)
    result = run_script("grpo.py", args, nproc=2, timeout=240)
    line = f"grpo.py: error: 16 of 16 completions got a non-finite reward from --reward_model_path {reward}: check it"
    assert result.returncode != 0 and result.stderr.count(line) == 1, result.stderr[-3000:]


def test_a_model_that_gets_no_gradient_is_refused(toy, tmp_path):
    """A weights file of zeros (a model saved before its weights were filled in) loads, and trained with a flat loss,
    a gradient norm of exactly 0 at every step, and exit 0. Its first step now stops the run, naming the model."""
    zeros = tmp_path / "zeros"
    shutil.copytree(toy / "model", zeros)
    save_file({k: torch.zeros_like(v) for k, v in load_file(zeros / "model.safetensors").items()},
              zeros / "model.safetensors", metadata={"format": "pt"})
    error, _ = run_in_process("sft.py", script_args("sft.py", zeros, toy / "sft", tmp_path / "out", None))
    assert isinstance(error, ValueError) and str(error).startswith(
        f"step 1: no weight of --model_name_or_path {zeros} gets a gradient (grad_norm 0)"
    ), repr(error)


ONE_RANK_SCRIPT = r"""
import os, sys, types, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import sft

dist.init_process_group("gloo")
rank, args = dist.get_rank(), types.SimpleNamespace(output_dir=sys.argv[1], model_name_or_path="m")
cases = {"nan loss": (float("nan"), 1.0), "inf grad_norm": (0.5, float("inf")), "no gradient": (0.5, 0.0),
         "signal": (0.5, 1.0)}
for name, (loss, norm) in cases.items():
    sft.STOP_SIGNALS[:] = [15] if name == "signal" and rank == 1 else []
    loss, norm = (torch.tensor(loss), torch.tensor(norm)) if rank == 1 else (torch.tensor(0.0), torch.tensor(1.0))
    try:
        verdict = f"stop {sft.guard_step(loss, norm, 1, args)}"
    except sft.ScriptError as e:
        verdict = f"error {str(e)[:18]!r}"
    print(f"rank {rank} {name}: {verdict}", flush=True)
dist.destroy_process_group()
"""


def test_a_nan_or_a_signal_on_one_rank_alone_reaches_every_rank(tmp_path):
    """guard_step's one all-reduce: a NaN loss, an inf gradient norm, a loss without a gradient or a SIGTERM seen by
    rank 1 alone stops rank 0 too (a rank that updated while another stopped would leave the shards of different
    steps; one that stopped alone would hang the other in its next collective)."""
    (tmp_path / "one_rank.py").write_text(ONE_RANK_SCRIPT)
    out = run_script(str(tmp_path / "one_rank.py"), [tmp_path], nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    expected = {"nan loss": "error 'step 1: non-finite'", "inf grad_norm": "error 'step 1: non-finite'",
                "no gradient": "error 'step 1: no weight '", "signal": "stop True"}
    for rank in (0, 1):
        for name, verdict in expected.items():
            assert f"rank {rank} {name}: {verdict}" in lines, out.stdout[-3000:]


def test_nan_names_the_last_complete_checkpoint(toy, tmp_path):
    """sft at learning rate 1e30: step 1 is finite, its update sends the weights to about 1e30 and step 2 overflows. The
    message names step 2 and the checkpoint of step 1."""
    error, _ = run_in_process(
        "sft.py",
        script_args(
            "sft.py",
            toy / "model",
            toy / "sft",
            tmp_path,
            None,
            "--learning_rate",
            1e30,
            "--lr_scheduler_type",
            "constant",
            "--save_every",
            1,
            "--max_steps",
            4,
        ),
    )
    assert isinstance(error, ValueError) and str(error).startswith("step 2:"), repr(error)
    assert f"Last complete checkpoint: {tmp_path / 'checkpoints' / 'step_1'}." in str(error)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


@pytest.fixture(scope="module")
def checkpointed(toy, tmp_path_factory):
    """sft, 4 steps, a checkpoint every 2: step_2 and step_4."""
    out = tmp_path_factory.mktemp("checkpointed")
    error, _ = run_in_process(
        "sft.py", script_args("sft.py", toy / "model", toy / "sft", out, None, "--max_steps", 4, "--save_every", 2)
    )
    assert error is None, repr(error)
    return out


def test_auto_never_picks_an_incomplete_checkpoint(checkpointed, toy, tmp_path):
    from sft import complete_checkpoints, is_complete

    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    shutil.rmtree(out / "checkpoints" / "step_2")
    good = out / "checkpoints" / "step_4"
    assert complete_checkpoints(out) == [str(good)]
    # a save interrupted before DCP wrote its last file, .metadata; one without its manifest
    shutil.copytree(good, out / "checkpoints" / "step_8")
    json.dump(
        {**json.load(open(good / "checkpoint.json")), "step": 8},
        open(out / "checkpoints" / "step_8" / "checkpoint.json", "w"),
    )
    assert complete_checkpoints(out) == [
        str(good),
        str(out / "checkpoints" / "step_8"),
    ]  # the check itself accepts a whole copy
    os.remove(out / "checkpoints" / "step_8" / ".metadata")
    shutil.copytree(good, out / "checkpoints" / "step_7")
    os.remove(out / "checkpoints" / "step_7" / "checkpoint.json")
    assert not is_complete(out / "checkpoints" / "step_8") and not is_complete(out / "checkpoints" / "step_7")
    assert complete_checkpoints(out) == [str(good)]
    error, _ = run_in_process(
        "sft.py",
        script_args(
            "sft.py",
            toy / "model",
            toy / "sft",
            out,
            None,
            "--max_steps",
            4,
            "--resume_from",
            out / "checkpoints" / "step_8",
        ),
    )
    assert isinstance(error, ValueError) and "is not a complete checkpoint" in str(error)


def test_a_checkpoint_of_another_run_is_refused(checkpointed, toy, tmp_path):
    """Other learning rate, other global batch: stops naming each mismatch. Another split of the same global batch is
    fine."""
    resume = ["--resume_from", checkpointed / "checkpoints" / "step_4"]
    error, _ = run_in_process(
        "sft.py",
        script_args(
            "sft.py",
            toy / "model",
            toy / "sft",
            tmp_path / "a",
            None,
            "--learning_rate",
            2e-3,
            "--max_steps",
            4,
            "--gradient_accumulation_steps",
            2,
            *resume,
        ),
    )
    assert (
        isinstance(error, ValueError)
        and "does not match the arguments: learning_rate 0.001 in the checkpoint, 0.002 now; "
        "batch_size (processes x micro-batch x accumulation) 4 in the checkpoint, 8 now"
        in str(error)
    )
    error, _ = run_in_process(
        "sft.py",
        script_args(
            "sft.py",
            toy / "model",
            toy / "sft",
            tmp_path / "b",
            None,
            "--max_steps",
            4,
            "--per_device_train_batch_size",
            2,
            "--gradient_accumulation_steps",
            2,
            *resume,
        ),
    )
    assert error is None, repr(error)


def test_loading_a_checkpoint_runs_no_code(checkpointed, toy, tmp_path):
    """DCP's .metadata is a pickle: one that calls a function (here it would write a file) is refused by the
    allow-list."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    step = out / "checkpoints" / "step_4"

    class Planted:
        def __reduce__(self):
            return (shutil.copy, (str(step / "checkpoint.json"), str(tmp_path / "ran")))

    (step / ".metadata").write_bytes(pickle.dumps(Planted()))
    error, _ = run_in_process(
        "sft.py", script_args("sft.py", toy / "model", toy / "sft", out, None, "--max_steps", 4, "--resume_from", step)
    )
    assert "checkpoint metadata refers to shutil.copy: not a DCP metadata class" in str(error), repr(error)
    assert not (tmp_path / "ran").exists()


def test_a_planted_bytes_entry_runs_no_code(checkpointed, toy, tmp_path):
    """An allow-listed .metadata can still point a key at a bytes entry, which DCP's load_bytes would read with
    torch.load(weights_only=False), running code planted in that file. Our checkpoints hold tensors only, so any
    bytes entry is refused before DCP reads anything."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    step = out / "checkpoints" / "step_4"

    class Planted:
        def __reduce__(self):
            return (shutil.copy, (str(step / "checkpoint.json"), str(tmp_path / "ran")))

    torch.save(Planted(), step / "planted.distcp")
    metadata = pickle.load(open(step / ".metadata", "rb"))
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))  # a key that resume loads
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    size = os.path.getsize(step / "planted.distcp")
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(relative_path="planted.distcp", offset=0, length=size)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    error, _ = run_in_process(
        "sft.py", script_args("sft.py", toy / "model", toy / "sft", out, None, "--max_steps", 4, "--resume_from", step)
    )
    assert f"checkpoint {step} lists a non-tensor entry ({key})" in str(error), repr(error)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_arguments_that_cannot_be_meant_are_refused_before_loading(script, toy, tmp_path):
    """Each stops in setup, naming the flag, before any dataset or model is read (the model folder here does not
    exist: a later failure would name it instead)."""
    bad = [
        ("--gradient_accumulation_steps", -1, "at least 1"),
        ("--max_steps", 0, "-1 (off) or at least 1"),
        ("--per_device_train_batch_size", 0, "at least 1"),
        ("--log_every", 0, "at least 1"),
        ("--learning_rate", -1e-5, "above 0"),
        ("--warmup_ratio", 1.5, "in [0, 1]"),
        ("--shard_degree", 2, "-1 (all) or a divisor of the 1 processes"),  # 1 process here: it names their number
    ]
    if not torch.cuda.is_available():  # FSDP2's offload pins memory for a GPU: a traceback per process, once
        bad.append(("--cpu_offload", True, "False on a machine without a GPU"))
    bad += {
        "dpo.py": [("--beta", -0.1, "above 0"), ("--beta", 0.0, "above 0")],
        "grpo.py": [
            ("--beta", -0.1, "0 or more"),
            ("--num_mini_batches", 0, "at least 1"),
            ("--temperature", 0.0, "above 0"),
        ],
        "ppo.py": [("--num_mini_batches", 0, "at least 1"), ("--gamma", 1.5, "in [0, 1]")],
    }.get(script, [])
    for flag, value, allowed in bad:
        given = [flag] if value is True else [flag, value]  # a switch has no value
        args = script_args(script, tmp_path / "no_model", toy / DATA[script], tmp_path / "out", "rm", *given)
        error, _ = run_in_process(script, args)
        assert isinstance(error, ValueError) and f"{flag} {value}: must be {allowed}" in str(error), (flag, repr(error))


@pytest.mark.parametrize("script", SCRIPTS)
def test_computed_batch_sizes_are_not_flags(script, capsys):
    """`--batch_size 64` was once accepted and silently ignored (the run used processes x micro-batch x accumulation).
    The computed sizes are not flags: --help does not list them and the parser refuses them."""
    import importlib

    import tyro

    Args = importlib.import_module(script[:-3]).Args
    computed = ["world_size", "batch_size", "num_training_steps"]
    computed += ["rollout_batch_size"] if script in ("grpo.py", "ppo.py") else []
    with pytest.raises(SystemExit):
        tyro.cli(Args, args=["--help"])
    listed = capsys.readouterr().out
    assert "--per_device_train_batch_size" in listed or "--per-device-train-batch-size" in listed
    for name in computed:
        assert f"--{name} " not in listed and f"--{name.replace('_', '-')} " not in listed, name
        with pytest.raises(SystemExit):
            tyro.cli(Args, args=[f"--{name}", "64"])
    assert "unrecognized" in capsys.readouterr().err.lower()


def test_a_folder_holding_another_run_is_refused_unless_continued(checkpointed, toy, tmp_path):
    """A new run into a finished run's folder once overwrote its model and metrics and left its checkpoints beside the
    new model. Now: refused, naming what is there; --resume_from auto continues it (a finished run without checkpoints
    cannot be). A run stopped before its first checkpoint (metrics, no checkpoint, no model) is restarted by
    --resume_from auto, the same command."""
    out = tmp_path / "finished"
    shutil.copytree(checkpointed, out)
    args = script_args("sft.py", toy / "model", toy / "sft", out, None, "--max_steps", 4)
    error, _ = run_in_process("sft.py", args)
    assert isinstance(error, ValueError), repr(error)
    assert "holds another run (metrics.jsonl, checkpoints, model.safetensors)" in str(error), str(error)
    assert "--resume_from auto continues it, or remove it" in str(error)
    assert len(read_metrics(out)) == 4  # untouched
    error, printed = run_in_process("sft.py", args + ["--resume_from", "auto"])  # step_4 of 4: nothing left to do
    assert error is None and len(read_metrics(out)) == 4, (repr(error), printed[-2000:])
    shutil.rmtree(out / "checkpoints")
    error, _ = run_in_process("sft.py", args + ["--resume_from", "auto"])  # a finished model, no checkpoint: refused
    assert isinstance(error, ValueError) and "holds another run (metrics.jsonl, model.safetensors): or remove" in str(
        error
    ), repr(error)
    stopped = tmp_path / "stopped_early"  # what a SIGKILL before the first checkpoint leaves
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    error, _ = run_in_process("sft.py", script_args("sft.py", toy / "model", toy / "sft", stopped, None))
    assert isinstance(error, ValueError) and "holds another run (metrics.jsonl)" in str(error), repr(error)
    restart = script_args("sft.py", toy / "model", toy / "sft", stopped, None, "--resume_from", "auto")
    error, _ = run_in_process("sft.py", restart)
    assert error is None and [r["step"] for r in read_metrics(stopped)] == [1, 2], repr(error)


def test_a_second_live_run_on_the_same_folder_is_refused(toy, tmp_path):
    """Two runs into one folder once both exited 0 with their metrics.jsonl interleaved. The first run holds an
    exclusive lock on output_dir/.lock while it lives (held here by the test, as a live run would); the second stops
    at once, naming it. When the holder ends, the folder is free."""
    import fcntl

    out = tmp_path / "busy"
    out.mkdir()
    holder = open(out / ".lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    args = script_args("sft.py", toy / "model", toy / "sft", out, None)
    error, _ = run_in_process("sft.py", args)
    assert isinstance(error, ValueError) and f"another run is writing to --output_dir {out}" in str(error), repr(error)
    assert not (out / "metrics.jsonl").exists()
    holder.close()
    error, _ = run_in_process("sft.py", args)
    assert error is None and len(read_metrics(out)) == 2, repr(error)


def test_tokenizer_and_model_limits_are_checked_before_the_model_loads(toy, tmp_path):
    """Once: a folder without tokenizer files gave a 1-token tokenizer and a late crash; token ids past the model's
    vocabulary an IndexError mid-run; prompts plus completions past max_position_embeddings a crash inside generate (and
    --max_completion_length 100000 a hang). Each now stops in data loading, before the model loads (the folders here
    would not load: their configs do not match their weights)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(toy / "model" / name, bare)
    args = script_args("sft.py", bare, toy / "sft", tmp_path / "out_bare", None)
    error, _ = run_in_process("sft.py", args)
    assert isinstance(error, ValueError) and f"--model_name_or_path {str(bare)!r} has no tokenizer files" in str(error)

    def edited(name, **changes):
        folder = tmp_path / name
        shutil.copytree(toy / "model", folder)
        config = json.load(open(folder / "config.json"))
        json.dump({**config, **changes}, open(folder / "config.json", "w"))
        return folder

    error, _ = run_in_process(
        "sft.py", script_args("sft.py", edited("vocab", vocab_size=50), toy / "sft", tmp_path / "a", None)
    )
    assert isinstance(error, ValueError) and "past the vocab_size 50" in str(error), repr(error)
    assert "the tokenizer and the model do not belong together" in str(error)
    short = edited("positions", max_position_embeddings=8)
    error, _ = run_in_process("sft.py", script_args("sft.py", short, toy / "sft", tmp_path / "b", None))
    assert isinstance(error, ValueError) and "past the 8 positions" in str(error) and "and its completion take" in str(
        error
    ), repr(error)
    assert "lower --max_prompt_length (dropping longer prompts) or --max_completion_length" in str(error)
    args = script_args(
        "grpo.py", toy / "model", toy / "prompts", tmp_path / "c", None, "--max_completion_length", 100000
    )
    error, _ = run_in_process("grpo.py", args)
    assert isinstance(error, ValueError) and "past the 256 positions" in str(error), repr(error)
    assert "and --max_completion_length 100000 take 10" in str(error), repr(error)


def test_data_a_library_would_choke_on_is_named_by_file_row_and_cause(toy, tmp_path):
    """Once library tracebacks (or, for one, a conversation trained on with an empty turn): a malformed JSON line, bytes
    that are not UTF-8, an empty file, a message with an unknown role or without content, rows of messages mixed with
    rows of prompt/completion. Each now stops before the model loads, naming the file or split and the row."""
    rows = open(toy / "sft" / "train.jsonl").readlines()[:40]
    conversation = [{"role": "user", "content": "sort: 21 ->"}, {"role": "assistant", "content": " 12"}]

    def messages(*last):
        return [json.dumps({"messages": conversation}) + "\n"] * 39 + [json.dumps({"messages": list(last)}) + "\n"]

    cases = {
        "broken.jsonl": (
            "".join(rows[:5]) + '{"prompt": "sort: 21 ->", "completion": \n' + "".join(rows[5:]),
            "line 6 is not valid JSON",
        ),
        "latin1.jsonl": (
            "".join(rows[:2]).encode() + '{"prompt": "caf\xe9", "completion": " 1"}\n'.encode("latin-1"),
            "line 3 is not UTF-8 text",
        ),
        "empty.jsonl": ("", "is empty"),
        "role.jsonl": (
            "".join(messages(conversation[0], {"role": "bot", "content": " 12"})),
            "column 'messages', row 39: message {'role': 'bot', 'content': ' 12'} has no role: give one of system",
        ),
        "content.jsonl": ("".join(messages(conversation[0], {"role": "assistant"})), "has no text content"),
        "mixed.jsonl": ("".join(rows[:39]) + json.dumps({"messages": conversation}) + "\n", "row 39: no value"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        error, _ = run_in_process("sft.py", script_args("sft.py", toy / "model", path, tmp_path / name[:-6], None))
        assert isinstance(error, ValueError) and expected in str(error), (name, repr(error))


def test_a_local_path_that_is_not_there_is_not_looked_up_on_the_hub(toy, tmp_path):
    """`--model_name_or_path runs/sft` with no such folder once spent a minute retrying the hub, then a traceback per
    rank. A name meant as local (absolute, ./, or under a folder that is here) that is not there stops at once."""
    for flag, script_args_for in (
        ("--model_name_or_path", lambda p: script_args("sft.py", p, toy / "sft", tmp_path / "o1", None)),
        ("--dataset_name", lambda p: script_args("sft.py", toy / "model", p, tmp_path / "o2", None)),
    ):
        for missing in (str(tmp_path / "nowhere"), f"{toy}/sft_typo"):
            error, _ = run_in_process("sft.py", script_args_for(missing))
            assert isinstance(error, ValueError) and f"{flag} {missing!r}: no such" in str(error), repr(error)


def test_a_model_neither_here_nor_on_the_hub_is_one_line(toy, tmp_path, monkeypatch, caplog):
    """A hub id that is not cached, with the hub not set offline and out of reach (no network here): the line came
    after 23 lines of the hub library's retries (85 on two processes). Now that line alone. (The retries' waits, 50 s,
    are skipped here.)"""
    import logging
    import time

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    try:
        error, printed = run_in_process("sft.py", script_args("sft.py", "no-such-org/no-such-model", toy / "sft",
                                                              tmp_path, None))
    finally:
        hub_logger.setLevel(level)
    assert isinstance(error, ValueError) and "--model_name_or_path 'no-such-org/no-such-model': no such folder, nor " \
        "on the hub" in str(error), repr(error)
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()], caplog.text[-2000:]


def test_data_that_is_nowhere_or_has_no_files_is_one_line(toy, tmp_path):
    """Once a traceback per rank (85 lines under torchrun, the two interleaved): a data file in a folder that is not
    there (a name ending in a data file's extension is a file, not a hub id), a hub id the hub cannot give (offline
    here), a folder without data files. Each is now one line naming --dataset_name and the cause."""
    (tmp_path / "no_data").mkdir()
    (tmp_path / "no_data" / "notes.md").write_text("nothing to train on\n")
    cases = {
        "nowhere/pairs.jsonl": "--dataset_name 'nowhere/pairs.jsonl': no such file or folder",
        str(tmp_path / "no_data"): f"--dataset_name {str(tmp_path / 'no_data')!r}: a folder without .json, .jsonl",
    }
    for name, expected in cases.items():
        error, _ = run_in_process("sft.py", script_args("sft.py", toy / "model", name, tmp_path / "out", None))
        assert isinstance(error, ValueError) and str(error).startswith(expected), (name, repr(error))
    hub = run_script("sft.py", script_args("sft.py", toy / "model", "some-org/some-dataset", tmp_path / "hub", None))
    line = "sft.py: error: --dataset_name 'some-org/some-dataset': not here, and the hub says: Couldn't reach"
    assert hub.returncode == 2 and hub.stderr.startswith(line) and len(hub.stderr.splitlines()) == 1, hub.stderr[-3000:]


def test_a_config_that_does_not_match_its_weights_names_the_tensor(toy, tmp_path):
    """A config.json whose hidden_size (64) is not its weights' (128): HF raised "look at the above report" after the
    report had been filtered out, and the other process died of a gloo error. Now one line: the flag, the first tensor
    and both shapes, from the first process, on 2 processes."""
    folder = tmp_path / "mismatched"
    shutil.copytree(toy / "model", folder)
    json.dump({**json.load(open(folder / "config.json")), "hidden_size": 64}, open(folder / "config.json", "w"))
    result = run_script("sft.py", script_args("sft.py", folder, toy / "sft", tmp_path / "out", None), nproc=2)
    line = (f"sft.py: error: --model_name_or_path {str(folder)!r}: model.embed_tokens.weight is [261, 128]; "
            "config.json makes [261, 64]")
    assert result.returncode != 0 and result.stderr.count(line) == 1 and "Traceback" not in result.stderr, (
        result.stderr[-3000:]
    )


def test_help_piped_into_head_and_an_output_folder_that_is_a_file_are_quiet(tmp_path):
    """`python sft.py --help | head -5` once ended in a 17-line BrokenPipeError traceback, exit 1; examples/details.py
    given OUT=<a file> in a bare FileExistsError. Now nothing after head's lines, and one line with exit status 2."""
    (tmp_path / "file").write_text("")
    piped, details = at_once([f"{sys.executable} sft.py --help | head -5",  # every script ends as sft.py does
                              [sys.executable, "examples/details.py"]], {"FAST": "1", "OUT": str(tmp_path / "file")})
    assert len(piped.stdout.splitlines()) == 5 and piped.stderr == "", piped.stderr[-3000:]
    assert (details.returncode, details.stderr.strip()) == (
        2, f"details.py: error: OUT={tmp_path / 'file'} is a file: give a folder"
    )


def at_once(commands, env=None):
    """Run the commands (a string: through the shell) side by side from ROOT; their CompletedProcesses, in order."""
    processes = [subprocess.Popen(c, shell=isinstance(c, str), cwd=ROOT, env=script_env(env), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate(timeout=300) for p in processes]  # each read to its end: no pipe fills up
    return [subprocess.CompletedProcess(p.args, p.returncode, *output) for p, output in zip(processes, outputs)]


def test_a_damaged_weights_file_names_the_flag(toy, scored_model, tmp_path):
    """A model.safetensors cut short (an interrupted copy) once gave safetensors' own traceback, "incomplete metadata,
    file not fully covered". The shared loader (every --*_path flag) and reward.py's loader now name the flag."""
    for name, source in (("policy", toy / "model"), ("scorer", scored_model)):
        shutil.copytree(source, tmp_path / name)
        weights = tmp_path / name / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = [
        ("sft.py", tmp_path / "policy", None, "--model_name_or_path", "incomplete metadata"),
        ("grpo.py", toy / "model", tmp_path / "scorer", "--reward_model_path", "incomplete metadata"),
        ("reward.py", tmp_path / "policy", None, "--model_name_or_path", "incomplete metadata"),
    ]
    for script, model, reward, flag, expected in cases:
        args = script_args(script, model, toy / DATA[script], tmp_path / script[:-3], reward)
        error, _ = run_in_process(script, args)
        assert isinstance(error, ValueError) and str(error).startswith(flag) and expected in str(error), repr(error)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(toy, tmp_path, monkeypatch):
    """The disk fills up while step 4's checkpoint is written (DCP's file writer raises ENOSPC, as a full disk makes
    it): the run stops with DCP's error, which names the cause; step_4 has no .metadata (DCP writes it last), so it is
    no checkpoint and step_2 is the latest; the same command with --resume_from auto then finishes the run from
    step_2, rewriting step_4."""
    from sft import complete_checkpoints
    from torch.distributed.checkpoint import filesystem

    write_item, checkpoints = filesystem._write_item, tmp_path / "checkpoints"

    def fills_up(*args, **kwargs):
        if (checkpoints / "step_2" / ".metadata").exists():  # the first checkpoint is written whole
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", fills_up)
    args = script_args("sft.py", toy / "model", toy / "sft", tmp_path, None, "--max_steps", 6, "--save_every", 2)
    error, _ = run_in_process("sft.py", args)
    assert "No space left on device" in repr(error), repr(error)
    assert complete_checkpoints(tmp_path) == [str(checkpoints / "step_2")] and (checkpoints / "step_4").exists()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    monkeypatch.setattr(filesystem, "_write_item", write_item)  # room again
    error, _ = run_in_process("sft.py", args + ["--resume_from", "auto"])
    assert error is None and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6], repr(error)
    assert complete_checkpoints(tmp_path) == [str(checkpoints / f"step_{k}") for k in (2, 4, 6)]


def test_a_data_folder_whose_files_datasets_would_skip(toy, tmp_path):
    """datasets names a folder's splits after words in its file names and silently skips the other files once one
    matches: `mine.jsonl` beside `eval.jsonl` trained on nothing (no train split), `holdout.jsonl` beside train.jsonl
    and dev.jsonl was dropped. Each is named now, with the splits found and the rule; a folder of unnamed files (all
    train, datasets' rule) still runs, and so does one with datasets' own metadata file beside its splits. The same
    for gzip-compressed files, which datasets reads too."""
    rows = open(toy / "sft" / "train.jsonl").readlines()[:8]
    cases = {
        "a": ({"mine.jsonl": rows, "eval.jsonl": rows[:2]}, "['mine.jsonl'] would be in no split (found {'test': "),
        "b": ({"train.jsonl": rows, "dev.jsonl": rows[:2], "holdout.jsonl": rows[:2]}, "['holdout.jsonl'] would be"),
        "c": ({"eval.jsonl": rows}, "has no split 'train': name one with --dataset_train_split"),
        "d": ({"part1.jsonl": rows[:4], "part2.jsonl": rows[4:]}, None),
        "e": ({"train.jsonl": rows, "test.jsonl": rows[:2], "dataset_infos.json": ["{}"]}, None),  # datasets' metadata
        "f": ({"mine.jsonl.gz": rows, "eval.jsonl.gz": rows[:2]}, "['mine.jsonl.gz'] would be in no split (found {'"),
        # two train files whose columns differ: datasets cannot stack them; one of them, named as the split, loads
        "g": (
            {"train_a.jsonl": rows, "train_b.jsonl": [json.dumps({"messages": [{"role": "user", "content": "x"}]})]},
            "split 'train' ['train_a.jsonl', 'train_b.jsonl'] does not load (",
        ),
    }
    for name, (files, expected) in cases.items():
        (tmp_path / name).mkdir()
        for file, lines in files.items():
            text = "".join(lines).encode()
            (tmp_path / name / file).write_bytes(gzip.compress(text) if file.endswith(".gz") else text)
        args = script_args("sft.py", toy / "model", tmp_path / name, tmp_path / f"out_{name}", None, "--max_steps", 1)
        error, printed = run_in_process("sft.py", args)
        if expected is None:
            assert error is None and "train: 8 of 8 rows kept" in printed, (name, repr(error), printed[-2000:])
        else:
            assert isinstance(error, ValueError) and expected in str(error), (name, repr(error))
    args = script_args("sft.py", toy / "model", tmp_path / "g", tmp_path / "out_g2", None, "--max_steps", 1)
    error, printed = run_in_process("sft.py", args + ["--dataset_train_split", "train_a"])  # the fix the message gives
    assert error is None and "train: 8 of 8 rows kept" in printed, (repr(error), printed[-2000:])


def test_a_reward_model_with_another_tokenizer_and_a_stop_token_of_several_tokens(toy, scored_model, tmp_path):
    """The reward model is fed the policy's token ids: a reward model folder whose tokenizer differs (one token added)
    is refused by name, not scored on ids that mean other text. And ppo's --stop_token must be one token."""
    other = tmp_path / "other_tokenizer"
    shutil.copytree(scored_model, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    error, _ = run_in_process("grpo.py", script_args("grpo.py", toy / "model", toy / "prompts", tmp_path / "a", other))
    assert isinstance(error, ValueError) and f"--reward_model_path {other}: its tokenizer is not the policy's" in str(
        error
    ), repr(error)
    args = script_args("ppo.py", toy / "model", toy / "prompts", tmp_path / "b", scored_model, "--stop_token", "ab")
    error, _ = run_in_process("ppo.py", args)
    assert isinstance(error, ValueError) and "--stop_token 'ab' is not one token of the tokenizer" in str(error)


def test_a_refusal_is_one_line_from_one_process_and_exit_status_2(toy, tmp_path):
    """Under torchrun a refusal once printed 61 lines: a traceback from each process, the two messages interleaved.
    Now the first process prints one line, `sft.py: error: ...`, no process prints a traceback, and each exits with 2
    (torchrun's own report of the failed workers follows); under plain python the line is all of stderr."""
    args = ["sft.py", "--model_name_or_path", toy / "model", "--dataset_name", toy / "sft", "--output_dir", tmp_path,
            "--per_device_train_batch_size", "0"]
    line = "sft.py: error: --per_device_train_batch_size 0: must be at least 1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun, plain = at_once([launcher + [str(a) for a in args], [sys.executable] + [str(a) for a in args]])
    output = torchrun.stdout + torchrun.stderr
    workers = output.split("failed (exitcode")[0]  # what the scripts printed, before torchrun's report
    assert output.count(line) == 1 and "Traceback" not in workers.replace(line, ""), output[-3000:]
    assert torchrun.returncode != 0 and output.count("exitcode  : 2") == 2, output[-3000:]
    assert (plain.returncode, plain.stderr.strip()) == (2, line), plain.stderr[-3000:]


def test_a_value_tyro_refuses_and_track_without_a_wandb_key_are_one_refusal(toy, tmp_path):
    """tyro prints its refusal of a value (2.5 for an integer) on every process, whatever console_outputs says: the
    other processes' stderr is muted while it parses, so the box shows once. --track without a wandb key (and not
    offline) once failed after the data and the model had loaded, a 116-line traceback: now a one-line refusal."""
    args = ["--model_name_or_path", toy / "model", "--dataset_name", toy / "sft", "--output_dir", tmp_path / "out"]
    unlogged = {"HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "online"}
    value = run_script("sft.py", args + ["--per_device_train_batch_size", "2.5"], nproc=2)
    track = run_script("sft.py", args + ["--track"], nproc=2, env=unlogged)
    assert value.returncode == 2 and (value.stdout + value.stderr).count("Value error") == 1, value.stderr[-3000:]
    line = ("sft.py: error: --track: wandb has no API key here: run `wandb login`, or set "
            "WANDB_MODE=offline\n")
    assert track.returncode == 2 and track.stderr == line and "train:" not in track.stdout, track.stderr[-3000:]


def test_help_spells_flags_as_the_readme_does(toy):
    """`--help` once listed `--learning-rate` where the README, the docstrings and every message say
    `--learning_rate`: the scripts' own parser uses underscores."""
    result = subprocess.run([sys.executable, "sft.py", "--help"], cwd=ROOT, env=script_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "--learning_rate" in result.stdout and "--learning-rate" not in result.stdout


def test_inputs_that_once_got_through_or_got_the_wrong_diagnosis(toy, scored_model, tmp_path):
    """A reward model folder given as dpo's policy (HF only warned that score.weight was unused); control tokens
    written as text (they became real ones); an output_dir that is a file (a bare FileExistsError on one process).
    And what a user's own folder needs: laid out as a hub preference dataset (several files per split)."""
    rows = open(toy / "preference" / "train.jsonl").readlines()
    hub = tmp_path / "hub"
    hub.mkdir()
    for name, part in (("train_prefs", rows[:40]), ("train_sft", rows[40:48]), ("test_prefs", rows[48:56])):
        (hub / f"{name}.jsonl").write_text("".join(part))
    (tmp_path / "file").write_text("")
    eos = json.load(open(toy / "model" / "tokenizer_config.json"))["eos_token"]
    spelt = write_rows(tmp_path / "spelt.jsonl", [ROW["dpo.py"]] * 8 + [{**ROW["dpo.py"], "prompt": f"sort: 2{eos}1"}])
    cases = [
        ("policy", scored_model, toy / "preference", [], "weights ['score.weight'] it does not use as "
         "Qwen2ForCausalLM: give a causal LM"),
        ("spelt", toy / "model", spelt, [], f"split 'train', column 'prompt', row 8: the text {eos!r} would become"),
        ("file", toy / "model", toy / "preference", ["--output_dir", tmp_path / "file"], "give a folder"),
        ("hub", toy / "model", hub, ["--dataset_train_split", "train_prefs", "--dataset_test_split", "test_prefs"],
         "train: 40 of 40 rows kept"),
    ]
    for name, model, data, extra, expected in cases:
        error, printed = run_in_process("dpo.py", script_args("dpo.py", model, data, tmp_path / name, None, *extra))
        if name == "hub":
            assert error is None and expected in printed and "eval: no split" not in printed, (name, repr(error))
        else:
            assert isinstance(error, ValueError) and expected in str(error), (name, repr(error))
