import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests import from the top-level scripts: `from sft import ...`
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """The offline toy task (tokenizer, tiny model, datasets), written once per test session."""
    from toy_task import write_toy_task

    out = tmp_path_factory.mktemp("toy")
    write_toy_task(str(out))
    return out


def run_script(script, args, nproc=1, timeout=600, env=None):
    """Run a top-level script the way users do: `torchrun --nproc_per_node N script.py ...`, or `python script.py`
    for one process. Returns the CompletedProcess; its output is kept for the assertion messages."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(launcher + [os.path.join(ROOT, script)] + [str(a) for a in args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
