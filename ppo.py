"""Proximal Policy Optimization (PPO) for RLHF in one file: sample a completion for each prompt, score it with a
reward model, penalise each token's KL to the reference model, and train the policy with PPO's clipped surrogate and a
value model with a clipped value loss, on advantages from GAE. Papers: arXiv:1909.08593 (Ziegler et al.,
lm-human-preferences), arXiv:1707.06347 (PPO), arXiv:2403.17031 (the N+ implementation details of RLHF with PPO).
What differs from those: (1) the loss is divided by the completion tokens of the whole global mini-batch, so the split
into processes and micro-batches does not change the update; (2) rollouts are seeded by (seed, rollout, generation
chunk), so a run samples the same completions on any number of processes and resumes bit for bit; (3) the value model
is a separate model (initialised from the reward model), trained by the same optimizer.
Read `main` first; the functions below the Infrastructure line are the same in every script and can be skipped.
Run:  torchrun --nproc_per_node 2 ppo.py --model_name_or_path runs/sft --reward_model_path runs/reward \
          --dataset_name toy/prompts --output_dir runs/ppo --max_completion_length 12 --optimizer adam_tf \
          --adam_epsilon 1e-5
      torchrun --nproc_per_node 8 ppo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
          --reward_model_path runs/reward_qwen --dataset_name trl-lib/tldr --max_completion_length 53 \
          --optimizer adam_tf --adam_epsilon 1e-5 --track
"""

import collections
import contextlib
import fcntl
import json
import math
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import datasets
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import tyro
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig, get_scheduler)

from adam_tf import AdamTF


@dataclass
class Args:
    # common arguments: the same names and meaning in every script
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (wandb run names start with it)"""
    seed: int = 1
    """seed of the experiment (data order, initialisation, sampling)"""
    track: bool = False
    """log to Weights and Biases (`WANDB_MODE=offline` works)"""
    wandb_project_name: str = "rlhf-scripts"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    output_dir: str = "runs/ppo"
    """where the final Hugging Face model folder, checkpoints and metrics.jsonl are written"""
    overwrite_output_dir: bool = False
    """replace a previous run in output_dir (removing its metrics, checkpoints, model), which is refused otherwise"""
    model_name_or_path: str = "runs/sft"
    """a hub id or a local Hugging Face model folder: the SFT model the policy starts from (and the reference)"""
    dataset_name: str = "toy/prompts"
    """a hub id, a local .json/.jsonl/.parquet/.csv file (the train split) or a local folder of such files"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_test_split: str = "test"
    """the split to evaluate on (skipped, with a message, if the dataset has none)"""
    max_steps: int = -1
    """number of optimizer steps; -1: run `num_train_epochs` epochs"""
    num_train_epochs: int = 1
    """passes over the training prompts (used when max_steps is -1)"""
    learning_rate: float = 1e-6
    """peak learning rate"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """learning rate schedule after warmup (transformers.get_scheduler), stepped once per optimizer step"""
    warmup_ratio: float = 0.0
    """fraction of the optimizer steps spent warming up linearly from 0"""
    per_device_train_batch_size: int = 8
    """micro-batch size: completions per process per forward/backward (HF name; `local_micro_batch_size`)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step on each process"""
    per_device_eval_batch_size: int = 32
    """test prompts per process per greedy generation in evaluation"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this value (0: no clipping, the norm is still logged)"""
    optimizer: Literal["adamw", "adam_tf"] = "adamw"
    """adamw: torch.optim.AdamW; adam_tf: TensorFlow-style Adam (epsilon hat), see adam_tf.py"""
    adam_epsilon: float = 1e-8
    """Adam's epsilon (lm-human-preferences used 1e-5 with adam_tf)"""
    weight_decay: float = 0.0
    """decoupled weight decay (adamw only)"""
    bf16: bool = True
    """bf16 mixed precision (parameters kept in fp32) on GPU; CPU runs always compute in fp32"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    cpu_offload: bool = False
    """keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)"""
    reshard_after_forward: bool = True
    """free each decoder layer's gathered parameters after its forward (least memory). False: faster, one full copy of
    each model per process: kept until the backward (one all-gather per micro-batch instead of two; in grpo/ppo from
    generation on); a frozen model (reference, reward) stays gathered after its first forward"""
    log_every: int = 10
    """print and log metrics every this many optimizer steps"""
    eval_every: int = -1
    """evaluate every this many optimizer steps (-1: only at the end)"""
    save_every: int = -1
    """write a resumable checkpoint every this many optimizer steps (-1: never)"""
    resume_from: Optional[str] = None
    """a checkpoint folder (output_dir/checkpoints/step_N) to continue the same run from; auto: the latest complete one
    in output_dir, if any (the same command then starts a run and continues it after a preemption)"""
    keep_last: int = -1
    """keep only the newest N checkpoints (-1: all)"""
    skip_nonfinite: int = 0
    """skip up to N optimizer steps whose loss or gradient norm is NaN/inf (0: the first one stops the run)"""
    trust_remote_code: bool = False
    """allow models and tokenizers whose code comes from the hub (runs that code: only for repositories you trust)"""
    max_prompt_length: int = 512
    """prompts longer than this (in tokens) are dropped, and counted in a message at start"""
    max_completion_length: int = 256
    """new tokens per completion; a completion with no EOS by then is truncated (see missing_eos_penalty)"""

    # batch sizes, computed at start (not flags): a rollout samples one completion for each of its rollout_batch_size
    # prompts, then makes num_ppo_epochs passes over them, each pass num_mini_batches optimizer steps of batch_size =
    # local_batch_size x world_size completions (local_batch_size = per_device_train_batch_size x
    # gradient_accumulation_steps, per process), so rollout_batch_size = batch_size x num_mini_batches;
    # num_training_steps = rollouts x num_ppo_epochs x num_mini_batches, fixed before training

    # RL: rollouts and rewards
    num_ppo_epochs: int = 4
    """passes over each rollout"""
    num_mini_batches: int = 1
    """optimizer steps per pass over a rollout"""
    local_rollout_forward_batch_size: int = 64
    """completions per process per generation call and per forward pass without gradients in a rollout"""
    temperature: float = 0.7
    """sampling temperature; log-probs are computed from logits / temperature, the distribution sampled from"""
    cache_implementation: Literal["dynamic", "static"] = "dynamic"
    """generation's KV cache. static: allocated once, and on a GPU HF compiles the decoding step (torch.compile: about
    30 s per new batch shape; 3.3x the samples/s of dynamic at Qwen2.5-0.5B's shape on an H100, bench/RESULTS.md)"""
    reward_model_path: str = "runs/reward"
    """the reward model folder written by reward.py (same tokenizer as the policy)"""
    value_model_path: Optional[str] = None
    """the value model's starting point, a sequence-classification folder (default: the reward model)"""
    stop_token: Optional[str] = None
    """generation stops after the first of this token, which ends the completion (default: the EOS token)"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a completion that did not end with the stop token within max_completion_length"""

    # PPO
    kl_coef: float = 0.05
    """weight of the per-token KL penalty in the reward (the initial value when kl_target is set)"""
    kl_estimator: Literal["k1", "k2", "k3", "k1_ratio"] = "k1"
    """the per-token KL estimate in the reward (see kl_estimate; k1 = logp - logp_ref as in lm-human-preferences)"""
    kl_target: Optional[float] = None
    """adaptive KL controller (lm-human-preferences): steer kl_coef so that objective/kl approaches this; None: fixed"""
    kl_horizon: int = 10000
    """the adaptive controller's horizon in completions: how fast kl_coef moves"""
    whiten_rewards: bool = False
    """scale the per-token rewards to unit variance over the rollout before GAE (not centred)"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """clip range of the policy ratio pi / pi_old"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around the rollout's value"""
    vf_coef: float = 0.1
    """weight of the value loss in the total loss"""
def token_values(model, input_ids, attention_mask, completion_width):
    """The value model's V(s_t) for each of the last `completion_width` tokens: the head's output (plus the folder's
    score_bias, so a value model copied from a reward model starts as its score) at the position before token t, the
    state in which t was chosen (the last prompt token for the first one)."""
    outputs = []
    hook = model.score.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hook.remove()
    return outputs[0][:, -completion_width - 1 : -1, 0].float() + getattr(model.config, "score_bias", 0.0)


def kl_estimate(logps, ref_logps, old_logps, kl_estimator):
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi_old, d = logp - logp_ref (Schulman,
    http://joschu.net/blog/kl-approx.html). On-policy, k1 = d and k3 = exp(-d) - 1 + d (Eq. 4 of arXiv:2402.03300, never
    negative) have the right expected value; k2 = d^2 / 2 the right expected gradient (k1's is 0, k3's that of
    KL(pi_ref || pi)). k1_ratio = (pi / pi_old) d: the right value and gradient also off-policy (num_iterations > 1)."""
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
    """(x - mean) / std over the tokens in `mask`, with the biased variance, as TF's tf.nn.moments in
    lm-human-preferences; shift_mean False adds the mean back (rewards are scaled, not centred)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_mean((x - mean) ** 2, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def penalised_scores(scores, completions, stop_token_id, missing_eos_penalty):
    """The reward model's scores, minus missing_eos_penalty for each completion that does not end with the stop token
    (generation ran out of tokens first)."""
    ended = torch.tensor([c[-1] == stop_token_id for c in completions], device=scores.device)
    return scores - missing_eos_penalty * (~ended).float(), ended


def token_rewards(scores, logps, ref_logps, mask, kl_coef, kl_estimator):
    """Eq. 2 of arXiv:1909.08593 per token: -kl_coef x the KL estimate at every completion token, plus the score at the
    last real token (from the mask: right when pad == eos). Returns the rewards and the KL estimates."""
    kl = kl_estimate(logps, ref_logps, logps, kl_estimator) * mask
    rewards = -kl_coef * kl
    rewards[torch.arange(len(scores), device=scores.device), last_token_index(mask)] += scores
    return rewards, kl


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (arXiv:1506.02438) over right-padded completions: rewards and values past the
    end are 0, so the last real token bootstraps from 0. Returns the advantages and the returns (advantages +
    values)."""
    rewards, values = rewards * mask, values * mask
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        last = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def adapt_kl_coef(kl_coef, kl, num_samples, args):
    """lm-human-preferences' adaptive KL controller (Sec. 2.2 of arXiv:1909.08593): the error kl / target - 1,
    clipped to +-0.2, moves kl_coef by a factor 1 + error x samples / horizon after each rollout."""
    error = max(min(kl / args.kl_target - 1, 0.2), -0.2)
    return kl_coef * (1 + error * num_samples / args.kl_horizon)


def ppo_loss(logps, old_logps, values, old_values, advantages, returns, mask, normaliser, args):
    """PPO's clipped policy loss (Eq. 7 of arXiv:1707.06347) + vf_coef x the clipped value loss, per token, summed over
    the tokens in `mask` and divided by `normaliser` (the completion tokens of the global mini-batch). Returns the loss
    and, per token, the ratio, the policy loss, the value loss and which of them were clipped."""
    ratio = torch.exp(logps - old_logps)
    policy_losses = -advantages * ratio, -advantages * ratio.clamp(1 - args.cliprange, 1 + args.cliprange)
    values_clipped = old_values + (values - old_values).clamp(-args.cliprange_value, args.cliprange_value)
    value_losses = (values - returns) ** 2, (values_clipped - returns) ** 2
    policy_loss, value_loss = torch.max(*policy_losses), 0.5 * torch.max(*value_losses)
    loss = ((policy_loss + args.vf_coef * value_loss) * mask).sum() / normaliser
    return loss, ratio, policy_loss, value_loss, policy_losses[1] > policy_losses[0], value_losses[1] > value_losses[0]


@torch.no_grad()
def evaluate(model, reward_model, test, stop_token_id, pad_token_id, args, rank):
    """Mean reward-model score (missing-EOS penalty included) of greedy completions of the test prompts."""
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    with unsharded(model, keep=not args.reshard_after_forward):
        for rows, valid in rank_micro_batches(len(test["prompt"]), rank, args.world_size,
                                              args.per_device_eval_batch_size):
            prompts = [test["prompt"][i] for i in rows]
            completions = generate_completions(model, prompts, args.max_completion_length, None, stop_token_id,
                                               pad_token_id, args.cache_implementation)
            input_ids, attention_mask, _ = [t.to(device) for t in make_batch(prompts, completions, pad_token_id)]
            scores = sequence_scores(reward_model, input_ids, attention_mask)
            total += valid * penalised_scores(scores, completions, stop_token_id, args.missing_eos_penalty)[0].sum()
    dist.all_reduce(total)
    return {"eval/scores": total.item() / len(test["prompt"])}


@torch.no_grad()
def score_rollout(models, prompts, completions, pad_token_id, args, rank):
    """The reward-model scores of a rollout's completions, and the policy's and the reference's log-probs and the
    values of their tokens: each rank its share in micro-batches of local_rollout_forward_batch_size, summed over
    ranks."""
    n, width = len(prompts), args.max_completion_length
    device = next(models["policy"].parameters()).device
    scores = torch.zeros(n, device=device)
    logps, ref_logps, values = (torch.zeros(n, width, device=device) for _ in range(3))
    for rows, valid in rank_micro_batches(n, rank, args.world_size, args.local_rollout_forward_batch_size):
        input_ids, attention_mask, completion_mask = batch_on(device, prompts, completions, rows, pad_token_id)
        cols = completion_mask.shape[1]
        scores[rows] += valid * sequence_scores(models["reward"], input_ids, attention_mask)
        for table, name in ((logps, "policy"), (ref_logps, "ref")):
            table[rows, :cols] += valid * completion_logprobs(models[name], input_ids, attention_mask, cols,
                                                              args.temperature)
        values[rows, :cols] += valid * token_values(models["value"], input_ids, attention_mask, cols)
    for table in (scores, logps, ref_logps, values):
        dist.all_reduce(table)
    return scores, logps, ref_logps, values


def accumulate_gradients(models, rollout, mini, args, rank, sums, extremes, pad_token_id):
    """The gradients of one optimizer step: this rank's micro-batches of the global mini-batch `mini`, each loss
    divided by the completion tokens of the whole mini-batch, so the split does not change the update. The statistics
    (sums over the tokens in the loss) go into `sums`; the ratio's max and -min into `extremes`. Returns this rank's
    part of the step's loss."""
    device = next(models["policy"].parameters()).device
    step_loss, normaliser = torch.zeros((), device=device), rollout["mask"][mini].sum()
    for micro in micro_batches(mini, args, rank):
        input_ids, attention_mask, completion_mask = batch_on(device, rollout["prompts"], rollout["completions"], micro,
                                                              pad_token_id)
        width = completion_mask.shape[1]
        mask, old = rollout["mask"][micro, :width], rollout["logps"][micro, :width]
        logps, entropy = completion_logprobs(models["policy"], input_ids, attention_mask, width, args.temperature,
                                             with_entropy=True)
        values = token_values(models["value"], input_ids, attention_mask, width)
        old_values, advantages, returns = (rollout[name][micro, :width] for name in ("values", "advantages", "returns"))
        loss, ratio, policy_loss, value_loss, clipped, value_clipped = ppo_loss(
            logps, old, values, old_values, advantages, returns, mask, normaliser, args)
        loss.backward()
        step_loss += loss.detach()
        with torch.no_grad():
            token_stats = {"policy_loss": policy_loss, "value_loss": value_loss, "approxkl": 0.5 * (logps - old) ** 2,
                           "clipfrac": clipped, "value_clipfrac": value_clipped, "ratio": ratio, "ratio_sq": ratio**2,
                           "entropy": entropy}
            for name, values in token_stats.items():
                sums[name] += (values * mask).sum()
            sums["loss"] += loss.detach()
            sums["tokens"] += mask.sum()
            sums["processed"] += attention_mask.sum()
            in_loss = torch.stack([ratio, -ratio]).masked_fill(mask == 0, -math.inf).flatten(1).max(1).values
            extremes.copy_(torch.maximum(extremes, in_loss))
    return step_loss


def main(args):
    # 1. distributed init, computed batch sizes
    rank, world_size, device = setup(args)
    args.rollout_batch_size = args.batch_size * args.num_mini_batches
    N = args.rollout_batch_size

    # 2. data: every rank tokenises the same prompts, so each knows the whole rollout
    tokenizer, pad_token_id = load_tokenizer(args)
    stop_token_id = tokenizer.convert_tokens_to_ids(args.stop_token) if args.stop_token else tokenizer.eos_token_id
    if stop_token_id is None or stop_token_id == tokenizer.unk_token_id:
        raise ValueError(f"--stop_token {args.stop_token!r} is not one token of the tokenizer")
    train, test, dropped = load_data(args, tokenizer, tokenize_prompts, rank)
    num_prompts = len(train["prompt"])
    num_rollouts, steps_per_rollout = rollouts_of(num_prompts, 1, "num_ppo_epochs", args, dropped, rank)

    # 3. models + FSDP2: the policy and the value model (trained), then the frozen reference and reward model
    value_path, value_flag = ((args.value_model_path, "--value_model_path") if args.value_model_path
                              else (args.reward_model_path, "--reward_model_path"))
    policy_path, policy_flag = args.model_name_or_path, "--model_name_or_path"
    models = {"policy": load_trained(AutoModelForCausalLM, policy_path, args, policy_flag, device),
              "value": load_trained(AutoModelForSequenceClassification, value_path, args, value_flag, device),
              "ref": load_frozen(AutoModelForCausalLM, policy_path, args, policy_flag, device),
              "reward": load_reward_model(args, tokenizer, device)}
    model = models["policy"]
    trained = torch.nn.ModuleDict({"policy": model, "value": models["value"]})  # one optimizer, one checkpoint

    # 4. optimizer and LR schedule, its total fixed now (or both restored by --resume_from, with the KL controller)
    optimizer, scheduler, start_step, state = make_optimizer(trained, args)
    state.setdefault("kl_coef", args.kl_coef)  # the adaptive controller's value for the next rollout
    metrics_path = open_metrics(args, start_step, rank)

    # 5. training loop: a rollout, then num_ppo_epochs x num_mini_batches optimizer steps on it
    trained.train()
    progress = tqdm(total=args.num_training_steps, initial=start_step, disable=rank != 0, desc="ppo")
    stop = False  # a SIGTERM/SIGINT seen at an optimizer step (a resumed run may have no step left)
    sums, window_steps, window_start = collections.defaultdict(lambda: torch.zeros((), device=device)), 0, time.time()
    extremes = torch.full((2,), -math.inf, device=device)  # the ratio's max and -min over the window's loss tokens
    for rollout_index in range(start_step // steps_per_rollout, num_rollouts):
        rollout_start = time.time()
        # ALGO LOGIC: 1. the rollout's prompts
        prompts = [train["prompt"][row] for row in global_batch(rollout_index, num_prompts, N, args.seed)]

        # 2. sample the completions (seeded by rollout and chunk, the parameters gathered once: sample_rollout)
        completions, lengths = sample_rollout(model, prompts, args, rollout_index, rank, stop_token_id, pad_token_id,
                                              device)

        # 3. scores, the policy's and the reference's log-probs and the values of the sampled tokens
        scores, logps, ref_logps, values = score_rollout(models, prompts, completions, pad_token_id, args, rank)

        # 4. rewards: the KL penalty at every token, the (penalised) score at the last one; GAE; whitened advantages
        mask = (torch.arange(args.max_completion_length, device=device) < lengths[:, None]).float()
        scores, ended = penalised_scores(scores, completions, stop_token_id, args.missing_eos_penalty)
        rewards, kl = token_rewards(scores, logps, ref_logps, mask, state["kl_coef"], args.kl_estimator)
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask)
        rollout = {"prompts": prompts, "completions": completions, "mask": mask, "logps": logps, "values": values,
                   "advantages": advantages, "returns": returns}
        non_score_reward = (-state["kl_coef"] * kl).sum(1).mean().item()
        rollout_stats = {"objective/scores": scores.mean().item(), "objective/kl_coef": state["kl_coef"],
                         "objective/kl": (kl_estimate(logps, ref_logps, logps, "k3") * mask).sum(1).mean().item(),
                         "objective/non_score_reward": non_score_reward,
                         "objective/rlhf_reward": scores.mean().item() + non_score_reward,
                         "completions/mean_length": lengths.float().mean().item(),
                         "val/num_eos_tokens": ended.sum().item(), "time/rollout": time.time() - rollout_start}
        samples = [["prompt", "completion", "score"]]
        samples += [[tokenizer.decode(prompts[i]), tokenizer.decode(completions[i]), scores[i].item()]
                    for i in range(min(4, N))]
        if args.kl_target is not None:  # for the next rollout
            state["kl_coef"] = adapt_kl_coef(state["kl_coef"], kl.sum(1).mean().item(), N, args)

        # 5. num_ppo_epochs passes over the rollout, each in num_mini_batches optimizer steps
        for k, mini in enumerate(rollout_mini_batches(rollout_index, args.num_ppo_epochs, args)):
            update_start = time.time()
            step_loss = accumulate_gradients(models, rollout, mini, args, rank, sums, extremes, pad_token_id)
            done = rollout_index * steps_per_rollout + k + 1
            lr, grad_norm, stop = optimizer_step(trained, optimizer, scheduler, step_loss, done, args, state["skipped"])
            progress.update(1)
            sums["seconds"] += time.time() - update_start  # this rank's seconds in updates
            window_steps += 1

            if is_due(done, args.log_every, args) or is_due(done, args.eval_every, args):
                w = reduce_sums(sums)
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
                tokens = max(w["tokens"], 1.0)
                metrics = {"step": done, "episode": (rollout_index + 1) * N, "lr": lr, "loss": w["loss"] / window_steps,
                           "grad_norm": grad_norm.item(), **rollout_stats,
                           "tokens_per_second": w["processed"] / (time.time() - window_start),
                           "time/update": w["seconds"] / world_size / window_steps,
                           "objective/entropy": w["entropy"] / tokens, "policy/approxkl_avg": w["approxkl"] / tokens,
                           "policy/clipfrac_avg": w["clipfrac"] / tokens, "loss/policy_avg": w["policy_loss"] / tokens,
                           "loss/value_avg": w["value_loss"] / tokens, "val/clipfrac_avg": w["value_clipfrac"] / tokens,
                           "val/ratio": w["ratio"] / tokens,
                           "val/ratio_var": w["ratio_sq"] / tokens - (w["ratio"] / tokens) ** 2,
                           "val/ratio_max": extremes[0].item(), "val/ratio_min": -extremes[1].item()}
                if is_due(done, args.eval_every, args) and test and test["prompt"]:
                    metrics.update(evaluate(model, models["reward"], test, stop_token_id, pad_token_id, args, rank))
                log_metrics(metrics, metrics_path, args, progress, rank, samples)
                sums, window_steps, window_start = collections.defaultdict(sums.default_factory), 0, time.time()
                extremes.fill_(-math.inf)
            if (args.save_every > 0 and done % args.save_every == 0) or (stop and done % steps_per_rollout == 0):
                checkpoint = save_checkpoint(trained, optimizer, scheduler, done, args, state)
        if stop:  # the signal was seen during this rollout; its checkpoint is written
            break
    progress.close()
    if stop:
        leave_after_signal(checkpoint, rank)

    # 6. save the policy's Hugging Face folder (the value model is a training aid); report the peak memory
    finish(model, tokenizer, args, device, rank)


# ---------------------------------------------------------------------------------------------------------------------
# Infrastructure: identical in every script that has it (tests/test_consistency.py). Skip it on a first read.
# ---------------------------------------------------------------------------------------------------------------------
# numeric arguments that cannot be meant outside these ranges: (flags, what they must be, the check); a script
# without the flag skips it
ARGUMENT_RULES = [
    (["num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size",
      "log_every", "max_prompt_length", "max_completion_length", "num_mini_batches", "num_iterations", "num_ppo_epochs",
      "local_rollout_forward_batch_size", "kl_horizon"], "at least 1", lambda v: v >= 1),
    (["max_steps", "eval_every", "save_every", "keep_last"], "-1 (off) or at least 1", lambda v: v == -1 or v >= 1),
    (["learning_rate", "adam_epsilon", "temperature", "kl_target"], "above 0", lambda v: v > 0),
    (["weight_decay", "max_grad_norm", "skip_nonfinite", "beta", "epsilon", "epsilon_high", "rpo_alpha",
      "missing_eos_penalty", "kl_coef", "cliprange", "cliprange_value", "vf_coef"], "0 or more", lambda v: v >= 0),
    (["warmup_ratio", "gamma", "lam"], "in [0, 1]", lambda v: 0 <= v <= 1),
    (["label_smoothing"], "in [0, 0.5)", lambda v: 0 <= v < 0.5),
]


def check_arguments(args):
    """Refuse a numeric argument that cannot be meant (a batch size of 0, --max_steps 0, a negative --beta...),
    naming the flag, before anything is loaded."""
    for names, allowed, check in ARGUMENT_RULES:
        for name in names:
            value = getattr(args, name, None)
            if value is not None and not check(value):
                raise ValueError(f"--{name} {value}: must be {allowed}")


def setup(args):
    """The arguments checked (check_arguments); distributed init (torchrun sets RANK and WORLD_SIZE; `python
    script.py` is world size 1 on the same code path); SIGTERM/SIGINT handlers; --resume_from auto; the computed
    batch sizes, the seeds and the output folder. Returns rank, world size, device. TRY NOT TO MODIFY: each rank
    seeds its own stream (dropout); the data order and the sampling use generators of their own, seeded by step."""
    check_arguments(args)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    signal.signal(signal.SIGTERM, request_stop)  # preemption: checkpoint at the next optimizer step, then leave
    signal.signal(signal.SIGINT, request_stop)
    auto = args.resume_from == "auto"
    if auto:  # the latest complete checkpoint; None: nothing to continue, start at step 0
        args.resume_from = (complete_checkpoints(args.output_dir) or [None])[-1]
    claim_output_dir(args, rank, auto)
    args.world_size = world_size
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * world_size
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    return rank, world_size, device


RUN_FILES = ("metrics.jsonl", "checkpoints", "model.safetensors", "model.safetensors.index.json")  # a run's own
OUTPUT_DIR_LOCK = []  # rank 0's open output_dir/.lock while the run lives


def claim_output_dir(args, rank, auto):
    """Rank 0 holds an exclusive flock on output_dir/.lock for the whole run (the system drops it when the process
    ends, however it ends): a second live run on the same folder is refused. A folder holding another run (RUN_FILES)
    is refused too, unless this run continues it (--resume_from, or auto restarting a run stopped before its first
    checkpoint and model) or --overwrite_output_dir, which removes that run's files first. Every rank raises rank 0's
    verdict (a collective), before anything is loaded."""
    verdict = [None]
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = open(os.path.join(args.output_dir, ".lock"), "w")
        found = [name for name in RUN_FILES if os.path.exists(os.path.join(args.output_dir, name))]
        finished = any(name.startswith("model.") for name in found)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            OUTPUT_DIR_LOCK[:] = [lock]
        except OSError:
            verdict[0] = (f"another run is writing to --output_dir {args.output_dir} (it holds {lock.name}): let it "
                          "finish, stop it, or choose another folder")
        if verdict[0] is None and found and args.resume_from is None and args.overwrite_output_dir:
            for name in found:
                path = os.path.join(args.output_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            print(f"--overwrite_output_dir: removed the previous run's {', '.join(found)} from {args.output_dir}")
        elif verdict[0] is None and found and args.resume_from is None and (finished or not auto):
            verdict[0] = (f"--output_dir {args.output_dir} holds another run ({', '.join(found)}), which this one "
                          "does not continue: --resume_from auto continues it from its latest checkpoint, "
                          "--overwrite_output_dir replaces it, or choose another folder")
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ValueError(verdict[0])


def missing_local_path(path):
    """A name meant as a local file or folder that is not there: an absolute or ./ path, or one whose first folder is
    here (runs/sft, with runs/ here). Such a name is not sent to the hub, where it would be retried for a minute."""
    first = path.split("/")[0]
    meant_local = path.startswith(("/", "./", "../", "~")) or ("/" in path and os.path.isdir(first))
    return meant_local and not os.path.exists(os.path.expanduser(path))


def data_file_problem(path):
    """Why a local JSON/JSONL file did not load, by line (datasets' own error does not say where): empty, not UTF-8,
    or a line that is not JSON. None when none of these is the cause."""
    raw = open(path, "rb").read()
    if not raw.strip():
        return f"dataset file {path!r} is empty"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        return f"dataset file {path!r} line {line} is not UTF-8 text ({e.reason} at byte {e.start})"
    try:
        json.loads(text)  # one JSON document is a valid file too
        return None
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), 1):
        try:
            json.loads(line.strip() or "null")  # a blank line is no row, and no error
        except json.JSONDecodeError as e:
            return f"dataset file {path!r} line {number} is not valid JSON ({e.msg}, column {e.colno}): {line[:80]!r}"
    return None


def load_split(name, split):
    """A split of a hub dataset, a local dataset folder, or a local file (a single file is the train split).
    Returns None when there is no such split."""
    if os.path.isfile(name):
        builders = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}
        extension = name.rsplit(".", 1)[-1]
        if extension not in builders:
            raise ValueError(f"dataset file {name!r}: unknown format .{extension}; give a .json, .jsonl, .parquet or "
                             ".csv file, a folder of them, or a hub id")
        if split != "train":
            return None
        try:
            return datasets.load_dataset(builders[extension], data_files=name, split="train")
        except Exception as e:  # datasets' own errors name neither the line nor the cause
            problem = data_file_problem(name) if builders[extension] == "json" else None
            raise ValueError(problem or f"dataset file {name!r} does not load: {e!r}") from e
    if os.path.isfile(os.path.join(name, "dataset_dict.json")):  # a DatasetDict written by save_to_disk
        dataset_dict = datasets.load_from_disk(name)
        return dataset_dict[split] if split in dataset_dict else None
    if missing_local_path(name):
        raise ValueError(f"dataset {name!r}: no such file or folder (a hub id is owner/name, with no local folder of "
                         "that name)")
    if os.path.isdir(name):
        check_split_files(name)
    try:
        return datasets.load_dataset(name, split=split)
    except ValueError as e:
        if "Unknown split" in str(e):
            return None
        raise
    except FileNotFoundError as e:
        raise ValueError(f"dataset {name!r} is neither a local file or folder of data files nor a dataset on the hub: "
                         f"{e}") from e


DATA_EXTENSIONS = tuple(kind + packing for kind in (".json", ".jsonl", ".parquet", ".csv")
                        for packing in ("", ".gz", ".bz2", ".xz", ".zst"))  # datasets reads them compressed too
DATASETS_METADATA = {"dataset_infos.json", "dataset_info.json", "state.json", "dataset_dict.json"}  # datasets' own


def check_split_files(folder):
    """Every data file of a local folder must land in a split. datasets names a split after a word in a file or folder
    name (train; test or eval; validation or dev) and, once one name has such a word, silently skips the files whose
    names have none (with none at all, every file is train)."""
    splits = {str(split): files for split, files in datasets.load_dataset_builder(folder).config.data_files.items()}
    used, skipped = {os.path.realpath(f) for files in splits.values() for f in files}, []
    for root, folders, files in os.walk(folder):
        folders[:] = [f for f in folders if not f.startswith((".", "__"))]  # hidden: datasets skips them too
        paths = [os.path.join(root, f) for f in files if f.endswith(DATA_EXTENSIONS) and f not in DATASETS_METADATA
                 and not f.startswith((".", "__"))]
        skipped += [os.path.relpath(p, folder) for p in paths if os.path.realpath(p) not in used]
    if skipped:
        found = "; ".join(f"{split}: {[os.path.relpath(f, folder) for f in files]}" for split, files in splits.items())
        raise ValueError(f"dataset folder {folder!r}: {sorted(skipped)} would be in no split (found {found}). A split "
                         "is named after a word in the file or folder name (train; test or eval; validation or dev): "
                         "rename the files, e.g. train.jsonl and test.jsonl")


def load_pretrained(auto_class, path, args, flag):
    """auto_class.from_pretrained(path), stopping with a message that names the flag when `path` is not such a model
    or tokenizer, or when the model lacks weights (a causal LM given as a reward model would get a random score head:
    HF only warns). Code from the hub runs only with --trust_remote_code."""
    if missing_local_path(path):
        raise ValueError(f"{flag} {path!r}: no such folder (a hub id is owner/name, with no local folder of that name)")
    from safetensors import SafetensorError  # the error of a damaged weights file (transformers' format)

    model_kwargs = {} if auto_class is AutoTokenizer else {"dtype": torch.float32, "output_loading_info": True}
    try:
        loaded = auto_class.from_pretrained(path, trust_remote_code=args.trust_remote_code, **model_kwargs)
    except SafetensorError as e:  # e.g. "incomplete metadata, file not fully covered": a file cut short
        raise ValueError(f"{flag} {path!r}: a weights file there is damaged ({e}); copy or download it again") from e
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path!r} does not load with {auto_class.__name__}: {e}") from e
    if auto_class is AutoTokenizer:
        return loaded
    model, info = loaded
    if info["missing_keys"]:
        raise ValueError(f"{flag} {path!r} has no weights for {sorted(info['missing_keys'])} as "
                         f"{type(model).__name__}: give a model of that kind (a reward model: the output folder of "
                         "reward.py)")
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
ID_COLUMNS = ("prompt", "completion", "chosen", "rejected")  # the token-id columns; the others (answer) are text


def check_model_limits(args, tokenizer, splits):
    """Token ids against the model's vocabulary and lengths against its positions, from its config, before the model
    loads: past either, the embedding lookup fails mid-run (IndexError) or generate does. A sequence is a prompt and its
    longest completion; for prompts alone (grpo, ppo), the prompt and --max_completion_length new tokens."""
    config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    config, model = config.get_text_config(), f"the model {args.model_name_or_path!r}"
    special = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    for name, token_id in special.items():
        if token_id is not None and token_id >= config.vocab_size:
            raise ValueError(f"the tokenizer's {name} token id {token_id} is past the vocab_size {config.vocab_size} "
                             f"of {model}: the tokenizer and the model do not belong together")
    limit = getattr(config, "max_position_embeddings", None)
    for split, data in splits.items():
        columns = [data[c] for c in ID_COLUMNS if data and c in data]
        top = max((max(ids) for column in columns for ids in column if ids), default=0)
        if top >= config.vocab_size:
            raise ValueError(f"split {split!r} has token id {top}, past the vocab_size {config.vocab_size} of "
                             f"{model}: the tokenizer and the model do not belong together")
        completions, generated = columns[1:], f"--max_completion_length {args.max_completion_length} new tokens"
        lengths = [len(prompt) + (max(len(c[i]) for c in completions) if completions else args.max_completion_length)
                   for i, prompt in enumerate(columns[0] if columns else [])]
        if limit and lengths and max(lengths) > limit:
            prompt = tokenizer.decode(columns[0][lengths.index(max(lengths))])[:60]
            raise ValueError(f"split {split!r}: {max(lengths)} tokens (the prompt {prompt!r}, then "
                             f"{'its longest completion' if completions else generated}), past the {limit} positions "
                             f"of {model} (max_position_embeddings): lower --max_completion_length or "
                             "--max_prompt_length (longer rows are dropped)")


def load_tokenizer(args):
    """The tokenizer of --model_name_or_path and the pad token id (its EOS when it has no pad token)."""
    path = args.model_name_or_path
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"--model_name_or_path {path!r} has no tokenizer files (one of "
                         f"{', '.join(TOKENIZER_FILES)}): save the tokenizer into the model folder")
    tokenizer = load_pretrained(AutoTokenizer, path, args, "--model_name_or_path")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {args.model_name_or_path} has no eos_token: completions could never end")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, pad_token_id


ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles of a conversation's messages


def check_text_columns(dataset, args, split):
    """The columns the scripts read as text must have been read as text. A CSV cell, or a JSON value in a column
    that mixes strings and numbers, that looks like a number comes back as one: "0457" becomes 457, and a verifier
    then scores the right answer 0. Conversations (lists of messages) are the other form a column may take; each
    message needs a known role and a text content, and no row may lack a column the others have."""
    for column in ["prompt", "completion", "chosen", "rejected", "messages", getattr(args, "answer_column", "answer")]:
        feature = dataset.features.get(column)
        if feature is None:
            continue
        where = f"dataset {args.dataset_name!r}, split {split!r}"
        try:
            values = list(dataset[column])
        except UnicodeDecodeError as e:  # pyarrow keeps the bytes unchecked: they fail when read as text
            problem = data_file_problem(args.dataset_name) if args.dataset_name.endswith((".json", ".jsonl")) else None
            raise ValueError(problem or f"{where}, column {column!r}: text that is not UTF-8 ({e.reason})") from e
        for row, value in enumerate(values):  # a row without it, or a conversation with a malformed message
            if value is None:
                raise ValueError(f"{where}, row {row}: no {column!r} (every row needs the same columns: rows of "
                                 "prompt/completion and rows of messages cannot be mixed)")
            bad = [m for m in value if not isinstance(m, dict) or m.get("role") not in ROLES
                   or not isinstance(m.get("content"), str)] if isinstance(value, list) else []
            if bad:
                raise ValueError(f"{where}, row {row}, column {column!r}: message {bad[0]!r} needs a role (one of "
                                 f"{', '.join(ROLES)}) and a text content")
        if isinstance(feature, (list, datasets.List, datasets.LargeList, datasets.Sequence)):
            continue
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            continue
        kind = feature.dtype if isinstance(feature, datasets.Value) else "mixed (text and numbers)"
        raise ValueError(f"dataset {args.dataset_name!r}, split {split!r}: column {column!r} was read as {kind}, not "
                         f"text (first row: {dataset[0][column]!r}); a number loses its leading zeros ('0457' -> 457). "
                         "Store the column as text: quoted strings in JSON/JSONL, a string column in parquet (a CSV "
                         "cell that looks like a number is always read as one)")


def load_data(args, tokenizer, tokenize, rank):
    """The train and test splits of --dataset_name through tokenize(dataset, tokenizer, args) -> (columns, dropped).
    Every rank holds all of it, so each knows the whole global batch. Returns train, test (None: no such split) and
    the train split's dropped rows by reason."""
    train_dataset = load_split(args.dataset_name, args.dataset_train_split)
    if train_dataset is None:
        raise ValueError(f"dataset {args.dataset_name!r} has no split {args.dataset_train_split!r}: give another "
                         "with --dataset_train_split (a data folder's splits are named after its files, e.g. "
                         "train.jsonl and test.jsonl)")
    check_text_columns(train_dataset, args, args.dataset_train_split)
    train, dropped = tokenize(train_dataset, tokenizer, args)
    eval_dataset = load_split(args.dataset_name, args.dataset_test_split)
    if eval_dataset:
        check_text_columns(eval_dataset, args, args.dataset_test_split)
    test = tokenize(eval_dataset, tokenizer, args)[0] if eval_dataset else None
    check_model_limits(args, tokenizer, {args.dataset_train_split: train, args.dataset_test_split: test})
    if rank == 0:
        print(f"train: {len(train['prompt'])} of {len(train_dataset)} rows kept; dropped: {dropped}")
        print(f"eval: {len(test['prompt'])} rows" if test else f"no split {args.dataset_test_split!r}: eval skipped")
    return train, test, dropped


def tokenize_prompts(dataset, tokenizer, args, answer_column=None):
    """Rows of `prompt` (a string, or a list of {"role", "content"} messages rendered with the chat template and its
    generation prompt), plus an answer column for verifiers -> {"prompt": token ids, "answer": ...}. Empty and
    over-long prompts are dropped and counted, never silently."""
    columns = dataset.column_names
    if "prompt" not in columns or (answer_column and answer_column not in columns):
        answer = f" and an {answer_column!r} column for the verifier" if answer_column else ""
        raise ValueError(f"dataset {args.dataset_name!r} has columns {columns}, but needs a 'prompt' column (a "
                         f"string, or a list of {{'role', 'content'}} messages){answer}")
    answers = dataset[answer_column] if answer_column else [None] * len(dataset)
    data, dropped = {"prompt": [], "answer": []}, {"empty prompt": 0, "prompt too long": 0}
    for prompt, answer in zip(dataset["prompt"], answers):
        if not prompt:
            dropped["empty prompt"] += 1
            continue
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:  # the template writes the special tokens itself
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > args.max_prompt_length:
            dropped["prompt too long"] += 1
        else:
            data["prompt"].append(ids)
            data["answer"].append(answer)
    return data, dropped


def rollouts_of(num_prompts, generations, passes, args, dropped, rank):
    """The rollouts of an RL run: --max_steps, or --num_train_epochs passes over the prompts. A rollout samples
    `generations` completions for each of its prompts (rollout_batch_size completions), then makes `passes`
    (num_iterations, num_ppo_epochs) x num_mini_batches optimizer steps on them. Sets num_training_steps; returns the
    number of rollouts and the optimizer steps per rollout."""
    steps_per_rollout = getattr(args, passes) * args.num_mini_batches
    for flag, value in (("--max_steps", args.max_steps), ("--save_every", args.save_every)):
        if value > 0 and value % steps_per_rollout:
            raise ValueError(f"{flag} must be a multiple of {passes} x num_mini_batches = {steps_per_rollout}, the "
                             "optimizer steps of a rollout (checkpoints are taken between rollouts)")
    prompts_per_rollout = args.rollout_batch_size // generations
    if num_prompts // prompts_per_rollout == 0:
        raise ValueError(f"{num_prompts} training prompts cannot fill one rollout of {prompts_per_rollout} prompts; "
                         f"dropped: {dropped}. Lower the batch sizes or the number of processes, use more data, or "
                         "raise --max_prompt_length if the prompts were dropped as too long")
    epochs = args.num_train_epochs * (num_prompts // prompts_per_rollout)
    num_rollouts = args.max_steps // steps_per_rollout if args.max_steps > 0 else epochs
    args.num_training_steps = num_rollouts * steps_per_rollout
    if rank == 0:
        groups = f" x {generations} generations = {args.rollout_batch_size} completions" if generations > 1 else ""
        print(f"{num_rollouts} rollouts of {prompts_per_rollout} prompts{groups}, each {getattr(args, passes)} "
              f"{passes.split('_')[-1]} x {args.num_mini_batches} mini-batches of {args.batch_size} completions "
              f"({args.world_size} processes x {args.per_device_train_batch_size} per micro-batch x "
              f"{args.gradient_accumulation_steps} accumulation) = {args.num_training_steps} optimizer steps")
    return num_rollouts, steps_per_rollout


def global_batch(step, num_rows, batch_size, seed):
    """Row indices of global batch number `step` (of an optimizer step; of a rollout in RL scripts): the same on every
    rank and a function of the step alone, so a resumed run sees the same data. Reshuffled every epoch; each epoch
    leaves its remainder rows out."""
    epoch, position = divmod(step, num_rows // batch_size)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch_size : (position + 1) * batch_size].tolist()


def micro_batches(batch, args, rank):
    """This rank's micro-batches of a global batch: gradient_accumulation_steps of per_device_train_batch_size rows,
    the k-th starting at row (k x world_size + rank) x size, so that every split reads the same global batch."""
    size = args.per_device_train_batch_size
    for k in range(args.gradient_accumulation_steps):
        start = (k * args.world_size + rank) * size
        yield batch[start : start + size]


def rank_micro_batches(num_rows, rank, world_size, size):
    """This rank's share of rows 0..num_rows-1 in micro-batches of `size`, as many on every rank because each forward
    of an FSDP model is a collective: a rank that has run out gets row 0 with valid=False, to be ignored."""
    share = list(range(rank, num_rows, world_size))
    for start in range(0, math.ceil(num_rows / world_size), size):
        rows = share[start : start + size]
        yield (rows, True) if rows else ([0], False)


def pad(sequences, value, side):
    """Pad lists of ints to one width, on the left or the right; returns a LongTensor."""
    width = max(len(s) for s in sequences)
    fill = [[value] * (width - len(s)) for s in sequences]
    return torch.tensor([f + s if side == "left" else s + f for s, f in zip(sequences, fill)], dtype=torch.long)


def make_batch(prompts, completions, pad_token_id):
    """[left-padded prompts | right-padded completions]. Masks come from lengths, never from pad_token_id, so the
    completion's EOS stays in the loss when pad == eos. Returns input_ids, attention_mask, completion_mask."""
    ones = [[1] * len(s) for s in prompts], [[1] * len(s) for s in completions]
    input_ids = torch.cat([pad(prompts, pad_token_id, "left"), pad(completions, pad_token_id, "right")], 1)
    completion_mask = pad(ones[1], 0, "right")
    return input_ids, torch.cat([pad(ones[0], 0, "left"), completion_mask], 1), completion_mask


def batch_on(device, prompts, completions, rows, pad_token_id):
    """make_batch of the given rows, on the device."""
    batch = make_batch([prompts[i] for i in rows], [completions[i] for i in rows], pad_token_id)
    return [t.to(device) for t in batch]


def completion_logprobs(model, input_ids, attention_mask, completion_width, temperature=1.0, with_entropy=False):
    """Log-probabilities of the last `completion_width` tokens, from logits / temperature; with_entropy: also the
    entropy of each of those next-token distributions (detached: a statistic, not a loss term). The model's own head
    runs on the last position only; HeadLogprobs applies it to the completion's hidden states, in chunks."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: the first real token is position 0
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    output_hidden_states=True, logits_to_keep=1)
    hidden, head = outputs.hidden_states[-1], model.get_output_embeddings()  # hidden states after the final norm
    with torch.no_grad():  # HeadLogprobs must compute what the model's head computed at the last position
        theirs = outputs.logits[:, -1].float()
        difference = (torch.nn.functional.linear(hidden[:, -1], head.weight, head.bias).float() - theirs).abs()
        if (difference > 0.02 * (1 + theirs.abs().max())).any():  # NaN passes here: the step's own check names it
            raise ValueError(f"{type(model).__name__}: its logits are not its head's linear map of its last hidden "
                             "states (a logit scale or soft-capping?), which completion_logprobs assumes")
    labels = input_ids[:, -completion_width:]
    hidden = hidden[:, -completion_width - 1:-1]  # the state at t predicts token t + 1
    logprobs, entropy = HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                           labels.reshape(-1), temperature, with_entropy)
    if not with_entropy:
        return logprobs.view(labels.shape)
    return logprobs.view(labels.shape), entropy.view(labels.shape)


class HeadLogprobs(torch.autograd.Function):
    """log_softmax(linear(hidden, weight, bias).float() / temperature) at `labels`, ROWS rows at a time, and the
    entropies if asked (no gradient; else an empty tensor). Autograd through that expression on the whole batch keeps
    about four fp32 copies of the (rows, vocabulary) logits: 1.9 GB each for 8 x 385 tokens and a 152k vocabulary.
    Here a chunk's logits are freed before the next chunk's; the backward computes them again (one more matmul of the
    head) from the saved hidden states."""

    ROWS = 1024

    @staticmethod
    def logits(hidden, weight, bias, temperature):  # one chunk's, the same in the forward and the backward
        return torch.nn.functional.linear(hidden, weight, bias).float() / temperature

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy):
        n = len(hidden)
        logprobs, logsumexp = hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for start in range(0, n, HeadLogprobs.ROWS):
            rows = slice(start, start + HeadLogprobs.ROWS)
            logits = HeadLogprobs.logits(hidden[rows], weight, bias, temperature)
            logsumexp[rows] = logits.logsumexp(-1)
            logprobs[rows] = logits.gather(-1, labels[rows, None])[:, 0] - logsumexp[rows]
            if with_entropy:  # H = logsumexp - sum(p * logits)
                entropy[rows] = logsumexp[rows] - (logits.softmax(-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, logsumexp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # summed over the chunks in fp32
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for start in range(0, len(hidden), HeadLogprobs.ROWS):
            rows = slice(start, start + HeadLogprobs.ROWS)
            logits, g = HeadLogprobs.logits(hidden[rows], weight, bias, ctx.temperature), grad_logprobs[rows, None]
            # d log p(label) / d logits = onehot(label) - softmax(logits), then divided by the temperature
            grad_logits = logits.sub_(logsumexp[rows, None]).exp_().mul_(-g).scatter_add_(-1, labels[rows, None], g)
            grad_logits = grad_logits.div_(ctx.temperature).to(hidden.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight += (grad_logits.T @ hidden[rows]).float()
            if bias is not None:
                grad_bias += grad_logits.float().sum(0)
        grad_bias = None if bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None


def last_token_index(attention_mask):
    """Column of the last real token of each row, from the mask alone: right for left or right padding, and when
    pad == eos (HF's sequence classification takes the last token != pad_token_id, which skips an EOS equal to pad)."""
    return (attention_mask * torch.arange(attention_mask.shape[1], device=attention_mask.device)).argmax(1)


def sequence_scores(model, input_ids, attention_mask):
    """Reward-model score of each row at its last real token, plus the config's `score_bias` (reward.py
    --normalize_reward; HF's decoder classification heads have no bias parameter to hold it). HF applies the head at
    every position and pools by pad_token_id; a hook keeps the head's output for all positions and we index it."""
    outputs = []
    hook = model.score.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hook.remove()
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return outputs[0][rows, last_token_index(attention_mask), 0].float() + getattr(model.config, "score_bias", 0.0)


def disable_dropout(model):
    """Dropout off: every dropout layer, and the attention dropout that HF models read from an attribute."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def shard_model(model, args, device):
    """FSDP2: each decoder layer, then the root (embeddings, final norm, head). Gradients are summed over ranks,
    not averaged: every loss here is already divided by a count taken over the whole global batch."""
    bf16 = args.bf16 and device.type == "cuda"
    mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
    policies = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
                "mp_policy": MixedPrecisionPolicy(**mixed),
                "offload_policy": CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()}
    layer_classes = set(model._no_split_modules or [])  # HF's name for the decoder layer classes
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, reshard_after_forward=args.reshard_after_forward, **policies)
    fully_shard(model, **policies)  # the root keeps its own default: it runs first in the backward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def load_trained(auto_class, path, args, flag, device):
    """A model to train: loaded, dropout off (the log-probs and values of the same tokens must not change between the
    passes that compare them), activations recomputed in the backward with --gradient_checkpointing, sharded."""
    model = load_pretrained(auto_class, path, args, flag)
    disable_dropout(model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return shard_model(model, args, device)


def load_reward_model(args, tokenizer, device):
    """The frozen reward model of --reward_model_path (written by reward.py), refused unless its tokenizer is the
    policy's: the scripts feed it the policy's token ids."""
    reward_tokenizer = load_pretrained(AutoTokenizer, args.reward_model_path, args, "--reward_model_path")
    if reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the reward model {args.reward_model_path} has another tokenizer than the policy: this "
                         "script feeds it the policy's token ids")
    return load_frozen(AutoModelForSequenceClassification, args.reward_model_path, args, "--reward_model_path", device)


def load_frozen(auto_class, path, args, flag, device):
    """A model that is not trained (a reference or a reward model): loaded, dropout off, no gradients, eval mode,
    sharded like the policy."""
    model = load_pretrained(auto_class, path, args, flag)
    disable_dropout(model.requires_grad_(False).eval())
    return shard_model(model, args, device)


def make_optimizer(model, args):
    """AdamW (fused: one kernel over all parameters; foreach over DTensors took 2-3x the time on CPU) or TF Adam; the
    LR schedule, fixed now for num_training_steps and stepped once per optimizer step; and the step and the loop's own
    state from --resume_from (else 0 and a fresh {"skipped": []})."""
    if args.optimizer == "adam_tf":
        optimizer = AdamTF(model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay, fused=True)
    warmup = math.ceil(args.warmup_ratio * args.num_training_steps)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                              num_training_steps=args.num_training_steps)
    start_step, state = (0, {"skipped": []})
    if args.resume_from:
        start_step, state = load_checkpoint(args.resume_from, model, optimizer, scheduler, args)
    return optimizer, scheduler, start_step, state


def optimizer_step(model, optimizer, scheduler, loss, step, args, skipped):
    """Clip the gradient norm (--max_grad_norm; 0: measured only), apply the update unless guard_step refuses it,
    step the LR schedule once, clear the gradients. `loss` is this rank's part of the step's loss. Returns the
    learning rate the step used, the gradient norm, and whether to stop (a signal arrived)."""
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    update, stop = guard_step(loss, grad_norm, step, args, skipped)
    if update:
        optimizer.step()
    lr = scheduler.get_last_lr()[0]  # the learning rate this step used
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm, stop


def is_due(step, every, args):
    """Whether to log (or evaluate) after optimizer step `step`: every `every` steps (-1: never), and the last one."""
    return step == args.num_training_steps or (every > 0 and step % every == 0)


def reduce_sums(sums):
    """{name: this rank's running sum (a 0-d tensor)} -> {name: the sum over all ranks}, in one all-reduce. Every
    rank runs the same code, so every rank has the same names."""
    names = sorted(sums)
    totals = torch.stack([sums[name].float() for name in names])
    dist.all_reduce(totals)
    return dict(zip(names, totals.tolist()))


def open_metrics(args, start_step, rank):
    """Rank 0: the wandb run (--track) and output_dir/metrics.jsonl; a resumed run continues the file, and the rows
    logged after its checkpoint are dropped. Returns the file's path."""
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if rank == 0:
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), save_code=True,
                       name=f"{args.exp_name}__{args.seed}__{int(time.time())}")
        old = [json.loads(line) for line in open(path)] if start_step > 0 and os.path.exists(path) else []
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in old if row["step"] <= start_step)
    return path


def log_metrics(metrics, path, args, progress, rank, samples=None):
    """Rank 0 prints the metrics, appends them to metrics.jsonl and logs them to wandb. `samples`: a table of
    completions, its first row the header (prompt, completion, then numbers), printed and logged as a wandb table.
    No collective here: the metrics are reduced before."""
    if rank != 0:
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


@contextlib.contextmanager
def unsharded(model, keep=False):
    """Every FSDP2 parameter gathered once for the whole block: generation runs one forward per new token, and FSDP2
    would otherwise all-gather every layer again for each one. No forward in the block is then a collective, so ranks
    may generate different numbers of tokens. FSDP2's forward hooks are set aside meanwhile: with everything gathered
    they have nothing to do, yet they ran at every module for every token (a third of a GRPO step on an H100,
    bench/RESULTS.md) and would split a compiled graph. keep (--no-reshard_after_forward): still gathered after the
    block, so the next forward needs no all-gather; the backward frees them."""
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    hooks = [(module._forward_pre_hooks, module._forward_hooks) for module in fsdp_modules]
    for module in fsdp_modules:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
        module._forward_pre_hooks, module._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
    try:
        yield
    finally:
        for module, (pre_hooks, post_hooks) in zip(fsdp_modules, hooks):
            module._forward_pre_hooks, module._forward_hooks = pre_hooks, post_hooks
            if not keep:
                module.set_reshard_after_forward(module is not model, recurse=False)  # as shard_model left it
                module.reshard()


@torch.no_grad()
def generate_completions(model, prompts, max_new_tokens, temperature, eos_token_id, pad_token_id, cache="dynamic"):
    """One completion per prompt (lists of token ids) with HF generate: sampled from softmax(logits / temperature), or
    greedy if temperature is None. Each completion is cut after its first EOS; one without EOS is truncated. cache:
    --cache_implementation; static pads the prompts to a multiple of 64 tokens, so that widths share a compiled step."""
    device = next(model.parameters()).device
    input_ids, attention_mask = pad(prompts, pad_token_id, "left"), pad([[1] * len(p) for p in prompts], 0, "left")
    if cache == "static":
        extra = -input_ids.shape[1] % 64
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=pad_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
    # Sample from exactly the distribution the log-probs are computed from: generate fills every option left unset
    # from the model folder's generation_config (Qwen's sets top_k 20, top_p 0.8, repetition_penalty 1.05), and its
    # global default top_k is 50, so swap in a blank config and turn top_k off.
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    config = GenerationConfig(**(sampling or {"do_sample": False}), max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              cache_implementation=None if cache == "dynamic" else cache)
    folder_config, model.generation_config, was_training = model.generation_config, GenerationConfig(), model.training
    model.eval()  # gradient checkpointing acts in training mode only, and there it turns the KV cache off
    try:  # position ids: generate derives them from the attention mask itself. synced_gpus: HF would all-reduce a
        # "finished" flag after every token of an FSDP model; with the parameters gathered, ranks need not keep step
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=config, synced_gpus=False)
    finally:
        model.generation_config = folder_config
        model.train(was_training)
    rows = output[:, input_ids.shape[1] :].tolist()
    return [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]


def sample_rollout(model, prompts, args, rollout, rank, eos_token_id, pad_token_id, device):
    """Completions of every prompt, the parameters gathered once: chunks of local_rollout_forward_batch_size rows,
    round-robin over the ranks, each seeded by (seed, rollout, chunk), so the samples depend neither on the number of
    processes nor on a resume; the sum over ranks of the zero-initialised tables gives every rank the whole rollout.
    Returns the completions (lists of token ids, cut after EOS) and their lengths (a tensor)."""
    n, width, chunk_size = len(prompts), args.max_completion_length, args.local_rollout_forward_batch_size
    completion_ids = torch.zeros(n, width, dtype=torch.long, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    with unsharded(model, keep=not args.reshard_after_forward):
        for chunk, start in enumerate(range(0, n, chunk_size)):
            if chunk % args.world_size != rank:
                continue
            torch.manual_seed((args.seed * 100_003 + rollout) * 100_003 + chunk)
            chunk_prompts = prompts[start : start + chunk_size]
            completions = generate_completions(model, chunk_prompts, width, args.temperature, eos_token_id,
                                               pad_token_id, args.cache_implementation)
            for i, completion in enumerate(completions, start):
                completion_ids[i, : len(completion)] = torch.tensor(completion)
                lengths[i] = len(completion)
    dist.all_reduce(completion_ids)
    dist.all_reduce(lengths)
    return [completion_ids[i, :length].tolist() for i, length in enumerate(lengths.tolist())], lengths


def rollout_mini_batches(rollout, passes, args):
    """`passes` passes over a rollout of rollout_batch_size completions, each a fresh order (seeded by rollout and
    pass) cut into num_mini_batches global mini-batches of batch_size: the same on every rank and after a resume."""
    for iteration in range(passes):
        seed = (args.seed * 100_003 + rollout) * 100_003 + iteration
        order = torch.randperm(args.rollout_batch_size, generator=torch.Generator().manual_seed(seed)).tolist()
        for k in range(args.num_mini_batches):
            yield order[k * args.batch_size : (k + 1) * args.batch_size]


STOP_SIGNALS = []  # signals received: request_stop appends, guard_step reads


def request_stop(signum, frame):
    """SIGTERM (preemption: torchrun forwards it to every process) or SIGINT (Ctrl-C) only raise a flag; the loop sees
    it at the next optimizer step, saves a checkpoint and leaves. A second Ctrl-C stops at once."""
    if signum == signal.SIGINT and STOP_SIGNALS:
        raise KeyboardInterrupt
    STOP_SIGNALS.append(signum)


def guard_step(loss, grad_norm, step, args, skipped):
    """Before optimizer.step(), one all-reduce: is this step's loss (this rank's part) or gradient norm NaN or inf
    anywhere, and has any rank been asked to stop? Every rank gets the same answer and takes the same branch. A
    non-finite step is not applied, up to --skip_nonfinite times (`skipped` lists them); past that the run stops with
    a message naming the step, the metric and the last complete checkpoint. Returns (apply the update, stop now)."""
    stop_flag = torch.tensor(float(bool(STOP_SIGNALS)), device=grad_norm.device)
    bad = [(~torch.isfinite(value)).float() for value in (loss, grad_norm)]
    flags = torch.stack([*bad, stop_flag])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_loss, bad_norm, stop = flags.tolist()
    if not bad_loss and not bad_norm:
        return True, stop > 0
    what = " and ".join(name for name, bad in [("loss", bad_loss), ("grad_norm", bad_norm)] if bad)
    skipped.append(step)
    if len(skipped) <= args.skip_nonfinite:
        if dist.get_rank() == 0:
            print(f"step {step}: non-finite {what}: update skipped ({len(skipped)} of --skip_nonfinite "
                  f"{args.skip_nonfinite})")
        return False, stop > 0
    last = (complete_checkpoints(args.output_dir) or ["none (see --save_every)"])[-1]
    raise FloatingPointError(
        f"step {step}: non-finite {what} (grad_norm {grad_norm.item()}); the model was not updated with it. Last "
        f"complete checkpoint: {last}. Resume from it with a lower --learning_rate or --max_grad_norm, check this "
        "step's data, or pass --skip_nonfinite N to skip up to N such steps")


def leave_after_signal(checkpoint, rank):
    """After the checkpoint a SIGTERM/SIGINT asked for: say how to continue, close the process group and exit with
    128 + the signal, so that a job scheduler sees an interrupted run, not a finished one."""
    signum = STOP_SIGNALS[0] if STOP_SIGNALS else signal.SIGTERM  # the signal may have reached another rank only
    if rank == 0:
        print(f"stopped by {signal.Signals(signum).name}: checkpoint {checkpoint}; the same command with "
              "--resume_from auto continues the run")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(128 + signum)


def complete_checkpoint(path):
    """The manifest (checkpoint.json) of a complete checkpoint folder, else None: the folder is named after its step,
    and every file the manifest lists is there at its size (a folder still being written, truncated or copied in
    part fails this)."""
    try:
        manifest = json.load(open(os.path.join(path, "checkpoint.json")))
        sizes = all(os.path.getsize(os.path.join(path, name)) == size for name, size in manifest["files"].items())
        return manifest if sizes and os.path.basename(os.path.normpath(path)) == f"step_{manifest['step']}" else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoints(output_dir):
    """The complete checkpoints of output_dir/checkpoints, oldest step first (--resume_from auto takes the last)."""
    root = os.path.join(output_dir, "checkpoints")
    found = [(manifest["step"], os.path.join(root, name)) for name in (os.listdir(root) if os.path.isdir(root) else [])
             if (manifest := complete_checkpoint(os.path.join(root, name)))]
    return [path for _, path in sorted(found)]


def save_checkpoint(model, optimizer, scheduler, step, args, state):
    """output_dir/checkpoints/step_N: model and optimizer tensors (torch.distributed.checkpoint, sharded), and per
    rank the scheduler, the RNG states and `state` (the loop's own: skipped steps, the KL controller) in a
    weights_only file. Written as step_N.tmp; when every rank is done, rank 0 lists each file with its size in
    checkpoint.json (with the arguments) and renames the folder, so a crash while saving leaves the previous
    checkpoint the latest complete one. --keep_last N then removes the older ones. Returns the folder. A write that
    fails (a full disk) removes the partial folder and stops the run, naming the checkpoint to resume from."""
    rank = dist.get_rank()
    path = os.path.join(args.output_dir, "checkpoints", f"step_{step}")
    if rank == 0:
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)  # left by a crash
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=f"{path}.tmp")
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        extra = {"step": step, "scheduler": scheduler.state_dict(), "rng": rng, "state": state}
        torch.save(extra, f"{path}.tmp/rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            files = {name: os.path.getsize(os.path.join(f"{path}.tmp", name)) for name in os.listdir(f"{path}.tmp")}
            with open(f"{path}.tmp/checkpoint.json", "w") as f:
                json.dump({"step": step, "args": vars(args), "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(path, ignore_errors=True)  # a run restarted into the same output_dir overwrites its old step
            os.replace(f"{path}.tmp", path)
    except (OSError, RuntimeError, dcp.api.CheckpointException) as e:  # DCP gathers every rank's write errors in one
        if rank == 0:
            shutil.rmtree(f"{path}.tmp", ignore_errors=True)  # what was written of it: room for the next try
        cause = next(iter(e.failures.values()))[0] if isinstance(e, dcp.api.CheckpointException) else e
        last = (complete_checkpoints(args.output_dir) or ["none"])[-1]
        free = shutil.disk_usage(args.output_dir).free / 2**30
        raise OSError(f"step {step}: the checkpoint {path} could not be written ({cause!r}; {free:.1f} GiB free "
                      f"there). The latest complete checkpoint, {last}, is kept: make room, then run the same command "
                      "with --resume_from auto") from e
    if rank == 0:  # the new checkpoint is complete: --keep_last may drop older ones
        for old in complete_checkpoints(args.output_dir)[: -args.keep_last] if args.keep_last > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return path


# arguments that may change when a run resumes: where it logs, how often, and how the same global batch is split
RESUMABLE = {"exp_name", "track", "wandb_project_name", "wandb_entity", "output_dir", "overwrite_output_dir",
             "resume_from", "log_every", "eval_every", "save_every", "keep_last", "skip_nonfinite",
             "per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size",
             "local_rollout_forward_batch_size", "cache_implementation", "gradient_checkpointing", "cpu_offload",
             "reshard_after_forward", "world_size", "local_batch_size"}


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, with its .metadata (a pickle) read through an allow-list: DCP's metadata classes, torch
    sizes, dtypes and layouts, paths. And no bytes entry: DCP reads those with torch.load(weights_only=False), which
    runs whatever the file holds; save_checkpoint writes tensors only (the rest is in json and weights_only files).
    So loading a checkpoint cannot run code planted in it."""

    def read_metadata(self, *args, **kwargs):
        allowed_names = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                         ("pathlib", "WindowsPath"), ("pathlib", "Path")}

        def allowed(module, name):
            return (module == "torch.distributed.checkpoint.metadata" or (module, name) in allowed_names
                    or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if not allowed(module, name):
                    raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: not a DCP "
                                                 "metadata class")
                return super().find_class(module, name)

        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = Unpickler(f).load()
        entries = metadata.state_dict_metadata.items()
        pickled = [key for key, entry in entries if isinstance(entry, BytesStorageMetadata)]
        if pickled:
            raise ValueError(f"checkpoint {self.path} lists a non-tensor entry ({pickled[0]}), which DCP would "
                             "unpickle: not a checkpoint of these scripts (they save tensors only)")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_checkpoint(path, model, optimizer, scheduler, args):
    """Restore a checkpoint of save_checkpoint, after checking that it is complete and belongs to this run: every
    argument outside RESUMABLE must match (model, data, seed, schedule, algorithm, the global batch). The number of
    processes may change if the global batch stays the same (DCP reshards; the per-rank RNG streams then restart).
    Nothing is unpickled. Returns the step and the loop's own state."""
    manifest = complete_checkpoint(path)
    if manifest is None:
        raise ValueError(f"--resume_from {path!r} is not a complete checkpoint (a step_N folder whose checkpoint.json "
                         "lists files that are all there); --resume_from auto picks the latest complete one")
    now = json.loads(json.dumps(vars(args)))
    mismatched = [f"{name} {manifest['args'].get(name)!r} in the checkpoint, {value!r} now"
                  for name, value in now.items() if name not in RESUMABLE and manifest["args"].get(name) != value]
    if mismatched:
        raise ValueError(f"checkpoint {path} does not match the arguments: {'; '.join(mismatched)}. Resume with the "
                         "arguments it was written with (batch_size = processes x --per_device_train_batch_size x "
                         "--gradient_accumulation_steps), or start a new run in another --output_dir")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state["state"]}
    reader = CheckpointReader(path)
    reader.read_metadata()  # a refusal surfaces here: DCP itself (torch 2.11) swallows read_metadata's errors
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optimizer"], "param_groups": optimizer_state["param_groups"]})
    same_processes = manifest["args"]["world_size"] == args.world_size
    extra = torch.load(os.path.join(path, f"rank{dist.get_rank() if same_processes else 0}.pt"), weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the learning rate of the next step (param_groups are not in the checkpoint)
    if same_processes:
        torch.set_rng_state(extra["rng"]["torch"])
        random.setstate(extra["rng"]["python"])
        if "cuda" in extra["rng"]:
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
    elif dist.get_rank() == 0:
        print(f"resuming on {args.world_size} processes a run of {manifest['args']['world_size']}: same weights, "
              "optimizer, schedule and data order; the per-process random streams (dropout) restart")
    return extra["step"], extra["state"]


def save_hf_model(model, tokenizer, output_dir, rank):
    """Gather the full weights on rank 0 (a collective: every rank calls this) and write a Hugging Face folder."""
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first_name = {}  # tied parameters (input embeddings = head) come back as copies: keep the first name only
    for name, param in model.named_parameters(remove_duplicate=False):
        if first_name.setdefault(id(param), name) != name:
            state_dict.pop(name, None)
    if rank == 0:
        model.save_pretrained(output_dir, state_dict=state_dict)
        tokenizer.save_pretrained(output_dir)


def finish(model, tokenizer, args, device, rank):
    """Write the Hugging Face folder (a collective), print the peak memory of the busiest process (GPU allocations,
    or the CPU resident set), close wandb and the process group."""
    save_hf_model(model, tokenizer, args.output_dir, rank)
    on_gpu = device.type == "cuda"
    used = torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = torch.tensor(float(used), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"saved {args.output_dir}; peak {'GPU' if on_gpu else 'CPU RSS'} memory per process "
              f"{peak.item() / 2**30:.2f} GiB")
        if args.track:
            import wandb

            wandb.finish()
    dist.barrier()  # no rank tears gloo/nccl down while another still communicates (gloo can abort at exit otherwise)
    dist.destroy_process_group()
    while OUTPUT_DIR_LOCK:  # the folder is free for the next run
        OUTPUT_DIR_LOCK.pop().close()


if __name__ == "__main__":
    main(tyro.cli(Args))
