import concurrent.futures
import json
import os
import sys
import tempfile

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests import from the top-level scripts: `from sft import ...`
sys.path.insert(0, os.path.join(ROOT, "examples"))

from launch import launch  # noqa: E402  (tests/ is on the path: pytest puts a conftest's folder there)


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """The offline toy task (tokenizer, tiny model, datasets), written once per test session."""
    from toy_task import write_toy_task

    out = tmp_path_factory.mktemp("toy")
    write_toy_task(str(out))
    return out


def run_script(script, args, nproc=1, timeout=600, env=None, terminate_when=None):
    """Run a top-level script as users do, `torchrun --nproc_per_node N script.py ...` (`python script.py` for one
    process), through the tests' quick launcher (launch.py: the same ranks, variables and code path, each rank a fork
    of one process that imported the libraries once; SIGTERM to every rank once `terminate_when()`). Returns a
    CompletedProcess with every rank's output, kept for the assertion messages."""
    with tempfile.TemporaryDirectory() as logs:
        path, args = os.path.join(ROOT, script), [str(a) for a in args]
        return launch(path, args, nproc, script_env(env), ROOT, logs, timeout, terminate_when)


def run_scripts(runs, timeout=600):
    """Independent runs at once, each a (script, args, nproc) for run_script: on 2 cores one run's waits (loading,
    writing, collectives) overlap another's work, about 20 % less wall time than one after the other (the reward and
    dpo split fixtures: 5.6 and 5.8 s, against 7.5 and 6.9 s). Returns the finished processes in the order given."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run_script(*run[:2], nproc=run[2], timeout=timeout), runs))


def script_env(extra=None):
    """The environment of every script run here: one thread per process (2 processes share 2 cores), offline; a
    process that crashes (a signal such as SIGABRT) prints every thread's Python stack."""
    return {
        **os.environ,
        "PYTHONFAULTHANDLER": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        **(extra or {}),
    }


def read_metrics(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


@pytest.fixture(scope="session")
def sft_model(toy, tmp_path_factory):
    """The toy SFT model: 300 steps on 2 processes (about 40 s), the quickstart's: it has converged to the flawed
    demonstrator, right answers included (at 150 steps its samples were right 9% of the time on the flawed subset,
    at 300 steps 28%, the demonstrator 30%: RL needs them). test_sft checks the run; the other stages start from it.
    Returns the output folder and the finished process (its output)."""
    out = tmp_path_factory.mktemp("sft")
    result = run_script(
        "sft.py",
        [
            "--model_name_or_path",
            toy / "model",
            "--dataset_name",
            toy / "sft",
            "--output_dir",
            out,
            "--learning_rate",
            2e-3,
            "--max_steps",
            300,
            "--warmup_ratio",
            0.05,
            "--lr_scheduler_type",
            "cosine",
            "--per_device_train_batch_size",
            16,
            "--log_every",
            50,
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    return out, result


@pytest.fixture(scope="session")
def tool_model(toy, tmp_path_factory):
    """A toy model that calls the calculator: 120 SFT steps (1 process) on running sums of 2 or 3 numbers, each
    demonstration a call then the result (sum_task.py's tool demonstrator, always calling). Returns its folder and the
    prompts (messages) to train on with grpo.py --tools calculator."""
    import random

    from sum_task import TOOLS_LINE, tool_demonstration

    out, rng = tmp_path_factory.mktemp("tools"), random.Random(0)
    sums = [[rng.randint(1, 99) for _ in range(rng.choice([2, 3]))] for _ in range(512)]
    users = [[{"role": "user", "content": "sum: " + " ".join(map(str, n)) + " ->"}] for n in sums]
    rows = [{"prompt": [TOOLS_LINE, *user, *before], "completion": after}
            for user, n in zip(users, sums) for before, after in tool_demonstration(rng, n, 1.0)]
    (out / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": user, "answer": str(sum(n))}) + "\n"
                                               for user, n in zip(users, sums)))
    result = run_script("sft.py", ["--model_name_or_path", toy / "model", "--dataset_name", out / "sft.jsonl",
                                   "--output_dir", out / "model", "--learning_rate", 2e-3, "--max_steps", 120,
                                   "--per_device_train_batch_size", 16, "--log_every", 40])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    return out / "model", out / "prompts.jsonl"


def tiny_gpt2():
    """Absolute position embeddings: left padding without position_ids would shift every position (RoPE would not)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
    ).eval()


def reference_logprobs(model, prompt, completion, temperature=1.0):
    """One unpadded sequence, full log_softmax: the textbook computation."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="session")
def reward_model(sft_model, tmp_path_factory, toy):
    """The toy reward model: 125 steps from the SFT model on toy/preference, 2 processes (about 30 s). test_reward
    checks the run; ppo.py scores with it and starts its value model from it. Returns the folder and the process."""
    out = tmp_path_factory.mktemp("reward")
    result = run_script(
        "reward.py",
        [
            "--model_name_or_path",
            sft_model[0],
            "--dataset_name",
            toy / "preference",
            "--output_dir",
            out,
            "--learning_rate",
            1e-3,
            "--max_steps",
            125,
            "--warmup_ratio",
            0.05,
            "--lr_scheduler_type",
            "cosine",
            "--per_device_train_batch_size",
            16,
            "--log_every",
            25,
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    return out, result


def run_in_process(script, args):
    """Run a top-level script inside the test process, as `python script.py ...` would (one process, the same code
    path), for the runs that stop before training: no interpreter start or imports to pay. Returns the exception it
    raised (None if it finished) and what it printed. What it leaves behind is undone: the process group, the signal
    handlers, the excepthook and log filter it sets, and the lock it took on its output_dir (a process that ends drops
    it; this one goes on)."""
    import contextlib
    import io
    import logging
    import signal
    import types

    import torch.distributed as dist

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)  # SIGALRM: grpo.py --tools
    handlers, argv, printed = {s: signal.getsignal(s) for s in signals}, sys.argv, io.StringIO()
    hook, hf_filters = sys.excepthook, list(logging.getLogger("transformers.modeling_utils").filters)
    path, main = os.path.join(ROOT, script), sys.modules["__main__"]
    module = types.ModuleType("__main__")  # what runpy.run_path(run_name="__main__") does, keeping the namespace
    module.__file__, sys.argv, error = path, [script] + [str(a) for a in args], None
    try:
        sys.modules["__main__"] = module
        with contextlib.redirect_stdout(printed):
            exec(compile(open(path).read(), path, "exec"), module.__dict__)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit, and DCP's CheckpointException (a BaseException)
        error = e
    finally:
        sys.argv, sys.modules["__main__"] = argv, main
        sys.excepthook, logging.getLogger("transformers.modeling_utils").filters = hook, hf_filters
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if dist.is_initialized():
            dist.destroy_process_group()
        for lock in module.__dict__.get("OUTPUT_DIR_LOCK", []):
            lock.close()
    return error, printed.getvalue()
