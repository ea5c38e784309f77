"""Group Relative Policy Optimization (GRPO) in one file: sample a group of completions per prompt, score them (a
verifier and/or a reward model), take each reward relative to its group as the advantage of all its completion's
tokens, and optimise PPO's clipped surrogate with a KL penalty to the reference model in the loss. No value model.
Paper: arXiv:2402.03300 (DeepSeekMath, Sec. 4.1). Variants (README): DAPO, Dr. GRPO, GSPO, CISPO, RLOO, REINFORCE++,
rejection sampling (RSO), online DPO. Unlike the paper: --loss_type token (DAPO) by default; outcome rewards only; a
group of equal rewards gets 0 advantage.
Run (the toy task's: README):
      torchrun --nproc_per_node 8 grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
          --dataset_name gsm8k_prompts.jsonl --reward_fn gsm8k --max_completion_length 512 --track
"""

import collections
import contextlib
import decimal
import fcntl
import functools
import glob
import importlib
import inspect
import json
import logging
import math
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass, fields
from typing import Annotated, Literal, Optional, TypeVar, get_args

import datasets
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
import tyro
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig, get_scheduler)
from tyro.conf import Suppress

from adam_tf import AdamTF

# the numeric flags' rules, as their types in Args (guard_run)
AtLeast1 = Annotated[int, ("at least 1", lambda v: v >= 1)]
OffOrAtLeast1 = Annotated[int, ("-1 (off) or at least 1", lambda v: v == -1 or v >= 1)]
Positive = Annotated[float, ("above 0", lambda v: v > 0)]
NonNegative = Annotated[float, ("0 or more", lambda v: v >= 0)]
Fraction = Annotated[float, ("in [0, 1]", lambda v: 0 <= v <= 1)]
Weight = Annotated[float, ("finite in float32 (the rewards')", lambda v: abs(v) <= torch.finfo().max)]
Penalty = Annotated[float, ("0 or more, finite in float32 (the rewards')", lambda v: 0 <= v <= torch.finfo().max)]
ShardDegree = Annotated[int, ("-1 (all) or a divisor of the {} processes",
                              lambda v: v == -1 or v >= 1 and dist.get_world_size() % v == 0)]
Pair = Annotated[tuple[float, float], ("two finite numbers above 0", lambda v: all(0 < x < math.inf for x in v))]
Offload = Annotated[bool, ("False on a machine without a GPU", lambda v: not v or torch.cuda.is_available())]
RESUMABLE = "may change on resume: logging, the global batch's split"
Resumable = Annotated[TypeVar("T"), RESUMABLE]

@dataclass
class Args:
    # common arguments: the same in every script
    seed: int = 1
    """seed of data order, initialisation and sampling"""
    track: Resumable[bool] = False
    """log to Weights and Biases"""
    wandb_project_name: Resumable[str] = "rlhf-scripts"
    """the wandb project"""
    wandb_entity: Resumable[Optional[str]] = None
    """the wandb entity (team)"""
    output_dir: Resumable[str] = "runs/grpo"
    """the Hugging Face model folder, with checkpoints/ and metrics.jsonl"""
    model_name_or_path: str = "runs/sft"
    """a hub id or a local model folder: the SFT policy (and reference)"""
    dataset_name: str = "toy/prompts"
    """a hub id, a local .json/.jsonl/.parquet/.csv file (train split), or a folder of them"""
    dataset_train_split: str = "train"
    """the split to train on (or, in a folder, a data file by its name)"""
    dataset_test_split: str = "test"
    """the split to evaluate on, likewise"""
    max_steps: OffOrAtLeast1 = -1
    """optimizer steps; -1: num_train_epochs epochs"""
    num_train_epochs: AtLeast1 = 1
    """passes over the training prompts"""
    learning_rate: Positive = 1e-6
    """peak learning rate"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """the schedule after warmup (transformers.get_scheduler)"""
    warmup_ratio: Fraction = 0.0
    """fraction of the steps warming up linearly from 0"""
    per_device_train_batch_size: Resumable[AtLeast1] = 8
    """micro-batch: completions per process per forward/backward"""
    gradient_accumulation_steps: Resumable[AtLeast1] = 1
    """micro-batches per optimizer step on each process"""
    per_device_eval_batch_size: Resumable[AtLeast1] = 32
    """test prompts per process per greedy generation"""
    max_grad_norm: NonNegative = 1.0
    """clip the global gradient norm (0: off)"""
    optimizer: Literal["adamw", "adam_tf"] = "adamw"
    """adam_tf: TensorFlow-style Adam (adam_tf.py)"""
    adam_epsilon: Positive = 1e-8
    """Adam's epsilon"""
    weight_decay: NonNegative = 0.0
    """decoupled weight decay (adamw only)"""
    bf16: bool = True
    """bf16 compute on GPU, fp32 parameters"""
    gradient_checkpointing: Resumable[bool] = False
    """recompute activations in the backward to save memory"""
    padding_free: Resumable[bool] = True
    """a micro-batch's sequences end to end, no padding (--no-padding_free: padded); the same update"""
    cpu_offload: Resumable[Offload] = False
    """parameters, gradients, optimizer state in CPU memory (FSDP2's CPUOffloadPolicy)"""
    shard_degree: Resumable[ShardDegree] = -1
    """shard each model over groups of this many processes (-1: all), replicated across them (HSDP)"""
    reshard_after_forward: Resumable[bool] = True
    """free gathered parameters after a layer's forward (False: faster, more memory)"""
    log_every: Resumable[AtLeast1] = 10
    """log every this many optimizer steps"""
    eval_every: Resumable[OffOrAtLeast1] = -1
    """evaluate every this many steps (-1: at the end)"""
    save_every: Resumable[OffOrAtLeast1] = -1
    """checkpoint every this many steps (-1: never)"""
    resume_from: Resumable[Optional[str]] = None
    """a checkpoint (output_dir/checkpoints/step_N) to continue; auto: the latest, if any"""
    trust_remote_code: bool = False
    """run model and tokenizer code from the hub"""

    # computed at start, not flags
    world_size: Resumable[Suppress[Optional[int]]] = None
    """(computed) processes"""
    batch_size: Suppress[Optional[int]] = None
    """(computed) an optimizer step's global batch: processes x micro-batch x accumulation"""
    num_training_steps: Suppress[Optional[int]] = None
    """(computed) the run's optimizer steps"""
    rollout_batch_size: Resumable[Suppress[Optional[int]]] = None
    """(computed) batch_size x num_mini_batches: a rollout's completions"""

    # RL: rollouts and rewards
    max_prompt_length: AtLeast1 = 512
    """longer prompts (tokens) are dropped and counted"""
    max_completion_length: AtLeast1 = 256
    """new tokens per completion (then truncated)"""
    num_generations: Annotated[int, ("at least 2", lambda v: v >= 2)] = 8
    """completions per prompt, a group (G)"""
    num_candidates: Optional[AtLeast1] = None
    """completions sampled per prompt, rejection sampling keeping G"""
    rejection_sampling_beta: Optional[Positive] = None
    """its temperature (RSO): near 0 keeps the best, large any"""
    num_mini_batches: AtLeast1 = 1
    """optimizer steps per pass over a rollout"""
    num_iterations: AtLeast1 = 1
    """passes over each rollout (mu in the paper)"""
    local_rollout_forward_batch_size: Resumable[AtLeast1] = 64
    """completions per process per generation call or no-grad forward"""
    temperature: Positive = 1.0
    """sampling temperature (log-probs from logits / T; online DPO's at 1)"""
    cache_implementation: Resumable[Literal["dynamic", "static"]] = "dynamic"
    """generation's KV cache (static: compiled on a GPU, faster after the first rollout)"""
    reward_fn: Optional[Literal["exact_match", "last_number", "gsm8k"]] = "exact_match"
    """the verifier against the answer column (None: none)"""
    prompt_column: str = "prompt"
    """the prompts' column (GSM8K: question)"""
    answer_column: str = "answer"
    """the answers' column (GSM8K: the solution)"""
    reward_model_path: Optional[str] = None
    """a reward model folder written by reward.py"""
    reward_fn_weight: Weight = 1.0
    """reward = reward_fn_weight x verifier + reward_model_weight x score"""
    reward_model_weight: Weight = 1.0
    """see reward_fn_weight"""
    missing_eos_penalty: Penalty = 0.0
    """subtracted from the reward of a completion without EOS"""
    mask_truncated_completions: bool = False
    """completions without EOS out of the loss (DAPO's overlong filtering)"""
    overlong_buffer: Optional[AtLeast1] = None
    """DAPO's soft overlong punishment: 0 to -overlong_penalty_factor over the last this many tokens"""
    overlong_penalty_factor: Optional[Penalty] = None
    """see overlong_buffer (default 1)"""
    dynamic_sampling: AtLeast1 = 1
    """DAPO's dynamic sampling: up to this many rounds of prompts a rollout, for groups with a spread (the prompts
    read on in their order: the same rollouts read more of them)"""
    tools: Optional[list[str]] = None
    """tools the policy may call: names in TOOLS (below) or module.function (importable); prompts as messages"""
    max_tool_calls: Optional[AtLeast1] = None
    """turns calling tools a completion may take (TRL's max_tool_calling_iterations; default: as many as fit)"""
    tool_timeout: Optional[Positive] = None
    """seconds a tool call may run, then an error the model reads (default 10)"""

    # GRPO and its variants (the README's table)
    policy_loss: Literal["clip", "cispo", "sapo", "vespo", "dpo"] = "clip"
    """clip: PPO's clipped surrogate; cispo: clipped weight x A log pi; sapo, vespo: soft gates (grpo_loss); dpo:
    online DPO (no flag below but --beta and the reference's)"""
    beta: NonNegative = 0.04
    """weight of the KL penalty in the loss (0: no reference model); online DPO's beta"""
    ref_model_sync_steps: OffOrAtLeast1 = -1
    """every this many steps the reference becomes alpha x the policy + (1 - alpha) x itself (TR-DPO, TRL's
    sync_ref_model)"""
    ref_model_mixup_alpha: Fraction = 0.6
    """TR-DPO's alpha"""
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    """how rewards become advantages"""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """normalize_then_sum (GDPO): the verifier, the penalties, the reward model's score each normalised in the group,
    summed by weight, normalised over the rollout"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo: r - group mean over the std of the group, of the rollout (batch), or none (Dr. GRPO)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """a ratio pi / pi_old per token, or per completion (GSPO)"""
    epsilon: NonNegative = 0.2
    """pi / pi_old is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: Optional[NonNegative] = None
    """default: epsilon (DAPO's clip-higher: 0.28)"""
    delta: Optional[Positive] = None
    """two-sided clip: pi / pi_old capped at delta where A < 0 too (INTELLECT-2: above 1 + epsilon_high)"""
    sapo_temperature: Pair = (1.0, 1.05)
    """SAPO's gate temperatures where A > 0 and A <= 0"""
    vespo_k: Annotated[tuple[float, float], ("two finite numbers", lambda v: all(abs(x) < math.inf for x in v))] = (
        2.0, 3.0)
    """VESPO's power exponents where A >= 0 and A < 0"""
    vespo_lambda: Pair = (3.0, 2.0)
    """VESPO's decay rates where A >= 0 and A < 0"""
    kl_estimator: Literal["k1", "k2", "k3", "k1_ratio"] = "k3"
    """the KL estimate in the loss; objective/kl is logged with k3"""
    use_bias_correction_kl: bool = False
    """the KL term x pi / pi_old (TRL's default: True)"""
    off_policy_mask_threshold: Optional[Positive] = None
    """completions with A < 0 whose mean log(pi_old / pi) is above this out of the policy loss"""
    top_entropy_quantile: Fraction = 1.0
    """the policy loss on this top fraction of the tokens by entropy (80/20: 0.2)"""
    entropy_coef: NonNegative = 0.0
    """weight of the mean entropy subtracted from the loss"""
    use_adaptive_entropy: bool = False
    """the entropy bonus only while the entropy is at most entropy_target; its weight up or down a step"""
    entropy_target: NonNegative = 0.2
    """nats a token"""
    entropy_coef_delta: NonNegative = 0.005
    """the weight's step"""
    entropy_coef_range: Annotated[tuple[float, float], ("0 <= min <= max", lambda v: 0 <= v[0] <= v[1])] = (0.0, 1.0)
    """the weight's bounds"""
    loss_type: Literal["token", "sequence", "constant"] = "token"
    """what the loss sum is divided by"""


def calculator(expression: str) -> str:
    """Evaluates arithmetic: numbers, + - * / and brackets.

    Args:
        expression: for example "23+7*(41-5)"
    """
    if not re.fullmatch(r"[\d.+\-*/() ]+", expression) or "**" in expression:  # no names, no 9**9**9 to hang on
        raise ValueError(f"{expression!r} is not arithmetic: numbers, + - * / and brackets")
    return str(eval(expression, {"__builtins__": {}}))


# the tools --tools names: a function with a docstring (its schema, as transformers reads it); add yours here
TOOLS = {"calculator": calculator}

# a number: -1,234.5 or 1234, not a part of 1,2345, 3/4, 2^4 or 1e3
NUMBER = r"(?<![\d.,/^eE])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d,.]?\d|/\d|\^|[eE][-+]?\d)"


def parse_answer(text, reward_fn):
    """A text's final answer as a Decimal (18 = 18.0), or None: gsm8k, the number after '#### ' (thousands separators,
    $ and bold allowed); else the last number."""
    found = re.findall(rf"####[\s*$]*({NUMBER})" if reward_fn == "gsm8k" else NUMBER, text)
    return decimal.Decimal(found[0 if reward_fn == "gsm8k" else -1].replace(",", "")) if found else None


def verifier_reward(completion, answer, reward_fn):
    """1.0 if the completion's answer is right, else 0.0: exact_match compares stripped texts, the others parsed
    answers (the answer may be a GSM8K solution)."""
    if reward_fn == "exact_match":
        return float(completion.strip() == answer.strip())
    got = parse_answer(completion, reward_fn)
    return float(got is not None and got == parse_answer(answer, "gsm8k" if "####" in answer else "last_number"))


def has_spread(values, group_size, usable=True):
    """Groups (consecutive rows) whose values differ among their `usable` rows (copies of a text score alike:
    rollout_rewards)."""
    groups, usable = values.view(-1, group_size), torch.as_tensor(usable).expand_as(values).view(-1, group_size)
    return groups.where(usable, -math.inf).amax(1) > groups.where(usable, math.inf).amin(1)


def group_advantages(rewards, num_tokens, group_size, args, objectives=None):
    """A completion's advantage for all its tokens (Sec. 4.1.2 of arXiv:2402.03300); the groups without spread.
    grpo: (r - group mean) / (std + 1e-4), the std of the group, rollout (batch) or none (Dr. GRPO); rloo: r - the
    others' mean (arXiv:2402.14740); both 0 without spread. reinforce_plus_plus: r whitened over the rollout's tokens
    (arXiv:2501.03262); _baseline: r - group mean, whitened. `objectives` (normalize_then_sum, GDPO,
    arXiv:2601.05242): each normalised as grpo's in its group, summed by weight, then over the rollout."""
    groups, zero_std = rewards.view(-1, group_size), ~has_spread(rewards, group_size)
    advantages = groups - groups.mean(1, keepdim=True)
    if objectives is not None:
        o = objectives.view(*groups.shape, -1)
        weights = torch.tensor([args.reward_fn_weight, 1, args.reward_model_weight], device=o.device)
        summed = ((o - o.mean(1, keepdim=True)) / (o.std(1, keepdim=True) + 1e-4) * weights).sum(2)
        advantages = (summed - summed.mean()) / (summed.std() + 1e-4)
    elif args.advantage_estimator.startswith("reinforce_plus_plus"):
        x = (rewards if args.advantage_estimator == "reinforce_plus_plus" else advantages.flatten()).double()
        w = num_tokens.double()  # mean and unbiased variance over the tokens
        mean = (w * x).sum() / w.sum().clamp(min=1)
        variance = (w * (x - mean) ** 2).sum() / (w.sum() - 1).clamp(min=1)
        return ((x - mean) * torch.rsqrt(variance + 1e-8)).to(rewards.dtype), zero_std
    elif args.advantage_estimator == "rloo":  # G / (G - 1) (r - group mean)
        advantages = advantages * group_size / (group_size - 1)
    elif args.scale_rewards == "group":
        advantages = advantages / (groups.std(1, keepdim=True) + 1e-4)
    elif args.scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages.masked_fill(zero_std[:, None], 0.0).flatten(), zero_std


def rejection_sample(rewards, keep, beta, generator):
    """RSO's Algorithm 1 (arXiv:2309.06657) on each row of `rewards`: passes over those left, in random order,
    keeping each with probability exp((r - r_max) / beta) until `keep` are; flat indices. Finite rewards, beta > 0
    (checked before): else a pass might keep none, forever."""
    kept = []
    for row, r in enumerate(rewards.tolist()):
        left, chosen = torch.randperm(len(r), generator=generator).tolist(), []
        while len(chosen) < keep:
            r_max = max(r[i] for i in left)
            for i in list(left):
                if len(chosen) < keep and torch.rand(1, generator=generator).item() < math.exp((r[i] - r_max) / beta):
                    chosen.append(i)
                    left.remove(i)
        kept += [row * len(r) + i for i in sorted(chosen)]
    return kept


def best_and_worst(rewards, usable):
    """Online DPO's pairs: each row's first best and worst of its `usable` entries, as flat indices."""
    pairs = torch.stack([rewards.where(usable, -math.inf).argmax(1), rewards.where(usable, math.inf).argmin(1)], 1)
    return (pairs + rewards.shape[1] * torch.arange(len(rewards))[:, None]).flatten().tolist()


def training_rows(kept, spread, rewards, usable, num_groups, args):
    """The rows a rollout trains on, of the rows `kept` (G a group, in sampling order): num_groups groups, those with a
    `spread` first (DAPO's dynamic sampling); online DPO: each group's best and worst usable row; their metrics."""
    G, N = args.num_generations, args.num_candidates
    groups = torch.argsort((~spread).int(), stable=True)[:num_groups].tolist()
    rows = [kept[g * G + i] for g in groups for i in range(G)]
    stats = {"objective/scores": rewards[rows].mean()}
    if N > G:  # of all the groups' candidates
        stats["objective/candidate_scores"] = rewards.view(-1, N)[groups].mean()
    if args.dynamic_sampling > 1:  # groups without a spread sampled, and those of them kept
        stats |= {"dynamic_sampling/groups_filtered": (~spread).sum(),
                  "dynamic_sampling/groups_short": max(num_groups - spread.sum().item(), 0)}
    if args.policy_loss == "dpo":
        rows = [rows[i] for i in best_and_worst(rewards[rows].view(-1, G), usable[rows].view(-1, G))]
    return rows, stats


def top_entropy_tokens(entropy, mask, rho):
    """The tokens of `mask` with an entropy at least the (1 - rho) quantile of theirs ("Beyond the 80/20 rule",
    arXiv:2506.01939: the forks of a reasoning path), the quantile over a whole mini-batch (TRL: a micro-batch)."""
    values = entropy[mask > 0].sort().values
    if len(values) == 0:
        return mask
    rank = (1 - rho) * (len(values) - 1)
    threshold = values[math.floor(rank)].lerp(values[math.ceil(rank)], rank - math.floor(rank))  # torch.quantile's
    return mask * (entropy >= threshold)  # (which takes 2^24 values at most)


def kl_estimate(logps, ref_logps, old_logps, kl_estimator):
    """Per-token estimate of KL(pi || pi_ref) on pi_old's tokens, d = logp - logp_ref (joschu.net/blog/kl-approx.html).
    On-policy, k1 = d and k3 = exp(-d) - 1 + d (Eq. 4 of arXiv:2402.03300, never negative) have the right expected
    value, k2 = d^2 / 2 the right gradient (k1's is 0, k3's that of KL(pi_ref || pi)); k1_ratio = (pi / pi_old) d both,
    off-policy too."""
    d = logps - ref_logps
    if kl_estimator == "k1":
        return d
    if kl_estimator == "k2":
        return d**2 / 2
    if kl_estimator == "k3":
        return torch.exp(-d) - 1 + d
    return torch.exp(logps - old_logps) * d


def loss_normaliser(completion_mask, args):
    """A global mini-batch's loss divisor, counted over all of it (its split cannot change the update): tokens (Eq. 12
    of arXiv:2503.14476), completions (sequence), completions x max length, pairs (online DPO)."""
    if args.policy_loss == "dpo":
        return completion_mask[:, 0].view(-1, 2).prod(1).sum().clamp(min=1)
    if args.loss_type == "token":
        return completion_mask.sum().clamp(min=1)
    if args.loss_type == "sequence":
        return (completion_mask.sum(1) > 0).sum().clamp(min=1)
    return completion_mask.shape[0] * args.max_completion_length


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, normaliser, args, keep=1.0):
    """Eq. 3 of arXiv:2402.03300 as a loss: per token -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) (or
    another policy loss) in `keep` + beta KL, ratio = pi / pi_old (or GSPO's), summed over `mask` (sequence: each
    completion's mean), over `normaliser`; the ratio and policy loss."""
    log_ratio, A = logps - old_logps, advantages[:, None]
    mean_log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    if args.importance_sampling_level == "sequence":  # GSPO, Eq. 7 of arXiv:2507.18071: one ratio per completion
        log_ratio = mean_log_ratio
    ratio = torch.exp(log_ratio)
    if args.policy_loss == "cispo":  # Eq. 4 of arXiv:2506.13585 with no lower bound on the weight (as the paper ran)
        policy_loss = -ratio.clamp(max=1 + args.epsilon_high).detach() * A * logps
    elif args.policy_loss == "sapo":  # arXiv:2511.20347: a sigmoid gate, PPO's gradient at ratio 1
        tau = torch.where(A > 0, *args.sapo_temperature)
        policy_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
    elif args.policy_loss == "vespo":  # arXiv:2602.10693: the completion's weight phi(w) x A log pi
        policy_loss = -vespo_weight(logps.detach() - old_logps, A, mask, args) * A * logps
    else:  # INTELLECT-2's two-sided clip (arXiv:2505.07291): ratio capped at delta, for A < 0 too
        clipped = ratio.clamp(1 - args.epsilon, 1 + args.epsilon_high)
        policy_loss = -torch.min(ratio.clamp(max=args.delta or math.inf) * A, clipped * A)
    if args.off_policy_mask_threshold:  # DeepSeek-V3.2's Eq. 9 (arXiv:2512.02556): off-policy failures out
        keep = keep * ((A >= 0) | (-mean_log_ratio.detach() <= args.off_policy_mask_threshold))
    kl = args.beta * kl_estimate(logps, ref_logps, old_logps, args.kl_estimator) if args.beta > 0 else 0.0
    if args.use_bias_correction_kl:  # the unbiased gradient of KL(pi || pi_ref) off-policy too (DeepSeek-V3.2)
        kl = kl * ratio
    per_token = (policy_loss * keep + kl) * mask
    if args.loss_type == "sequence":
        per_token = per_token.sum(1) / mask.sum(1).clamp(min=1)
    return per_token.sum() / normaliser, ratio, policy_loss * keep


def vespo_weight(log_ratio, A, mask, args):
    """VESPO's phi(w) = exp(lambda) w^k exp(-lambda w) (phi(1) = 1), w = pi / pi_old of the completion, k and lambda
    by the sign of A, in logs and clamped as TRL."""
    log_w = (log_ratio.clamp(-20, 20) * mask).sum(1, keepdim=True).clamp(math.log(1e-8), 20)
    k, lam = (torch.where(A >= 0, *pair) for pair in (args.vespo_k, args.vespo_lambda))
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0, 0, 0)


def online_dpo_loss(logps, ref_logps, mask, normaliser, beta):
    """DPO's -log sigmoid(beta h) (Eq. 7 of arXiv:2305.18290), h = log(pi / pi_ref) of the chosen minus the rejected's,
    rows (chosen, rejected), over pairs in `mask`, over `normaliser`; dpo.py's metrics."""
    logps, ref_logps = (logps * mask).sum(1).view(-1, 2), (ref_logps * mask).sum(1).view(-1, 2)
    rewards, in_loss = beta * (logps - ref_logps), mask[:, 0].view(-1, 2).prod(1) / normaliser  # no empty row
    chosen, rejected = rewards.unbind(1)
    metrics = {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/accuracies": chosen > rejected,
               "rewards/margins": chosen - rejected, "logps/chosen": logps[:, 0], "logps/rejected": logps[:, 1]}
    loss = -F.logsigmoid(chosen - rejected)
    return (loss * in_loss).sum(), {name: (value.detach() * in_loss).sum() for name, value in metrics.items()}


def loss_temperature(args):
    """1 in online DPO, as in DPO (sampling picks its pairs); else the sampling one."""
    return 1.0 if args.policy_loss == "dpo" else args.temperature


def sample_rollout(model, prompts, draw, args, tokenizer, pad_token_id, tools):
    """Completions in chunks round-robin over the ranks, each seeded by (seed, draw, chunk) (draw: the batch of prompts;
    None: greedy): the same on any number of processes and on resume. With which tokens are the policy's (not a
    tool's), and each completion's tool calls and failures."""
    device, rank, greedy = next(model.parameters()).device, dist.get_rank(), draw is None
    n, width = len(prompts), args.max_completion_length
    chunk_size = args.per_device_eval_batch_size if greedy else args.local_rollout_forward_batch_size
    table = torch.full((2, n, width), -1, device=device)  # token ids, and 1 a policy's token, 0 a tool's; -1: none
    counts = torch.zeros(n, 2, device=device)
    with unsharded(model, keep=not args.reshard_after_forward):
        for chunk, start in enumerate(range(0, n, chunk_size)):
            if chunk % args.world_size == rank:
                torch.manual_seed((args.seed * 100_003 + (draw or 0)) * 100_003 + chunk)
                turns = sample_turns(model, prompts[start : start + chunk_size], greedy, args, tokenizer, pad_token_id,
                                     tools)
                for i, (completion, mask, calls) in enumerate(turns, start):
                    table[:, i, : len(completion)] = torch.tensor([completion, mask])
                    counts[i] = torch.tensor(calls)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # each row filled by one rank
    dist.all_reduce(counts)
    lengths = (table[0] >= 0).sum(1)
    return {"completion": [row[:k] for row, k in zip(table[0].tolist(), lengths.tolist())], "length": lengths,
            "policy_mask": table[1].clamp(min=0), "tool_calls": counts}


def sample_turns(model, prompts, greedy, args, tokenizer, pad_token_id, tools):
    """A chunk's completions, each with its mask (1: the policy's token, 0: a tool's) and [tool calls, failures]:
    sampled to EOS; a turn that calls tools goes on after their results as the chat template writes them, up to
    --max_tool_calls turns and --max_completion_length tokens in all (a result cut there ends it, truncated)."""
    eos, width, turn = tokenizer.eos_token_id, args.max_completion_length, 0
    out, going = [([], [], [0, 0]) for _ in prompts], range(len(prompts))
    while going:
        turns = generate_completions(model, [prompts[i] + out[i][0] for i in going],
                                     width - min(len(out[i][0]) for i in going), None if greedy else args.temperature,
                                     eos, pad_token_id, args.cache_implementation)
        may_call, going_on = tools and turn < (args.max_tool_calls or width), []
        for i, ids in zip(going, turns):
            completion, mask, counts = out[i]
            ids = ids[: width - len(completion)]
            results = may_call and ids[-1:] == [eos] and len(completion) + len(ids) < width and call_tools(
                tokenizer, ids, prompts[i] + completion, tools, args, counts)
            completion += ids
            mask += [1] * len(ids)
            suffix = results and tool_suffix(tokenizer, results)  # None: the template writes them otherwise
            if suffix:  # the tools' tokens, to the next turn's start
                suffix = suffix[: width - len(completion)]
                completion += suffix
                mask += [0] * len(suffix)
                going_on += [i] * (len(completion) < width)
        going, turn = going_on, turn + 1
    return out


def call_tools(tokenizer, turn, prefix, tools, args, counts):
    """The results (tool, text) of the calls a turn makes, as the tokenizer parses them; counts += [calls, failures].
    A failure is the model's, not the run's: an exception, a malformed call, an unknown tool, a call past
    --tool_timeout, each an error message it reads."""
    results = []
    try:
        calls = tokenizer.parse_response(turn, prefix=prefix, tools=list(tools.values())).get("tool_calls", [])
    except Exception as e:  # a malformed call
        calls, results = [], [("error", f"error: {(str(e).splitlines() or [repr(e)])[0]}")]
        counts[1] += 1
    for call in calls:
        name = "error"
        try:
            signal.setitimer(signal.ITIMER_REAL, args.tool_timeout)  # then SIGALRM: tool_timed_out
            try:  # KeyError: no name, or no such tool
                name = str(call["function"]["name"])
                text = str(tools[name](**call["function"].get("arguments") or {}))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Exception as e:  # a late alarm too
            text = f"error: {e!r}"
            counts[1] += 1
        results.append((name, text))
    counts[0] += len(results)
    return results


def tool_timed_out(signum, frame):
    """SIGALRM in a tool call."""
    raise TimeoutError("past --tool_timeout")


def tool_suffix(tokenizer, results):
    """What the chat template writes after the EOS of a turn that calls tools: their results (tool, text) as tool
    messages, then the next turn's generation prompt (token ids); None (the completion ends) if it writes the turn's
    start otherwise."""
    call = {"type": "function", "function": {"name": results[0][0], "arguments": {}}}
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tokenizer.apply_chat_template(turn, tokenize=False)
    messages = turn + [{"role": "tool", "name": name, "content": text} for name, text in results]
    after = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before = before[: before.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]  # Qwen writes "\n" after EOS
    return tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"] if after.startswith(before) else None


def tools_of(args):
    """--tools as {name: function}, refused unless each is a function with a schema (its docstring); SIGALRM ends a
    call past --tool_timeout."""
    tools = {}
    for name in args.tools or []:
        module, _, function = name.rpartition(".")
        try:
            tool = TOOLS[name] if name in TOOLS else getattr(importlib.import_module(module), function, None)
        except Exception as e:  # no such module, or one that fails to import
            raise ScriptError(f"--tools {name}: not in grpo.py's TOOLS {list(TOOLS)}, nor module.function importable "
                              f"beside grpo.py or on PYTHONPATH ({e!r})") from e
        if not inspect.isfunction(tool) or tool.__name__ in tools:
            raise ScriptError(f"--tools {name}: not a Python function (def), or a second tool of that name")
        try:
            tools[tool.__name__] = tool
            transformers.utils.get_json_schema(tool)
        except Exception as e:
            raise ScriptError(f"--tools {name}: {e} (its docstring is its schema)") from e
    if tools:
        args.tool_timeout = args.tool_timeout or 10.0
        signal.signal(signal.SIGALRM, tool_timed_out)
    return tools


def check_tool_template(tokenizer, tools, args):
    """--tools refused unless the tokenizer reads back a call its chat template writes (its response_template) and the
    template writes a tool's result after a turn that ends with EOS."""
    if not tools:
        return
    name, user = next(iter(tools)), [{"role": "user", "content": "?"}]
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    try:
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False)[len(prompt) :]
        works = tokenizer.parse_response(turn, prefix=prompt).get("tool_calls") == [call]
        works &= "a result" in tokenizer.decode(tool_suffix(tokenizer, [(name, "a result")]))
    except Exception:  # no response_template; the template refuses tool messages, or ends no turn with EOS
        works = False
    if not works:
        raise ScriptError(f"--tools: the tokenizer of {args.model_name_or_path} does not read back the tool calls its "
                          "chat template writes (set a response_template in its tokenizer_config.json), or the "
                          "template writes no tool result after a turn that ends with EOS")


@torch.no_grad()
def rollout_rewards(rollout, reward_model, tokenizer, args, device):
    """reward_fn_weight x verifier - missing_eos_penalty x (no EOS) - the overlong punishment + reward_model_weight x
    score (finite), which completions ended, the outcome: the verifier's, else the score."""
    completions, masks = rollout["completion"], rollout["policy_mask"].tolist()
    last_turns = [c[max([i + 1 for i in range(len(c)) if not m[i]], default=0) :] for c, m in zip(completions, masks)]
    texts = tokenizer.batch_decode(last_turns, skip_special_tokens=True)  # the verifier reads the last turn
    correct = torch.tensor([verifier_reward(t, a, args.reward_fn) if args.reward_fn else 0.0
                            for t, a in zip(texts, rollout["answer"])], device=device)
    ended = torch.tensor([c[-1] == tokenizer.eos_token_id for c in completions], device=device)
    penalties = [args.missing_eos_penalty * (~ended).float()]
    if args.overlong_buffer:  # DAPO's Eq. 13 x the factor, EOS counted (as TRL, verl)
        too_long = (rollout["length"] - args.max_completion_length) / args.overlong_buffer + 1
        penalties.append(args.overlong_penalty_factor * too_long.clamp(0, 1))
    rewards = functools.reduce(torch.sub, penalties, args.reward_fn_weight * correct)
    scores = torch.zeros_like(rewards)
    if reward_model:  # one score a distinct text: its copies tie exactly, whatever the rows scored beside each
        texts = {}
        copy_of = [texts.setdefault((tuple(p), tuple(c)), len(texts)) for p, c in zip(rollout["prompt"], completions)]
        distinct = {"prompt": [p for p, _ in texts], "completion": [c for _, c in texts]}
        scores = no_grad_pass(reward_model, distinct, args, True)[copy_of, 0]
    sources = [f"--reward_fn {args.reward_fn} with the penalties", f"--reward_model_path {args.reward_model_path}"]
    weighted = args.reward_model_weight * scores
    check_rewards(torch.stack([rewards, weighted], 1), sources)
    return {"reward": rewards + weighted, "ended": ended, "outcome": correct if args.reward_fn else weighted,
            "objectives": torch.stack([correct, -sum(penalties), scores], 1)}  # apart for normalize_then_sum


@torch.no_grad()
def no_grad_pass(net, rollout, args, scores=False, entropy=False):
    """Log-probs of the completions at the loss's temperature (the reference's, the old policy's) [and entropies], or
    a reward model's scores."""
    device = next(net.parameters()).device
    table = torch.zeros(1 + entropy, len(rollout["prompt"]), 1 if scores else args.max_completion_length, device=device)
    for rows, valid in rank_micro_batches(table.shape[1], args.local_rollout_forward_batch_size):
        batch = make_batch(device, rollout["prompt"], rollout["completion"], rows, args)
        if scores:
            values = sequence_scores(net, batch)[None, :, None]
        else:
            values = completion_logprobs(net, batch, loss_temperature(args), entropy)
            values = torch.stack(values) if entropy else values[None]
        table[:, rows, : values.shape[2]] += valid * values
    dist.all_reduce(table)
    return table if entropy else table[0]


def accumulate_gradients(model, rollout, mini, normalisers, args, sums, entropy_coef=0.0):
    """One step's gradients from this rank's micro-batches of `mini`, statistics in `sums`; the sum of the entropies
    of the tokens in the policy loss (`keep`), and their count."""
    device, step_loss, (normaliser, kept) = next(model.parameters()).device, 0.0, normalisers
    entropies = torch.zeros(2, device=device)
    for micro in micro_batches(mini, args):
        batch = make_batch(device, rollout["prompt"], rollout["completion"], micro, args)
        width = batch["completion_mask"].shape[1]
        mask, keep = (rollout[name][micro, :width] for name in ("loss_mask", "keep"))
        A = rollout["advantages"][micro, None]
        logps, entropy = completion_logprobs(model, batch, loss_temperature(args), True)
        old = rollout["old_logps"][micro, :width] if rollout["old_logps"] is not None else logps.detach()
        ref = rollout["ref_logps"][micro, :width] if rollout["ref_logps"] is not None else None
        if args.policy_loss == "dpo":
            loss, pair_stats = online_dpo_loss(logps, ref, mask, normaliser, args.beta)
            ratio, policy_loss = torch.exp(logps - old).detach(), None
        else:
            (loss, ratio, policy_loss), pair_stats = grpo_loss(logps, old, ref, A[:, 0], mask, normaliser, args,
                                                               keep), {}
        if entropy_coef:  # an entropy bonus: their mean (Skywork-OR1, arXiv:2505.22312)
            loss = loss - entropy_coef * (entropy * keep).sum() / kept
        loss.backward()
        step_loss += loss.detach()
        entropies += torch.stack([(entropy * keep).sum(), keep.sum()]).detach()
        with torch.no_grad():
            kl = kl_estimate(logps, ref, old, "k3") if ref is not None else 0 * logps
            clipped = args.policy_loss in ("clip", "cispo")  # SAPO's and VESPO's gates clip nothing
            token_stats = {"loss/policy_avg": policy_loss, "policy/approxkl_avg": 0.5 * (logps - old) ** 2,
                           "objective/entropy": entropy, "val/ratio": ratio, "val/ratio_squared": ratio**2,
                           "clip_ratio/low": (ratio < 1 - args.epsilon) & (A < 0) & (args.policy_loss == "clip"),
                           "clip_ratio/high": (ratio > 1 + args.epsilon_high) & (A > 0) & clipped,
                           "objective/kl": kl}
            stats = {name: (v * mask).sum() for name, v in token_stats.items() if v is not None}  # None: online DPO's
            stats |= pair_stats | {"loss": loss.detach(), "tokens": mask.sum(), "processed": batch["tokens"]}
            for name, value in stats.items():
                sums[name] += value
    return step_loss, entropies


@torch.no_grad()
def sync_reference(ref_model, model, alpha):
    """TR-DPO's (arXiv:2404.09656), as TRL's SyncRefModelCallback: the reference becomes alpha x the policy + (1 -
    alpha) x itself, on the shards (gathered weights, a root's or --no-reshard_after_forward's, set back first)."""
    for module in [m for m in (*ref_model.modules(), *model.modules()) if isinstance(m, FSDPModule)]:
        module.reshard()
    for ref, new in zip(ref_model.parameters(), model.parameters(), strict=True):
        ref.mul_(1 - alpha).add_(new, alpha=alpha)


def entropy_weight(state, args, entropies=None):
    """The entropy bonus's weight this step. Adaptive (Skywork-OR1, arXiv:2505.22312, as TRL): after a step, given
    its `entropies` (sum, count), a step up if their mean is at most --entropy_target, else down (in
    --entropy_coef_range); no bonus while the last mean is above the target."""
    if entropies is not None:
        state["entropy"] = (entropies[0] / entropies[1].clamp(min=1)).item()
        c, step, (low, high) = state["entropy_coef"], args.entropy_coef_delta, args.entropy_coef_range
        state["entropy_coef"] = min(c + step, high) if state["entropy"] <= args.entropy_target else max(c - step, low)
    idle = args.use_adaptive_entropy and state["entropy"] > args.entropy_target
    return 0.0 if idle else state["entropy_coef"]


def window_metrics(w, steps, seconds, args):
    """The metrics since the last log: per loss token, per completion (KL), per step."""
    tokens, per_token = max(w.pop("tokens"), 1.0), ("loss/", "policy/", "objective/entropy", "val/ratio", "clip")
    metrics = {"tokens_per_second": w.pop("processed") / seconds,
               "objective/kl": w.pop("objective/kl") / steps / args.batch_size}
    metrics |= {name: value / (tokens if name.startswith(per_token) else steps) for name, value in w.items()}
    metrics["policy/clipfrac_avg"] = metrics["clip_ratio/low"] + metrics["clip_ratio/high"]
    metrics["val/ratio_var"] = metrics.pop("val/ratio_squared") - metrics["val/ratio"] ** 2
    return metrics


def main(args):
    # 1. distributed init, batch sizes, argument checks
    rank, world_size, device, mesh = setup(args)
    G, dpo = args.num_generations, args.policy_loss == "dpo"
    N = args.num_candidates = args.num_candidates or G
    K = 2 if dpo else G  # a prompt's rows in the loss (online DPO: a pair)
    args.rollout_batch_size = args.batch_size * args.num_mini_batches
    P, rounds = args.rollout_batch_size // K, args.dynamic_sampling  # groups a rollout
    changed = {f.name for f in fields(Args) if getattr(args, f.name) != f.default}
    unused = [f"--{f.name}" for f in fields(Args)[-20:] if f.name in changed]  # after the reference's
    needs = {f"--beta above 0, not {args.beta}": args.beta == 0, f"none of GRPO's flags, not {unused}": unused,
             f"an even --per_device_train_batch_size (whole pairs), not {args.per_device_train_batch_size}":
             args.per_device_train_batch_size % 2}
    if dpo and any(needs.values()):
        raise ScriptError(f"--policy_loss dpo needs {'; '.join(need for need, unmet in needs.items() if unmet)}")
    if args.rollout_batch_size % K:
        raise ScriptError(f"--num_generations {G} does not divide a rollout's {args.rollout_batch_size} completions "
                          f"({world_size} processes x --per_device_train_batch_size x --gradient_accumulation_steps x "
                          "--num_mini_batches)")
    if N < G or (N > G) != (args.rejection_sampling_beta is not None):
        raise ScriptError(f"--num_candidates {N}, --num_generations {G}: rejection sampling needs --num_candidates "
                          "above G and --rejection_sampling_beta")
    if args.reward_fn is None and args.reward_model_path is None:
        raise ScriptError("no reward: set --reward_fn, --reward_model_path, or both")
    grpo, loss = args.advantage_estimator == "grpo", args.policy_loss
    needs = {  # what each flag does nothing without
        "max_tool_calls tool_timeout": ("--tools", args.tools),
        "scale_rewards": ("--advantage_estimator grpo, --multi_objective_aggregation sum_then_normalize", grpo and
                          args.multi_objective_aggregation == "sum_then_normalize"),
        "overlong_penalty_factor": ("--overlong_buffer (the punishment's tokens)", args.overlong_buffer),
        "ref_model_sync_steps": ("--beta above 0 (a reference)", args.beta > 0),
        "ref_model_mixup_alpha": ("--ref_model_sync_steps", args.ref_model_sync_steps > 0),
        "multi_objective_aggregation": ("--advantage_estimator grpo", grpo),
        "importance_sampling_level": ("a --policy_loss but vespo (weighs a completion)", loss != "vespo"),
        "epsilon": ("--policy_loss clip, or cispo without --epsilon_high", loss == "clip" or loss == "cispo" and
                    args.epsilon_high is None),
        "delta": ("--policy_loss clip", loss == "clip"),
        "epsilon_high": ("--policy_loss clip or cispo", loss in ("clip", "cispo")),
        "sapo_temperature": ("--policy_loss sapo", loss == "sapo"),
        "vespo_k vespo_lambda": ("--policy_loss vespo", loss == "vespo"),
        "use_bias_correction_kl": ("--beta above 0, a --kl_estimator but k1_ratio (x the ratio already)",
                                   args.beta > 0 and args.kl_estimator != "k1_ratio"),
        "off_policy_mask_threshold": ("--num_iterations above 1 (else pi_old is pi)", args.num_iterations > 1),
        "entropy_target entropy_coef_delta entropy_coef_range": ("--use_adaptive_entropy", args.use_adaptive_entropy),
    }
    for names, (need, met) in needs.items():
        for name in names.split():
            if name in changed and not met:
                raise ScriptError(f"--{name} {getattr(args, name)} does nothing without {need}")
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    if (args.overlong_buffer or 0) > args.max_completion_length:
        raise ScriptError(f"--overlong_buffer {args.overlong_buffer}: at most --max_completion_length "
                          f"{args.max_completion_length} (a longer one punishes every completion)")
    if args.overlong_penalty_factor is None:
        args.overlong_penalty_factor = 1.0

    # 2. data: every rank tokenises all prompts
    tools = tools_of(args)
    tokenize = functools.partial(tokenize_prompts, tools=list(tools.values()) or None)  # the template writes them in
    tokenizer, pad_token_id, train, test, dropped = load_data(args, tokenize)
    check_tool_template(tokenizer, tools, args)
    num_rollouts, steps_per_rollout = rollouts_of(len(train["prompt"]), P, f" x {N}", "--num_iterations", args, dropped)

    # 3. models + FSDP2: the policy, the frozen reference (the SFT model), the reward model
    path, flag = args.model_name_or_path, "--model_name_or_path"
    model = load_model(AutoModelForCausalLM, path, args, flag, mesh)
    ref_model = load_model(AutoModelForCausalLM, path, args, flag, mesh, frozen=True) if args.beta > 0 else None
    reward_model = load_reward_model(args, tokenizer, mesh) if args.reward_model_path else None
    check_layout(model, train["prompt"], train["prompt"], args, flag)
    if reward_model:
        check_layout(reward_model, train["prompt"], train["prompt"], args, "--reward_model_path")

    # 4. optimizer and LR schedule (or both restored by --resume_from)
    optimizer, scheduler, start_step, state = make_optimizer(model, args)
    if "ref_model" in state:  # synced: as it was saved
        set_model_state_dict(ref_model, state.pop("ref_model"), options=StateDictOptions(full_state_dict=True,
                                                                                         broadcast_from_rank0=True))
    metrics_path, progress = open_metrics(args, start_step)

    # 5. training loop
    sums = collections.defaultdict(lambda: torch.zeros((), device=device))  # this rank's, since the last log
    logged, window_start, learned = start_step, time.time(), False
    first, per_epoch = start_step // steps_per_rollout, len(train["prompt"]) // P
    # batches of prompts read, in order, adaptive entropy's weight and last entropy: the checkpoint keeps them
    state = {"batches": first * rounds, "entropy_coef": args.entropy_coef, "entropy": math.inf} | state
    rho = args.top_entropy_quantile < 1
    for rollout_index in range(first, num_rollouts):
        rollout_start, said, rollout, kept = time.time(), time.time(), collections.defaultdict(list), []
        generator = torch.Generator().manual_seed((args.seed * 100_003 + rollout_index) * 100_003 - 1)
        for round_index in range(rounds):
            # ALGO LOGIC: 1. the next batch of P prompts (each read once an epoch), each N times in a row
            batch = state["batches"]
            state["batches"] += 1
            if batch % per_epoch == 0 and batch and rank == 0:
                print(f"rollout {rollout_index + 1}: epoch {batch // per_epoch + 1} of the prompts begins")
            rows = global_batch(batch, len(train["prompt"]), P, args.seed)
            part = {name: [column[row] for row in rows for _ in range(N)] for name, column in train.items()}

            # 2. sample the completions
            part |= sample_rollout(model, part["prompt"], batch, args, tokenizer, pad_token_id, tools)

            # 3. the rewards; rejection sampling keeps G of N (not the policy's gradient then)
            part |= rollout_rewards(part, reward_model, tokenizer, args, device)
            picked = range(P * N) if N == G else rejection_sample(part["reward"].view(-1, N).cpu(), G,
                                                                  args.rejection_sampling_beta, generator)
            kept += [len(rollout["prompt"]) + i for i in picked]
            for name, column in part.items():
                rollout[name] += list(column)
            ended = torch.stack(rollout["ended"])
            usable = ended | (not dpo or not args.mask_truncated_completions)  # online DPO pairs those in the loss
            spread = has_spread(torch.stack(rollout["outcome"])[kept], G, usable[kept])
            if spread.sum() >= P:
                break
            if rank == 0 and time.time() > said + 60:
                print(f"rollout {rollout_index + 1}: {round_index + 1} rounds of up to {rounds}, {spread.sum()} of "
                      f"{P} groups with a spread")
                said = time.time()
        rows, stats = training_rows(kept, spread, torch.stack(rollout["reward"]), usable, P, args)
        if tools:  # TRL's, over the completions sampled: calls a completion, failures a call
            calls, failures = torch.stack(rollout["tool_calls"]).unbind(1)
            stats |= {"tools/call_frequency": calls.mean(), "tools/failure_frequency": failures.sum()
                      / calls.sum().clamp(min=1)}
        if rounds > 1:
            stats["dynamic_sampling/rounds"] = round_index + 1
        rollout = {name: [column[i] for i in rows] for name, column in rollout.items()}
        rewards, lengths, ended = (torch.stack(rollout.pop(name)) for name in ("reward", "length", "ended"))
        rollout["ref_logps"] = no_grad_pass(ref_model, rollout, args) if ref_model else None
        old = no_grad_pass(model, rollout, args, entropy=rho) if args.num_iterations > 1 or rho else None
        if rho:  # the sampling policy's entropies, for the 80/20 rule
            old, rollout["entropy"] = old
        rollout["old_logps"] = old if args.num_iterations > 1 else None

        # 4. the tokens in the loss, and the advantages
        rollout["loss_mask"] = torch.stack(rollout.pop("policy_mask")).float()  # not the tools' tokens
        if args.mask_truncated_completions:
            rollout["loss_mask"] *= ended[:, None]
        gdpo = args.multi_objective_aggregation == "normalize_then_sum"
        objectives = torch.stack(rollout["objectives"]) if gdpo else None
        rollout["advantages"], zero_std = group_advantages(rewards, rollout["loss_mask"].sum(1), K, args, objectives)
        if dpo:  # equal rewards: no pair
            rollout["loss_mask"] *= ~zero_std.repeat_interleave(2)[:, None]
        rollout["keep"] = rollout["loss_mask"].clone()  # the policy loss's tokens
        learned |= bool((rollout["advantages"][:, None] * rollout["loss_mask"]).any())
        stats |= {"completions/mean_length": lengths.float().mean(), "val/num_eos_tokens": ended.sum(),
                  "completions/clipped_ratio": 1 - ended.float().mean(),
                  "frac_reward_zero_std": zero_std.float().mean(), "time/rollout": time.time() - rollout_start}
        samples = [["prompt", "completion", "reward", "advantage"]]
        samples += [[tokenizer.decode(rollout["prompt"][i]), tokenizer.decode(rollout["completion"][i]),
                     rewards[i].item(), rollout["advantages"][i].item()] for i in (0, 1)]

        # 5. num_iterations passes over the rollout, each in num_mini_batches optimizer steps
        for k, mini in enumerate(rollout_mini_batches(rollout_index, args.num_iterations, args, K if dpo else 1)):
            update_start, mask = time.time(), rollout["loss_mask"][mini]
            if rho:  # the policy loss on the tokens of highest entropy, of the whole mini-batch
                rollout["keep"][mini] = top_entropy_tokens(rollout["entropy"][mini], mask, args.top_entropy_quantile)
            normalisers = loss_normaliser(mask, args), rollout["keep"][mini].sum().clamp(min=1)
            step_loss, entropies = accumulate_gradients(model, rollout, mini, normalisers, args, sums,
                                                        entropy_weight(state, args))
            step = rollout_index * steps_per_rollout + k + 1
            lr, grad_norm, stop = optimizer_step(model, optimizer, scheduler, step_loss, step, args)
            if args.use_adaptive_entropy:  # the weight follows the step's entropy, all ranks'
                dist.all_reduce(entropies)
                entropy_weight(state, args, entropies)
            if args.ref_model_sync_steps > 0 and step % args.ref_model_sync_steps == 0:
                sync_reference(ref_model, model, args.ref_model_mixup_alpha)
            progress.update(1)
            stats["time/update"] = time.time() - update_start
            if args.entropy_coef or args.use_adaptive_entropy:
                stats["entropy_coef"] = state["entropy_coef"]
            for name, value in stats.items():  # the same on every rank: each adds its share
                sums[name] += value / world_size

            if is_due(step, args.log_every, args) or is_due(step, args.eval_every, args):
                metrics = {"step": step, "episode": (rollout_index + 1) * args.rollout_batch_size, "lr": lr,
                           "grad_norm": grad_norm.item()}
                metrics |= window_metrics(reduce_sums(sums), step - logged, time.time() - window_start, args)
                if is_due(step, args.eval_every, args) and test:
                    test |= sample_rollout(model, test["prompt"], None, args, tokenizer, pad_token_id, tools)
                    scored = rollout_rewards(test, reward_model, tokenizer, args, device)["reward"]
                    metrics["eval/scores"] = scored.mean().item()
                if not learned and rank == 0:
                    print(f"steps {logged + 1}-{step}: no advantage or pair in the loss (equal rewards, or masked)")
                log_metrics(metrics, metrics_path, args, progress, samples)
                sums, logged, window_start = collections.defaultdict(sums.default_factory), step, time.time()
                learned = False
            if (args.save_every > 0 and step % args.save_every == 0) or (stop and step % steps_per_rollout == 0):
                if args.ref_model_sync_steps > 0:  # the synced reference: state too
                    state["ref_model"] = get_model_state_dict(ref_model, options=StateDictOptions(
                        full_state_dict=True, cpu_offload=True))
                save_checkpoint(model, optimizer, scheduler, step, args, state, stop)
                state.pop("ref_model", None)

    # 6. save the Hugging Face folder
    finish(model, tokenizer, args, device)


# ---------------------------------------------------------------------------------------------------------------------
# Infrastructure: identical in every script that has it (tests/test_consistency.py). Skip it on a first read.
def setup(args):
    """Distributed init (plain `python`: one process), guards, batch sizes, seed, the models' mesh."""
    gpu, alone = torch.cuda.is_available(), {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("nccl" if gpu else "gloo", **({} if "RANK" in os.environ else alone))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    auto, latest = args.resume_from == "auto", [(complete_checkpoints(args.output_dir) or [None])[-1]]
    dist.broadcast_object_list(latest, src=0)  # the first process's view
    args.resume_from = latest[0] if auto else args.resume_from
    guard_run(args, auto)
    args.world_size = world_size
    args.batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    torch.manual_seed(args.seed + rank)  # dropout (sft.py leaves it on)
    shards = world_size if args.shard_degree == -1 else args.shard_degree  # one replica: FSDP, 1-D; else HSDP
    dims = {"replicate": world_size // shards, "shard": shards} if shards < world_size else {"shard": shards}
    mesh = dist.init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    return rank, world_size, device, mesh


def load_data(args, tokenize):
    """The tokenizer, its pad id (EOS if none: masks come from lengths), the splits tokenised on every rank, drops."""
    tokenizer = load_pretrained(AutoTokenizer, args.model_name_or_path, args, "--model_name_or_path")
    check_tokenizer(tokenizer, args)
    pad_token_id, splits = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id, {}
    for split in (args.dataset_train_split, args.dataset_test_split):
        dataset = load_split(args.dataset_name, split)
        if dataset is not None:
            check_columns(dataset, args, split, tokenizer)
            splits[split] = (*tokenize(dataset, tokenizer, args), len(dataset))
    check_splits(args, tokenizer, {split: data for split, (data, _, _) in splits.items()})
    (train, dropped, size), test = splits[args.dataset_train_split], splits.get(args.dataset_test_split, [None])[0]
    if not train["prompt"]:
        raise ScriptError(f"all {size} training rows were dropped ({dropped}): fix them, or the limit dropping them")
    if dist.get_rank() == 0:
        print(f"train: {len(train['prompt'])} of {size} rows kept; dropped: {dropped}; eval: "
              + (f"{len(test['prompt'])} rows" if test else f"no split {args.dataset_test_split!r}"))
    return tokenizer, pad_token_id, train, test if test and test["prompt"] else None, dropped


DATA_EXTENSIONS = tuple(kind + packing for kind in (".json", ".jsonl", ".parquet", ".csv")
                        for packing in ("", ".gz", ".bz2", ".xz", ".zst"))


def load_split(name, split):
    """A split of a hub dataset, folder or file (train only), or None; in a folder a split may be a file."""
    check_local_path(name, "--dataset_name")
    if os.path.isfile(name):
        return load_file(name) if split == "train" else None
    if os.path.isfile(os.path.join(name, "dataset_dict.json")):
        return datasets.load_from_disk(name).get(split)
    files = {}
    if os.path.isdir(name):  # the files of each split, as datasets finds them
        if not any(f.endswith(DATA_EXTENSIONS) for f in glob.glob(f"{name}/**/*", recursive=True)):
            raise ScriptError(f"--dataset_name {name!r}: a folder without .json, .jsonl, .parquet or .csv files")
        files = {str(k): list(v) for k, v in datasets.load_dataset_builder(name).config.data_files.items()}
        check_split_files(name, files)
    if files and split not in files:
        named = sorted(f for f in os.listdir(name) if f.endswith(DATA_EXTENSIONS) and f.split(".")[0] == split)
        return load_file(os.path.join(name, named[0])) if named else None
    try:
        return datasets.load_dataset(name, split=split)
    except ValueError as e:
        if "Unknown split" not in str(e):
            raise
    except datasets.exceptions.DatasetGenerationError as e:  # the files of one split differ in their columns
        names = [os.path.basename(f) for f in files.get(split, [])]
        raise ScriptError(f"dataset {name!r}, split {split!r} {names} does not load ({e.__cause__ or e}): name one "
                          "file as the split (its name without extension)") from e
    except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
        raise ScriptError(f"--dataset_name {name!r}: not here, and the hub says: {e}") from e


def load_file(path):
    """A local data file as a dataset."""
    builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(path.split(".")[-1])
    if not builder:
        raise ScriptError(f"dataset file {path!r}: unknown format; give a .json, .jsonl, .parquet or .csv file")
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:
        raise ScriptError(builder == "json" and data_file_problem(path) or f"dataset {path!r}: {e!r}") from e


def tokenize_prompts(dataset, tokenizer, args, tools=None):
    """Prompts (strings, or messages with the generation prompt and the `tools`), the verifier's answers; empty or long
    ones dropped, counted."""
    prompts, answers = args.prompt_column, getattr(args, "reward_fn", None) and args.answer_column
    if prompts not in dataset.column_names or (answers and answers not in dataset.column_names):
        needs = f"a {prompts!r} column" + (f" and an {answers!r} column" if answers else "")
        raise ScriptError(f"dataset {args.dataset_name!r} has columns {dataset.column_names}: it needs {needs} "
                          "(--prompt_column, --answer_column)")
    data, dropped = {"prompt": [], "answer": []}, {"empty prompt": 0, "prompt too long": 0}
    for prompt, answer in zip(dataset[prompts], dataset[answers] if answers else [None] * len(dataset)):
        if isinstance(prompt, str) and tools:
            raise ScriptError(f"--tools: the prompts of {args.dataset_name!r} are text; give messages (the template "
                              "writes the tools in)")
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:  # the template writes the special tokens
            text = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False,
                                                 add_generation_prompt=True) if prompt else ""
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        reason = "empty prompt" if not ids else "prompt too long" if len(ids) > args.max_prompt_length else None
        if reason:
            dropped[reason] += 1
        else:
            data["prompt"].append(ids)
            data["answer"].append(answer)
    return data, dropped


def rollouts_of(num_prompts, prompts_per_rollout, samples, passes_flag, args, dropped):
    """Set num_training_steps: rollouts of `passes_flag` x num_mini_batches steps."""
    steps_per_rollout = getattr(args, passes_flag[2:]) * args.num_mini_batches
    for flag, value in (("--max_steps", args.max_steps), ("--save_every", args.save_every)):
        if value > 0 and value % steps_per_rollout:
            raise ScriptError(f"{flag} {value}: must be a multiple of a rollout's {steps_per_rollout} optimizer steps "
                              f"({passes_flag} x --num_mini_batches)")
    if num_prompts < prompts_per_rollout:
        raise ScriptError(f"{num_prompts} training prompts (dropped: {dropped}) cannot fill a rollout of "
                          f"{prompts_per_rollout}: lower the batch sizes")
    epochs = args.num_train_epochs * (num_prompts // prompts_per_rollout)
    num_rollouts = args.max_steps // steps_per_rollout if args.max_steps > 0 else epochs
    args.num_training_steps = num_rollouts * steps_per_rollout
    if dist.get_rank() == 0:
        print(f"{num_rollouts} rollouts of {prompts_per_rollout} prompts{samples}, each {steps_per_rollout} steps of "
              f"{args.batch_size}")
    return num_rollouts, steps_per_rollout


def global_batch(step, num_rows, batch_size, seed):
    """Rows of global batch `step`: a function of the step alone (every rank, resume)."""
    epoch, position = divmod(step, num_rows // batch_size)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch_size : (position + 1) * batch_size].tolist()


def micro_batches(batch, args):
    """This rank's micro-batches of a global batch."""
    size = args.per_device_train_batch_size
    for k in range(args.gradient_accumulation_steps):
        start = (k * args.world_size + dist.get_rank()) * size
        yield batch[start : start + size]


def rank_micro_batches(num_rows, size):
    """This rank's share of the rows, as many micro-batches on every rank (FSDP forwards are collectives): out of rows,
    row 0, valid False."""
    share = list(range(dist.get_rank(), num_rows, dist.get_world_size()))
    for start in range(0, math.ceil(num_rows / dist.get_world_size()), size):
        rows = share[start : start + size]
        yield (rows, True) if rows else ([0], False)


def pad(sequences, value, side):
    """Lists of ints padded to one width on `side`."""
    tensors = [torch.tensor(s, dtype=torch.long) for s in sequences]
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=side)


def make_batch(device, prompts, completions, rows, args):
    """A micro-batch of `rows` on the device: sequences end to end in right-padded rows, positions restarting at each
    (no attention mask: causal attention never reads a later pad, the positions part packed sequences); one a row,
    or (--padding_free) packed best fit into rows as long as the longest. Also each completion token's flat index,
    each sequence's last token's, and the tokens but padding."""
    prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
    lengths, tokens, positions = [len(p) + len(c) for p, c in zip(prompts, completions)], [], []
    first = [0] * len(lengths)  # each completion's first token
    width = max(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [r for r in range(len(tokens)) if args.padding_free and len(tokens[r]) + lengths[i] <= width]
        r = max(fits, key=lambda r: len(tokens[r]), default=len(tokens))
        if r == len(tokens):
            tokens.append([])
            positions.append([])
        first[i] = r * width + len(tokens[r]) + len(prompts[i])
        tokens[r] += prompts[i] + completions[i]
        positions[r] += range(lengths[i])
    input_ids = pad(tokens, 0, "right")
    completion_mask = pad([[1] * len(c) for c in completions], 0, "right")  # from the lengths: pad may be EOS
    first = torch.tensor(first)
    batch = {"input_ids": input_ids, "position_ids": pad(positions, 0, "right"), "completion_mask": completion_mask,
             "targets": first[:, None] + torch.arange(completion_mask.shape[1]),  # past a completion's end: masked
             "last": first + completion_mask.sum(1) - 1, "tokens": torch.tensor(sum(lengths))}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def decoder_states(model, batch, **options):
    """A batch's forward and its decoder's output (hooked: output_hidden_states gives views, FSDP2 warns)."""
    hidden = []
    hook = model.get_decoder().register_forward_hook(lambda module, inputs, output: hidden.append(output[0]))
    output = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **options)
    hook.remove()
    return output, hidden[0]


def load_pretrained(auto_class, path, args, flag, **options):
    """auto_class.from_pretrained(path), refused naming `flag`; a model (fp32, its load report) read by the first
    process, built on the meta device by the others."""
    check_local_path(path, flag, auto_class)
    if auto_class is AutoTokenizer:
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as e:
            raise loading_error(auto_class, path, flag, e) from e
    model, report = None, [None, None]  # the first process's error and load report
    if dist.get_rank() == 0:
        try:
            model, report[1] = auto_class.from_pretrained(path, trust_remote_code=args.trust_remote_code,
                                                          dtype=torch.float32, output_loading_info=True,
                                                          ignore_mismatched_sizes=True, **options)
            for name, found, built in sorted(report[1]["mismatched_keys"])[:1]:  # HF would re-initialise it
                report[0] = ScriptError(f"{flag} {path!r}: {name} is {list(found)}; config.json makes {list(built)}")
        except (OSError, ValueError, SafetensorError) as e:
            report[0] = loading_error(auto_class, path, flag, e)
    dist.broadcast_object_list(report, src=0)
    if report[0]:
        raise report[0]
    if model is None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code, **options)
        with torch.device("meta"):
            model = auto_class.from_config(config, trust_remote_code=args.trust_remote_code, dtype=torch.float32)
    return model, report[1]


def disable_dropout(model):
    """Dropout off: passes that compare log-probs must agree."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def shard_model(model, args, mesh):
    """FSDP2 over `mesh` (HSDP if 2-D), gradients summed (each loss is a global mean); the first process's weights
    broadcast a tensor at a time."""
    loaded = model.state_dict() if dist.get_rank() == 0 else {}
    if args.gradient_checkpointing:  # in training mode only: not on frozen models
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gpu = mesh.device_type == "cuda"
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if args.bf16 and gpu else {}
    policies = {"mesh": mesh,
                "mp_policy": MixedPrecisionPolicy(**bf16),
                "offload_policy": CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()}
    layers = [module for module in model.modules() if type(module).__name__ in (model._no_split_modules or [])]
    for module in layers + [model]:  # None: the root keeps its weights gathered
        fully_shard(module, reshard_after_forward=None if args.reshard_after_forward else False, **policies)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if dist.get_rank() > 0:  # built on the meta device: room for its shards
        model.to_empty(device="cpu" if args.cpu_offload else mesh.device_type)
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # not all are in a state dict (rotary inv_freq)
        dist.broadcast(buffer, src=0)
    return model


def load_model(auto_class, path, args, flag, mesh, frozen=False):
    """A model sharded, dropout off; frozen: no gradients."""
    model, report = load_pretrained(auto_class, path, args, flag)
    check_weights(model, report, path, flag)
    disable_dropout(model)
    return shard_model(model.requires_grad_(False).eval() if frozen else model, args, mesh)


def load_reward_model(args, tokenizer, mesh):
    """The frozen reward model, whose tokenizer must be the policy's (it reads its ids)."""
    path, flag = args.reward_model_path, "--reward_model_path"
    if load_pretrained(AutoTokenizer, path, args, flag).get_vocab() != tokenizer.get_vocab():
        raise ScriptError(f"{flag} {path}: its tokenizer is not the policy's")
    return load_model(AutoModelForSequenceClassification, path, args, flag, mesh, frozen=True)


def completion_logprobs(model, batch, temperature=1.0, with_entropy=False):
    """Log-probs (and entropies) of the completions' tokens from logits / T, by HeadLogprobs: a (sequences, completion
    width) table, 0 past a completion's end."""
    output, hidden = decoder_states(model, batch, logits_to_keep=1)
    head = model.get_output_embeddings()
    check_linear_head(model, head, hidden[:, -1], output.logits[:, -1])
    mask = batch["completion_mask"].bool()
    at = batch["targets"][mask]  # the completion tokens' flat indices: the state before each predicts it
    bias = None if head.bias is None else head.bias / temperature  # logits / T: states and bias / T, not the head
    outputs = HeadLogprobs.apply(hidden.flatten(0, 1)[at - 1] / temperature, batch["input_ids"].flatten()[at],
                                 with_entropy, head.weight, bias)
    logprobs, entropy = (out.new_zeros(mask.shape).masked_scatter(mask, out) for out in outputs)
    return (logprobs, entropy) if with_entropy else logprobs


HEAD_ROWS = 1024  # 0.9 GiB of logits for a vocabulary of 151,936


class HeadLogprobs(torch.autograd.Function):
    """log_softmax(head(hidden)) at `labels` (and entropies), HEAD_ROWS rows at a time; the backward recomputes the
    softmax as the logits' gradient (autograd would keep the logits), a vocabulary slice for all rows at a time (as
    many logits as a chunk's): a slice's head gradient is one matrix product, no fp32 copy of the head."""

    @staticmethod
    def forward(ctx, hidden, labels, with_entropy, weight, bias=None):
        logprobs, entropy, log_z = torch.zeros(3, len(labels), device=hidden.device)
        for rows in torch.arange(len(labels), device=hidden.device).split(HEAD_ROWS):
            logits = F.linear(hidden[rows], weight, bias)
            log_p = logits.log_softmax(-1, dtype=torch.float32)  # one kernel
            logprobs[rows] = log_p.gather(1, labels[rows, None])[:, 0]
            log_z[rows] = logits.gather(1, labels[rows, None])[:, 0] - logprobs[rows]  # the softmax's log divisor
            entropy[rows] = -(log_p.exp() * log_p).sum(-1) if with_entropy else 0
        ctx.save_for_backward(hidden, labels, logprobs, log_z, entropy, weight, bias)
        ctx.set_materialize_grads(False)  # entropy out of the loss: None
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad, grad_entropy):
        hidden, labels, logprobs, log_z, entropy, weight, bias = ctx.saved_tensors
        grad = -grad[:, None]  # the logits' gradient: grad x (one-hot - softmax), a row's factor out of the products
        factor = grad if grad_entropy is None else torch.ones_like(grad)  # with the entropy's: in them
        head, scaled = [p for p in (weight, bias) if p is not None], (hidden * factor).to(hidden.dtype)
        grads, grad_hidden = [torch.empty_like(p) for p in head], torch.zeros_like(hidden, dtype=torch.float32)
        size = max(HEAD_ROWS * len(weight) // len(hidden), 1)
        for start in range(0, len(weight), size):
            w, *b = (p[start : start + size] for p in head)
            probs = F.linear(hidden, w, *b).float().sub_(log_z[:, None])  # log p
            at = ((labels >= start) & (labels < start + size)).nonzero()[:, 0]  # one sync
            probs[at, labels[at] - start] = logprobs[at]  # at the labels, the forward's (not recomputed)
            if grad_entropy is None:
                probs.exp_()
            else:  # d entropy / d logit: -p (log p + entropy)
                p = probs.exp()
                probs = probs.add_(entropy[:, None]).mul_(-grad_entropy[:, None]).add_(grad).mul_(p)
            probs[at, labels[at] - start] -= 1 if grad_entropy is None else grad[at, 0]  # - one-hot
            probs = probs.to(w.dtype)  # rounded once
            grad_hidden += probs @ w * factor
            for whole, x in zip(grads, (scaled, factor[:, 0].to(probs.dtype))):
                whole[start : start + size] = probs.T @ x
        return grad_hidden.to(hidden.dtype), None, None, *grads, None  # a None to spare: no bias


def head_scores(model, batch):
    """A reward or value model's score at every position, flat, plus its config's score_bias."""
    scores = []
    hook = model.score.register_forward_hook(lambda module, inputs, output: scores.append(output[..., 0].float()))
    decoder_states(model, batch)
    hook.remove()
    return scores[0].flatten() + getattr(model.config, "score_bias", 0.0)


def sequence_scores(model, batch):
    """A reward model's score at each sequence's last token."""
    return head_scores(model, batch)[batch["last"]]


def make_optimizer(model, args):
    """AdamW or TF-style Adam, the LR schedule, what --resume_from restores."""
    if args.optimizer == "adam_tf":
        optimizer = AdamTF(model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay, fused=True)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, math.ceil(args.warmup_ratio * args.num_training_steps),
                              args.num_training_steps)
    if args.resume_from:
        return optimizer, scheduler, *load_checkpoint(args.resume_from, model, optimizer, scheduler, args)
    return optimizer, scheduler, 0, {}


def open_metrics(args, start_step):
    """wandb, metrics.jsonl (kept up to a resumed step), a progress bar at a terminal."""
    path, rank = os.path.join(args.output_dir, "metrics.jsonl"), dist.get_rank()
    if rank == 0:
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), save_code=True,
                       name=f"{os.path.basename(sys.argv[0])}__{args.seed}__{int(time.time())}")
        old = [json.loads(line) for line in open(path)] if start_step > 0 and os.path.exists(path) else []
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in old if row["step"] <= start_step)
    bar = tqdm(total=args.num_training_steps, initial=start_step, disable=rank != 0 or not sys.stderr.isatty())
    return path, bar


@contextlib.contextmanager
def unsharded(model, keep=False):
    """Parameters gathered once, FSDP2's hooks set aside: generating is no collective."""
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    hooks = [(module._forward_pre_hooks, module._forward_hooks) for module in fsdp_modules]
    for module in fsdp_modules:
        module.unshard()
        module._forward_pre_hooks, module._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
    try:
        yield
    finally:
        for module, (pre_hooks, post_hooks) in zip(fsdp_modules, hooks):
            module._forward_pre_hooks, module._forward_hooks = pre_hooks, post_hooks
            if not keep:  # --no-reshard_after_forward: gathered for the next forward
                module.reshard()


@torch.no_grad()
def generate_completions(model, prompts, max_new_tokens, temperature, eos_token_id, pad_token_id, cache="dynamic"):
    """A completion per prompt from softmax(logits / temperature) (None: greedy), cut after EOS."""
    device = next(model.parameters()).device
    input_ids, attention_mask = pad(prompts, pad_token_id, "left"), pad([[1] * len(p) for p in prompts], 0, "left")
    if cache == "static":  # prompt widths in steps of 64: fewer shapes to compile
        extra = -input_ids.shape[1] % 64
        input_ids = F.pad(input_ids, (extra, 0), value=pad_token_id)
        attention_mask = F.pad(attention_mask, (extra, 0), value=0)
    # the log-probs' distribution: no top_k or top_p (not the folder's generation_config, nor HF's top_k 50)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    config = GenerationConfig(**(sampling or {"do_sample": False}), max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              cache_implementation=None if cache == "dynamic" else cache)
    folder_config, model.generation_config, was_training = model.generation_config, GenerationConfig(), model.training
    model.eval()  # in training mode gradient checkpointing turns the KV cache off
    try:  # unsharded: the ranks need not keep step
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=config, synced_gpus=False)
    finally:
        model.generation_config = folder_config
        model.train(was_training)
    rows = output[:, input_ids.shape[1] :].tolist()
    return [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]


def rollout_mini_batches(rollout_index, passes, args, group=1):
    """`passes` passes over a rollout, each a fresh order of its groups of rows, in mini-batches."""
    for iteration in range(passes):
        seed = (args.seed * 100_003 + rollout_index) * 100_003 + iteration
        order = torch.randperm(args.rollout_batch_size // group, generator=torch.Generator().manual_seed(seed))
        order = (order[:, None] * group + torch.arange(group)).flatten().tolist()
        for k in range(args.num_mini_batches):
            yield order[k * args.batch_size : (k + 1) * args.batch_size]


def optimizer_step(model, optimizer, scheduler, loss, step, args):
    """Clip the gradient norm, update unless guard_step stops the run, step the schedule."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf).full_tensor()
    stop = guard_step(loss, grad_norm, step, args)
    optimizer.step()
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm, stop


def is_due(step, every, args):
    """Every `every` steps (-1: never) and the last."""
    return step == args.num_training_steps or (every > 0 and step % every == 0)


def reduce_sums(sums):
    """{name: this rank's sum} -> {name: the sum over ranks}."""
    names = sorted(sums)
    totals = torch.stack([sums[name].float() for name in names])
    dist.all_reduce(totals)
    return dict(zip(names, totals.tolist()))


def log_metrics(metrics, path, args, progress, samples=None):
    """Rank 0 prints the metrics (and samples), to metrics.jsonl and wandb."""
    if dist.get_rank() != 0:
        return
    progress.write(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    for prompt, completion, *numbers in (samples or [[]])[1:]:
        values = ", ".join(f"{name} {value:+.3f}" for name, value in zip(samples[0][2:], numbers))
        progress.write(f"  {values} | {prompt!r} -> {completion!r}")
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if args.track:
        import wandb

        table = {"samples": wandb.Table(columns=samples[0], data=samples[1:])} if samples else {}
        wandb.log({**metrics, **table}, step=metrics["step"])


def save_checkpoint(model, optimizer, scheduler, step, args, state, stop):
    """checkpoints/step_N: the arguments, each rank's scheduler, RNG and loop state, then model and optimizer (DCP:
    its .metadata, written last, marks it complete); if `stop`, the exit."""
    rank, path = dist.get_rank(), os.path.join(args.output_dir, "checkpoints", f"step_{step}")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # a crash's, or a restarted run's old step
        os.makedirs(path)
        with open(f"{path}/checkpoint.json", "w") as f:
            json.dump({"step": step, "args": vars(args)}, f, indent=1)
    dist.barrier()
    rng = {"torch": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng, "state": state}, f"{path}/rank{rank}.pt")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=path)
    signum = STOP_SIGNALS[0] if STOP_SIGNALS else signal.SIGTERM  # the signal may have reached another rank only
    if stop and rank == 0:
        print(f"stopped by {signal.Signals(signum).name}: checkpoint {path}; --resume_from auto continues")
    dist.barrier()
    if stop:
        dist.destroy_process_group()
        sys.exit(128 + signum)


def complete_checkpoints(output_dir):
    """output_dir's complete checkpoints, oldest first."""
    found = filter(is_complete, glob.glob(os.path.join(glob.escape(output_dir), "checkpoints", "*")))
    return sorted(found, key=lambda path: json.load(open(f"{path}/checkpoint.json"))["step"])


def is_complete(path):
    """With its arguments and .metadata."""
    return os.path.exists(f"{path}/checkpoint.json") and os.path.exists(f"{path}/.metadata")


def load_checkpoint(path, model, optimizer, scheduler, args):
    """A checkpoint of this run restored on any number of processes."""
    manifest = check_checkpoint(path, args)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=path)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    same = manifest["args"]["world_size"] == args.world_size  # else per-rank random streams restart
    extra = torch.load(f"{path}/rank{dist.get_rank() if same else 0}.pt", weights_only=True, mmap=True)  # read as used
    scheduler.load_state_dict(extra["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the next step's (not in the checkpoint)
    if same:
        torch.set_rng_state(extra["rng"]["torch"])
        if "cuda" in extra["rng"]:
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} (written by {manifest['args']['world_size']} processes)")
    return manifest["step"], extra["state"]


def finish(model, tokenizer, args, device):
    """The full weights gathered into a Hugging Face folder, the peak memory printed, wandb and the group closed."""
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    kept = dict(model.named_parameters()) | dict(model.named_buffers())  # not a tied head's copy
    state_dict = {name: tensor for name, tensor in state_dict.items() if name in kept}
    if dist.get_rank() == 0:
        model.save_pretrained(args.output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(args.output_dir)
    gpu = device.type == "cuda"
    peak = torch.tensor(torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                        * 1024.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"saved {args.output_dir}; peak {'GPU' if gpu else 'CPU RSS'} memory per process {peak / 2**30:.2f} GiB")
        if args.track:
            import wandb

            wandb.finish()
    dist.barrier()  # no rank tears the group down while another communicates
    dist.destroy_process_group()


# Guards: what only refuses bad input or protects a run, each reached by one call from the plumbing or main.
class ScriptError(ValueError):
    """An error on purpose: its message names the problem, where, and the fix."""


def guard_run(args, auto):
    """Errors as one line, signals as a checkpoint, bars and logs at a terminal only, numbers their types rule out
    refused, output_dir claimed."""
    sys.excepthook = report_error
    signal.signal(signal.SIGTERM, request_stop)  # preemption: torchrun forwards it to every process
    signal.signal(signal.SIGINT, request_stop)
    logging.getLogger("transformers.modeling_utils").addFilter(lambda record: "LOAD REPORT" not in str(record.msg))
    if dist.get_rank() > 0 or not sys.stderr.isatty():  # a log file: metric lines and refusals alone
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        logging.getLogger("datasets").setLevel(logging.CRITICAL)  # its errors: named by ours
        logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # retries: our one line says why
    for field in fields(args):
        value, types = getattr(args, field.name), (field.type, *get_args(field.type))  # Optional[X]: X too
        for allowed, check in [rule for t in types for rule in getattr(t, "__metadata__", ()) if type(rule) is tuple]:
            if value is not None and not check(value):
                raise ScriptError(f"--{field.name} {value}: {'not a number' if value != value else 'must be'} "
                                  f"{allowed.format(dist.get_world_size())}")
    claim_output_dir(args, auto)


def report_error(kind, error, traceback):
    """sys.excepthook: a ScriptError is one line from the first process, exit 2."""
    if not isinstance(error, ScriptError):
        return sys.__excepthook__(kind, error, traceback)
    if os.environ.get("RANK", "0") == "0":
        print(f"{os.path.basename(sys.argv[0])}: error: {' '.join(str(error).split())}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


RUN_FILES = ("metrics.jsonl", "checkpoints", "model.safetensors", "model.safetensors.index.json")


OUTPUT_DIR_LOCK = []  # the first process's open output_dir/.lock


def claim_output_dir(args, auto):
    """The first process claims output_dir (and checks --track); every process must read its token there."""
    verdict = [None, f"{os.uname().nodename} {os.getpid()} {time.time()}"]
    if dist.get_rank() == 0:
        verdict[0] = output_dir_verdict(args, auto, verdict[1]) or tracking_problem(args)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ScriptError(verdict[0])
    lock, views = os.path.join(args.output_dir, ".lock"), [None] * dist.get_world_size()
    dist.all_gather_object(views, (os.uname().nodename, os.path.exists(lock) and open(lock).read() == verdict[1]))
    if not all(same for _, same in views):
        raise ScriptError(f"--output_dir {args.output_dir} on {sorted({n for n, same in views if not same})} is not "
                          "the first node's: give a shared folder")


def output_dir_verdict(args, auto, token):
    """The first process's refusal or None: a flock for the run's life; another run's folder unless continued."""
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = open(os.path.join(args.output_dir, ".lock"), "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"another run is writing to --output_dir {args.output_dir}: wait, or choose another"
    except OSError as e:
        return f"--output_dir {args.output_dir}: {e.strerror}; give a folder"
    lock.truncate(0)
    lock.write(token)
    lock.flush()
    OUTPUT_DIR_LOCK[:] = [lock]
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(args.output_dir, name))]
    finished = any(name.startswith("model.") for name in found)
    if not found or args.resume_from or (auto and not finished):  # auto: restarts a run stopped before a checkpoint
        return None
    auto = "--resume_from auto continues it, " if not finished or complete_checkpoints(args.output_dir) else ""
    return f"--output_dir {args.output_dir} holds another run ({', '.join(found)}): {auto}or remove it, or choose " \
           "another"


def tracking_problem(args):
    """--track online without a wandb key: wandb would raise once the models are loaded."""
    if args.track:
        import wandb

        hook, mode = sys.excepthook, wandb.setup().settings.mode
        sys.excepthook = hook  # not wandb's: it prints a refusal's traceback
        if mode not in ("offline", "disabled", "dryrun") and not wandb.login(verify=False, prompt=False):
            return "--track: wandb has no API key here: run `wandb login`, or set WANDB_MODE=offline"


STOP_SIGNALS = []


def request_stop(signum, frame):
    """SIGTERM or SIGINT: checkpoint after this step and leave (a second Ctrl-C: at once)."""
    if signum == signal.SIGINT and STOP_SIGNALS:
        raise KeyboardInterrupt
    STOP_SIGNALS.append(signum)


def guard_step(loss, grad_norm, step, args):
    """One all-reduce: a non-finite loss or norm anywhere, or a first step without gradient, stops the run before the
    update; a signal anywhere, after it."""
    no_gradient = (grad_norm == 0) & (loss != 0) & (step == 1)
    flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(grad_norm), no_gradient,
                         torch.tensor(bool(STOP_SIGNALS), device=grad_norm.device)]).float()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_loss, bad_norm, no_gradient, stop = flags.tolist()
    if bad_loss or bad_norm:
        what = " and ".join(name for name, bad in [("loss", bad_loss), ("grad_norm", bad_norm)] if bad)
        last = (complete_checkpoints(args.output_dir) or ["none (see --save_every)"])[-1]
        raise ScriptError(f"step {step}: non-finite {what} (grad_norm {grad_norm.item()}), not applied. Last "
                          f"complete checkpoint: {last}. Lower --learning_rate")
    if no_gradient:
        raise ScriptError(f"step 1: no weight of --model_name_or_path {args.model_name_or_path} gets a gradient "
                          "(grad_norm 0): its weights are broken (all zero, or past float range)")
    return stop > 0


def check_local_path(path, what, auto_class=None):
    """A missing local path, refused before the hub retries it for a minute."""
    meant_local = path.startswith(("/", "./", "../", "~")) or ("/" in path and os.path.isdir(path.split("/")[0]))
    meant_local |= path.endswith(DATA_EXTENSIONS)  # a file, not a hub id
    if meant_local and not os.path.exists(os.path.expanduser(path)):
        raise ScriptError(f"{what} {path!r}: no such file or folder")
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if auto_class is AutoTokenizer and os.path.isdir(path) and not any(os.path.exists(f"{path}/{f}") for f in files):
        raise ScriptError(f"{what} {path!r} has no tokenizer files: save the tokenizer there")


def loading_error(auto_class, path, flag, error):
    """Why it does not load: no such name, or HF's reason."""
    if not os.path.exists(path):
        return ScriptError(f"{flag} {path!r}: no such folder, nor on the hub ({str(error).splitlines()[0]})")
    return ScriptError(f"{flag} {path!r} does not load with {auto_class.__name__}: {error}")


def check_weights(model, info, path, flag):
    """No weight missing (HF would make it up) or left over (a reward model as a causal LM)."""
    problems = [f"no weights for {sorted(info['missing_keys'])}"] if info["missing_keys"] else []
    problems += [f"weights {sorted(info['unexpected_keys'])} it does not use"] if info["unexpected_keys"] else []
    if problems:
        wanted = "reward.py's output" if "Classification" in type(model).__name__ else "a causal LM"
        raise ScriptError(f"{flag} {path!r} has {' and '.join(problems)} as {type(model).__name__}: give {wanted}")


def check_tokenizer(tokenizer, args):
    """An EOS (and a pad, if any) from the tokenizer's files, not made up by HF."""
    listed = tokenizer.init_kwargs.get("added_tokens_decoder")  # the added tokens of its files
    for name in ("eos", "pad"):
        token = getattr(tokenizer, f"{name}_token_id")
        made_up = listed and token and token >= tokenizer.vocab_size and token not in listed
        if made_up or (name == "eos" and token is None):
            raise ScriptError(f"the tokenizer of {args.model_name_or_path} has no {name}_token"
                              f"{' (HF made one up)' if made_up else ''}: set one in its tokenizer_config.json")


DATASETS_METADATA = {"dataset_infos.json", "dataset_info.json", "state.json", "dataset_dict.json"}


def check_split_files(folder, splits):
    """Every data file of a folder in a split (datasets skips files without a split word once one has one)."""
    used = {os.path.realpath(f) for files in splits.values() for f in files}
    skipped = [os.path.relpath(f, folder) for f in glob.glob(f"{folder}/**/*", recursive=True)  # hidden ones aside
               if f.endswith(DATA_EXTENSIONS) and os.path.basename(f) not in DATASETS_METADATA
               and os.path.realpath(f) not in used]
    if skipped:
        found = {split: [os.path.relpath(f, folder) for f in files] for split, files in splits.items()}
        raise ScriptError(f"dataset folder {folder!r}: {sorted(skipped)} would be in no split (found {found}); name "
                          "each after its split")


def data_file_problem(path, column=None):
    """Why a JSON(L) file does not load, or the first row whose `column` is not text, by line; or None."""
    raw = open(path, "rb").read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        return f"dataset file {path!r} line {line} is not UTF-8 text ({e.reason} at byte {e.start})"
    if not text.strip():
        return f"dataset file {path!r} is empty"
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line.strip() or "null")  # a blank line: no row, no error
        except json.JSONDecodeError as e:
            return f"dataset file {path!r} line {number} is not valid JSON ({e.msg}, column {e.colno}): {line[:80]!r}"
        if column and isinstance(row, dict) and not isinstance(row.get(column, ""), str):
            return f"dataset file {path!r} line {number}: {column!r} is {row[column]!r}, not text: give a JSON string"
    return None


ROLES = ("system", "developer", "user", "assistant", "tool")


def check_columns(dataset, args, split, tokenizer):
    """Text, not numbers ("0457" read as 457); messages with a role and text; no text spelling a special token (a
    fake turn, an early EOS)."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special})
    names = ["prompt", "completion", "chosen", "rejected", "messages", getattr(args, "prompt_column", "prompt"),
             getattr(args, "answer_column", "answer")]
    file = args.dataset_name if os.path.isfile(args.dataset_name) else ""
    for column in [name for name in dict.fromkeys(names) if name in dataset.column_names]:
        where = f"dataset {args.dataset_name!r}, split {split!r}, column {column!r}"
        if isinstance(dataset.features[column], datasets.Json):  # mixed types: datasets decodes " 39" to 39 too
            raise ScriptError(file and data_file_problem(file, column) or f"{where}: text mixed with other values")
        try:
            values = list(dataset[column])
        except UnicodeDecodeError as e:  # pyarrow keeps bytes unchecked: they fail when read as text
            raise ScriptError(file and data_file_problem(file) or f"{where}: not UTF-8 text ({e.reason})") from e
        for row, value in enumerate(values):
            problem = value_problem(value, specials, ".csv" in file)
            if problem:
                raise ScriptError(f"{where}, row {row}: {problem}")


def value_problem(value, specials, csv):
    """What is wrong with a text column's value (a string, or messages), or None."""
    if value is None:
        return "no value (null, or missing where other rows have one)"
    if not isinstance(value, (str, list)):
        return f"{value!r} was read as a number, not text: " + ("convert the CSV file to JSON Lines" if csv else
                                                                "give a string")
    messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"message {message!r} has no role: give one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {message!r} has no text content: give one"
    spelt = [token for token in specials for message in messages if token in message["content"]]
    return f"the text {spelt[0]!r} would become a special token: remove it" if spelt else None


def check_splits(args, tokenizer, splits):
    """A train split; token ids and lengths within the model's vocabulary and positions."""
    if args.dataset_train_split not in splits:
        raise ScriptError(f"dataset {args.dataset_name!r} has no split {args.dataset_train_split!r}: name one with "
                          "--dataset_train_split")
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    config, model = config.get_text_config(), f"the model {args.model_name_or_path!r}"
    limit = getattr(config, "max_position_embeddings", None) or math.inf
    for split, data in splits.items():
        columns = [data[c] for c in ("prompt", "completion", "chosen", "rejected") if c in data]
        top = max([max(ids) for column in columns for ids in column] + [tokenizer.eos_token_id])
        if top >= config.vocab_size:
            raise ScriptError(f"split {split!r} has token id {top}, past the vocab_size {config.vocab_size} of "
                              f"{model}: the tokenizer and the model do not belong together")
        lengths = [len(p) + max([len(c[i]) for c in columns[1:]] or [args.max_completion_length])
                   for i, p in enumerate(columns[0])]
        longest = max(range(len(lengths)), key=lengths.__getitem__, default=0)
        if lengths and lengths[longest] > limit:
            then = "its completion" if columns[1:] else f"--max_completion_length {args.max_completion_length}"
            raise ScriptError(f"split {split!r}: the prompt {tokenizer.decode(columns[0][longest])[:40]!r}... and "
                              f"{then} take {lengths[longest]} tokens, past the {limit} positions of {model}: lower "
                              "--max_prompt_length (dropping longer prompts) or --max_completion_length")


def check_rewards(rewards, sources):
    """Finite rewards (column j from sources[j]): a NaN would reach the advantages unseen."""
    for count, source in zip((~torch.isfinite(rewards)).sum(0).tolist(), sources):
        if count:
            raise ScriptError(f"{count} of {len(rewards)} completions got a non-finite reward from {source}: check it")


@torch.no_grad()
def check_linear_head(model, head, hidden, logits):
    """HeadLogprobs needs logits linear in the last hidden state (no logit scale or soft-capping)."""
    difference = (F.linear(hidden, head.weight, head.bias).float() - logits.float()).abs()
    if (difference > 0.02 * (1 + logits.float().abs().max())).any():
        raise ScriptError(f"{type(model).__name__}: its logits are not its head's linear map of its last hidden "
                          "states")


@torch.no_grad()
def check_layout(model, prompts, completions, args, flag):
    """--padding_free refused for a model that reads across the sequences of a packed row (a forward that drops
    position_ids, as remote code may): the longest first row cut in three, the last two packed, together against
    alone; the first, alone in its row both ways, gives the kernels' own noise."""
    t = max([p + c for p, c in zip(prompts[:8], completions)], key=len)
    h, q = len(t) // 2, len(t) // 4
    if not args.padding_free or q == 0:
        return
    pieces = [(t[:h], t[h:]), (t[:q], t[q:h]), (t[h : h + q], t[h + q :])]  # L, L/2, L/2 tokens
    logits = {} if hasattr(model, "score") else {"logits_to_keep": 1}  # a reward model takes no such argument
    training = model.training
    model.eval()  # no dropout (sft.py's ranks but the first build their model in training mode)

    def states(rows):  # the decoder's output at the completion tokens
        batch = make_batch(next(model.parameters()).device, *zip(*pieces), rows, args)
        found = decoder_states(model, batch, **logits)[1].flatten(0, 1)[batch["targets"][batch["completion_mask"] > 0]]
        return found.float()

    together = states(range(3)).split([len(c) for _, c in pieces])
    gaps = torch.stack([(a - b).norm() / b.norm() for a, b in zip(together, map(states, ([0], [1], [2])))])
    model.train(training)
    for module in model.modules():  # the sharded parameters back: a forward leaves the root's gathered
        if isinstance(module, FSDPModule):
            module.reshard()
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # one verdict on every rank
    leak = gaps[1:].max().item()
    if leak > max(10 * gaps[0].item(), 2e-2 if args.bf16 and torch.cuda.is_available() else 1e-3):
        raise ScriptError(f"{flag} {getattr(args, flag[2:])!r} reads across the sequences of a packed row ({leak:.2g} "
                          "relative change): use --no-padding_free")


def check_checkpoint(path, args):
    """The manifest of a complete checkpoint of this run (the same arguments but Resumable ones); its .metadata read
    through an allow-list, with no bytes entry (DCP unpickles those): loading runs no planted code."""
    if not is_complete(path):
        raise ScriptError(f"--resume_from {path!r} is not a complete checkpoint: --resume_from auto finds one")
    allowed = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "Path")}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if not (module == "torch.distributed.checkpoint.metadata" or (module, name) in allowed
                    or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
                raise ScriptError(f"checkpoint metadata refers to {module}.{name}: not a DCP metadata class")
            return super().find_class(module, name)

    with open(f"{path}/.metadata", "rb") as f:
        entries = Unpickler(f).load().state_dict_metadata.items()
    pickled = [key for key, entry in entries if isinstance(entry, dcp.metadata.BytesStorageMetadata)]
    if pickled:
        raise ScriptError(f"checkpoint {path} lists a non-tensor entry ({pickled[0]}): not ours")
    manifest = json.load(open(f"{path}/checkpoint.json"))
    origin = {"batch_size": " (processes x micro-batch x accumulation)",  # computed: named by what makes them
              "num_training_steps": " (--max_steps, or --num_train_epochs x the rows)"}
    now, then = json.loads(json.dumps(vars(args))), manifest["args"]  # as JSON has them
    fixed = [field.name for field in fields(args) if RESUMABLE not in getattr(field.type, "__metadata__", ())]
    mismatched = [f"{name}{origin.get(name, '')} {then.get(name)!r} in the checkpoint, {now[name]!r} now"
                  for name in fixed if then.get(name) != now[name]]
    if mismatched:
        raise ScriptError(f"checkpoint {path} does not match the arguments: {'; '.join(mismatched)}. Resume with "
                          "its arguments")
    return manifest


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # output into a closed pipe (--help | head): exit quietly
    first = os.environ.get("RANK", "0") == "0"  # tyro prints a value's refusal on every process: the first's alone
    with contextlib.redirect_stderr(sys.stderr if first else open(os.devnull, "w")):
        args = tyro.cli(Args, use_underscores=True, console_outputs=first)
    main(args)
