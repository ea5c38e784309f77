"""Helpers are pasted verbatim into each script that needs them (STYLE.md): any function or class defined under the
same name in several top-level scripts must have the same source, so the copies cannot drift apart."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [s for s in ("sft.py", "reward.py", "dpo.py", "ppo.py", "grpo.py") if os.path.exists(os.path.join(ROOT, s))]
PER_SCRIPT = {"Args"}  # each script has its own Args (the common block is checked field by field below)


def definitions(source):
    """name -> source text of every top-level function and class."""
    tree = ast.parse(source)
    return {node.name: ast.get_source_segment(source, node) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def drifted_copies(sources):
    """Names defined in several scripts whose sources differ, with the scripts involved."""
    by_name = {}
    for script, source in sources.items():
        for name, text in definitions(source).items():
            by_name.setdefault(name, {})[script] = text
    return {name: sorted(copies) for name, copies in by_name.items()
            if name not in PER_SCRIPT and len(copies) > 1 and len(set(copies.values())) > 1}


def test_shared_helpers_are_identical_across_scripts():
    sources = {s: open(os.path.join(ROOT, s)).read() for s in SCRIPTS}
    assert drifted_copies(sources) == {}


def test_the_check_catches_a_drifted_copy():
    a = "def pad(x):\n    return x\n\ndef loss(y):\n    return y\n"
    b = "def pad(x):\n    return x + 0\n\ndef loss(y):\n    return -y\n"
    c = "def pad(x):\n    return x\n"
    assert drifted_copies({"a.py": a, "c.py": c}) == {}  # a verbatim copy passes; a name in one script is free
    assert drifted_copies({"a.py": a, "b.py": b, "c.py": c}) == {"pad": ["a.py", "b.py", "c.py"], "loss": ["a.py", "b.py"]}


COMMON_FIELDS = ["exp_name", "seed", "track", "wandb_project_name", "wandb_entity", "output_dir", "model_name_or_path",
                 "dataset_name", "dataset_train_split", "dataset_test_split", "max_steps", "num_train_epochs", "learning_rate",
                 "lr_scheduler_type", "warmup_ratio", "per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size",
                 "max_grad_norm", "optimizer", "adam_epsilon", "weight_decay", "bf16", "gradient_checkpointing", "cpu_offload", "reshard_after_forward",
                 "log_every", "eval_every", "save_every", "resume_from", "keep_last", "skip_nonfinite", "trust_remote_code"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_common_arguments_come_first_in_every_script(script):
    """The common command line (DESIGN.md) opens every Args, in the same order, so `diff` shows only the algorithm."""
    args = next(node for node in ast.parse(open(os.path.join(ROOT, script)).read()).body if isinstance(node, ast.ClassDef) and node.name == "Args")
    fields = [node.target.id for node in args.body if isinstance(node, ast.AnnAssign)]
    assert fields[: len(COMMON_FIELDS)] == COMMON_FIELDS
