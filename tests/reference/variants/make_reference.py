"""Writes reference.json beside this file: losses and gradients computed by TRL 1.16's own GRPOTrainer and DPOTrainer
code, and advantages computed by verl 0.9.1's own estimator functions, on fixed random inputs stored in the same file.
tests/test_variants.py feeds those inputs to grpo.py's and dpo.py's functions and compares.

Not run by the tests (neither TRL nor verl is a dependency). To regenerate, in an environment with both:
    python -m venv --system-site-packages /tmp/refenv
    /tmp/refenv/bin/pip install trl==1.16.0 omegaconf ray tensordict codetiming
    /tmp/refenv/bin/pip install --no-deps verl==0.9.1
    /tmp/refenv/bin/python tests/reference/variants/make_reference.py

TRL's loss code runs as written: the trainer methods are called unbound on a stand-in `self` that holds only the
attributes they read (no model, no accelerator, one process, no gradient accumulation), and the "model" returns the
given per-token log-probabilities, so the loss and its gradient come from TRL's own arithmetic."""

import collections
import importlib.metadata
import json
import os
import types

import numpy as np
import torch

torch.manual_seed(0)
B, T = 12, 6  # 3 groups of 4 completions, up to 6 tokens
LENGTHS = [6, 3, 1, 5, 2, 6, 4, 1, 6, 6, 3, 2]
MASK = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()


def rounded(x):
    """float64 values that survive the round trip through JSON exactly (float32 inputs are exact in float64)."""
    return x.double().tolist()


def stand_in(**attributes):
    return types.SimpleNamespace(**attributes)


def one_process_accelerator():
    return stand_in(
        num_processes=1,
        device=torch.device("cpu"),
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        sync_gradients=True,
    )


# ------------------------------------------------------------------------------------------- GRPO losses (TRL)
def trl_grpo_loss(inputs, loss_type, importance_sampling_level, epsilon, epsilon_high, beta):
    from trl.trainer.grpo_trainer import GRPOTrainer

    logps = torch.tensor(inputs["logps"], dtype=torch.float32, requires_grad=True)
    mask = torch.tensor(inputs["mask"])
    trainer = stand_in(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        model=stand_in(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        accelerator=one_process_accelerator(),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        args=stand_in(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    batch = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(inputs["advantages"], dtype=torch.float32),
        "old_per_token_logps": torch.tensor(inputs["old_logps"], dtype=torch.float32),
        "ref_per_token_logps": torch.tensor(inputs["ref_logps"], dtype=torch.float32),
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, batch)
    loss.backward()
    return {"loss": loss.item(), "grad": rounded(logps.grad)}


def grpo_inputs():
    logps = -torch.rand(B, T) * 3
    advantages = torch.randn(B)
    # token level: log-ratios of about +-0.3, so that some tokens fall outside [0.8, 1.28] or above CISPO's cap;
    # sequence level (GSPO's epsilon 3e-4 / 4e-4): about +-1e-3 per token, some completions clipped, some not
    token_old = logps + 0.3 * torch.randn(B, T)
    sequence_old = logps + 1e-3 * torch.randn(B, T)
    ref = logps + 0.2 * torch.randn(B, T)
    return {
        "logps": rounded(logps),
        "advantages": rounded(advantages),
        "mask": rounded(MASK),
        "token_old_logps": rounded(token_old),
        "sequence_old_logps": rounded(sequence_old),
        "ref_logps": rounded(ref),
    }


# name: TRL's settings, ours; the old log-probs used
GRPO_CASES = {
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, beta=0.0),
        dict(
            loss_type="sequence",
            importance_sampling_level="sequence",
            policy_loss="clip",
            epsilon=3e-4,
            epsilon_high=4e-4,
            beta=0.0,
        ),
        "sequence_old_logps",
    ),
    "gspo_token_normalised_with_kl": (
        dict(loss_type="dapo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, beta=0.04),
        dict(
            loss_type="token",
            importance_sampling_level="sequence",
            policy_loss="clip",
            epsilon=3e-4,
            epsilon_high=4e-4,
            beta=0.04,
        ),
        "sequence_old_logps",
    ),
    "cispo": (
        dict(loss_type="cispo", importance_sampling_level="token", epsilon=0.2, epsilon_high=1.2, beta=0.0),
        dict(
            loss_type="token",
            importance_sampling_level="token",
            policy_loss="cispo",
            epsilon=0.2,
            epsilon_high=0.2,
            beta=0.0,
        ),
        "token_old_logps",
    ),
    "cispo_with_kl": (
        dict(loss_type="cispo", importance_sampling_level="token", epsilon=0.2, epsilon_high=1.2, beta=0.04),
        dict(
            loss_type="token",
            importance_sampling_level="token",
            policy_loss="cispo",
            epsilon=0.2,
            epsilon_high=0.2,
            beta=0.04,
        ),
        "token_old_logps",
    ),
    # the losses grpo.py already had, against the same code: DAPO's token mean, the paper's, Dr. GRPO's
    "dapo": (
        dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, beta=0.04),
        dict(
            loss_type="token",
            importance_sampling_level="token",
            policy_loss="clip",
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.04,
        ),
        "token_old_logps",
    ),
    "grpo": (
        dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2, beta=0.04),
        dict(
            loss_type="sequence",
            importance_sampling_level="token",
            policy_loss="clip",
            epsilon=0.2,
            epsilon_high=0.2,
            beta=0.04,
        ),
        "token_old_logps",
    ),
    "dr_grpo": (
        dict(loss_type="dr_grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2, beta=0.0),
        dict(
            loss_type="constant",
            importance_sampling_level="token",
            policy_loss="clip",
            epsilon=0.2,
            epsilon_high=0.2,
            beta=0.0,
        ),
        "token_old_logps",
    ),
}


# ------------------------------------------------------------------------------------------- advantages (verl)
def verl_advantages(rewards, estimator):
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos

    token_level_rewards = torch.zeros(B, T)
    token_level_rewards[torch.arange(B), torch.tensor(LENGTHS) - 1] = rewards  # the outcome at the last token
    index = np.array([i // 4 for i in range(B)])
    function = core_algos.get_adv_estimator_fn(estimator)
    config = OmegaConf.create({"gamma": 1.0, "lam": 1.0})
    advantages, _ = function(token_level_rewards=token_level_rewards, response_mask=MASK, index=index, config=config)
    per_completion = advantages[:, 0]  # the same on every token of a completion for these outcome estimators
    assert torch.allclose(advantages, per_completion[:, None] * MASK, atol=1e-6), estimator
    return rounded(per_completion)


def reward_inputs():
    return torch.tensor([1.0, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 0.3, -1.2, 2.0, 0.7])  # mixed, all equal, continuous


# ------------------------------------------------------------------------------------------- DPO losses (TRL)
def trl_dpo_loss(inputs, loss_type, beta):
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs, width = len(inputs["chosen_lengths"]), inputs["width"]
    lengths = torch.tensor(inputs["chosen_lengths"] + inputs["rejected_lengths"])
    prompt = 3
    # TRL's batch: [chosen; rejected] rows of prompt + completion; log_probs are those of tokens 1.., 0 off completion
    completion_mask = torch.zeros(2 * pairs, prompt + width, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        completion_mask[row, prompt : prompt + n] = 1
    per_token = torch.tensor(inputs["per_token_logps"], dtype=torch.float32, requires_grad=True)  # (2 pairs, width)
    log_probs = torch.cat([torch.zeros(2 * pairs, prompt - 1), per_token], 1) * completion_mask[:, 1:]
    outputs = stand_in(
        log_probs=log_probs,
        entropy=torch.zeros_like(log_probs),
        mean_logits=torch.zeros_like(log_probs),
        is_top1=torch.zeros_like(log_probs, dtype=torch.bool),
    )
    trainer = stand_in(
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        use_weighting=False,
        label_smoothing=0.0,
        _total_train_tokens=0,
        _tp_size=1,
        model=stand_in(training=True),
        accelerator=one_process_accelerator(),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    batch = {
        "input_ids": torch.ones(2 * pairs, prompt + width, dtype=torch.long),
        "attention_mask": torch.ones(2 * pairs, prompt + width, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor(inputs["ref_chosen_logps"], dtype=torch.float32),
        "ref_rejected_logps": torch.tensor(inputs["ref_rejected_logps"], dtype=torch.float32),
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, batch, return_outputs=False)
    loss.backward()
    return {"loss": loss.item(), "grad": rounded(per_token.grad)}


def dpo_inputs():
    pairs, width = 5, 7
    chosen_lengths, rejected_lengths = [7, 2, 5, 1, 4], [3, 7, 5, 6, 1]
    lengths = torch.tensor(chosen_lengths + rejected_lengths)
    per_token = -torch.rand(2 * pairs, width) * 2 * (torch.arange(width)[None, :] < lengths[:, None])
    summed = per_token.sum(1)
    return {
        "width": width,
        "chosen_lengths": chosen_lengths,
        "rejected_lengths": rejected_lengths,
        "per_token_logps": rounded(per_token),
        "ref_chosen_logps": rounded(summed[:pairs] + torch.randn(pairs)),
        "ref_rejected_logps": rounded(summed[pairs:] + torch.randn(pairs)),
    }


# name: TRL's loss_type, ours, beta
DPO_CASES = {
    "ipo_per_token": ("ipo", "ipo_per_token", 0.1),
    "sigmoid": ("sigmoid", "sigmoid", 0.1),
    "hinge": ("hinge", "hinge", 0.5),
}


# ------------------------------------------------------------------------------------ soft overlong punishment (TRL)
SOFT_OVERLONG_CASES = [(16, 4), (16, 1), (16, 16), (64, 20)]  # (max_completion_len, soft_punish_cache)


def trl_soft_overlong():
    """TRL's DAPO length reward on completions of 0 to max + 2 tokens (EOS counted, as its trainer counts them)."""
    from trl.rewards import get_soft_overlong_punishment

    cases = []
    for max_length, cache in SOFT_OVERLONG_CASES:
        lengths = list(range(max_length + 3))
        rewards = get_soft_overlong_punishment(max_length, cache)([[7] * n for n in lengths])
        cases.append({"max_completion_len": max_length, "soft_punish_cache": cache, "lengths": lengths,
                      "rewards": rewards})
    return cases


if __name__ == "__main__":
    reference = {"versions": {p: importlib.metadata.version(p) for p in ("trl", "verl", "torch")}}
    inputs = grpo_inputs()
    reference["grpo"] = {"inputs": inputs, "cases": {}}
    for name, (trl_settings, ours, old) in GRPO_CASES.items():
        result = trl_grpo_loss({**inputs, "old_logps": inputs[old]}, **trl_settings)
        reference["grpo"]["cases"][name] = {"trl": trl_settings, "ours": ours, "old_logps": old, **result}
    rewards = reward_inputs()
    reference["advantages"] = {
        "rewards": rounded(rewards),
        "lengths": LENGTHS,
        "verl": {
            name: verl_advantages(rewards.clone(), name)
            for name in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
        },
    }
    inputs = dpo_inputs()
    reference["dpo"] = {"inputs": inputs, "cases": {}}
    for name, (trl_type, ours, beta) in DPO_CASES.items():
        reference["dpo"]["cases"][name] = {
            "trl": trl_type,
            "ours": ours,
            "beta": beta,
            **trl_dpo_loss(inputs, trl_type, beta),
        }
    reference["soft_overlong"] = trl_soft_overlong()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference.json")
    with open(path, "w") as f:
        json.dump(reference, f, indent=1)
    print(f"wrote {path}: {len(GRPO_CASES)} grpo losses, 3 advantage estimators, {len(DPO_CASES)} dpo losses, "
          "the soft overlong punishment")
