"""The tests' quick launcher: `torchrun --nproc_per_node N script.py ...` without paying each process's start-up.

On the 2-core CI machine a fresh process spends about 4 CPU-s importing torch, transformers and datasets (`python
sft.py --help`: 3.8 s user, 0.5 s system), then more inside from_pretrained for the model's code (1.3 s under cProfile),
and torchrun's own process about 1.7 CPU-s: a 12-step sft run on the toy task took 10.6 s as `python sft.py`, and
1.4 s as a fork of a process that had imported all that. Here one server process does those imports once
(multiprocessing's "forkserver", started with the scripts' environment) and every rank of every run is a fork of it
that runs the script as `python script.py` would, with the variables torchrun gives its workers (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the same code path, init_process_group from those variables,
FSDP2 over gloo. The suite went from 631 s to 367-486 s (bench/RESULTS.md).

What torchrun itself does (forwarding SIGTERM to the workers, its exit code, the start-up) is tested through
torchrun: the SIGTERM/SIGKILL resume tests, the quickstart and the GPU bench's dry run launch it as users do.
A fork ends as multiprocessing's children do, with os._exit after the script: what would happen at interpreter
shutdown (a crash while tearing down) shows only in those torchrun launches. Like any multiprocessing child, a fork
first imports the parent's main module unless it is a package's __main__
(`python -m pytest`: nothing; the `pytest` command: its small script).
"""

import importlib
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Imported once in the server, inherited by every fork: the scripts themselves (as modules: their imports, no main)
# and what they import lazily (the toy model's architecture and tokenizer).
sys.path[0:0] = [ROOT]
for name in ("sft", "reward", "dpo", "grpo", "ppo"):
    importlib.import_module(name)
importlib.import_module("transformers.models.qwen2.modeling_qwen2")
importlib.import_module("transformers.models.qwen2.tokenization_qwen2")
del sys.path[0]

_context = None


def start(env):
    """The forkserver, started once with the scripts' environment: libraries that read their settings at import
    (OMP_NUM_THREADS, HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) read the same values as in a fresh `python script.py`.
    PYTHONPATH lets it import this module (Python 3.11's forkserver imports before it sets the parent's sys.path)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([__name__])
        saved = dict(os.environ)
        try:
            os.environ.update(env, PYTHONPATH=HERE)
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _context


def _rank(path, args, env, cwd, out, err):
    """One rank: the fork runs the script as `python script.py args` would (its folder first on sys.path, the tests'
    folders not on it), its output in two files."""
    for fd, name in ((1, out), (2, err)):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    tests = (HERE, ROOT, os.path.join(ROOT, "examples"))
    sys.argv, sys.path[:] = [path] + args, [os.path.dirname(path)] + [p for p in sys.path if p not in tests]
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception:  # what the interpreter does with an uncaught exception: the excepthook the script set
        sys.excepthook(*sys.exc_info())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def free_port():
    """A port no process listens on now, for rank 0's rendezvous store (what torchrun --standalone picks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(path, args, nproc, env, cwd, logs, timeout, terminate_when=None):
    """Run `path args` on `nproc` ranks (nproc 1: no distributed variables, like `python script.py`). Returns a
    CompletedProcess whose output is every rank's stdout and stderr in rank order. Like torchrun, the first rank
    that fails ends the others (they would wait for it in a collective), and once `terminate_when()` is true every
    rank gets SIGTERM (torchrun forwards the one it gets)."""
    ctx, port, processes = start(env), free_port(), []
    for rank in range(nproc):
        rank_env = dict(env)
        if nproc > 1:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        files = (os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err"))
        process = ctx.Process(target=_rank, args=(path, args, rank_env, cwd, *files))
        process.start()
        processes.append((process, files))
    deadline, code, failed_at = time.monotonic() + timeout, 0, None
    while any(p.is_alive() for p, _ in processes):
        alive = [p.sentinel for p, _ in processes if p.is_alive()]
        multiprocessing.connection.wait(alive, timeout=1 if terminate_when is None else 0.05)
        if terminate_when is not None and terminate_when():
            for p, _ in processes:
                p.terminate()  # SIGTERM
            terminate_when = None  # once
        failed = [p.exitcode for p, _ in processes if p.exitcode not in (None, 0)]
        if failed and failed_at is None:  # the root cause: the first failure seen (lowest rank if several at once)
            code, failed_at = failed[0], time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() > failed_at + 5):
            for p, _ in processes:
                p.kill()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([path] + args, timeout)
    for p, _ in processes:
        p.join()
    stdout = "".join(open(files[0]).read() for _, files in processes)
    stderr = "".join(open(files[1]).read() for _, files in processes)
    return subprocess.CompletedProcess([path] + args, code, stdout, stderr)
