"""grpo.py: KL estimators against exact expectations on categorical distributions, the loss types and the clipped
surrogate against hand-computed cases, advantages, verifiers on real GSM8K solutions, generation (the distribution
sampled from, left padding, EOS, parameters gathered once), and the script run the way users run it."""

import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import time
from decimal import Decimal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, read_metrics, run_in_process, run_script, run_scripts, tiny_gpt2
from grpo import (
    Args,
    accumulate_gradients,
    best_and_worst,
    completion_logprobs,
    generate_completions,
    grpo_loss,
    group_advantages,
    has_spread,
    kl_estimate,
    loss_normaliser,
    make_batch,
    no_grad_pass,
    online_dpo_loss,
    parse_answer,
    rejection_sample,
    rollout_rewards,
    shard_model,
    tokenize_prompts,
    training_rows,
    unsharded,
    verifier_reward,
    window_metrics,
)
from datasets import Dataset
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

GSM8K = os.path.join(ROOT, "tests", "data", "gsm8k", "test.jsonl")  # MIT, tests/data/gsm8k/LICENSE


def loss_args(**kw):
    return SimpleNamespace(
        **{
            **{field.name: field.default for field in dataclasses.fields(Args)},
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.0,
            "kl_estimator": "k3",
            "loss_type": "token",
            "max_completion_length": 4,
            "importance_sampling_level": "token",
            "policy_loss": "clip",
            **kw,
        }
    )


# ---------------------------------------------------------------------------------------------- KL estimators
def estimator_expectations(sampler):
    """Value and gradient (w.r.t. the policy logits) of E_{x ~ sampler}[estimator(x)] for each estimator, computed
    exactly as a sum over the 6 outcomes, and from 400k samples; plus the exact KL(pi || ref), KL(ref || pi) and their
    gradients. sampler: "policy" (on-policy) or "old" (an older policy, as with num_iterations > 1)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=g).requires_grad_()
    ref = torch.log_softmax(torch.randn(6, generator=g), -1)
    logp = torch.log_softmax(theta, -1)
    old = (
        torch.log_softmax(theta.detach() + 0.7 * torch.randn(6, generator=g), -1) if sampler == "old" else logp.detach()
    )
    exact = {"kl": (logp.exp() * (logp - ref)).sum(), "reverse_kl": (ref.exp() * (ref - logp)).sum()}
    exact = {k: (v.item(), torch.autograd.grad(v, theta, retain_graph=True)[0]) for k, v in exact.items()}
    samples = torch.multinomial(old.exp(), 400_000, replacement=True, generator=g)
    expected, sampled = {}, {}
    for kind in ("k1", "k2", "k3", "k1_ratio"):
        per_outcome = kl_estimate(logp, ref, old, kind)
        value = (old.exp() * per_outcome).sum()  # sum_x s(x) f(x): the expectation, no sampling noise
        expected[kind] = (value.item(), torch.autograd.grad(value, theta, retain_graph=True)[0])
        mean = per_outcome[samples].mean()
        sampled[kind] = (mean.item(), torch.autograd.grad(mean, theta, retain_graph=True)[0])
    return exact, expected, sampled


def assert_samples_agree(expected, sampled):
    """The same conclusions from 400k samples: each sample mean (value and gradient) is within 0.01 of its
    expectation."""
    for kind in expected:
        assert abs(sampled[kind][0] - expected[kind][0]) < 0.01, kind
        assert (sampled[kind][1] - expected[kind][1]).abs().max() < 0.01, kind


def test_kl_estimators_on_policy():
    exact, expected, sampled = estimator_expectations("policy")
    (kl, kl_grad), (_, reverse_grad) = exact["kl"], exact["reverse_kl"]
    assert kl > 0.3 and kl_grad.norm() > 0.3  # a KL and a gradient large enough for the biases below to show
    close = lambda a, b: torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-6)
    # unbiased in value: k1, k3 (and k1_ratio, which is k1 on-policy); k2 is not
    assert close(expected["k1"][0], kl) and close(expected["k3"][0], kl) and close(expected["k1_ratio"][0], kl)
    assert abs(expected["k2"][0] - kl) > 0.02
    # unbiased in gradient: k2 and k1_ratio; k1's expected gradient is 0, k3's is the gradient of KL(ref || pi)
    assert close(expected["k2"][1], kl_grad) and close(expected["k1_ratio"][1], kl_grad)
    assert close(expected["k1"][1], torch.zeros(6)) and close(expected["k3"][1], reverse_grad)
    assert (reverse_grad - kl_grad).norm() > 0.1
    assert_samples_agree(expected, sampled)


def test_kl_estimators_off_policy():
    """Tokens sampled by an older policy (num_iterations > 1): only the importance-weighted k1 keeps both the value
    and the gradient of KL(pi || ref)."""
    exact, expected, sampled = estimator_expectations("old")
    (kl, kl_grad) = exact["kl"]
    assert torch.allclose(torch.tensor(expected["k1_ratio"][0]), torch.tensor(kl), atol=1e-6)
    assert torch.allclose(expected["k1_ratio"][1], kl_grad, atol=1e-6)
    assert abs(expected["k1"][0] - kl) > 0.05 and abs(expected["k3"][0] - kl) > 0.05
    assert (expected["k2"][1] - kl_grad).norm() > 0.05
    assert_samples_agree(expected, sampled)


# ---------------------------------------------------------------------------------------------- the loss
def test_loss_types_by_hand_with_unequal_lengths():
    """Two completions of 3 and 1 tokens, ratio 1, advantages +1 and -2: the per-token losses are -1, -1, -1 and +2."""
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    expected = {"token": (-3 + 2) / 4, "sequence": (-3 / 3 + 2 / 1) / 2, "constant": (-3 + 2) / (2 * 4)}
    for loss_type, value in expected.items():
        args = loss_args(loss_type=loss_type)
        loss, ratio, _ = grpo_loss(logps, logps.detach(), None, advantages, mask, loss_normaliser(mask, args), args)
        assert loss.item() == pytest.approx(value), loss_type
        assert torch.equal(ratio, torch.ones(2, 3))
        # split into two micro-batches, each divided by the normaliser of the whole batch: the same loss
        parts = [
            grpo_loss(
                logps[i : i + 1],
                logps[i : i + 1].detach(),
                None,
                advantages[i : i + 1],
                mask[i : i + 1],
                loss_normaliser(mask, args),
                args,
            )[0]
            for i in range(2)
        ]
        assert sum(parts).item() == pytest.approx(value), loss_type
    # with the KL term: d = log 2 everywhere, so k3 = 1/2 - 1 + log 2 on each of the 4 tokens in the loss
    args = loss_args(beta=0.1)
    loss, _, _ = grpo_loss(
        logps, logps.detach(), logps.detach() - torch.log(torch.tensor(2.0)), advantages, mask, 4, args
    )
    assert loss.item() == pytest.approx(-0.25 + 0.1 * (0.5 - 1 + 0.6931471805599453))


def test_clipped_surrogate_by_hand():
    """epsilon 0.2, epsilon_high 0.28: a clipped token has no gradient; the surrogate is the pessimistic one."""
    ratio = torch.tensor([[1.5, 1.1, 0.5, 1.5]])
    old = torch.zeros(1, 4)
    logps = torch.log(ratio).requires_grad_()
    advantages_per_token = torch.tensor([1.0, 1.0, -1.0, -1.0])
    losses = []
    for j in range(4):  # one token at a time, so each advantage is the completion's
        mask = torch.zeros(1, 4)
        mask[0, j] = 1
        loss, _, policy_loss = grpo_loss(logps, old, None, advantages_per_token[j : j + 1], mask, 1, loss_args())
        (grad,) = torch.autograd.grad(loss, logps)
        losses.append((loss.item(), grad[0, j].item()))
    # A > 0, ratio 1.5 > 1.28: clipped to 1.28, no gradient; A > 0, ratio 1.1: -ratio, gradient -ratio
    # (d ratio / d logp = ratio);
    # A < 0, ratio 0.5 < 0.8: clipped to 0.8, no gradient; A < 0, ratio 1.5: not clipped (pessimistic), gradient +ratio
    assert losses == [pytest.approx(v) for v in [(-1.28, 0.0), (-1.1, -1.1), (0.8, 0.0), (1.5, 1.5)]]


def test_advantages_for_each_scale_rewards():
    rewards = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2, 0, 0, 0, 3])
    groups = [[1, 0, 0, 1], [2, 2, 2, 2], [0, 0, 0, 3]]
    centred = [r - statistics.mean(g) for g in groups for r in g]
    group_std = [statistics.stdev(g) for g in groups for _ in g]
    expected = {
        "group": [c / (s + 1e-4) for c, s in zip(centred, group_std)],
        "batch": [c / (statistics.stdev(rewards.tolist()) + 1e-4) for c in centred],
        "none": centred,
    }
    for scale, values in expected.items():
        args = SimpleNamespace(advantage_estimator="grpo", scale_rewards=scale)
        advantages, zero_std = group_advantages(rewards, torch.ones(12), 4, args)
        assert advantages.tolist() == pytest.approx(values, abs=1e-6), scale
        assert zero_std.tolist() == [False, True, False]
    # equal rewards give exactly 0, even where the float mean is not exact (3 x 0.1 / 3 != 0.1)
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5], dtype=torch.float64)
    for estimator in ("grpo", "rloo"):
        args = SimpleNamespace(advantage_estimator=estimator, scale_rewards="group")
        advantages, zero_std = group_advantages(rewards, torch.ones(6), 3, args)
        assert advantages[:3].tolist() == [0.0, 0.0, 0.0] and zero_std.tolist() == [True, False], estimator
    # rewards that differ have a spread, however little: the 1e-4 added to the std keeps its advantages as little
    # (copies of one text score alike: test_copies_of_a_text_score_alike_whatever_the_rows_beside_them)
    rewards = torch.tensor([0.75, 0.75, 0.75, 0.75, 0.75, 0.75 + 6e-8, 0.75, 0.75])
    advantages, zero_std = group_advantages(rewards, torch.ones(8), 4, SimpleNamespace(advantage_estimator="grpo",
                                                                                       scale_rewards="group"))
    assert advantages[:4].tolist() == [0.0] * 4 and 0 < advantages[4:].abs().max() < 1e-3
    assert zero_std.tolist() == [True, False]


# ---------------------------------------------------------------------------------------------- DAPO
def test_dynamic_sampling_decides_on_the_outcome_per_group(toy):
    """A group has a spread when its outcomes differ: not with all equal; yes with one odd completion, the whole group
    (rloo's advantages then move every row of it); among its usable rows only (online DPO with
    --mask_truncated_completions: a truncated odd one makes no pair), none with fewer than two. The outcome is the
    verifier's, whatever the reward mix: a group all wrong whose rewards differ by the missing-EOS penalty has none
    (its shaping alone would pass)."""
    outcomes = torch.tensor([1.0, 1, 1, 1, -9.8727, -9.8727, -9.8727, -9.8726, 0, 0, 1, 0, 0.5, 0.5, 0.5, 0.5])
    assert has_spread(outcomes, 4).tolist() == [False, True, True, False]
    usable = torch.tensor([True] * 7 + [False] + [True, False, False, False] + [True] * 4)
    assert has_spread(outcomes, 4, usable).tolist() == [False, False, False, False]
    rloo, _ = group_advantages(outcomes, torch.ones(16), 4, SimpleNamespace(advantage_estimator="rloo"))
    assert rloo.view(4, 4)[[1, 2]].abs().min() > 1e-5 and not rloo.view(4, 4)[[0, 3]].any()
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    right, wrong = (tokenizer(" " + text)["input_ids"] for text in ("12", "21"))
    completions = [wrong + [tokenizer.eos_token_id], wrong, right + [tokenizer.eos_token_id], wrong]
    rollout = {"completion": completions, "answer": ["12"] * 4, "policy_mask": torch.ones(4, 4)}
    args = SimpleNamespace(reward_fn="exact_match", reward_fn_weight=1.0, reward_model_weight=1.0,
                           missing_eos_penalty=0.5, overlong_buffer=None, reward_model_path=None)
    scored = rollout_rewards(rollout, None, tokenizer, args, torch.device("cpu"))
    assert scored["reward"].tolist() == [0.0, -0.5, 1.0, -0.5]
    assert scored["ended"].tolist() == [True, False, True, False]
    assert has_spread(scored["outcome"], 2).tolist() == [False, True]
    assert has_spread(scored["reward"], 2).tolist() == [True, True]


def test_training_rows_by_hand():
    """A rollout's rows to train on, worked by hand. Rejection sampling kept G = 2 of N = 3 candidates of each of 3
    prompts; the groups with a spread come first, in sampling order, then (at the cap) the others; the metrics are
    those of the chosen groups (of all their candidates: candidate_scores). Online DPO pairs each chosen group's best
    and worst completion of those in the loss: with rewards [0, 1, 0, -1 (truncated, masked), ...] the pair is (1, 0),
    not (1, 3), which the mask would drop whole."""
    rewards = torch.tensor([1.0, 0.5, 1, 0, 1, 0.25, 0.5, 1, 0])  # 3 prompts x 3 candidates
    kept = [0, 2, 3, 4, 7, 8]
    spread = has_spread(rewards[kept], 2)
    assert spread.tolist() == [False, True, True]
    args = SimpleNamespace(num_generations=2, num_candidates=3, dynamic_sampling=2, policy_loss="clip")
    everything = torch.ones(9, dtype=torch.bool)
    rows, stats = training_rows(kept, spread, rewards, everything, 2, args)
    assert rows == [3, 4, 7, 8]
    assert stats == {"objective/scores": 0.5, "objective/candidate_scores": pytest.approx(2.75 / 6),
                     "dynamic_sampling/groups_filtered": 1, "dynamic_sampling/groups_short": 0}
    rows, stats = training_rows(kept, spread, rewards, everything, 3, args)  # at the cap: the group without fills
    assert rows == [3, 4, 7, 8, 0, 2] and stats["dynamic_sampling/groups_short"] == 1
    assert stats["objective/scores"] == pytest.approx(4 / 6)
    assert stats["objective/candidate_scores"] == pytest.approx(5.25 / 9)
    rewards = torch.tensor([0.0, 1, 0, -1, 0, 0, 1, 0, 5, 5, 5, 5])  # online DPO, G = N = 4, the third group flat
    usable = torch.tensor([True, True, True, False] + [True] * 8)
    args = SimpleNamespace(num_generations=4, num_candidates=4, dynamic_sampling=1, policy_loss="dpo")
    rows, stats = training_rows(list(range(12)), has_spread(rewards, 4, usable), rewards, usable, 3, args)
    assert rows == [1, 0, 6, 4, 8, 8] and stats == {"objective/scores": pytest.approx(21 / 12)}


def test_copies_of_a_text_score_alike_whatever_the_rows_beside_them(toy):
    """A reward model's score of a text moves with the rows scored beside it: in bf16 by a whole bf16 step (GPUs run
    the reward model in bf16), copies of one completion scored in micro-batches of 3 get -0.0500 and -0.0518. Each
    distinct (prompt, completion) is scored once, so copies tie exactly: a group of them has no spread (no advantage,
    no online DPO pair of one text twice), whatever the order of the rows."""
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    copy = encode(" 1 2 3") + [tokenizer.eos_token_id]
    others = [encode(text) for text in (" 1 2 3 4 5 6 7 8 9", " 3", " 2 1 3 3 3 3 3 3 3 3 3 3", " 9 9")]
    args = SimpleNamespace(reward_fn=None, reward_fn_weight=1.0, missing_eos_penalty=0.0, overlong_buffer=None,
                           reward_model_path="rm", reward_model_weight=1.0, local_rollout_forward_batch_size=3,
                           max_completion_length=16, policy_loss="clip", temperature=1.0, padding_free=True)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(toy / "model", num_labels=1).to(torch.bfloat16).eval()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for order in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 4, 1, 5, 2, 6, 3, 7]):  # 4 copies, then 4 other texts
            completions = [([copy] * 4 + others)[i] for i in order]
            rollout = {"prompt": [encode("sort: 3 1 2 ->")] * 8, "completion": completions, "answer": [None] * 8,
                       "policy_mask": torch.ones(8, max(map(len, completions)))}
            alone = no_grad_pass(rm, rollout, args, scores=True)[:, 0]
            copies = [i for i, c in enumerate(completions) if c == copy]
            assert len(set(alone[copies].tolist())) > 1  # the control: scored row by row they differ
            rewards = rollout_rewards(rollout, rm, tokenizer, args, torch.device("cpu"))["reward"]
            assert len(set(rewards[copies].tolist())) == 1, rewards
        assert has_spread(rewards[copies], 4).tolist() == [False]
    finally:
        dist.destroy_process_group()


def test_dynamic_sampling_reads_the_prompts_in_order_once_an_epoch(toy, sft_model, tmp_path, monkeypatch):
    """Each rollout reads the next batches of prompts in the data's order (global_batch 0, 1, 2, ...), whatever rounds
    it takes: an epoch of 4 batches of 2 prompts reads each of the 8 prompts once, a line says where the next epoch
    begins, and the checkpoint keeps the position. Round r of rollout i once read batch i R + r: some prompts 2-4 times
    an epoch, others never. While a rollout's rounds go on, a line a minute says how far they are (the clock here
    runs 61 s a reading). In this test's process (run_in_process), one process."""
    from toy_task import in_flawed_subset

    rows = [line for line in open(toy / "prompts" / "train.jsonl") if in_flawed_subset(json.loads(line)["prompt"])]
    (tmp_path / "prompts.jsonl").write_text("".join(rows[:8]))  # the SFT model is right on these some of the time
    clock = itertools.count(time.time(), 61)
    monkeypatch.setattr(time, "time", lambda: next(clock))
    flags = ["--per_device_train_batch_size", 8, "--num_generations", 4, "--dynamic_sampling", 3, "--max_steps", 6,
             "--save_every", 6, "--max_completion_length", 8, "--dataset_test_split", "none"]
    error, printed = run_in_process("grpo.py", grpo_args(sft_model[0], tmp_path / "prompts.jsonl", tmp_path / "out",
                                                         *flags))
    assert error is None, printed[-3000:]
    metrics = read_metrics(tmp_path / "out")
    rounds = [int(row["dynamic_sampling/rounds"]) for row in metrics]
    read = [0] + list(itertools.accumulate(rounds))  # batches read before each rollout
    epochs = [f"rollout {i + 1}: epoch {b // 4 + 1} of the prompts begins" for i in range(len(rounds))
              for b in range(read[i], read[i + 1]) if b % 4 == 0 and b > 0]
    assert max(rounds) > 1 and epochs, rounds  # more than one round, and past an epoch of batches
    assert [line for line in printed.splitlines() if "of the prompts begins" in line] == epochs
    going_on = [int(line.split(":")[0].split()[1]) for line in printed.splitlines() if " rounds of up to 3, " in line]
    expected = [i + 1 for i, (n, row) in enumerate(zip(rounds, metrics))
                for _ in range(n - (row["dynamic_sampling/groups_short"] == 0))]
    assert going_on == expected, printed[-3000:]
    state = torch.load(tmp_path / "out" / "checkpoints" / "step_6" / "rank0.pt", weights_only=True)["state"]
    assert state == {"batches": sum(rounds), "entropy_coef": 0.0, "entropy": math.inf}  # no entropy bonus


def test_soft_overlong_punishment_equals_trls(toy):
    """DAPO's Eq. 13 as rollout_rewards adds it, against TRL 1.16's get_soft_overlong_punishment on completions of 1 to
    max + 2 tokens, four (max length, buffer) pairs (tests/reference/variants/reference.json), the factor scaling it.
    The length counts the EOS, as the script's do (sample_rollout) and TRL's trainer's; without it the values differ.
    TRL's length 0 is left out: a completion has a token at least."""
    reference = json.load(open(os.path.join(ROOT, "tests", "reference", "variants", "reference.json")))
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    for case in reference["soft_overlong"]:
        completions = [[5] * (n - 1) + [tokenizer.eos_token_id] for n in case["lengths"][1:]]
        rollout = {"completion": completions, "answer": [None] * len(completions),
                   "length": torch.tensor([len(c) for c in completions]),
                   "policy_mask": torch.ones(len(completions), max(map(len, completions)))}
        for factor in (1.0, 0.5):
            args = SimpleNamespace(reward_fn=None, reward_fn_weight=1.0, missing_eos_penalty=0.0,
                                   reward_model_weight=1.0, reward_model_path=None,
                                   max_completion_length=case["max_completion_len"],
                                   overlong_buffer=case["soft_punish_cache"], overlong_penalty_factor=factor)
            punished = rollout_rewards(rollout, None, tokenizer, args, torch.device("cpu"))["reward"]
            assert punished.tolist() == pytest.approx([factor * r for r in case["rewards"][1:]], abs=1e-6), case
        rollout["length"] -= 1
        without_eos = rollout_rewards(rollout, None, tokenizer, args, torch.device("cpu"))["reward"]
        assert (without_eos - punished).abs().max() > 0.01, case


# ------------------------------------------------------------------------------------ rejection sampling
def rso_distribution(rewards, keep, beta):
    """P(kept set) under RSO's Algorithm 1 (arXiv:2309.06657), the candidates visited in a uniformly random order:
    every order and every accept/reject outcome enumerated. A pass over the candidates left starts from their highest
    reward; it keeps each with probability exp((r - r_max) / beta) until `keep` are kept."""
    found = collections.Counter()

    def visit(left, position, after, kept, p):  # `left` in order; `after`: the rejected of this pass, for the next
        if len(kept) == keep:
            found[frozenset(kept)] += p
        elif position == len(left):
            visit(after, 0, [], kept, p)
        else:
            i, r_max = left[position], max(rewards[j] for j in left)
            accept = math.exp((rewards[i] - r_max) / beta)
            visit(left, position + 1, after, kept + [i], p * accept)
            if accept < 1:
                visit(left, position + 1, after + [i], kept, p * (1 - accept))

    orders = list(itertools.permutations(range(len(rewards))))
    for order in orders:
        visit(list(order), 0, [], [], 1 / len(orders))
    return found


def kept_sets(rewards, keep, beta, draws, seed=0):
    """The kept set of `draws` independent runs of rejection_sample on the same candidates."""
    kept = rejection_sample(torch.tensor([rewards] * draws), keep, beta, torch.Generator().manual_seed(seed))
    n = len(rewards)
    return collections.Counter(frozenset(i % n for i in kept[d * keep : (d + 1) * keep]) for d in range(draws))


def test_rejection_sampling_keeps_sets_as_rso_does():
    """The kept set's distribution equals RSO's, computed by enumeration (5 candidates, keep 2, a tie included), within
    5 standard errors of 20,000 draws; and every draw keeps 2 distinct candidates of its own row."""
    rewards, draws = [1.0, 0.25, 0.0, 0.25, -0.5], 20_000
    for beta in (0.3, 2.0):
        expected, got = rso_distribution(rewards, 2, beta), kept_sets(rewards, 2, beta, draws)
        assert sum(expected.values()) == pytest.approx(1.0) and set(got) <= set(expected)
        for kept, p in expected.items():
            assert abs(got[kept] / draws - p) <= 5 * math.sqrt(p * (1 - p) / draws) + 1e-9, (beta, sorted(kept), p)
    assert rejection_sample(torch.tensor([[0.0, 1, 2], [5, 4, 3]]), 2, 1e-6, torch.Generator()) == [1, 2, 3, 4]


def test_rejection_sampling_temperature_limits_and_ties():
    """beta -> 0 keeps the top G (ties at the top: each tied candidate equally often); a very large beta keeps each
    candidate with probability G / N, every set of G equally often."""
    assert kept_sets([0.3, 0.9, 0.1, 0.7, 0.5], 2, 1e-6, 200) == {frozenset({1, 3}): 200}
    draws = 12_000
    ties = kept_sets([1.0, 0.0, 1.0, 1.0], 2, 1e-6, draws)  # 2 of the 3 tied at the top: 3 sets, 1/3 each
    assert set(ties) == {frozenset({0, 2}), frozenset({0, 3}), frozenset({2, 3})}
    assert all(abs(n / draws - 1 / 3) <= 5 * math.sqrt(2 / 9 / draws) for n in ties.values()), ties
    uniform = kept_sets([3.0, -1.0, 0.5, 2.0], 2, 1e9, draws)  # C(4, 2) = 6 sets, 1/6 each; each candidate 1/2
    assert len(uniform) == 6 and all(abs(n / draws - 1 / 6) <= 5 * math.sqrt(5 / 36 / draws) for n in uniform.values())
    for i in range(4):
        share = sum(n for kept, n in uniform.items() if i in kept) / draws
        assert abs(share - 0.5) <= 5 * math.sqrt(0.25 / draws), (i, share)


def test_window_metrics_per_loss_token_per_completion_and_per_step():
    """Two steps of 8 completions, 20 loss tokens: the ratio statistics and clip fractions per loss token, the KL per
    completion, the rollout's statistics (val/num_eos_tokens among them: completions that ended) per step."""
    sums = {"tokens": 20.0, "processed": 50.0, "objective/kl": 4.0, "val/ratio": 20.0, "val/ratio_squared": 21.0,
            "clip_ratio/low": 2.0, "clip_ratio/high": 1.0, "val/num_eos_tokens": 14.0, "objective/scores": 1.2}
    metrics = window_metrics(sums, 2, 5.0, SimpleNamespace(batch_size=8))
    assert metrics["val/num_eos_tokens"] == 7.0 and metrics["objective/scores"] == 0.6
    assert metrics["val/ratio"] == 1.0 and metrics["val/ratio_var"] == pytest.approx(21 / 20 - 1)
    assert metrics["policy/clipfrac_avg"] == pytest.approx(0.15) and metrics["objective/kl"] == 4.0 / 2 / 8
    assert metrics["tokens_per_second"] == 10.0


# ---------------------------------------------------------------------------------------------- online DPO
def test_online_dpo_pairs_the_best_and_the_worst_first_of_equals():
    """Each group's chosen is its first highest reward, its rejected its first lowest, of the usable completions; a
    group of equal rewards gives a pair with no preference, which main marks (group_advantages over the pair: zero std)
    and the loss leaves out."""
    rewards = torch.tensor([[0.5, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [3.0, -1.0, -1.0, 3.0]])
    kept = best_and_worst(rewards, torch.ones(3, 4, dtype=torch.bool))
    assert kept == [1, 3, 4, 4, 8, 9]
    assert best_and_worst(rewards, torch.tensor([[True, False, True, False]] * 3)) == [2, 0, 4, 4, 8, 10]
    _, no_pair = group_advantages(rewards.flatten()[kept], torch.ones(6), 2, loss_args(advantage_estimator="grpo",
                                                                                       scale_rewards="group"))
    assert no_pair.tolist() == [False, True, False]


def test_online_dpo_loss_and_gradient_equal_trls():
    """grpo.py's DPO loss on pairs of consecutive rows against TRL 1.16's DPOTrainer sigmoid loss and gradient on the
    same log-probs (the reference of tests/test_variants.py, rows [chosen 0, rejected 0, chosen 1, ...]); two pairs
    out of the loss (no preference; a truncated chosen) change neither; chosen and rejected swapped give another."""
    reference = json.load(open(os.path.join(ROOT, "tests", "reference", "variants", "reference.json")))["dpo"]
    inputs, case = reference["inputs"], reference["cases"]["sigmoid"]
    pairs, width = len(inputs["chosen_lengths"]), inputs["width"]
    order = [i + pairs * side for i in range(pairs) for side in (0, 1)]  # TRL's rows: the chosen, then the rejected
    logps = torch.tensor(inputs["per_token_logps"], dtype=torch.float32)[order]
    lengths = torch.tensor(inputs["chosen_lengths"] + inputs["rejected_lengths"])[order]
    ref = torch.zeros_like(logps)
    ref[:, 0] = torch.tensor(inputs["ref_chosen_logps"] + inputs["ref_rejected_logps"])[order]  # sums, in column 0
    mask = (torch.arange(width) < lengths[:, None]).float()
    logps, ref, mask = (torch.cat([t, t[:4]]) for t in (logps, ref, mask))  # two more pairs ...
    mask[-4:-1] = 0  # ... out of the loss: no preference (both rows out), a truncated chosen (one row out)
    logps.requires_grad_(True)
    args = loss_args(policy_loss="dpo", beta=case["beta"])
    loss, _ = online_dpo_loss(logps, ref, mask, loss_normaliser(mask, args), args.beta)
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss_normaliser(mask, args).item() == pairs
    assert abs(loss.item() - case["loss"]) < 1e-6
    assert (grad[:-4] - torch.tensor(case["grad"])[order]).abs().max() < 1e-6 and not grad[-4:].any()
    swapped = [i ^ 1 for i in range(2 * pairs + 4)]
    assert abs(online_dpo_loss(logps[swapped], ref[swapped], mask, pairs, args.beta)[0].item() - case["loss"]) > 0.01


def test_online_dpo_log_probs_at_temperature_1_whatever_the_sampling_one():
    """Sampling at T = 0.5, the reference and old log-probs (no_grad_pass) and the loss's (accumulate_gradients) are
    log_softmax(logits) in online DPO, as in DPO and TRL's OnlineDPOTrainer; GRPO's are log_softmax(logits / T). No
    token counts as clipped in online DPO, whose loss clips nothing (pi / pi_old at e^0.5 on the chosen rows once put
    their 5 of the 9 tokens in clip_ratio/high), while the ratio's own metrics stay."""
    policy, ref_model = tiny_gpt2(), tiny_gpt2()
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    prompts, completions = [[1, 2, 3], [4, 5], [6], [7, 8]], [[9, 10, 11], [12], [13, 14], [15, 16, 17]]
    rollout = {"prompt": prompts, "completion": completions}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = loss_args(policy_loss="dpo", beta=0.1, temperature=0.5, max_completion_length=3, num_iterations=2,
                         world_size=1, local_rollout_forward_batch_size=4, per_device_train_batch_size=4,
                         gradient_accumulation_steps=1, padding_free=True)
        batch = make_batch("cpu", prompts, completions, range(4), args)
        completion_mask = batch["completion_mask"]
        at = {(net, t): completion_logprobs(net, batch, t).detach() for net in (policy, ref_model) for t in (1.0, 0.5)}
        for policy_loss, t in (("dpo", 1.0), ("clip", 0.5)):
            args.policy_loss = policy_loss
            ref_logps, old_logps = no_grad_pass(ref_model, rollout, args), no_grad_pass(policy, rollout, args)
            torch.testing.assert_close(ref_logps * completion_mask, at[ref_model, t] * completion_mask)
            torch.testing.assert_close(old_logps * completion_mask, at[policy, t] * completion_mask)
        args.policy_loss = "dpo"
        rollout |= {"ref_logps": at[ref_model, 1.0], "old_logps": at[policy, 1.0] - 0.5, "loss_mask": completion_mask,
                    "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0])}  # the chosen rows: A > 0
        sums = collections.defaultdict(lambda: torch.zeros(()))
        loss, _ = accumulate_gradients(policy, rollout | {"keep": completion_mask}, [0, 1, 2, 3], (2, 1), args, sums)
        want = online_dpo_loss(at[policy, 1.0], at[ref_model, 1.0], completion_mask, 2, 0.1)[0]
        assert abs(loss.item() - want.item()) < 1e-6
        at_sampling_temperature = online_dpo_loss(at[policy, 0.5], at[ref_model, 0.5], completion_mask, 2, 0.1)[0]
        assert abs(at_sampling_temperature.item() - want.item()) > 1e-4
        chosen = (at[policy, 1.0] * completion_mask).sum(1)[0::2]  # dpo.py's metrics: a mean over the pairs
        assert sums["logps/chosen"].item() == pytest.approx(chosen.mean().item(), rel=1e-5)
        ratio = math.exp(0.5) * completion_mask.sum()  # summed over the loss tokens
        assert sums["clip_ratio/high"] == 0 and sums["clip_ratio/low"] == 0
        assert sums["val/ratio"].item() == pytest.approx(ratio.item(), rel=1e-5)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- verifiers
def test_verifiers_on_every_gsm8k_solution():
    """All 1,319 real solutions: each scores 1 against itself and against its bare final number (gsm8k), its final
    number read by an independent split on '####' (thousands separators and signs included), and a wrong final
    number scores 0."""
    rows = [json.loads(line) for line in open(GSM8K)]
    assert len(rows) == 1319
    finals = [row["answer"].split("####")[1].strip().replace(",", "") for row in rows]
    assert (
        sum("," in row["answer"].split("####")[1] for row in rows) == 14 and sum(f.startswith("-") for f in finals) == 2
    )
    for row, final in zip(rows, finals):
        solution = row["answer"]
        assert parse_answer(solution, "gsm8k") == Decimal(final) == parse_answer(solution, "last_number")
        assert verifier_reward(solution, solution, "gsm8k") == 1.0
        assert verifier_reward(solution, final, "gsm8k") == 1.0
        assert verifier_reward(f"So the answer is {final}.", solution, "last_number") == 1.0
        wrong = solution.rsplit("####", 1)[0] + f"#### {Decimal(final) + 1}"
        assert (
            verifier_reward(wrong, solution, "gsm8k") == 0.0 and verifier_reward(wrong, solution, "last_number") == 0.0
        )


def test_verifiers_by_hand():
    assert verifier_reward(" 11345", "11345", "exact_match") == 1.0
    assert verifier_reward(" 113455", "11345", "exact_match") == 0.0
    assert verifier_reward("it costs $1,234.50 in total", "1234.5", "last_number") == 1.0
    assert verifier_reward("3, 4, 5", "5", "last_number") == 1.0  # a list, not the number 3,4
    assert verifier_reward("the result is -7", "-7", "last_number") == 1.0
    assert verifier_reward("no number here", "0", "last_number") == 0.0
    assert verifier_reward("#### 0", "0", "gsm8k") == 1.0  # 0 is a number, not a missing one
    assert verifier_reward("The answer is 18", "18", "gsm8k") == 0.0  # gsm8k wants the '#### N' form
    assert verifier_reward("#### $1,000", "1000", "gsm8k") == 1.0
    # no right boundary once: 1,2345 read as 1,234; 12,34 and 3/4 as 12 and 3; "costs 1,2345" as 5. A malformed
    # thousands group, a fraction or a run of dots is no number at all now
    for completion, answer in [
        ("#### 1,2345", "1234"),
        ("#### 12,34", "12"),
        ("#### 3/4", "3"),
        ("#### 12.5.6", "12.5"),
    ]:
        assert verifier_reward(completion, answer, "gsm8k") == 0.0, completion
    assert parse_answer("it costs 1,2345", "last_number") is None and parse_answer("3/4 of 8", "last_number") == 8
    assert verifier_reward("#### -1,234.50", "-1234.5", "gsm8k") == 1.0  # sign, thousands and decimals together
    assert verifier_reward("#### 7 ... #### 9", "7", "gsm8k") == 1.0  # several: the first '####' counts
    assert verifier_reward("so 12. Done", "12", "last_number") == 1.0  # a full stop is not a decimal point


# ---------------------------------------------------------------------------------------------- generation
def test_completion_logprobs_entropy():
    """Entropies and log-probs from logits / T of each sequence alone; 0 past a completion's end."""
    model = tiny_gpt2()
    prompts, completions = [[1, 2, 3, 4], [5]], [[6, 7, 8], [9]]
    batch = make_batch("cpu", prompts, completions, range(2), SimpleNamespace(padding_free=True))
    with torch.no_grad():
        logps, entropy = completion_logprobs(model, batch, temperature=0.7, with_entropy=True)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            log_p = torch.log_softmax(model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / 0.7, -1)
            torch.testing.assert_close(entropy[row, : len(c)], -(log_p.exp() * log_p).sum(-1))
            torch.testing.assert_close(logps[row, : len(c)], log_p.gather(-1, torch.tensor(c)[:, None])[:, 0])
    assert logps[1, 1:].tolist() == [0.0, 0.0] and entropy[1, 1:].tolist() == [0.0, 0.0]


def test_generation_samples_from_logits_over_temperature(toy, tmp_path):
    """The model folder's generation_config.json asks for top_k 1, top_p 0.5, repetition_penalty 3 and at least 5
    new tokens (HF generate fills every unset option from it, and defaults to top_k 50): the distribution sampled
    from must still be softmax(logits / temperature), the one log-probs are computed from."""
    folder = tmp_path / "model"
    shutil.copytree(toy / "model", folder)
    GenerationConfig(top_k=1, top_p=0.5, repetition_penalty=3.0, min_new_tokens=5, do_sample=True).save_pretrained(
        folder
    )
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[70, 71, 72], [73, 74]]
    original_generate, seen = model.generate, {}

    def spy(**kwargs):  # the same call, also returning the raw and the processed logits of every step
        out = original_generate(**kwargs, output_scores=True, output_logits=True, return_dict_in_generate=True)
        seen.update(scores=torch.stack(out.scores, 1), logits=torch.stack(out.logits, 1))
        return out.sequences

    model.generate = spy
    torch.manual_seed(0)
    completions = generate_completions(model, prompts, 6, 0.7, eos_token_id=1, pad_token_id=0)
    torch.testing.assert_close(seen["scores"], seen["logits"] / 0.7)
    assert len(completions) == 2 and model.generation_config.top_k == 1  # the folder's config is back in place
    # control: HF generate with the folder's defaults samples from another distribution
    out = original_generate(
        input_ids=torch.tensor([[70, 71, 72]]),
        do_sample=True,
        temperature=0.7,
        max_new_tokens=6,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert not torch.allclose(torch.stack(out.scores, 1), torch.stack(out.logits, 1) / 0.7)


def test_generation_left_padding_and_eos():
    """Greedy completions of left-padded prompts equal those of each prompt alone (absolute positions: GPT-2), and
    each completion is cut after its first EOS."""
    model = tiny_gpt2()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    alone = [generate_completions(model, [p], 8, None, eos_token_id=49, pad_token_id=0)[0] for p in prompts]
    assert generate_completions(model, prompts, 8, None, eos_token_id=49, pad_token_id=0) == alone
    assert all(len(c) == 8 for c in alone)  # 49 never comes: truncated, nothing cut
    eos = alone[2][-1]  # make the last token of the third completion the EOS
    cut = generate_completions(model, prompts, 8, None, eos_token_id=eos, pad_token_id=0)
    for completion, full in zip(cut, alone):
        assert completion == (full[: full.index(eos) + 1] if eos in full else full)
    assert 1 < len(cut[2]) < 8 and any(len(c) == 8 for c in cut)  # cut after the first EOS, not the last; others whole


def test_generation_runs_without_fsdp_hooks_and_matches_the_plain_model(toy):
    """Inside `unsharded`, FSDP2's forward hooks are set aside (everything is gathered: they have nothing to do, and
    on a GPU they cost a third of a GRPO step); the FSDP model then generates what the same model without FSDP
    generates, greedy and sampled with one seed, and afterwards the very same hooks are back."""
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain = AutoModelForCausalLM.from_pretrained(toy / "model").eval()
        args = SimpleNamespace(bf16=False, cpu_offload=False, reshard_after_forward=True, shard_degree=-1,
                               gradient_checkpointing=False)
        mesh = dist.init_device_mesh("cpu", (1,))
        model = shard_model(AutoModelForCausalLM.from_pretrained(toy / "model"), args, mesh)
        fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        hooks = [(list(m._forward_pre_hooks.values()), list(m._forward_hooks.values())) for m in fsdp_modules]
        assert all(pre and post for pre, post in hooks)
        prompts = [[70, 71, 72], [73]]
        outputs = {}
        for name, net in (("fsdp", model), ("plain", plain)):
            with unsharded(model) if name == "fsdp" else contextlib.nullcontext():
                if name == "fsdp":
                    assert not any(m._forward_pre_hooks or m._forward_hooks for m in fsdp_modules)
                torch.manual_seed(3)
                outputs[name] = [
                    generate_completions(net, prompts, 8, t, eos_token_id=-1, pad_token_id=0) for t in (None, 1.0)
                ]
        assert outputs["fsdp"] == outputs["plain"]
        assert [(list(m._forward_pre_hooks.values()), list(m._forward_hooks.values())) for m in fsdp_modules] == hooks
    finally:
        dist.destroy_process_group()


def test_static_cache_generates_what_the_dynamic_one_does(toy):
    """--cache_implementation static reaches generate (and the prompts are padded to a multiple of 64 tokens, one
    compiled step for many widths); the greedy completions are those of the default dynamic cache."""
    model = AutoModelForCausalLM.from_pretrained(toy / "model").eval()
    seen, original = [], model.generate

    def spy(**kwargs):
        seen.append((kwargs["generation_config"].cache_implementation, kwargs["input_ids"].shape[1]))
        return original(**kwargs)

    model.generate = spy
    prompts = [[70 + i for i in range(n)] for n in (3, 9, 5)]
    dynamic = generate_completions(model, prompts, 10, None, eos_token_id=-1, pad_token_id=0)
    static = generate_completions(model, prompts, 10, None, eos_token_id=-1, pad_token_id=0, cache="static")
    assert seen == [(None, 9), ("static", 64)]
    assert static == dynamic and all(len(c) == 10 for c in static)


def test_generation_gathers_parameters_once(toy):
    """Inside `unsharded`, generating 8 tokens twice unshards each FSDP module once; without it, each layer once per
    forward (control). The parameters are sharded again afterwards, and training works. With keep
    (--no-reshard_after_forward, layers sharded with reshard_after_forward=False) they stay gathered after the block:
    the training forward and backward gather nothing, and the backward leaves the layers sharded."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    original, gathers = FSDPParamGroup.unshard, []

    def counting_unshard(self, async_op=False):
        if not self.is_unsharded and self._all_gather_result is None:
            gathers.append(self)
        return original(self, async_op)

    try:
        FSDPParamGroup.unshard = counting_unshard
        for keep in (False, True):
            args = SimpleNamespace(
                bf16=False, cpu_offload=False, reshard_after_forward=not keep, gradient_checkpointing=False,
                shard_degree=-1,
            )
            mesh = dist.init_device_mesh("cpu", (1,))
            model = shard_model(AutoModelForCausalLM.from_pretrained(toy / "model"), args, mesh)
            num_groups = 1 + model.config.num_hidden_layers
            generate = lambda: generate_completions(
                model, [[70, 71, 72], [73]], 8, 1.0, eos_token_id=-1, pad_token_id=0
            )
            gathers.clear()
            with unsharded(model, keep=keep):
                assert not any(isinstance(p, DTensor) for p in model.parameters())
                completions = generate() + generate()
            assert [len(c) for c in completions] == [8] * 4 and len(gathers) == num_groups
            sharded = [isinstance(p, DTensor) for p in model.parameters()]
            assert not any(sharded) if keep else all(sharded)
            gathers.clear()
            ids = torch.tensor([[70, 71, 72, 73]])
            if keep:  # training right after the block: nothing gathered again; the backward frees the layers
                model(input_ids=ids, labels=ids).loss.backward()
                assert gathers == [] and all(p.grad is not None for p in model.parameters())
                assert all(isinstance(p, DTensor) for name, p in model.named_parameters() if ".layers." in name)
                continue
            generate()
            assert (
                len(gathers) == 1 + (num_groups - 1) * 8
            )  # control: each layer once per forward (FSDP2 keeps the root's)
            # training still works after the block: a forward and backward with gradients on every parameter
            model(input_ids=ids, labels=ids).loss.backward()
            assert all(p.grad is not None for p in model.parameters())
    finally:
        FSDPParamGroup.unshard = original
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- tool calls
def slow_tool(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def undocumented_tool(x: int) -> int:
    return x


def scripted_rollout(toy, monkeypatch, turns, tools, **kw):
    """grpo.sample_rollout on one prompt in this process, generate_completions answering each call with the next of
    `turns` (texts, cut at its max_new_tokens); returns the rollout, the token ids of a text, and each call's (prompts,
    max_new_tokens)."""
    import grpo

    tok, calls, left = AutoTokenizer.from_pretrained(toy / "model"), [], list(turns)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]

    def generate(model, prompts, max_new_tokens, *rest):
        calls.append((prompts, max_new_tokens))
        return [ids(left.pop(0))[:max_new_tokens] for _ in prompts]

    monkeypatch.setattr(grpo, "generate_completions", generate)
    args = grpo.Args(world_size=1, tools=list(tools), **{"max_completion_length": 200, "tool_timeout": 1.0, **kw})
    prompt = ids(tok.apply_chat_template([{"role": "user", "content": "sum: 2 3 ->"}], tools=list(tools.values()),
                                         tokenize=False, add_generation_prompt=True))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    alarm = signal.signal(signal.SIGALRM, grpo.tool_timed_out)
    try:
        return grpo.sample_rollout(torch.nn.Linear(1, 1), [prompt], 0, args, tok, 0, tools), ids, calls, prompt
    finally:
        signal.signal(signal.SIGALRM, alarm)
        dist.destroy_process_group()


def test_a_rollout_with_tool_calls_by_hand(toy, monkeypatch):
    """A crafted completion: a call, a turn of two calls that both fail (an exception, an unknown tool), the answer.
    Its tokens and mask (1: the policy's, 0: the tools' results as the toy template writes them) written by hand; 3
    calls, 2 failures; each turn sampled after what came before it, within what is left of --max_completion_length.
    --max_tool_calls 1 ends it after the second turn (its calls not run); a result that passes the length is cut
    there and the completion ends truncated."""
    from grpo import calculator

    turns = ['[calculator(expression="2+3")]<|eos|>', ' hm[calculator(expression="1/0"), nope(x=1)]<|eos|>',
             " 5<|eos|>"]
    results = ["<|system|>5<|assistant|>", "<|system|>error: ZeroDivisionError('division by zero')<|system|>error: "
               "KeyError('nope')<|assistant|>"]
    pieces = [(turns[0], 1), (results[0], 0), (turns[1], 1), (results[1], 0), (turns[2], 1)]
    rollout, ids, calls, prompt = scripted_rollout(toy, monkeypatch, turns, {"calculator": calculator})
    completion = [t for text, _ in pieces for t in ids(text)]
    mask = [m for text, m in pieces for _ in ids(text)]
    assert rollout["completion"] == [completion] and rollout["length"].tolist() == [len(completion)]
    assert rollout["policy_mask"][0].tolist() == mask + [0] * (200 - len(mask))
    assert rollout["tool_calls"].tolist() == [[3, 2]]
    seen = [ids(turns[0] + results[0]), ids(turns[0] + results[0] + turns[1] + results[1])]
    assert calls == [([prompt], 200)] + [([prompt + part], 200 - len(part)) for part in seen]

    # the verifier reads the last turn: " 5" is right; " done" is not, though the tool's 5 is the text's last number
    args = SimpleNamespace(reward_fn="last_number", reward_fn_weight=1.0, reward_model_weight=1.0,
                           missing_eos_penalty=0.0, overlong_buffer=None, reward_model_path=None)
    tok = AutoTokenizer.from_pretrained(toy / "model")
    done, *_ = scripted_rollout(toy, monkeypatch, [turns[0], " done<|eos|>"], {"calculator": calculator})
    assert [rollout_rewards(r | {"answer": ["5"]}, None, tok, args, "cpu")["reward"].item() for r in (rollout, done)
            ] == [1.0, 0.0]

    rollout, *_ = scripted_rollout(toy, monkeypatch, turns[:2], {"calculator": calculator}, max_tool_calls=1)
    assert rollout["completion"] == [ids(turns[0] + results[0] + turns[1])]
    assert rollout["tool_calls"].tolist() == [[1, 0]]

    width = len(ids(turns[0])) + 2  # room for 2 of the result's 3 tokens
    rollout, *_ = scripted_rollout(toy, monkeypatch, turns[:1], {"calculator": calculator}, max_completion_length=width)
    assert rollout["completion"] == [ids(turns[0]) + ids(results[0])[:2]] and rollout["length"].tolist() == [width]
    assert rollout["policy_mask"][0].tolist() == [1] * (width - 2) + [0, 0]


def test_the_loss_of_a_rollout_with_tools_is_the_policys_tokens_alone(toy, monkeypatch):
    """The crafted rollout above trained on as main does (its policy mask the loss mask), beta 0.04 against a made-up
    reference: loss and gradient equal those computed by hand over the policy's tokens alone, each scored by a plain
    forward of the whole sequence (the tools' results in its context)."""
    import grpo

    turns = ['[calculator(expression="2+3")]<|eos|>', " 5<|eos|>"]
    rollout, _, _, prompt = scripted_rollout(toy, monkeypatch, turns, {"calculator": grpo.calculator})
    completion, mask = rollout["completion"][0], rollout["policy_mask"].float()
    model = AutoModelForCausalLM.from_pretrained(toy / "model")
    ref = -torch.rand(1, 200, generator=torch.Generator().manual_seed(0))
    args = grpo.Args(world_size=1, beta=0.04, max_completion_length=200, per_device_train_batch_size=1,
                     epsilon_high=0.2)
    data = {"prompt": [prompt], "completion": [completion], "loss_mask": mask, "advantages": torch.tensor([0.7]),
            "old_logps": None, "ref_logps": ref, "keep": mask}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sums = collections.defaultdict(lambda: torch.zeros(()))
        loss, _ = accumulate_gradients(model, data, [0], (loss_normaliser(mask, args), mask.sum()), args, sums)
    finally:
        dist.destroy_process_group()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    logps = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    policy, d = mask[0, : len(completion)].bool(), logps - ref[0, : len(completion)]
    per_token = -0.7 * torch.exp(logps - logps.detach()) + 0.04 * (torch.exp(-d) - 1 + d)
    by_hand = per_token[policy].sum() / policy.sum()
    by_hand.backward()
    assert 0 < policy.sum() < len(completion) and sums["tokens"] == policy.sum()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    for name, p in model.named_parameters():
        scale = p.grad.abs().max()
        assert (grads[name] - p.grad).abs().max() <= 1e-5 * scale, (name, (grads[name] - p.grad).abs().max(), scale)


def test_a_tool_that_fails_is_the_models_problem(toy, monkeypatch):
    """A malformed call and a call past --tool_timeout: each an error message the model reads, counted as a failure;
    the rollout goes on."""
    from grpo import calculator

    turns = ["[calculator(expression=)]<|eos|>", "[slow_tool(seconds=30)]<|eos|>", " 0<|eos|>"]
    start = time.time()
    rollout, ids, *_ = scripted_rollout(toy, monkeypatch, turns, {"calculator": calculator, "slow_tool": slow_tool},
                                        tool_timeout=0.3)
    assert time.time() - start < 10 and rollout["tool_calls"].tolist() == [[2, 2]]
    tok = AutoTokenizer.from_pretrained(toy / "model")
    text = tok.decode(rollout["completion"][0])
    assert "<|system|>error: python-call-list: expected a string" in text
    assert "<|system|>error: TimeoutError('past --tool_timeout')<|assistant|> 0<|eos|>" in text
    assert calculator("(23 + 7) * 2 / 4") == "15.0"
    for unsafe in ("9**9**9", "__import__('os')", "'a' * 3"):  # no power to hang on, no names, no strings
        with pytest.raises(ValueError, match="is not arithmetic"):
            calculator(unsafe)


# ---------------------------------------------------------------------------------------------- data
def test_tokenize_prompts_formats_and_drops(toy):
    """Standard and conversational prompts (rendered with the chat template and its generation prompt); empty and
    over-long prompts dropped and counted; the answer column kept alongside."""
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    messages = [{"role": "user", "content": "sort: 21 ->"}]
    dataset = Dataset.from_dict(
        {"prompt": ["sort: 21 ->", "", "sort: " + "9" * 40 + " ->"], "answer": ["12", "x", "y"]}
    )
    args = SimpleNamespace(
        max_prompt_length=20, dataset_name="d", reward_fn="exact_match", prompt_column="prompt", answer_column="answer"
    )
    data, dropped = tokenize_prompts(dataset, tokenizer, args)
    assert data == {"prompt": [tokenizer("sort: 21 ->")["input_ids"]], "answer": ["12"]}
    assert dropped == {"empty prompt": 1, "prompt too long": 1}
    conversational = Dataset.from_list([{"prompt": messages, "answer": "12"}, {"prompt": [], "answer": "x"}])
    data, dropped = tokenize_prompts(conversational, tokenizer, args)
    assert tokenizer.decode(data["prompt"][0]) == "<|user|>sort: 21 -><|assistant|>"
    assert len(data["prompt"]) == 1 and dropped["empty prompt"] == 1  # no messages: no conversation to render


def test_gsm8k_rows_become_prompts_with_the_readme_mapping(toy):
    """The README's mapping of GSM8K rows (question, answer) to conversational prompts, on the real test split."""
    import datasets

    gsm8k = datasets.load_dataset("json", data_files=GSM8K, split="train")
    prompts = gsm8k.map(
        lambda r: {"prompt": [{"role": "user", "content": r["question"] + "\nGive the final answer after '####'."}]}
    )
    data, dropped = tokenize_prompts(
        prompts,
        AutoTokenizer.from_pretrained(toy / "model"),
        SimpleNamespace(
            max_prompt_length=2048, dataset_name="g", reward_fn="gsm8k", prompt_column="prompt", answer_column="answer"
        ),
    )
    assert len(data["prompt"]) == 1319 and dropped == {"empty prompt": 0, "prompt too long": 0}
    assert all(verifier_reward(answer, answer, "gsm8k") == 1.0 for answer in data["answer"])


# ---------------------------------------------------------------------------------------------- the script itself
def grpo_args(model, data, out, *extra):
    return [
        "--model_name_or_path",
        model,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--max_completion_length",
        12,
        "--per_device_train_batch_size",
        16,
        "--num_generations",
        8,
        "--log_every",
        1,
        *extra,
    ]


def test_bad_input(toy, tmp_path):
    """In the test process (conftest.run_in_process): each stops before any model is loaded. test_reliability.py covers
    what every script shares (formats, columns, dropped rows, tokenizer, model folders, reward model, batch sizes)."""
    (tmp_path / "no_answer.jsonl").write_text('{"prompt": "sort: 21 ->"}\n')
    for data, extra, message in [
        (tmp_path / "no_answer.jsonl", [], "and an 'answer' column (--prompt_column, --answer_column)"),
        (toy / "prompts", ["--num_generations", 3], "--num_generations 3 does not divide a rollout's 16 completions "
         "(1 processes x --per_device_train_batch_size x --gradient_accumulation_steps x --num_mini_batches)"),
        (toy / "prompts", ["--num_generations", 1], "--num_generations 1: must be at least 2"),
        (toy / "prompts", ["--reward_fn", "None"], "no reward"),
        # the mistakes of rejection sampling, by name
        (toy / "prompts", ["--num_candidates", 0], "--num_candidates 0: must be at least 1"),
        (toy / "prompts", ["--num_candidates", 16, "--rejection_sampling_beta", -1], "beta -1.0: must be above 0"),
        (toy / "prompts", ["--num_candidates", 16, "--rejection_sampling_beta", "nan"], "beta nan: not a number"),
        (toy / "prompts", ["--num_candidates", 4], "--num_candidates 4, --num_generations 8: rejection sampling needs"),
        (toy / "prompts", ["--num_candidates", 16], "needs --num_candidates above G and --rejection_sampling_beta"),
        (toy / "prompts", ["--rejection_sampling_beta", 1], "rejection sampling needs --num_candidates above G"),
        # online DPO: DPO's beta, micro-batches of whole pairs, and none of GRPO's flags (each was once ignored)
        (toy / "prompts", ["--policy_loss", "dpo", "--beta", 0], "--policy_loss dpo needs --beta above 0"),
        (toy / "prompts", ["--policy_loss", "dpo", "--per_device_train_batch_size", 3],
         "--policy_loss dpo needs an even --per_device_train_batch_size (whole pairs), not 3"),
        (toy / "prompts", ["--policy_loss", "dpo", "--loss_type", "sequence", "--epsilon", 0.3, "--epsilon_high", 0.28],
         "--policy_loss dpo needs none of GRPO's flags, not ['--epsilon', '--epsilon_high', '--loss_type']"),
        (toy / "prompts", ["--policy_loss", "dpo", "--advantage_estimator", "rloo", "--scale_rewards", "none",
                           "--importance_sampling_level", "sequence", "--kl_estimator", "k1", "--beta", 0],
         "needs --beta above 0, not 0.0; none of GRPO's flags, not ['--advantage_estimator', '--scale_rewards', "
         "'--importance_sampling_level', '--kl_estimator']"),
        # DAPO's: at least one round; a punishment over 1 token at least, its factor not alone (it would do nothing)
        (toy / "prompts", ["--dynamic_sampling", 0], "--dynamic_sampling 0: must be at least 1"),
        (toy / "prompts", ["--overlong_buffer", 0], "--overlong_buffer 0: must be at least 1"),
        (toy / "prompts", ["--overlong_buffer", 4, "--overlong_penalty_factor", -1], "factor -1.0: must be 0 or more"),
        (toy / "prompts", ["--overlong_penalty_factor", 0.5], "--overlong_penalty_factor 0.5 does nothing without "
         "--overlong_buffer (the punishment's tokens)"),
        (toy / "prompts", ["--overlong_penalty_factor", 1], "--overlong_penalty_factor 1.0 does nothing without "
         "--overlong_buffer"),
        (toy / "prompts", ["--overlong_buffer", 13], "--overlong_buffer 13: at most --max_completion_length 12 (a "
         "longer one punishes every completion)"),
        # rewards are float32: a weight or penalty past its range (or NaN) would make them non-finite after sampling
        (toy / "prompts", ["--overlong_buffer", 4, "--overlong_penalty_factor", "inf"],
         "--overlong_penalty_factor inf: must be 0 or more, finite in float32 (the rewards')"),
        (toy / "prompts", ["--missing_eos_penalty", 1e308], "--missing_eos_penalty 1e+308: must be 0 or more, finite"),
        (toy / "prompts", ["--reward_fn_weight", "nan"], "--reward_fn_weight nan: not a number finite in float32"),
        (toy / "prompts", ["--reward_model_weight", "-inf"], "--reward_model_weight -inf: must be finite in float32"),
        # TRL's techniques: a flag that would do nothing where it is given, or a value out of its range
        (toy / "prompts", ["--advantage_estimator", "rloo", "--scale_rewards", "none"],
         "--scale_rewards none does nothing without --advantage_estimator grpo"),
        (toy / "prompts", ["--multi_objective_aggregation", "normalize_then_sum", "--scale_rewards", "batch"],
         "--scale_rewards batch does nothing without --advantage_estimator grpo, --multi_objective_aggregation "
         "sum_then_normalize"),
        (toy / "prompts", ["--multi_objective_aggregation", "normalize_then_sum", "--advantage_estimator", "rloo"],
         "--multi_objective_aggregation normalize_then_sum does nothing without --advantage_estimator grpo"),
        (toy / "prompts", ["--policy_loss", "cispo", "--epsilon", 3, "--epsilon_high", 4], "--epsilon 3.0 does "
         "nothing without --policy_loss clip, or cispo without --epsilon_high"),
        (toy / "prompts", ["--policy_loss", "vespo", "--vespo_k", "nan", 1], "--vespo_k (nan, 1.0): must be two "
         "finite numbers"),
        (toy / "prompts", ["--ref_model_sync_steps", 10, "--beta", 0],
         "--ref_model_sync_steps 10 does nothing without --beta above 0 (a reference)"),
        (toy / "prompts", ["--ref_model_mixup_alpha", 0.5], "--ref_model_mixup_alpha 0.5 does nothing without "
         "--ref_model_sync_steps"),
        (toy / "prompts", ["--ref_model_sync_steps", 10, "--ref_model_mixup_alpha", 2], "alpha 2.0: must be in [0, 1]"),
        (toy / "prompts", ["--delta", 2, "--policy_loss", "cispo"], "--delta 2.0 does nothing without --policy_loss "
         "clip"),
        (toy / "prompts", ["--policy_loss", "sapo", "--epsilon_high", 0.28], "--epsilon_high 0.28 does nothing "
         "without --policy_loss clip or cispo"),
        (toy / "prompts", ["--sapo_temperature", 2, 1], "--sapo_temperature (2.0, 1.0) does nothing without "
         "--policy_loss sapo"),
        (toy / "prompts", ["--policy_loss", "sapo", "--sapo_temperature", 0, 1], "--sapo_temperature (0.0, 1.0): "
         "must be two finite numbers above 0"),
        (toy / "prompts", ["--vespo_k", 1, 2], "--vespo_k (1.0, 2.0) does nothing without --policy_loss vespo"),
        (toy / "prompts", ["--policy_loss", "vespo", "--importance_sampling_level", "sequence"],
         "--importance_sampling_level sequence does nothing without a --policy_loss but vespo"),
        (toy / "prompts", ["--use_bias_correction_kl", "--beta", 0], "--use_bias_correction_kl True does nothing "
         "without --beta above 0, a --kl_estimator but k1_ratio"),
        (toy / "prompts", ["--use_bias_correction_kl", "--kl_estimator", "k1_ratio"], "a --kl_estimator but k1_ratio"),
        (toy / "prompts", ["--off_policy_mask_threshold", 0.5], "--off_policy_mask_threshold 0.5 does nothing without "
         "--num_iterations above 1 (else pi_old is pi)"),
        (toy / "prompts", ["--top_entropy_quantile", 1.5], "--top_entropy_quantile 1.5: must be in [0, 1]"),
        (toy / "prompts", ["--entropy_target", 1], "--entropy_target 1.0 does nothing without --use_adaptive_entropy"),
        (toy / "prompts", ["--use_adaptive_entropy", "--entropy_coef_range", 0.5, 0.1],
         "--entropy_coef_range (0.5, 0.1): must be 0 <= min <= max"),
        (toy / "prompts", ["--policy_loss", "dpo", "--top_entropy_quantile", 0.2, "--entropy_coef", 0.01],
         "none of GRPO's flags, not ['--top_entropy_quantile', '--entropy_coef']"),
    ]:
        error, _ = run_in_process("grpo.py", grpo_args(toy / "model", data, tmp_path / "out", *extra))
        assert isinstance(error, ValueError) and message in str(error), (message, repr(error))
    # tools: a module, a function, a docstring, prompts as messages, a template that writes and parses tool calls
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"prompt": [{"role": "user", "content": "sum: 2 3 ->"}], "answer": "5"}) + "\n")
    shutil.copytree(toy / "model", tmp_path / "no_parser")
    config = json.loads((tmp_path / "no_parser" / "tokenizer_config.json").read_text())
    config.pop("response_template")
    (tmp_path / "no_parser" / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copytree(toy / "model", tmp_path / "no_tool_turns")  # a template that writes no calls nor tool messages
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
    tokenizer.save_pretrained(tmp_path / "no_tool_turns")
    for model, data, extra, message in [
        (toy / "model", messages, ["--max_tool_calls", 2], "--max_tool_calls 2 does nothing without --tools"),
        (toy / "model", messages, ["--tool_timeout", 5], "--tool_timeout 5.0 does nothing without --tools"),
        (toy / "model", messages, ["--tools", "calculater"], "--tools calculater: not in grpo.py's TOOLS "
         "['calculator'], nor module.function importable beside grpo.py or on PYTHONPATH"),
        (toy / "model", messages, ["--tools", "no_such_module.f"], "No module named 'no_such_module'"),
        (toy / "model", messages, ["--tools", "os.sep"], "--tools os.sep: not a Python function (def), or a second"),
        (toy / "model", messages, ["--tools", "calculator", "calculator"], "--tools calculator: not a Python function "
         "(def), or a second tool of that name"),
        (toy / "model", messages, ["--tools", "test_grpo.undocumented_tool"], "--tools test_grpo.undocumented_tool: "
         "Cannot generate JSON schema for undocumented_tool because it has no docstring! (its docstring is its "
         "schema)"),
        (toy / "model", toy / "prompts", ["--tools", "calculator"], "--tools: the prompts of"),
        (tmp_path / "no_parser", messages, ["--tools", "calculator", "--max_tool_calls", 1, "--tool_timeout", 2],
         "does not read back the tool calls its chat template writes (set a response_template in its "
         "tokenizer_config.json), or the template writes no tool result after a turn that ends with EOS"),
        (tmp_path / "no_tool_turns", messages, ["--tools", "calculator"], "does not read back the tool calls"),
    ]:
        error, _ = run_in_process("grpo.py", grpo_args(model, data, tmp_path / "out", *extra))
        assert isinstance(error, ValueError) and message in str(error), (message, repr(error))


def test_missing_eos_penalty_and_truncated_completions(toy, sft_model, tmp_path):
    """max_completion_length 6 leaves room for the answers of up to 4 digits (space, digits, EOS): the others are
    truncated. The same first rollout with --missing_eos_penalty 1 scores lower by exactly the truncated fraction;
    with DAPO's punishment over all 6 tokens at factor 0.5, by exactly 0.5 x the mean length (EOS counted) / 6.
    With 2 tokens every completion is truncated: --mask_truncated_completions leaves no token in the loss, so the
    loss is 0 and the weights do not move."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(open(toy / "prompts" / "train.jsonl").readlines()[:64]))
    variants = {
        "plain": ["--max_completion_length", 6],
        "penalty": ["--max_completion_length", 6, "--missing_eos_penalty", 1.0],
        "punished": ["--max_completion_length", 6, "--overlong_buffer", 6, "--overlong_penalty_factor", 0.5],
        "masked": ["--max_completion_length", 2, "--mask_truncated_completions", "--beta", 0.0],
    }
    launches = [
        (
            "grpo.py",
            grpo_args(sft_model[0], data, tmp_path / name, "--max_steps", 1, "--learning_rate", 1e-3, *extra),
            1,
        )
        for name, extra in variants.items()
    ]
    for result in run_scripts(launches):  # all at once
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    runs = {name: read_metrics(tmp_path / name)[0] for name in variants}
    plain, penalty, masked = runs["plain"], runs["penalty"], runs["masked"]
    truncated = plain["completions/clipped_ratio"]
    assert 0 < truncated < 1 and penalty["completions/clipped_ratio"] == truncated
    assert penalty["objective/scores"] == pytest.approx(plain["objective/scores"] - truncated)
    length, punished = plain["completions/mean_length"], runs["punished"]
    assert punished["completions/mean_length"] == length > 0  # the same completions
    assert punished["objective/scores"] == pytest.approx(plain["objective/scores"] - 0.5 * length / 6)
    assert masked["completions/clipped_ratio"] == 1.0 and masked["val/num_eos_tokens"] == 0 and masked["loss"] == 0.0
    before, after = load_file(sft_model[0] / "model.safetensors"), load_file(tmp_path / "masked" / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in after)


def test_conversational_prompts_gradient_checkpointing_and_tracking(toy, sft_model, tmp_path):
    """Prompts as message lists, --gradient_checkpointing (generation must still run in eval mode, with its KV cache)
    and --track (wandb offline, with the sample table) on one run."""
    rows = [json.loads(line) for line in open(toy / "prompts" / "train.jsonl")][:32]
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}) + "\n"
            for r in rows
        )
    )
    result = run_script(
        "grpo.py",
        grpo_args(sft_model[0], data, tmp_path / "out", "--max_steps", 2, "--gradient_checkpointing", "--track"),
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    assert (
        "'<|user|>sort: " in result.stdout and "<|assistant|>' -> " in result.stdout
    )  # the chat template in the sample table
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")) and len(read_metrics(tmp_path / "out")) == 2


def test_reward_model_scores(toy, tmp_path):
    """A reward model folder whose head is zero and whose config.score_bias is 0.75 (reward.py's normalisation):
    every completion scores exactly 0.75 x reward_model_weight, so every group has zero std and zero advantage, and
    each logged window says that nothing but the KL term trained (such a run once ended without a word). Dynamic
    sampling (with rejection sampling and rloo) finds no group with a spread in its 2 rounds of 2 prompts x 10
    candidates: it trains on 2 groups without, and says so."""
    rm = AutoModelForSequenceClassification.from_pretrained(toy / "model", num_labels=1)
    torch.nn.init.zeros_(rm.score.weight)
    rm.config.score_bias = 0.75
    rm.save_pretrained(tmp_path / "rm")
    shutil.copy(toy / "model" / "tokenizer.json", tmp_path / "rm")
    shutil.copy(toy / "model" / "tokenizer_config.json", tmp_path / "rm")
    result = run_script(
        "grpo.py",
        grpo_args(
            toy / "model",
            toy / "prompts",
            tmp_path / "out",
            "--reward_fn",
            "None",
            "--reward_model_path",
            tmp_path / "rm",
            "--reward_model_weight",
            2.0,
            "--max_steps",
            2,
            "--per_device_eval_batch_size",
            100,
            "--dynamic_sampling",
            2,
            "--num_candidates",
            10,
            "--rejection_sampling_beta",
            1.0,
            "--advantage_estimator",
            "rloo",
        ),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    rows = read_metrics(tmp_path / "out")
    dynamic = {"rounds": 2, "groups_filtered": 4, "groups_short": 2}  # all 4 sampled had no spread; 2 trained
    assert [{name: r[f"dynamic_sampling/{name}"] for name in dynamic} for r in rows] == [dynamic] * 2
    assert [r["objective/scores"] for r in rows] == [1.5, 1.5] and [r["frac_reward_zero_std"] for r in rows] == [
        1.0,
        1.0,
    ]
    assert rows[-1]["eval/scores"] == 1.5 and rows[0]["loss/policy_avg"] == 0.0
    for window in ("1-1", "2-2"):
        assert f"steps {window}: no advantage or pair in the loss (equal rewards, or masked)\n" in result.stdout


def test_online_dpo_logs_the_mean_reward_of_what_it_samples(toy, sft_model, tmp_path):
    """objective/scores is the mean reward of the G completions of each prompt in online DPO as in GRPO: from the SFT
    model the same first rollout (4 prompts x 4 samples, seeded alike) gives both the same figure (online DPO's was
    once the mean of each group's best and worst), and frac_reward_zero_std (online DPO: no pair); no window says
    that nothing trained."""
    flags = {"clip": ["--per_device_train_batch_size", 16], "dpo": ["--per_device_train_batch_size", 8, "--beta", 0.1]}
    runs = [("grpo.py", grpo_args(sft_model[0], toy / "prompts", tmp_path / loss, "--policy_loss", loss, *extra,
                                  "--num_generations", 4, "--max_steps", 1, "--dataset_test_split", "none"), 1)
            for loss, extra in flags.items()]
    for result in run_scripts(runs):
        assert result.returncode == 0 and "no advantage" not in result.stdout, result.stdout[-2000:] + result.stderr
    grpo, dpo = (read_metrics(tmp_path / loss)[0] for loss in flags)
    print({name: (grpo[name], dpo[name]) for name in ("objective/scores", "frac_reward_zero_std")})
    assert 0 < dpo["objective/scores"] == grpo["objective/scores"] < 1
    assert dpo["frac_reward_zero_std"] == grpo["frac_reward_zero_std"] < 1


def test_help_says_online_dpo_takes_beta_alone_of_grpos_flags(capsys):
    """--help says which flags online DPO takes: of the GRPO section, --beta and the reference's sync alone; the flags
    after them (the last 20 of Args, which main refuses under --policy_loss dpo) are GRPO's."""
    import grpo
    import tyro

    names = [field.name for field in dataclasses.fields(grpo.Args)]
    assert names[-24:-20] == ["policy_loss", "beta", "ref_model_sync_steps", "ref_model_mixup_alpha"]
    assert names[-20] == "advantage_estimator" and names[-1] == "loss_type"
    with pytest.raises(SystemExit):
        tyro.cli(grpo.Args, args=["--help"])
    assert "dpo: online DPO (no flag below but --beta and the reference's)" in " ".join(capsys.readouterr().out.split())


def test_grpo_raises_exact_match(toy, sft_model, tmp_path):
    """From the toy SFT model (which copies the flawed demonstrator), 2 processes, the exact-match verifier, 15 steps:
    greedy exact match on the test prompts rises by at least 0.15 (the quickstart, two seeds: 0.985 and 0.960 at step
    10, 1.000 from step 15 on); eval/scores (greedy, the same verifier) is that accuracy; the metric vocabulary is
    all there."""
    from toy_task import exact_match

    out = tmp_path / "grpo"
    before = exact_match(str(sft_model[0]), str(toy / "prompts" / "test.jsonl"))
    result = run_script(
        "grpo.py",
        grpo_args(
            sft_model[0],
            toy / "prompts",
            out,
            "--learning_rate",
            1e-4,
            "--max_steps",
            15,
            "--gradient_accumulation_steps",
            4,
            "--warmup_ratio",
            0.1,
            "--log_every",
            10,
            "--per_device_eval_batch_size",
            100,
        ),
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    after = exact_match(str(out), str(toy / "prompts" / "test.jsonl"))
    print(f"greedy exact match: SFT {before:.3f} -> GRPO {after:.3f}")
    assert after >= before + 0.15
    rows = read_metrics(out)
    assert rows[-1]["eval/scores"] == pytest.approx(after)
    for key in [
        "loss",
        "lr",
        "grad_norm",
        "episode",
        "tokens_per_second",
        "objective/scores",
        "objective/kl",
        "objective/entropy",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/policy_avg",
        "val/ratio",
        "val/ratio_var",
        "val/num_eos_tokens",
        "completions/mean_length",
        "frac_reward_zero_std",
        "clip_ratio/low",
        "clip_ratio/high",
    ]:
        assert key in rows[-1], key
    # one iteration: the old policy is the current one, so the ratio is exactly 1 and nothing is clipped
    assert all(r["val/ratio"] == 1.0 and r["val/ratio_var"] == 0.0 and r["policy/clipfrac_avg"] == 0.0 for r in rows)
    assert "reward +" in result.stdout  # the sample table


def test_online_dpo_raises_exact_match(toy, sft_model, tmp_path):
    """Online DPO from the toy SFT model, 2 processes, each group's best and worst sample by the exact-match verifier a
    pair, 10 steps: greedy exact match rises by at least 0.15 (measured: 0.520 to 0.985). With chosen and rejected
    swapped in grpo.py the same run ended at 0.500."""
    from toy_task import exact_match

    out, test_file = tmp_path / "online_dpo", str(toy / "prompts" / "test.jsonl")
    flags = ["--policy_loss", "dpo", "--beta", 1.0, "--learning_rate", 1e-4, "--max_steps", 10, "--log_every", 5,
             "--warmup_ratio", 0.1, "--per_device_eval_batch_size", 100]
    result = run_script("grpo.py", grpo_args(sft_model[0], toy / "prompts", out, *flags), nproc=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    before, after = exact_match(str(sft_model[0]), test_file), exact_match(str(out), test_file)
    print(f"greedy exact match: SFT {before:.3f} -> online DPO {after:.3f}")
    assert after >= before + 0.15 and read_metrics(out)[-1]["rewards/accuracies"] > 0.5


def test_verifier_numbers_are_whole_numbers():
    """`#### 1e3` once scored right against 1 and `#### 2^4` against 2 (the number was cut out of a longer one), and
    `#### **18**` (markdown bold) wrong against 18: a number is read whole, or not at all."""
    assert verifier_reward("#### 1e3", "1", "gsm8k") == 0.0 and verifier_reward("#### 2^4", "2", "gsm8k") == 0.0
    assert verifier_reward("#### **18**", "18", "gsm8k") == 1.0
    assert verifier_reward("so 18.", "18", "last_number") == 1.0
    assert verifier_reward("it is 1e3", "3", "last_number") == 0.0 and verifier_reward("2^4", "4", "last_number") == 0.0
