"""The policy-gradient and preference variants against other libraries' own code on identical inputs:
grpo.py's GSPO and CISPO losses (and its older loss types) against TRL 1.16's GRPOTrainer, its RLOO and REINFORCE++
advantages against verl 0.9.1's estimators, dpo.py's ipo_per_token (and sigmoid, hinge) against TRL 1.16's
DPOTrainer: loss and gradient to 1e-6. The reference values were computed once by those libraries' code
(tests/reference/variants/make_reference.py says how) and stored with their inputs. Each check is shown able to fail:
the neighbouring option gives another result on the same inputs. Then each option runs end to end on 2 processes."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, read_metrics, run_scripts
from dpo import dpo_loss
from grpo import Args, group_advantages, grpo_loss, loss_normaliser

REFERENCE = json.load(open(os.path.join(ROOT, "tests", "reference", "variants", "reference.json")))
TOLERANCE = 1e-6


def grpo_case(name, **override):
    """Our loss and its gradient w.r.t. the per-token log-probs, on the stored inputs, with the case's settings."""
    inputs, case = REFERENCE["grpo"]["inputs"], REFERENCE["grpo"]["cases"][name]
    logps = torch.tensor(inputs["logps"], dtype=torch.float32, requires_grad=True)
    old, ref = (torch.tensor(inputs[key], dtype=torch.float32) for key in (case["old_logps"], "ref_logps"))
    mask, advantages = torch.tensor(inputs["mask"]), torch.tensor(inputs["advantages"], dtype=torch.float32)
    args = Args(kl_estimator="k3", max_completion_length=mask.shape[1], **{**case["ours"], **override})
    loss, _, _ = grpo_loss(
        logps, old, ref if args.beta > 0 else None, advantages, mask, loss_normaliser(mask, args), args
    )
    loss.backward()
    return case, loss.item(), logps.grad


@pytest.mark.parametrize("name", list(REFERENCE["grpo"]["cases"]))
def test_grpo_loss_and_gradient_equal_trls(name):
    case, loss, grad = grpo_case(name)
    assert abs(loss - case["loss"]) < TOLERANCE, (loss, case["loss"])
    assert (grad - torch.tensor(case["grad"])).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(
    "name, neighbour",
    [
        ("gspo", {"importance_sampling_level": "token"}),
        ("cispo", {"policy_loss": "clip"}),
        ("grpo", {"loss_type": "token"}),
    ],
)
def test_the_trl_reference_tells_the_options_apart(name, neighbour):
    case, loss, grad = grpo_case(name, **neighbour)
    assert abs(loss - case["loss"]) > 1e-3 or (grad - torch.tensor(case["grad"])).abs().max().item() > 1e-3


def test_gspo_clips_whole_completions_and_cispo_keeps_every_token():
    """By hand. GSPO: one ratio per completion, the exp of the mean log-ratio over its tokens, so a completion is
    clipped as a whole. CISPO: the weight is capped at 1 + epsilon_high but the token keeps its gradient, A x weight."""
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.tensor([[-0.3, -0.3, -0.3], [0.0, 0.0, -0.06]])  # log-ratios 0.3 everywhere; 0, 0, 0.06
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1]])
    args = Args(
        epsilon=0.2,
        epsilon_high=0.2,
        beta=0.0,
        loss_type="sequence",
        max_completion_length=3,
        importance_sampling_level="sequence",
        policy_loss="clip",
        kl_estimator="k3",
    )
    loss, ratio, _ = grpo_loss(logps, old, None, torch.tensor([1.0, 1.0]), mask, 2, args)
    assert ratio.flatten().tolist() == pytest.approx([math.exp(0.3), math.exp(0.02)])
    (grad,) = torch.autograd.grad(loss, logps)
    # first completion: e^0.3 = 1.35 > 1.2, clipped for all its tokens; second: -e^0.02 / 3 per token, over 2 sequences
    assert grad[0].tolist() == [0.0, 0.0, 0.0] and grad[1].tolist() == pytest.approx([-math.exp(0.02) / 6] * 3)
    args.importance_sampling_level, args.policy_loss, args.loss_type = "token", "cispo", "token"
    loss, _, _ = grpo_loss(logps, old, None, torch.tensor([1.0, -1.0]), mask, 6, args)
    (grad,) = torch.autograd.grad(loss, logps)
    # weights min(e^0.3, 1.2) = 1.2 for the first completion (A = 1), e^0, e^0, e^0.06 for the second (A = -1)
    assert grad[0].tolist() == pytest.approx([-1.2 / 6] * 3) and grad[1].tolist() == pytest.approx(
        [1 / 6, 1 / 6, math.exp(0.06) / 6]
    )


@pytest.mark.parametrize("estimator", list(REFERENCE["advantages"]["verl"]))
def test_advantages_equal_verls(estimator):
    rewards, lengths = (torch.tensor(REFERENCE["advantages"][k]) for k in ("rewards", "lengths"))
    args = SimpleNamespace(advantage_estimator=estimator, scale_rewards="group")
    ours, _ = group_advantages(rewards.float(), lengths.float(), 4, args)
    expected = torch.tensor(REFERENCE["advantages"]["verl"][estimator])
    assert (ours - expected).abs().max().item() < TOLERANCE, (ours, expected)
    other = "rloo" if estimator != "rloo" else "grpo"  # the check can fail: another estimator, another result
    assert (
        group_advantages(
            rewards.float(), lengths.float(), 4, SimpleNamespace(advantage_estimator=other, scale_rewards="group")
        )[0]
        - expected
    ).abs().max().item() > 1e-3


def test_rloo_is_the_leave_one_out_baseline_and_reinforce_plus_plus_is_whitened_over_tokens():
    """By their definitions: RLOO's baseline is the mean of the other G - 1 rewards of the group; REINFORCE++'s
    advantages have mean 0 and (Bessel) variance 1 over the tokens, each completion counted once per token."""
    rewards, lengths = torch.tensor([1.0, 0.0, 0.5, 0.0, 3.0, 1.0]), torch.tensor([2.0, 5.0, 1.0, 3.0, 3.0, 4.0])
    args = SimpleNamespace(advantage_estimator="rloo", scale_rewards="group")
    rloo, _ = group_advantages(rewards, lengths, 3, args)
    for i in range(6):
        others = [rewards[j].item() for j in range(3 * (i // 3), 3 * (i // 3) + 3) if j != i]
        assert rloo[i].item() == pytest.approx(rewards[i].item() - sum(others) / 2)
    args.advantage_estimator = "reinforce_plus_plus"
    whitened, _ = group_advantages(rewards, lengths, 3, args)
    tokens = torch.repeat_interleave(whitened, lengths.long())
    assert tokens.mean().item() == pytest.approx(0.0, abs=1e-6) and tokens.var().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("name", list(REFERENCE["dpo"]["cases"]))
def test_dpo_loss_and_gradient_equal_trls(name):
    inputs, case = REFERENCE["dpo"]["inputs"], REFERENCE["dpo"]["cases"][name]
    pairs = len(inputs["chosen_lengths"])
    per_token = torch.tensor(inputs["per_token_logps"], dtype=torch.float32, requires_grad=True)
    lengths = torch.tensor(inputs["chosen_lengths"] + inputs["rejected_lengths"])
    ref_chosen, ref_rejected = (
        torch.tensor(inputs[k], dtype=torch.float32) for k in ("ref_chosen_logps", "ref_rejected_logps")
    )
    results = {}
    for loss_type in (case["ours"], "ipo"):  # ipo: the paper's summed form, which TRL's ipo is not
        args = SimpleNamespace(beta=case["beta"], loss_type=loss_type, label_smoothing=0.0, rpo_alpha=0.0)
        # 0 past each length, as completion_logprobs gives
        summed = (per_token * (torch.arange(per_token.shape[1]) < lengths[:, None])).sum(1)
        loss = dpo_loss(summed[:pairs], summed[pairs:], ref_chosen, ref_rejected, lengths, args)[0].mean()
        (grad,) = torch.autograd.grad(loss, per_token)
        results[loss_type] = (loss.item(), grad)
    loss, grad = results[case["ours"]]
    assert abs(loss - case["loss"]) < TOLERANCE and (grad - torch.tensor(case["grad"])).abs().max() < TOLERANCE
    if case["trl"] == "ipo":
        assert abs(results["ipo"][0] - case["loss"]) > 1.0  # the same name, another loss


# name: the script, its data, the options together (each option in at least one run; dpo's ipo_per_token runs end to
# end in tests/test_dpo.py::test_reference_logps_precomputed_or_online_give_the_same_run)
RUNS = {
    "gspo_rloo": (
        "grpo.py",
        "prompts",
        [
            "--importance_sampling_level",
            "sequence",
            "--loss_type",
            "sequence",
            "--advantage_estimator",
            "rloo",
            "--num_iterations",
            2,
        ],
    ),
    "cispo_reinforce_plus_plus": (
        "grpo.py",
        "prompts",
        [
            "--policy_loss",
            "cispo",
            "--epsilon_high",
            4.0,
            "--advantage_estimator",
            "reinforce_plus_plus",
            "--num_iterations",
            2,
        ],
    ),
    "reinforce_plus_plus_baseline": ("grpo.py", "prompts", ["--advantage_estimator", "reinforce_plus_plus_baseline"]),
    "sapo_normalize_then_sum": ("grpo.py", "prompts", ["--policy_loss", "sapo", "--sapo_temperature", 2.0, 1.0,
                                                       "--multi_objective_aggregation", "normalize_then_sum",
                                                       "--missing_eos_penalty", 0.5, "--num_iterations", 2]),
    "vespo_entropy_bonus": ("grpo.py", "prompts", ["--policy_loss", "vespo", "--entropy_coef", 0.01,
                                                   "--num_iterations", 2]),
}


@pytest.fixture(scope="module")
def variant_runs(toy, sft_model, tmp_path_factory):
    """Every run of RUNS at once: 2 processes each, 2 optimizer steps from the toy SFT model, on 256 training and 32
    test prompts of the toy task."""
    root, launches = tmp_path_factory.mktemp("variants"), []
    for split, rows in (("train", 256), ("test", 32)):
        (root / "prompts").mkdir(exist_ok=True)
        lines = open(toy / "prompts" / f"{split}.jsonl").readlines()[:rows]
        (root / "prompts" / f"{split}.jsonl").write_text("".join(lines))
    for name, (script, data, options) in RUNS.items():
        common = [
            "--model_name_or_path",
            sft_model[0],
            "--dataset_name",
            root / data,
            "--output_dir",
            root / name,
            "--learning_rate",
            1e-4,
            "--max_steps",
            2,
            "--log_every",
            1,
            "--per_device_train_batch_size",
            4,
        ]
        if script == "grpo.py":
            common += ["--num_generations", 4, "--max_completion_length", 10, "--per_device_eval_batch_size", 100]
        launches.append((script, common + options, 2))
    return root, dict(zip(RUNS, run_scripts(launches)))


@pytest.mark.parametrize("name", list(RUNS))
def test_each_option_runs_on_two_processes(name, variant_runs):
    root, results = variant_runs
    result, out = results[name], root / name
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2] and (out / "model.safetensors").exists()
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float)), rows
    if RUNS[name][0] == "grpo.py":
        assert "eval/scores" in rows[-1]
    if "cispo" in name:  # CISPO has no lower clip
        assert all(row["clip_ratio/low"] == 0.0 for row in rows)
    if "entropy_bonus" in name:
        assert all(row["entropy_coef"] == pytest.approx(0.01) for row in rows)
