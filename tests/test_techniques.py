"""grpo.py's techniques from TRL 1.16's GRPOTrainer against TRL's own code on identical inputs: two-sided clipping,
SAPO, VESPO, the top-entropy tokens (80/20), the entropy bonus and its adaptive control (the coefficient's trajectory),
off-policy sequence masking, the KL term times the ratio, normalize_then_sum. The reference values were computed once
by TRL's code (tests/reference/variants/make_techniques.py says how) and stored with their inputs; ours go through
accumulate_gradients, the training code, with the model's log-probs and entropies replaced by the stored ones. Each
check is shown able to fail: the technique off gives another result. Elsewhere: the refusals
(tests/test_grpo.py::test_bad_input), SAPO and VESPO end to end on 2 processes (tests/test_variants.py), the clip's
techniques together split 3 ways and resumed after SIGTERM (tests/test_training_loop.py)."""

import collections
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT

import grpo

REFERENCE = json.load(open(os.path.join(ROOT, "tests", "reference", "variants", "techniques.json")))
TOLERANCE = 1e-6


def our_args(trl, **override):
    """TRL's settings as grpo.py's flags."""
    loss = trl["loss_type"]
    args = dict(world_size=1, max_completion_length=6, per_device_train_batch_size=12, kl_estimator="k3",
                loss_type="token" if loss in ("dapo", "vespo") else "sequence",
                policy_loss=loss if loss in ("sapo", "vespo") else "clip",
                sapo_temperature=(trl.get("sapo_temperature_pos", 1.0), trl.get("sapo_temperature_neg", 1.05)),
                vespo_k=(trl.get("vespo_k_pos", 2.0), trl.get("vespo_k_neg", 3.0)),
                vespo_lambda=(trl.get("vespo_lambda_pos", 3.0), trl.get("vespo_lambda_neg", 2.0)),
                entropy_coef_range=(trl.get("entropy_coef_min", 0.0), trl.get("entropy_coef_max", 1.0)))
    same = ("importance_sampling_level", "epsilon", "epsilon_high", "beta", "delta", "use_bias_correction_kl",
            "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy",
            "entropy_target", "entropy_coef_delta")
    return grpo.Args(**args | {name: trl[name] for name in same if name in trl} | override)


@pytest.fixture(scope="module")
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def our_loss(args, monkeypatch, old_key="old_logps", scale=1.0, entropy_coef=None):
    """accumulate_gradients on the stored inputs (the entropies x `scale`), as main calls it for one mini-batch of one
    micro-batch: the loss, the gradients w.r.t. the log-probs and the entropies, the entropies' sum and count."""
    data = REFERENCE["inputs"]
    logps = torch.tensor(data["logps"], requires_grad=True)
    entropies = (torch.tensor(data["entropies"]) * scale).requires_grad_()
    mask = torch.tensor(data["mask"])
    monkeypatch.setattr(grpo, "make_batch", lambda device, p, c, rows, a: {"completion_mask": mask[rows],
                                                                            "tokens": mask[rows].sum()})
    monkeypatch.setattr(grpo, "completion_logprobs", lambda model, batch, t, e: (logps, entropies))
    keep = mask.clone()
    if args.top_entropy_quantile < 1:  # as main: over the mini-batch, from the sampling policy's entropies
        keep = grpo.top_entropy_tokens(entropies.detach(), mask, args.top_entropy_quantile)
    rollout = {"prompt": [[1]] * 12, "completion": [[1] * 6] * 12, "loss_mask": mask, "keep": keep,
               "advantages": torch.tensor(data["advantages"]), "old_logps": torch.tensor(data[old_key]),
               "ref_logps": torch.tensor(data["ref_logps"])}
    normalisers = grpo.loss_normaliser(mask, args), keep.sum().clamp(min=1)
    sums = collections.defaultdict(lambda: torch.zeros(()))
    coef = args.entropy_coef if entropy_coef is None else entropy_coef
    loss, window = grpo.accumulate_gradients(torch.nn.Linear(1, 1), rollout, list(range(12)), normalisers, args,
                                             sums, coef)
    grad = entropies.grad if entropies.grad is not None else torch.zeros_like(entropies)
    return loss.item(), logps.grad, grad, window


def close(loss, grad, entropy_grad, expected):
    return (abs(loss - expected["loss"]) < TOLERANCE
            and (grad - torch.tensor(expected["grad"])).abs().max().item() < TOLERANCE
            and (entropy_grad - torch.tensor(expected["entropy_grad"])).abs().max().item() < TOLERANCE)


@pytest.mark.parametrize("name", list(REFERENCE["cases"]))
def test_the_loss_and_gradient_equal_trls(name, one_process, monkeypatch):
    case = REFERENCE["cases"][name]
    loss, grad, entropy_grad, _ = our_loss(our_args(case["trl"]), monkeypatch, case["old_logps"])
    assert close(loss, grad, entropy_grad, case), (name, loss, case["loss"])


# each technique off (or its parameters back to the defaults): another loss or gradient on the same inputs
NEIGHBOURS = {"delta": {"delta": None}, "delta_sequence_with_kl": {"delta": None}, "sapo": {"policy_loss": "clip"},
              "sapo_temperatures_with_kl": {"sapo_temperature": (1.0, 1.05)}, "vespo": {"policy_loss": "cispo"},
              "vespo_exponents_with_kl": {"vespo_k": (2.0, 3.0), "vespo_lambda": (3.0, 2.0)},
              "top_entropy_quantile": {"top_entropy_quantile": 1.0},
              "off_policy_mask": {"off_policy_mask_threshold": None},
              "bias_correction_kl": {"use_bias_correction_kl": False},
              "bias_correction_kl_gspo": {"use_bias_correction_kl": False}, "entropy_bonus": {"entropy_coef": 0.0},
              "entropy_bonus_top_entropy_sapo": {"top_entropy_quantile": 1.0}}


@pytest.mark.parametrize("name", list(REFERENCE["cases"]))
def test_the_reference_tells_each_technique_from_its_absence(name, one_process, monkeypatch):
    case = REFERENCE["cases"][name]
    loss, grad, entropy_grad, _ = our_loss(our_args(case["trl"], **NEIGHBOURS[name]), monkeypatch, case["old_logps"])
    assert not close(loss, grad, entropy_grad, case)


def test_adaptive_entropy_follows_trls_trajectory(one_process, monkeypatch):
    """Eight steps, the entropies scaled each step so that their mean crosses the target: the weight each step
    applies (none on the first: no entropy measured yet; none after a mean above the target), the loss, the gradients
    and the weight after each step, as TRL's."""
    reference = REFERENCE["adaptive"]
    args, state = our_args(reference["trl"]), {"entropy_coef": reference["trl"]["entropy_coef"], "entropy": math.inf}
    applied = []
    for step in reference["steps"]:
        coef = grpo.entropy_weight(state, args)
        loss, grad, entropy_grad, window = our_loss(args, monkeypatch, scale=step["scale"], entropy_coef=coef)
        grpo.entropy_weight(state, args, window)
        applied.append(coef)
        assert close(loss, grad, entropy_grad, step), (step["scale"], loss, step["loss"])
        assert state["entropy_coef"] == pytest.approx(step["entropy_coef"], abs=1e-12)
    assert applied[0] == 0 and 0 in applied[1:] and len(set(applied)) > 3


def test_normalize_then_sum_equals_trls():
    """Three objectives (the verifier, the penalties, a reward model's score) of 3 groups of 4, weights 1, 1, 0.5:
    each normalised in its group, summed by weight, normalised over the rollout, as TRL's code."""
    reference = REFERENCE["normalize_then_sum"]
    objectives, weights = torch.tensor(reference["objectives"]), reference["weights"]
    args = grpo.Args(multi_objective_aggregation="normalize_then_sum", reward_fn_weight=weights[0],
                     reward_model_weight=weights[2])
    rewards = (objectives * torch.tensor(weights)).sum(1)
    ours, zero_std = grpo.group_advantages(rewards, torch.ones(12), 4, args, objectives)
    assert not zero_std.any()
    assert (ours - torch.tensor(reference["advantages"])).abs().max().item() < TOLERANCE
    summed, _ = grpo.group_advantages(rewards, torch.ones(12), 4, args)  # sum_then_normalize: another result
    assert (summed - ours).abs().max().item() > 1e-2
