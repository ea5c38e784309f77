"""Proximal Policy Optimization (PPO) for RLHF in one file: sample a completion for each prompt, score it with a
reward model, penalise each token's KL to the reference model, and train the policy with PPO's clipped surrogate and a
value model with a clipped value loss, on advantages from GAE. Papers: arXiv:1909.08593 (Ziegler et al.,
lm-human-preferences), arXiv:1707.06347 (PPO), arXiv:2403.17031 (the N+ implementation details of RLHF with PPO).
What differs: (1) the loss is divided by the global mini-batch's completion tokens, whatever its split; (2) rollouts
are seeded by (seed, rollout, generation chunk): the same on any number of processes and on resume; (3) the value
model is a separate model (from the reward model), trained by the same optimizer.
Run (the toy task's command: README):
      torchrun --nproc_per_node 8 ppo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
          --reward_model_path runs/reward_qwen --dataset_name trl-lib/tldr --max_completion_length 53 \
          --optimizer adam_tf --adam_epsilon 1e-5 --track
"""

import collections
import contextlib
import fcntl
import glob
import json
import logging
import math
import os
import pickle
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
Penalty = Annotated[float, ("0 or more, finite in float32 (the rewards')", lambda v: 0 <= v <= torch.finfo().max)]
ShardDegree = Annotated[int, ("-1 (all) or a divisor of the {} processes",
                              lambda v: v == -1 or v >= 1 and dist.get_world_size() % v == 0)]
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
    output_dir: Resumable[str] = "runs/ppo"
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
    """(computed) batch_size x num_mini_batches: a rollout's prompts, one completion each"""

    # RL: rollouts and rewards
    max_prompt_length: AtLeast1 = 512
    """longer prompts (tokens) are dropped, and counted"""
    max_completion_length: AtLeast1 = 256
    """new tokens per completion (then truncated)"""
    num_ppo_epochs: AtLeast1 = 4
    """passes over a rollout"""
    num_mini_batches: AtLeast1 = 1
    """optimizer steps per pass over a rollout"""
    local_rollout_forward_batch_size: Resumable[AtLeast1] = 64
    """completions per process per generation call or no-grad forward"""
    temperature: Positive = 0.7
    """sampling temperature (log-probs from logits / temperature)"""
    cache_implementation: Resumable[Literal["dynamic", "static"]] = "dynamic"
    """generation's KV cache (static: compiled on a GPU, faster after the first rollout)"""
    prompt_column: str = "prompt"
    """the dataset column of the prompts"""
    reward_model_path: str = "runs/reward"
    """the reward model folder written by reward.py"""
    value_model_path: Optional[str] = None
    """the value model's starting point (default: the reward model)"""
    stop_token: Optional[str] = None
    """the token that ends a completion (default: EOS)"""
    missing_eos_penalty: Penalty = 0.0
    """subtracted from the score of a completion without the stop token"""

    # PPO
    kl_coef: NonNegative = 0.05
    """weight of the per-token KL penalty in the reward (initial, with kl_target)"""
    kl_estimator: Literal["k1", "k2", "k3", "k1_ratio"] = "k1"
    """the per-token KL estimate in the reward (kl_estimate; k1 as in lm-human-preferences)"""
    kl_target: Optional[Positive] = None
    """adaptive KL controller (lm-human-preferences): kl_coef steered to this objective/kl (None: fixed)"""
    kl_horizon: AtLeast1 = 10000
    """the adaptive controller's horizon in completions (how fast kl_coef moves)"""
    whiten_rewards: bool = False
    """per-token rewards scaled to unit variance over the rollout before GAE (not centred)"""
    gamma: Fraction = 1.0
    """discount factor"""
    lam: Fraction = 0.95
    """GAE lambda"""
    cliprange: NonNegative = 0.2
    """clip range of the policy ratio pi / pi_old"""
    cliprange_value: NonNegative = 0.2
    """clip range of the value prediction around the rollout's value"""
    vf_coef: NonNegative = 0.1
    """weight of the value loss in the total loss"""


def token_values(model, batch):
    """The value model's V(s_t) for each completion token t: its score at the position before t (0 past the end)."""
    mask = batch["completion_mask"].bool()
    values = head_scores(model, batch)[batch["targets"][mask] - 1]
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


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


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the tokens in `mask` with the biased variance, as tf.nn.moments in lm-human-preferences;
    shift_mean False adds the mean back (rewards are scaled, not centred)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_mean((x - mean) ** 2, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def penalised_scores(scores, completions, stop_token_id, missing_eos_penalty):
    """The reward model's scores, minus missing_eos_penalty for each completion not ending with the stop token
    (cut short), and which completions ended."""
    ended = torch.tensor([c[-1] == stop_token_id for c in completions], device=scores.device)
    return scores - missing_eos_penalty * (~ended).float(), ended


def token_rewards(scores, logps, ref_logps, mask, kl_coef, kl_estimator):
    """Eq. 2 of arXiv:1909.08593 per token: -kl_coef x the KL estimate at every completion token, plus the score at
    the last real token; and the KL estimates."""
    kl = kl_estimate(logps, ref_logps, logps, kl_estimator) * mask
    rewards = -kl_coef * kl
    rewards[torch.arange(len(scores), device=scores.device), mask.sum(1).long() - 1] += scores  # right-padded
    return rewards, kl


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (arXiv:1506.02438) over right-padded completions: rewards and values past the
    end are 0 (the last real token bootstraps from 0). Returns the advantages and the returns (+ values)."""
    rewards, values = rewards * mask, values * mask
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def adapt_kl_coef(kl_coef, kl, num_samples, args):
    """lm-human-preferences' adaptive KL controller (Sec. 2.2 of arXiv:1909.08593): the error kl / target - 1,
    clipped to +-0.2, scales kl_coef by 1 + error x samples / horizon after each rollout."""
    error = max(min(kl / args.kl_target - 1, 0.2), -0.2)
    return kl_coef * (1 + error * num_samples / args.kl_horizon)


def ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, normaliser, args):
    """PPO's clipped policy loss (Eq. 7 of arXiv:1707.06347) + vf_coef x the clipped value loss, per token, summed
    over `mask` / `normaliser` (the global mini-batch's completion tokens). Also, per token, the ratio, both losses
    and which were clipped."""
    ratio = torch.exp(logps - old_logps)
    policy_losses = -advantages * ratio, -advantages * ratio.clamp(1 - args.cliprange, 1 + args.cliprange)
    values_clipped = old_values + (values - old_values).clamp(-args.cliprange_value, args.cliprange_value)
    value_losses = (values - returns) ** 2, (values_clipped - returns) ** 2
    policy_loss, value_loss = torch.max(*policy_losses), 0.5 * torch.max(*value_losses)
    loss = ((policy_loss + args.vf_coef * value_loss) * mask).sum() / normaliser
    return loss, ratio, policy_loss, value_loss, policy_losses[1] > policy_losses[0], value_losses[1] > value_losses[0]


@torch.no_grad()
def evaluate(model, reward_model, test, stop_token_id, pad_token_id, args):
    """Mean reward-model score (missing-EOS penalty included) of greedy completions of the test prompts."""
    prompts, total = test["prompt"], torch.zeros((), device=next(model.parameters()).device)
    completions, _ = sample_rollout(model, prompts, None, args, stop_token_id, pad_token_id)
    for rows, valid in rank_micro_batches(len(prompts), args.per_device_eval_batch_size):
        scores = sequence_scores(reward_model, make_batch(total.device, prompts, completions, rows, args))
        penalised, _ = penalised_scores(scores, [completions[i] for i in rows], stop_token_id, args.missing_eos_penalty)
        total += valid * penalised.sum()
    dist.all_reduce(total)
    return {"eval/scores": total.item() / len(prompts)}


@torch.no_grad()
def score_rollout(models, prompts, completions, args):
    """The reward-model scores of a rollout's completions, the policy's and reference's log-probs and the values of
    their tokens: each rank its share, summed over ranks."""
    n, width = len(prompts), args.max_completion_length
    device = next(models["policy"].parameters()).device
    scores = torch.zeros(n, device=device)
    logps, ref_logps, values = (torch.zeros(n, width, device=device) for _ in range(3))
    for rows, valid in rank_micro_batches(n, args.local_rollout_forward_batch_size):
        batch = make_batch(device, prompts, completions, rows, args)
        cols = batch["completion_mask"].shape[1]
        scores[rows] += valid * sequence_scores(models["reward"], batch)
        for table, name in ((logps, "policy"), (ref_logps, "ref")):
            table[rows, :cols] += valid * completion_logprobs(models[name], batch, args.temperature)
        values[rows, :cols] += valid * token_values(models["value"], batch)
    for table in (scores, logps, ref_logps, values):
        dist.all_reduce(table)
    return scores, logps, ref_logps, values


def accumulate_gradients(models, rollout, mini, args, sums, extremes):
    """One step's gradients from this rank's micro-batches of `mini`, statistics in `sums`, the ratio's max and -min
    in `extremes`; this rank's part of the loss."""
    device = next(models["policy"].parameters()).device
    step_loss, normaliser = 0.0, rollout["mask"][mini].sum()
    for micro in micro_batches(mini, args):
        batch = make_batch(device, rollout["prompts"], rollout["completions"], micro, args)
        width = batch["completion_mask"].shape[1]
        mask, old = rollout["mask"][micro, :width], rollout["logps"][micro, :width]
        logps, entropy = completion_logprobs(models["policy"], batch, args.temperature, True)
        values = token_values(models["value"], batch)
        old_values, advantages, returns = (rollout[name][micro, :width] for name in ("values", "advantages", "returns"))
        loss, ratio, policy_loss, value_loss, clipped, value_clipped = ppo_loss(
            logps, old, values, old_values, advantages, returns, mask, normaliser, args)
        loss.backward()
        step_loss += loss.detach()
        with torch.no_grad():  # sums over the loss tokens (window_metrics)
            token_stats = {"loss/policy_avg": policy_loss, "loss/value_avg": value_loss, "val/ratio": ratio,
                           "policy/approxkl_avg": 0.5 * (logps - old) ** 2, "policy/clipfrac_avg": clipped,
                           "val/clipfrac_avg": value_clipped, "val/ratio_squared": ratio**2,
                           "objective/entropy": entropy}
            for name, values in token_stats.items():
                sums[name] += (values * mask).sum()
            sums["loss"] += loss.detach()
            sums["tokens"] += mask.sum()
            sums["processed"] += batch["tokens"]
            in_loss = torch.stack([ratio, -ratio]).masked_fill(mask == 0, -math.inf).flatten(1).amax(1)
            extremes.copy_(torch.maximum(extremes, in_loss))
    return step_loss


def window_metrics(w, steps, seconds):
    """The metrics since the last log, from their sums over ranks: accumulate_gradients' token statistics per loss
    token, the rest per step."""
    tokens, per_token = max(w.pop("tokens"), 1.0), ("loss/", "policy/", "val/ratio", "val/clip", "objective/entropy")
    metrics = {"tokens_per_second": w.pop("processed") / seconds}
    metrics |= {name: value / (tokens if name.startswith(per_token) else steps) for name, value in w.items()}
    metrics["val/ratio_var"] = metrics.pop("val/ratio_squared") - metrics["val/ratio"] ** 2
    return metrics


def main(args):
    # 1. distributed init, batch sizes
    rank, world_size, device, mesh = setup(args)
    args.rollout_batch_size = N = args.batch_size * args.num_mini_batches

    # 2. data: every rank tokenises the same prompts, so each knows the whole rollout
    tokenizer, pad_token_id, train, test, dropped = load_data(args, tokenize_prompts)
    stop_token_id = tokenizer.convert_tokens_to_ids(args.stop_token) if args.stop_token else tokenizer.eos_token_id
    if stop_token_id is None or stop_token_id == tokenizer.unk_token_id:
        raise ScriptError(f"--stop_token {args.stop_token!r} is not one token of the tokenizer")
    num_rollouts, steps_per_rollout = rollouts_of(len(train["prompt"]), N, "", "--num_ppo_epochs", args, dropped)

    # 3. models + FSDP2: the policy and value model (trained), then the frozen reference and reward model
    value_path, value_flag = ((args.value_model_path, "--value_model_path") if args.value_model_path
                              else (args.reward_model_path, "--reward_model_path"))
    policy_path, policy_flag = args.model_name_or_path, "--model_name_or_path"
    models = {"policy": load_model(AutoModelForCausalLM, policy_path, args, policy_flag, mesh),
              "value": load_model(AutoModelForSequenceClassification, value_path, args, value_flag, mesh),
              "ref": load_model(AutoModelForCausalLM, policy_path, args, policy_flag, mesh, frozen=True),
              "reward": load_reward_model(args, tokenizer, mesh)}
    for name, flag in (("policy", policy_flag), ("value", value_flag), ("reward", "--reward_model_path")):
        check_layout(models[name], train["prompt"], train["prompt"], args, flag)
    model = models["policy"]
    trained = torch.nn.ModuleDict({"policy": model, "value": models["value"]})  # one optimizer, one checkpoint

    # 4. optimizer and LR schedule (or both restored by --resume_from)
    optimizer, scheduler, start_step, state = make_optimizer(trained, args)
    state.setdefault("kl_coef", args.kl_coef)  # the adaptive controller's, for the next rollout
    metrics_path, progress = open_metrics(args, start_step)

    # 5. training loop
    trained.train()
    sums = collections.defaultdict(lambda: torch.zeros((), device=device))  # this rank's, since the last log
    logged, window_start = start_step, time.time()
    extremes = torch.full((2,), -math.inf, device=device)
    for rollout_index in range(start_step // steps_per_rollout, num_rollouts):
        rollout_start = time.time()
        # ALGO LOGIC: 1. the rollout's prompts
        prompts = [train["prompt"][row] for row in global_batch(rollout_index, len(train["prompt"]), N, args.seed)]

        # 2. sample the completions
        completions, lengths = sample_rollout(model, prompts, rollout_index, args, stop_token_id, pad_token_id)

        # 3. scores, log-probs and values of the sampled tokens
        scores, logps, ref_logps, values = score_rollout(models, prompts, completions, args)
        check_rewards(scores[:, None], [f"--reward_model_path {args.reward_model_path}"])

        # 4. rewards: the KL penalty at every token, the (penalised) score at the last; GAE; whitened advantages
        mask = (torch.arange(args.max_completion_length, device=device) < lengths[:, None]).float()
        scores, ended = penalised_scores(scores, completions, stop_token_id, args.missing_eos_penalty)
        rewards, kl = token_rewards(scores, logps, ref_logps, mask, state["kl_coef"], args.kl_estimator)
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask)
        rollout = {"prompts": prompts, "completions": completions, "mask": mask, "logps": logps, "values": values,
                   "advantages": advantages, "returns": returns}
        non_score_reward = (-state["kl_coef"] * kl).sum(1).mean()
        stats = {"objective/scores": scores.mean(), "objective/kl_coef": state["kl_coef"],
                 "objective/kl": (kl_estimate(logps, ref_logps, logps, "k3") * mask).sum(1).mean(),
                 "objective/non_score_reward": non_score_reward,
                 "objective/rlhf_reward": scores.mean() + non_score_reward,
                 "completions/mean_length": lengths.float().mean(), "val/num_eos_tokens": ended.sum()}
        samples = [["prompt", "completion", "score"]]
        samples += [[tokenizer.decode(prompts[i]), tokenizer.decode(completions[i]), scores[i].item()]
                    for i in range(min(4, len(prompts)))]
        stats["time/rollout"] = time.time() - rollout_start
        if args.kl_target is not None:
            state["kl_coef"] = adapt_kl_coef(state["kl_coef"], kl.sum(1).mean().item(), N, args)

        # 5. num_ppo_epochs passes over the rollout, each in num_mini_batches optimizer steps
        for k, mini in enumerate(rollout_mini_batches(rollout_index, args.num_ppo_epochs, args)):
            update_start = time.time()
            step_loss = accumulate_gradients(models, rollout, mini, args, sums, extremes)
            step = rollout_index * steps_per_rollout + k + 1
            lr, grad_norm, stop = optimizer_step(trained, optimizer, scheduler, step_loss, step, args)
            progress.update(1)
            stats["time/update"] = time.time() - update_start
            for name, value in stats.items():  # the same on every rank: each adds its share
                sums[name] += value / world_size

            if is_due(step, args.log_every, args) or is_due(step, args.eval_every, args):
                metrics = {"step": step, "episode": (rollout_index + 1) * N, "lr": lr, "grad_norm": grad_norm.item()}
                metrics |= window_metrics(reduce_sums(sums), step - logged, time.time() - window_start)
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
                metrics |= {"val/ratio_max": extremes[0].item(), "val/ratio_min": -extremes[1].item()}
                extremes.fill_(-math.inf)
                if is_due(step, args.eval_every, args) and test:
                    metrics.update(evaluate(model, models["reward"], test, stop_token_id, pad_token_id, args))
                log_metrics(metrics, metrics_path, args, progress, samples)
                sums, logged, window_start = collections.defaultdict(sums.default_factory), step, time.time()
            if (args.save_every > 0 and step % args.save_every == 0) or (stop and step % steps_per_rollout == 0):
                save_checkpoint(trained, optimizer, scheduler, step, args, state, stop)

    # 6. save the policy's Hugging Face folder (the value model is a training aid)
    finish(model, tokenizer, args, device)


def sample_rollout(model, prompts, draw, args, eos_token_id, pad_token_id):
    """Completions in chunks round-robin over the ranks, each seeded by (seed, draw, chunk) (draw: the rollout;
    None: greedy): the same on any number of processes and on resume."""
    device, rank, greedy = next(model.parameters()).device, dist.get_rank(), draw is None
    n, width = len(prompts), args.max_completion_length
    chunk_size = args.per_device_eval_batch_size if greedy else args.local_rollout_forward_batch_size
    completion_ids = torch.full((n, width), -1, device=device)  # -1: no token
    with unsharded(model, keep=not args.reshard_after_forward):
        for chunk, start in enumerate(range(0, n, chunk_size)):
            if chunk % args.world_size == rank:
                torch.manual_seed((args.seed * 100_003 + (draw or 0)) * 100_003 + chunk)
                completions = generate_completions(model, prompts[start : start + chunk_size], width,
                                                   None if greedy else args.temperature, eos_token_id, pad_token_id,
                                                   args.cache_implementation)
                for i, completion in enumerate(completions, start):
                    completion_ids[i, : len(completion)] = torch.tensor(completion)
    dist.all_reduce(completion_ids, op=dist.ReduceOp.MAX)  # each row filled by one rank
    lengths = (completion_ids >= 0).sum(1)
    return [row[:length] for row, length in zip(completion_ids.tolist(), lengths.tolist())], lengths


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
