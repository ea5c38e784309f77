"""AdamTF against real TensorFlow trajectories (tests/reference/adam_tf/README.md), and the negative control."""

import copy
import os

import numpy as np
import pytest
import torch
from conftest import run_script

from adam_tf import AdamTF

REF = np.load(os.path.join(os.path.dirname(__file__), "reference", "adam_tf", "adam_tf_reference_A.npz"))
CASES = [str(c) for c in REF["cases"]]
TOL = 1e-4  # worst |error| <= TOL x how far TF moved that tensor (float32 re-orderings stay below 2.4e-5)
DISCRIMINATING = ["lmhp", "beta1_zero", "tiny_grads", "cosine_lr"]  # where eps placement changes the result


def run_case(case, make_optimizer):
    """Feed the case's gradients to an optimizer; returns per-parameter (T, *shape) trajectories and states."""
    steps, n = int(REF[f"{case}__steps"]), int(REF[f"{case}__num_params"])
    params = [torch.nn.Parameter(torch.from_numpy(REF[f"{case}__p{k}__init"].copy())) for k in range(n)]
    opt = make_optimizer(
        params,
        lr=float(REF[f"{case}__lr"][0]),
        betas=(float(REF[f"{case}__beta1"]), float(REF[f"{case}__beta2"])),
        eps=float(REF[f"{case}__eps"]),
    )
    after, ms, vs, b1p, b2p = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [], []
    for t in range(steps):
        for group in opt.param_groups:  # what an LR scheduler does between steps
            group["lr"] = float(REF[f"{case}__lr"][t])
        if isinstance(opt, AdamTF):
            b1p.append(opt.state[params[0]]["beta1_power"].item() if t else np.float32(REF[f"{case}__beta1"]))
            b2p.append(opt.state[params[0]]["beta2_power"].item() if t else np.float32(REF[f"{case}__beta2"]))
        for k, p in enumerate(params):
            p.grad = torch.from_numpy(np.array(REF[f"{case}__p{k}__grads"][t]))
        opt.step()
        for k, p in enumerate(params):
            after[k].append(p.detach().clone().numpy())
            if isinstance(opt, AdamTF):
                ms[k].append(opt.state[p]["exp_avg"].clone().numpy())
                vs[k].append(opt.state[p]["exp_avg_sq"].clone().numpy())
    return [np.stack(a) for a in after], ms, vs, np.array(b1p, np.float32), np.array(b2p, np.float32)


def relative_deviation(case, after):
    """max over tensors and steps of max|impl - tf| / max|tf - init| (the README's measure)."""
    worst = 0.0
    for k, a in enumerate(after):
        tf_after, init = REF[f"{case}__p{k}__after"], REF[f"{case}__p{k}__init"]
        worst = max(worst, np.abs(a - tf_after).max() / np.abs(tf_after - init).max())
    return worst


@pytest.mark.parametrize("case", CASES)
def test_adam_tf_matches_tensorflow(case):
    after, ms, vs, b1p, b2p = run_case(case, AdamTF)
    assert relative_deviation(case, after) <= TOL
    # the moments and beta powers involve no sqrt, so TF's operation order makes them bit-identical
    for k in range(len(after)):
        assert np.array_equal(np.stack(ms[k]), REF[f"{case}__p{k}__m"]), f"m of p{k}"
        assert np.array_equal(np.stack(vs[k]), REF[f"{case}__p{k}__v"]), f"v of p{k}"
    assert np.array_equal(b1p, REF[f"{case}__beta1_power"]) and np.array_equal(b2p, REF[f"{case}__beta2_power"])


@pytest.mark.parametrize("case", CASES)
def test_torch_adam_is_not_tf_adam(case):
    """Negative control: the same check fails torch.optim.Adam wherever epsilon's placement matters."""
    after = run_case(case, torch.optim.Adam)[0]
    if case == "lmhp":  # our harness reproduces the control stored with the reference
        for k, a in enumerate(after):
            np.testing.assert_allclose(a, REF[f"lmhp__p{k}__torch_adam_after"], rtol=0, atol=1e-9)
    assert (relative_deviation(case, after) > TOL) == (case in DISCRIMINATING)


def test_zero_gradient_entries_never_move():
    after = run_case("zero_grads", AdamTF)[0]
    init = REF["zero_grads__p0__init"]
    assert np.array_equal(after[0][:, 2, 0], np.full(after[0].shape[0], init[2, 0]))  # p0[2, 0]: grad always 0
    assert np.array_equal(after[1][:, -1], np.full(after[1].shape[0], REF["zero_grads__p1__init"][-1]))


def test_state_dict_resume_is_exact():
    """Save after 10 steps, load into a fresh optimizer, 10 more: same as 20 straight."""
    torch.manual_seed(0)
    grads = [torch.randn(20, 5) * 1e-3 for _ in range(20)]
    p_straight = torch.nn.Parameter(torch.randn(5))
    p_resumed = torch.nn.Parameter(p_straight.detach().clone())
    opt = AdamTF([p_straight], lr=1e-3, eps=1e-5)
    for g in grads:
        p_straight.grad = g.sum(0)
        opt.step()
    opt_a = AdamTF([p_resumed], lr=1e-3, eps=1e-5)
    for g in grads[:10]:
        p_resumed.grad = g.sum(0)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    opt_b = AdamTF([p_resumed], lr=1e-3, eps=1e-5)
    opt_b.load_state_dict(saved)
    for g in grads[10:]:
        p_resumed.grad = g.sum(0)
        opt_b.step()
    assert torch.equal(p_straight, p_resumed)


FSDP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, os.getcwd())
from adam_tf import AdamTF

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

def train(model, opt, rank, world):
    g = torch.Generator().manual_seed(1)
    for step in range(15):
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
        lo, hi = rank * 8 // world, (rank + 1) * 8 // world  # each rank takes its slice of the global batch
        loss = ((model(x[lo:hi]) - y[lo:hi]) ** 2).sum() / 8 * 1e-2
        loss.backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group["lr"] *= 0.9

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ref = make()
train(ref, AdamTF(ref.parameters(), lr=1e-2, eps=1e-5), 0, 1)  # one process, whole batch
model = make()
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
for m in model.modules():  # sum gradients over ranks: the loss is already divided by the global batch
    if hasattr(m, "set_gradient_divide_factor"):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
train(model, AdamTF(model.parameters(), lr=1e-2, eps=1e-5), rank, world)
worst = max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
moved = max((r - p0).abs().max().item() for r, p0 in zip(ref.parameters(), make().parameters()))
if rank == 0:
    print(f"WORST {worst:.3e} MOVED {moved:.3e}")
dist.barrier()  # no rank tears gloo down while the other still communicates (gloo can abort at exit otherwise)
dist.destroy_process_group()
"""


def test_adam_tf_fsdp2_two_processes_matches_one(tmp_path):
    script = tmp_path / "fsdp_adam.py"
    script.write_text(FSDP_SCRIPT)
    out = run_script(str(script), [], nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("WORST")][0]
    worst, moved = float(line.split()[1]), float(line.split()[3])
    assert moved > 1e-2 and worst <= 1e-6 * max(1.0, moved), line  # sharded = unsharded up to summation order
