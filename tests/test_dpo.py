"""dpo.py: each loss type by hand, summed completion log-probs against the textbook computation, reference log-probs
precomputed or online, and the script on the toy task (DPO from the SFT model raises greedy exact match)."""

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, reference_logprobs, run_in_process, run_script, run_scripts, tiny_gpt2

from dpo import dpo_loss, pair_logps
from toy_task import exact_match


def log_sigmoid(x):
    return -math.log(1 + math.exp(-x))


@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_dpo_losses_by_hand(beta):
    # two pairs: log-ratios chosen 0.5 / rejected -0.5 (h = 1), then chosen -1.0 / rejected 0.25 (h = -1.25)
    chosen, rejected = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0])
    ref_chosen, ref_rejected = torch.tensor([-1.5, -3.0]), torch.tensor([-2.5, -2.25])
    lengths, h = torch.tensor([2, 5, 4, 1]), [1.0, -1.25]  # the chosen completions' lengths, then the rejected
    expected = {
        ("sigmoid", 0.0, 0.0): [-log_sigmoid(beta * x) for x in h],
        ("sigmoid", 0.2, 0.0): [-0.8 * log_sigmoid(beta * x) - 0.2 * log_sigmoid(-beta * x) for x in h],
        ("ipo", 0.0, 0.0): [(x - 1 / (2 * beta)) ** 2 for x in h],
        # each log-ratio over its completion's length: 0.5 / 2 - (-0.5) / 4, then -1.0 / 5 - 0.25 / 1
        ("ipo_per_token", 0.0, 0.0): [(x - 1 / (2 * beta)) ** 2 for x in (0.25 + 0.125, -0.2 - 0.25)],
        ("hinge", 0.0, 0.0): [max(0.0, 1 - beta * x) for x in h],
        ("sigmoid", 0.0, 0.5): [
            -log_sigmoid(beta * h[0]) + 0.5 * 1.0 / 2,
            -log_sigmoid(beta * h[1]) + 0.5 * 4.0 / 5,
        ],  # + alpha NLL/token
    }
    for (loss_type, label_smoothing, rpo_alpha), values in expected.items():
        args = SimpleNamespace(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, rpo_alpha=rpo_alpha)
        losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths, args)
        assert losses.tolist() == pytest.approx(values, rel=1e-6), (loss_type, label_smoothing, rpo_alpha)
        assert chosen_rewards.tolist() == pytest.approx([beta * 0.5, beta * -1.0], rel=1e-6)
        assert rejected_rewards.tolist() == pytest.approx([beta * -0.5, beta * 0.25], rel=1e-6)
    hinge = SimpleNamespace(beta=2.0, loss_type="hinge", label_smoothing=0.0, rpo_alpha=0.0)
    assert (
        dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths, hinge)[0][0].item() == 0.0
    )  # beta h >= 1: no loss


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    args = SimpleNamespace(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, rpo_alpha=0.0)
    dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), torch.tensor([3, 3]), args)[
        0
    ].sum().backward()
    # d/dh of -log sigmoid(beta h) at h = 0 is -beta / 2: descent raises log pi(chosen), lowers log pi(rejected)
    assert chosen.grad.item() == pytest.approx(-0.05) and rejected.grad.item() == pytest.approx(0.05)


@pytest.mark.parametrize("packed", [True, False])
def test_pair_logps_sum_the_completion_tokens_eos_included(packed):
    model, eos = tiny_gpt2(), 0  # the id make_batch pads with
    data = {"prompt": [[1, 2, 3], [4]], "chosen": [[5, eos], [6, 7, 8, eos]], "rejected": [[7, 7, 7, eos], [eos]]}
    with torch.no_grad():  # rows out of order, pad == eos
        chosen, rejected, lengths, _ = pair_logps(model, data, [1, 0], SimpleNamespace(padding_free=packed))
    assert lengths.tolist() == [4, 2, 1, 4]  # the chosen, then the rejected
    for key, got in (("chosen", chosen), ("rejected", rejected)):
        expected = [reference_logprobs(model, data["prompt"][i], data[key][i]).sum().item() for i in (1, 0)]
        assert got.tolist() == pytest.approx(expected, abs=1e-5), key


# ---------------------------------------------------------------------------------------------- the script itself
def test_reference_logps_precomputed_or_online_give_the_same_run(toy, tmp_path):
    """The same 6 steps on 2 processes with the reference log-probs precomputed or computed online: the same metrics.
    With --loss_type ipo_per_token (TRL's ipo; tests/test_variants.py checks its arithmetic), so that this is also its
    run end to end: before the first update the policy is the reference, so the loss is (0 - 1 / (2 beta))^2."""
    (tmp_path / "small.jsonl").write_text("".join(open(toy / "preference" / "train.jsonl").readlines()[:32]))
    modes = ("--precompute-ref-logps", "--no-precompute-ref-logps")
    launches = [
        (
            "dpo.py",
            [
                "--model_name_or_path",
                toy / "model",
                "--dataset_name",
                tmp_path / "small.jsonl",
                "--output_dir",
                tmp_path / precompute,
                "--learning_rate",
                3e-3,
                "--beta",
                1.0,
                "--max_steps",
                6,
                "--per_device_train_batch_size",
                4,
                "--log_every",
                1,
                "--per_device_eval_batch_size",
                3,
                "--loss_type",
                "ipo_per_token",
                precompute,
            ],
            2,
        )
        for precompute in modes
    ]
    for precompute, result in zip(modes, run_scripts(launches)):  # both at once
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
        assert ("reference log-probs computed for 32 training pairs" in result.stdout) == (
            precompute == "--precompute-ref-logps"
        )
    runs = {precompute: read_metrics(tmp_path / precompute) for precompute in modes}
    first = runs["--precompute-ref-logps"][0]  # implicit rewards 0 before the first update (dropout off)
    assert abs(first["rewards/chosen"]) < 1e-5 and abs(first["rewards/rejected"]) < 1e-5
    assert first["loss"] == pytest.approx((0 - 1 / (2 * 1.0)) ** 2, rel=1e-5)
    for key in first:
        # the two modes group rows differently in padded batches: the log-probs differ by float noise (1e-7 relative),
        # which 6 updates at lr 3e-3 grow to about 1e-5 (1.3e-5 in rewards/rejected, on one CPU and head order): ten
        # times that is allowed, while a wrong reference row would be off by O(0.1). rewards/accuracies compares two
        # rewards that are that noise at step 1: from step 2 on
        skip = {"tokens_per_second": 6, "rewards/accuracies": 1}.get(key, 0)
        online, precomputed = runs["--no-precompute-ref-logps"][skip:], runs["--precompute-ref-logps"][skip:]
        assert [r[key] for r in online] == pytest.approx([r[key] for r in precomputed], rel=1e-3, abs=1e-4), key
    assert runs["--precompute-ref-logps"][-1]["loss"] < first["loss"] - 0.02  # the policy moved away from the reference


def test_dpo_raises_exact_match_over_the_sft_model(toy, sft_model, tmp_path):
    """Plain sigmoid DPO (beta 1) on toy/preference, which prefers the right answer over the demonstrator's mistake,
    from the SFT model that copies the demonstrator: 30 steps, 2 processes. In the quickstart (60 steps, two seeds)
    exact match went 0.505 -> 0.995 and 0.560 -> 0.980 by step 10; the margin asked is 0.15. The first 960 training
    pairs, what 30 steps of 32 use, so that the reference log-probs are computed for those only."""
    out, data = tmp_path / "dpo", tmp_path / "preference"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(open(toy / "preference" / "train.jsonl").readlines()[:960]))
    shutil.copy(toy / "preference" / "test.jsonl", data)
    result = run_script(
        "dpo.py",
        [
            "--model_name_or_path",
            sft_model[0],
            "--dataset_name",
            data,
            "--output_dir",
            out,
            "--learning_rate",
            1e-4,
            "--beta",
            1.0,
            "--max_steps",
            30,
            "--warmup_ratio",
            0.05,
            "--lr_scheduler_type",
            "cosine",
            "--per_device_train_batch_size",
            16,
            "--log_every",
            10,
        ],
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    rows = read_metrics(out)
    for key in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert "eval/loss" in rows[-1] and "eval/accuracy" not in rows[0]  # evaluated at the end only
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["eval/accuracy"] > 0.7
    before, after = (
        exact_match(str(sft_model[0]), str(toy / "prompts" / "test.jsonl")),
        exact_match(str(out), str(toy / "prompts" / "test.jsonl")),
    )
    print(
        f"toy exact match: SFT {before:.3f}, after DPO {after:.3f}; implicit-reward test accuracy "
        f"{rows[-1]['eval/accuracy']:.3f}"
    )
    assert after >= before + 0.15


def test_label_smoothing_with_another_loss_stops_with_a_clear_message(toy, tmp_path):
    error, _ = run_in_process(
        "dpo.py",
        [
            "--model_name_or_path",
            toy / "model",
            "--dataset_name",
            toy / "preference",
            "--output_dir",
            tmp_path,
            "--loss_type",
            "ipo",
            "--label_smoothing",
            0.1,
        ],
    )
    assert isinstance(error, ValueError) and "--label_smoothing applies to --loss_type sigmoid only, not ipo" in str(
        error
    )
