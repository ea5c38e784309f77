"""Direct Preference Optimization (DPO) in one file: the policy learns from preference pairs directly, its implicit
reward beta * log(pi / pi_ref) replacing a reward model. Paper: arXiv:2305.18290. Also: IPO (arXiv:2310.12036), hinge
(SLiC, arXiv:2305.10425) and conservative DPO (label smoothing). What differs from the paper: (1) the reference
log-probabilities are computed once, before training, for the whole training split, and the reference model is freed
(--no-precompute-ref-logps keeps it and recomputes them online; both give the same losses); (2) dropout is off in
the policy, so the implicit reward is exactly 0 before the first step; (3) --loss_type ipo uses summed
log-probabilities, as the other losses do; ipo_per_token averages them over tokens (TRL's ipo); (4) optional RPO term.
Read `main` first; the functions below the Infrastructure line are the same in every script and can be skipped.
Run:  torchrun --nproc_per_node 2 dpo.py --model_name_or_path runs/sft --dataset_name toy/preference \
          --output_dir runs/dpo --learning_rate 1e-5 --beta 0.1 --num_train_epochs 1
      torchrun --nproc_per_node 8 dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
          --dataset_name trl-lib/ultrafeedback_binarized --track
"""

import collections
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
import torch.nn.functional as F
import tyro
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

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
    output_dir: str = "runs/dpo"
    """where the final Hugging Face model folder, checkpoints and metrics.jsonl are written"""
    overwrite_output_dir: bool = False
    """replace a previous run in output_dir (removing its metrics, checkpoints, model), which is refused otherwise"""
    model_name_or_path: str = "runs/sft"
    """a hub id or a local Hugging Face model folder: the SFT model the policy starts from"""
    dataset_name: str = "toy/preference"
    """a hub id, a local .json/.jsonl/.parquet/.csv file (the train split) or a local folder of such files"""
    dataset_train_split: str = "train"
    """the split to train on"""
    dataset_test_split: str = "test"
    """the split to evaluate on (skipped, with a message, if the dataset has none)"""
    max_steps: int = -1
    """number of optimizer steps; -1: run `num_train_epochs` epochs"""
    num_train_epochs: int = 1
    """passes over the training split (used when max_steps is -1)"""
    learning_rate: float = 1e-6
    """peak learning rate"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """learning rate schedule after warmup (transformers.get_scheduler), stepped once per optimizer step"""
    warmup_ratio: float = 0.0
    """fraction of the optimizer steps spent warming up linearly from 0"""
    per_device_train_batch_size: int = 8
    """micro-batch size: samples per process per forward/backward (HF name; `local_micro_batch_size`)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step on each process"""
    per_device_eval_batch_size: int = 32
    """samples per process per forward pass without gradients (evaluation, reference log-probs, reward scores)"""
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
    """pairs whose prompt is longer than this (in tokens) are dropped, and counted in a message at start"""
    max_completion_length: int = 1024
    """pairs with a completion longer than this (in tokens, EOS included) are dropped, and counted in a message at
    start"""

    # batch sizes, computed at start (not flags): world_size processes; local_batch_size = per_device_train_batch_size
    # x gradient_accumulation_steps samples per process per optimizer step; batch_size = local_batch_size x world_size
    # samples, the global batch; num_training_steps, fixed before training (the LR schedule ends exactly there)

    # DPO
    beta: float = 0.1
    """strength of the KL regularisation to the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["sigmoid", "ipo", "ipo_per_token", "hinge"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO (arXiv:2310.12036, Eq. 17: summed log-ratios); ipo_per_token: each log-ratio divided by
    its completion's length, what TRL 1.16 calls ipo (a beta means something else in each); hinge: SLiC
    (arXiv:2305.10425)"""
    label_smoothing: float = 0.0
    """assumed probability that a preference label is flipped (conservative DPO; sigmoid only)"""
    ref_model_name_or_path: Optional[str] = None
    """the reference model (default: model_name_or_path, the SFT model)"""
    rpo_alpha: float = 0.0
    """weight of the chosen completion's per-token NLL added to the loss (RPO, arXiv:2404.19733; 0: plain DPO)"""
    precompute_ref_logps: bool = True
    """compute the reference log-probs once before training, then free the reference model (--no-...: keep it and
    compute them online)"""


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, lengths, args):
    """Per-pair loss and the implicit rewards beta * log(pi / pi_ref) of both completions. With h = the chosen
    log-ratio minus the rejected one: sigmoid -log sigmoid(beta h) (Eq. 7 of arXiv:2305.18290), mixed with
    -log sigmoid(-beta h) by label_smoothing (conservative DPO: labels flipped with that probability);
    ipo (h - 1 / (2 beta))^2 (Eq. 17 of arXiv:2310.12036); ipo_per_token the same with each log-ratio divided by its
    completion's length (`lengths`: the chosen, then the rejected); hinge max(0, 1 - beta h) (SLiC). Plus rpo_alpha x
    the chosen completion's negative log-likelihood per token (RPO, Eq. 3 of arXiv:2404.19733): DPO alone can lower the
    likelihood of the chosen answer too when the two completions differ by a token or two."""
    beta, eps = args.beta, args.label_smoothing
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    chosen_lengths, rejected_lengths = lengths.chunk(2)
    h = chosen_ratio - rejected_ratio
    if args.loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif args.loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif args.loss_type == "ipo_per_token":  # TRL 1.16's "ipo": per TRL, the form the IPO paper's experiments used
        losses = (chosen_ratio / chosen_lengths - rejected_ratio / rejected_lengths - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)
    losses = losses - args.rpo_alpha * chosen_logps / chosen_lengths
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_logps(model, data, rows, pad_token_id):
    """Summed log-probabilities of the chosen and of the rejected completion of `rows` (EOS included), in one
    forward of 2 x len(rows) sequences; also the completions' lengths (the chosen, then the rejected) and the tokens
    processed."""
    prompts = [data["prompt"][i] for i in rows]
    completions = [data["chosen"][i] for i in rows] + [data["rejected"][i] for i in rows]
    device = next(model.parameters()).device
    input_ids, attention_mask, completion_mask = [t.to(device) for t in make_batch(prompts + prompts, completions,
                                                                                      pad_token_id)]
    logps = (completion_logprobs(model, input_ids, attention_mask, completion_mask.shape[1]) * completion_mask).sum(1)
    return logps[: len(rows)], logps[len(rows) :], completion_mask.sum(1), attention_mask.sum()


@torch.no_grad()
def reference_table(ref_model, data, args, pad_token_id, rank):
    """Summed reference log-probs of the chosen and rejected completions of every row of `data`, as a (rows, 2)
    table: each rank computes its share and the sum gives every rank all of it. The rows are always grouped the
    same way, so the table, and a run resumed from a checkpoint, are identical to the bit."""
    table = torch.zeros(len(data["prompt"]), 2, device=next(ref_model.parameters()).device)
    for rows, valid in rank_micro_batches(len(data["prompt"]), rank, args.world_size, args.per_device_eval_batch_size):
        chosen, rejected, _, _ = pair_logps(ref_model, data, rows, pad_token_id)
        table[rows] += valid * torch.stack([chosen, rejected], 1)
    dist.all_reduce(table)
    return table


@torch.no_grad()
def reference_logps(ref_model, table, data, rows, pad_token_id):
    """The reference log-probs of the chosen and rejected completions of `rows`: from the precomputed table, or
    (--no-precompute-ref-logps, table None) from a forward of the reference model."""
    if table is not None:
        return table[rows].unbind(1)
    return pair_logps(ref_model, data, rows, pad_token_id)[:2]


@torch.no_grad()
def evaluate(model, ref_model, table, test, args, pad_token_id, rank):
    """Mean loss and accuracy of the implicit reward (chosen above rejected) over the test pairs, each rank its
    share."""
    model.eval()
    totals = torch.zeros(2, device=next(model.parameters()).device)
    for rows, valid in rank_micro_batches(len(test["prompt"]), rank, args.world_size, args.per_device_eval_batch_size):
        chosen, rejected, lengths, _ = pair_logps(model, test, rows, pad_token_id)
        ref_chosen, ref_rejected = reference_logps(ref_model, table, test, rows, pad_token_id)
        loss, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths, args)
        totals += valid * torch.stack([loss.sum(), (chosen_rewards > rejected_rewards).sum()])
    dist.all_reduce(totals)
    model.train()
    loss, accuracy = (totals / len(test["prompt"])).tolist()
    return {"eval/loss": loss, "eval/accuracy": accuracy}


def main(args):
    # 1. distributed init, computed batch sizes, seeds, signal handlers (setup, in the appendix)
    rank, world_size, device = setup(args)
    if args.beta <= 0:  # the implicit reward is beta x the log-ratio: with beta 0 the loss has no gradient
        raise ValueError(f"--beta {args.beta}: must be above 0")
    if args.label_smoothing > 0 and args.loss_type != "sigmoid":
        raise ValueError(f"--label_smoothing applies to --loss_type sigmoid only (got {args.loss_type})")

    # 2. data: every rank tokenises the same rows, so each knows the whole global batch
    tokenizer, pad_token_id = load_tokenizer(args)
    train, test, dropped = load_data(args, tokenizer, tokenize_preference, rank)
    epochs_of(len(train["prompt"]), args, dropped, rank)  # sets args.num_training_steps

    # 3. models + FSDP2: the policy, then the frozen reference (the same SFT model unless --ref_model_name_or_path)
    # (dropout off in both: the implicit reward compares their log-probs, with no noise in either)
    model = load_trained(AutoModelForCausalLM, args.model_name_or_path, args, "--model_name_or_path", device)
    ref_path = args.ref_model_name_or_path or args.model_name_or_path
    ref_model = load_frozen(AutoModelForCausalLM, ref_path, args, "--ref_model_name_or_path", device)
    tables = {"train": None, "test": None}  # the reference log-probs, once, before training; then the model is freed
    if args.precompute_ref_logps:
        tables = {name: reference_table(ref_model, data, args, pad_token_id, rank) if data else None
                  for name, data in (("train", train), ("test", test))}
        ref_model = None
        if rank == 0:
            print(f"reference log-probs computed for {len(train['prompt'])} training pairs and "
                  f"{len(test['prompt']) if test else 0} test pairs")

    # 4. optimizer and LR schedule, its total fixed now (or both restored by --resume_from)
    optimizer, scheduler, start_step, state = make_optimizer(model, args)
    metrics_path = open_metrics(args, start_step, rank)

    # 5. training loop
    model.train()
    progress = tqdm(total=args.num_training_steps, initial=start_step, disable=rank != 0, desc="dpo")
    stop = False  # a SIGTERM/SIGINT seen at an optimizer step (a resumed run may have no step left)
    tokens, window_start = torch.zeros((), device=device), time.time()
    for step in range(start_step, args.num_training_steps):
        batch = global_batch(step, len(train["prompt"]), args.batch_size, args.seed)
        last = collections.defaultdict(lambda: torch.zeros((), device=device))  # this step, this rank's part
        for micro in micro_batches(batch, args, rank):
            chosen, rejected, lengths, micro_tokens = pair_logps(model, train, micro, pad_token_id)
            ref_chosen, ref_rejected = reference_logps(ref_model, tables["train"], train, micro, pad_token_id)
            losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths,
                                                                args)
            # ALGO LOGIC: the mean over the global batch of pairs, whatever the split (each part divided by its size)
            loss = losses.sum() / args.batch_size
            loss.backward()
            last["loss"] += loss.detach()
            pairs = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                     "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                     "rewards/margins": chosen_rewards - rejected_rewards,
                     "logps/chosen": chosen, "logps/rejected": rejected}
            for name, values in pairs.items():  # means over the global batch
                last[name] += values.detach().sum() / args.batch_size
            tokens += micro_tokens
        done = step + 1
        lr, grad_norm, stop = optimizer_step(model, optimizer, scheduler, last["loss"], done, args, state["skipped"])
        progress.update(1)

        if is_due(done, args.log_every, args) or is_due(done, args.eval_every, args):
            totals = reduce_sums({**last, "tokens": tokens})  # the last step's statistics, the window's tokens
            metrics = {"step": done, "episode": done * args.batch_size, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_second": totals.pop("tokens") / (time.time() - window_start), **totals}
            if is_due(done, args.eval_every, args) and test and test["prompt"]:
                metrics.update(evaluate(model, ref_model, tables["test"], test, args, pad_token_id, rank))
            log_metrics(metrics, metrics_path, args, progress, rank)
            tokens, window_start = torch.zeros((), device=device), time.time()
        if (args.save_every > 0 and done % args.save_every == 0) or stop:
            checkpoint = save_checkpoint(model, optimizer, scheduler, done, args, state)
        if stop:
            break
    progress.close()
    if stop:
        leave_after_signal(checkpoint, rank)

    # 6. save the Hugging Face folder; report the peak memory
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


def tokenize_prompt_completion(tokenizer, prompt, completion):
    """Token ids of a prompt and of its completion, EOS appended to the completion unless already there.
    Standard format: two strings. Conversational format: two lists of {"role", "content"} messages, rendered with
    the tokenizer's chat template (the completion is what the template adds after the generation prompt)."""
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt)["input_ids"]  # special tokens (BOS) as the tokenizer adds them
    else:
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise ValueError("the chat template renders the conversation without its prompt as a prefix")
        completion = full_text[len(prompt_text) :]
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]  # the template has them
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    # a chat template ends the turn itself, sometimes with text after EOS (Qwen: "<|im_end|>\n"): no second EOS then
    eos = tokenizer.eos_token_id
    ended = eos in completion_ids if not isinstance(prompt, str) else completion_ids[-1:] == [eos]
    if not ended:
        completion_ids = completion_ids + [eos]
    return prompt_ids, completion_ids


def tokenize_preference(dataset, tokenizer, args):
    """Rows of prompt/chosen/rejected (strings or message lists; without a prompt column, conversations whose shared
    opening is the prompt) -> {"prompt", "chosen", "rejected", "margin"} lists of token ids (margin: the optional
    column, else 0). Empty completions and over-long rows are dropped and counted, never silently."""
    columns = dataset.column_names
    if "chosen" not in columns or "rejected" not in columns:
        raise ValueError(
            f"dataset {args.dataset_name!r} has columns {columns}, but preference data needs 'chosen' and 'rejected' "
            "columns, with 'prompt' (standard: strings; conversational: lists of {'role', 'content'} messages) or "
            "without it (conversational only: the messages before the last one are the prompt)"
        )
    prompts = dataset["prompt"] if "prompt" in columns else [None] * len(dataset)
    margins = dataset["margin"] if "margin" in columns else [0.0] * len(dataset)
    data = {"prompt": [], "chosen": [], "rejected": [], "margin": []}
    dropped = {"empty completion": 0, "prompt too long": 0, "completion too long": 0}
    for prompt, chosen, rejected, margin in zip(prompts, dataset["chosen"], dataset["rejected"], margins):
        if prompt is None:  # implicit prompt (e.g. trl-lib/ultrafeedback_binarized)
            if isinstance(chosen, str) or chosen[:-1] != rejected[:-1]:
                raise ValueError(f"dataset {args.dataset_name!r} has no 'prompt' column and its chosen/rejected are "
                                 "not two conversations that differ only in their last message")
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        if any(not c if isinstance(c, str) else not c or not c[-1]["content"] for c in (chosen, rejected)):
            dropped["empty completion"] += 1
            continue
        prompt_ids, chosen_ids = tokenize_prompt_completion(tokenizer, prompt, chosen)
        _, rejected_ids = tokenize_prompt_completion(tokenizer, prompt, rejected)
        if len(prompt_ids) > args.max_prompt_length:
            dropped["prompt too long"] += 1
        elif max(len(chosen_ids), len(rejected_ids)) > args.max_completion_length:
            dropped["completion too long"] += 1
        else:
            for key, value in zip(data, (prompt_ids, chosen_ids, rejected_ids, float(margin))):
                data[key].append(value)
    return data, dropped


def epochs_of(num_rows, args, dropped, rank):
    """--max_steps optimizer steps, or --num_train_epochs passes of whole global batches; sets num_training_steps."""
    steps_per_epoch = num_rows // args.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{num_rows} training rows cannot fill one global batch of {args.batch_size}; dropped: "
                         f"{dropped}. Lower the batch sizes or the number of processes, use more data, or raise "
                         "--max_prompt_length / --max_completion_length if the rows were dropped as too long")
    args.num_training_steps = args.max_steps if args.max_steps > 0 else args.num_train_epochs * steps_per_epoch
    if rank == 0:
        print(f"{args.world_size} processes x {args.per_device_train_batch_size} per micro-batch x "
              f"{args.gradient_accumulation_steps} accumulation = global batch {args.batch_size}; {steps_per_epoch} "
              f"steps per epoch ({num_rows % args.batch_size} rows left out of each epoch, reshuffled every epoch)")


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
