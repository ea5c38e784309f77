"""Where the time of a training step goes, without editing the script: run one of our scripts under torchrun with
timers wrapped around what it calls.

    torchrun --standalone --nproc_per_node 2 bench/profile_rl.py grpo.py --model_name_or_path ... [the script's args]

Exclusive wall time per rank (a nested label is not counted in its parent), summed over the optimizer steps after
the first PROFILE_SKIP (environment variable, default 2: warm-up), divided by their number:
  generation          HF generate (KV-cached sampling), parameters already gathered by the script
  forward no_grad X   a forward pass outside generate with gradients off, per model class (reference / old log-probs,
                      reward model, values)
  forward train X     a forward pass with gradients on (FSDP2's all-gathers inside it are listed apart)
  backward            loss.backward() (FSDP2's re-gathers and gradient reduce-scatters inside it are listed apart)
  fsdp all-gather / fsdp reduce-scatter   the collectives FSDP2 issues, waited for
  optimizer step, grad clip, script all_reduce   the rest of the step that the script calls
  other               the remainder of the step: data, padding, losses, statistics, Python
On a GPU every label's edges wait for the GPU (torch.cuda.synchronize), so its work is counted where it was issued;
PROFILE_JSON=path also writes rank 0's seconds per step by label as JSON.
"""

import collections
import contextlib
import functools
import json
import os
import runpy
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

totals, stack = collections.defaultdict(float), []  # label -> exclusive seconds; the open labels, innermost last
state = {"steps": 0, "counting": False, "start": None, "end": None, "at_end": {}}
SKIP = int(os.environ.get("PROFILE_SKIP", "2"))


SYNC = torch.cuda.is_available()  # GPU work is asynchronous: wait for it at every label's edges, so it is counted where
# it was issued (generate already waits once per token; a forward or backward would be charged to the next wait)


def clock():
    if SYNC:
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def timed(label):
    now = clock()
    if stack:  # pause the parent
        parent, since = stack[-1]
        if state["counting"]:
            totals[parent] += now - since
    stack.append([label, now])
    try:
        yield
    finally:
        now = clock()
        label, since = stack.pop()
        if state["counting"]:
            totals[label] += now - since
        if stack:
            stack[-1][1] = now


def wrap(owner, name, label_of):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        label = label_of(*args)
        if label is None:
            return original(*args, **kwargs)
        with timed(label):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def forward_label(model, *args):
    if any(label.startswith(("forward", "generation")) for label, _ in stack):
        return None  # the inner base model, or a forward inside generate
    kind = "train" if torch.is_grad_enabled() else "no_grad"
    return f"forward {kind} {type(model).__name__.removeprefix('FSDP')}"


wrap(transformers.GenerationMixin, "generate", lambda *a: "generation")
transformers.PreTrainedModel.__call__ = lambda self, *a, **k: torch.nn.Module.__call__(self, *a, **k)
wrap(transformers.PreTrainedModel, "__call__", forward_label)
wrap(torch.Tensor, "backward", lambda *a: "backward")
wrap(torch.nn.utils, "clip_grad_norm_", lambda *a: "grad clip")
wrap(dist, "all_reduce", lambda *a: None if stack and stack[-1][0].startswith("grad clip") else "script all_reduce")
# FSDP2's collectives: the waits on them are where communication costs this process time
from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # noqa: E402  (it imported the collectives by name)

wrap(_fsdp_param_group, "foreach_all_gather", lambda *a: "fsdp all-gather (issue)")
wrap(_fsdp_param_group, "foreach_all_gather_copy_out", lambda *a: "fsdp all-gather (wait + copy out)")
wrap(_fsdp_param_group, "foreach_reduce", lambda *a: "fsdp reduce-scatter")


def step_pre_hook(optimizer, args, kwargs):
    stack.append(["optimizer step", clock()])


def step_post_hook(optimizer, args, kwargs):
    label, since = stack.pop()
    now = clock()
    if state["counting"]:
        totals[label] += now - since
    state["steps"] += 1
    if state["steps"] == SKIP:
        state["counting"], state["start"] = True, now
    state["end"], state["at_end"] = now, dict(totals)  # what the last step saw: evaluation and saving come after it


register_optimizer_step_pre_hook(step_pre_hook)
register_optimizer_step_post_hook(step_post_hook)


def report():
    steps = state["steps"] - SKIP
    if steps <= 0:
        print("profile: too few steps")
        return
    wall, totals = state["end"] - state["start"], state["at_end"]
    rank = os.environ.get("RANK", "0")
    lines = [f"rank {rank}: {steps} steps, {wall / steps:.3f} s/step"]
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:48s} {seconds / steps:8.3f} s  {100 * seconds / wall:5.1f} %")
    other = wall - sum(totals.values())
    lines.append(f"  {'other':48s} {other / steps:8.3f} s  {100 * other / wall:5.1f} %")
    print("\n".join(lines), flush=True)
    if os.environ.get("PROFILE_JSON") and rank == "0":  # seconds per step by label, for bench/gpu.py
        with open(os.environ["PROFILE_JSON"], "w") as f:
            json.dump(
                {
                    "steps": steps,
                    "seconds_per_step": wall / steps,
                    "other": other / steps,
                    **{label: seconds / steps for label, seconds in totals.items()},
                },
                f,
                indent=1,
            )


script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would (ppo.py imports adam_tf)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    report()
