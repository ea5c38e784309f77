"""Direct Preference Optimization (DPO) in one file: the policy learns from preference pairs directly, its implicit
reward beta * log(pi / pi_ref) replacing a reward model. Paper: arXiv:2305.18290. Also: IPO (arXiv:2310.12036), hinge
(SLiC, arXiv:2305.10425) and conservative DPO (label smoothing). What differs from the paper: (1) the reference
log-probs are computed once, before training, and the reference model freed (--no-precompute-ref-logps keeps it,
recomputing them online: the same losses); (2) dropout is off in the policy, so the implicit reward is exactly 0 before
the first step; (3) IPO on summed log-probs (--loss_type ipo; TRL's, per token: ipo_per_token); (4) optional RPO term.
Online DPO, on pairs the policy samples and a reward model or verifier labels: grpo.py --policy_loss dpo.
Run (the toy task's command: README):
      torchrun --nproc_per_node 8 dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
          --dataset_name trl-lib/ultrafeedback_binarized --track
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from tyro.conf import Suppress

from adam_tf import AdamTF

# the numeric flags' rules, as their types in Args (guard_run)
AtLeast1 = Annotated[int, ("at least 1", lambda v: v >= 1)]
OffOrAtLeast1 = Annotated[int, ("-1 (off) or at least 1", lambda v: v == -1 or v >= 1)]
Positive = Annotated[float, ("above 0", lambda v: v > 0)]
NonNegative = Annotated[float, ("0 or more", lambda v: v >= 0)]
Fraction = Annotated[float, ("in [0, 1]", lambda v: 0 <= v <= 1)]
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
    output_dir: Resumable[str] = "runs/dpo"
    """the Hugging Face model folder, with checkpoints/ and metrics.jsonl"""
    model_name_or_path: str = "runs/sft"
    """a hub id or a local model folder: the SFT model the policy starts from"""
    dataset_name: str = "toy/preference"
    """a hub id, a local .json/.jsonl/.parquet/.csv file (train split), or a folder of them"""
    dataset_train_split: str = "train"
    """the split to train on (or, in a folder, a data file by its name)"""
    dataset_test_split: str = "test"
    """the split to evaluate on, likewise"""
    max_steps: OffOrAtLeast1 = -1
    """optimizer steps; -1: num_train_epochs epochs"""
    num_train_epochs: AtLeast1 = 1
    """passes over the training split"""
    learning_rate: Positive = 1e-6
    """peak learning rate"""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """the schedule after warmup (transformers.get_scheduler)"""
    warmup_ratio: Fraction = 0.0
    """fraction of the steps warming up linearly from 0"""
    per_device_train_batch_size: Resumable[AtLeast1] = 8
    """micro-batch: pairs per process per forward/backward"""
    gradient_accumulation_steps: Resumable[AtLeast1] = 1
    """micro-batches per optimizer step on each process"""
    per_device_eval_batch_size: Resumable[AtLeast1] = 32
    """pairs per process per forward pass without gradients"""
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
    max_prompt_length: AtLeast1 = 512
    """pairs whose prompt is longer (in tokens) are dropped, and counted"""
    max_completion_length: AtLeast1 = 1024
    """pairs with a longer completion (in tokens, EOS included) are dropped, and counted"""

    # DPO
    beta: Positive = 0.1
    """strength of the KL regularisation to the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["sigmoid", "ipo", "ipo_per_token", "hinge"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO; ipo_per_token: IPO of each log-ratio over its completion's length (TRL's ipo); hinge:
    SLiC"""
    label_smoothing: Annotated[float, ("in [0, 0.5)", lambda v: 0 <= v < 0.5)] = 0.0
    """assumed probability that a preference label is flipped (conservative DPO; sigmoid only)"""
    ref_model_name_or_path: Optional[str] = None
    """the reference model (default: model_name_or_path, the SFT model)"""
    rpo_alpha: NonNegative = 0.0
    """weight of the chosen completion's per-token NLL in the loss (RPO; 0: plain DPO)"""
    precompute_ref_logps: bool = True
    """compute the reference log-probs once before training, then free the reference model (False: online)"""


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, lengths, args):
    """Per-pair loss and the implicit rewards beta * log(pi / pi_ref) of both completions. With h = the chosen
    log-ratio minus the rejected one: sigmoid -log sigmoid(beta h) (Eq. 7 of arXiv:2305.18290), mixed with
    -log sigmoid(-beta h) by label_smoothing (conservative DPO);
    ipo (h - 1 / (2 beta))^2 (Eq. 17 of arXiv:2310.12036); ipo_per_token the same with each log-ratio divided by its
    completion's length (`lengths`: the chosen, then the rejected); hinge max(0, 1 - beta h) (SLiC). Plus rpo_alpha x
    the chosen completion's negative log-likelihood per token (RPO, Eq. 3 of arXiv:2404.19733): DPO alone can lower the
    likelihood of the chosen answer too when the two completions differ by a token or two."""
    beta, eps = args.beta, args.label_smoothing
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    chosen_lengths, rejected_lengths = lengths.chunk(2)
    h = chosen_ratio - rejected_ratio
    if args.loss_type == "ipo_per_token":  # per TRL, the form the IPO paper's experiments used
        h = chosen_ratio / chosen_lengths - rejected_ratio / rejected_lengths
    if args.loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif args.loss_type.startswith("ipo"):
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)
    losses = losses - args.rpo_alpha * chosen_logps / chosen_lengths
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_logps(model, data, rows, args):
    """Summed log-probs of the chosen and of the rejected completion of `rows` (EOS included), in one forward of
    2 x len(rows) sequences; also the completions' lengths (the chosen, then the rejected) and the tokens processed."""
    prompts = [data["prompt"][i] for i in rows] * 2
    completions = [data["chosen"][i] for i in rows] + [data["rejected"][i] for i in rows]
    batch = make_batch(next(model.parameters()).device, prompts, completions, range(len(prompts)), args)
    logps = completion_logprobs(model, batch).sum(1)
    return *logps.chunk(2), batch["completion_mask"].sum(1), batch["tokens"]


@torch.no_grad()
def reference_table(ref_model, data, args):
    """The summed reference log-probs of the chosen and rejected completions of every row, a (rows, 2) table, each
    rank scoring its share; the rows always grouped the same way, so the same to the bit."""
    table = torch.zeros(len(data["prompt"]), 2, device=next(ref_model.parameters()).device)
    for rows, valid in rank_micro_batches(len(data["prompt"]), args.per_device_eval_batch_size):
        table[rows] += valid * torch.stack(pair_logps(ref_model, data, rows, args)[:2], 1)
    dist.all_reduce(table)
    return table


@torch.no_grad()
def reference_logps(ref_model, table, data, rows, args):
    """The reference log-probs of `rows`: from the precomputed table, or a forward of the reference."""
    if table is not None:
        return table[rows].unbind(1)
    return pair_logps(ref_model, data, rows, args)[:2]


@torch.no_grad()
def evaluate(model, ref_model, table, test, args):
    """Mean loss and accuracy of the implicit reward over the test pairs, each rank its share."""
    model.eval()
    totals = torch.zeros(2, device=next(model.parameters()).device)
    for rows, valid in rank_micro_batches(len(test["prompt"]), args.per_device_eval_batch_size):
        chosen, rejected, lengths, _ = pair_logps(model, test, rows, args)
        ref_chosen, ref_rejected = reference_logps(ref_model, table, test, rows, args)
        loss, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths, args)
        totals += valid * torch.stack([loss.sum(), (chosen_rewards > rejected_rewards).sum()])
    dist.all_reduce(totals)
    model.train()
    loss, accuracy = (totals / len(test["prompt"])).tolist()
    return {"eval/loss": loss, "eval/accuracy": accuracy}


def main(args):
    # 1. distributed init, batch sizes, seeds, the guards
    rank, world_size, device, mesh = setup(args)
    if args.label_smoothing > 0 and args.loss_type != "sigmoid":
        raise ScriptError(f"--label_smoothing applies to --loss_type sigmoid only, not {args.loss_type}")

    # 2. data: every rank tokenises the same rows, so each knows the whole global batch
    tokenizer, _, train, test, dropped = load_data(args, tokenize_preference)
    epochs_of(len(train["prompt"]), args, dropped)

    # 3. models + FSDP2: the policy, then the frozen reference
    path, flag = args.model_name_or_path, "--model_name_or_path"
    model = load_model(AutoModelForCausalLM, path, args, flag, mesh)
    ref_path = args.ref_model_name_or_path or path
    ref_model = load_model(AutoModelForCausalLM, ref_path, args, "--ref_model_name_or_path", mesh, frozen=True)
    check_layout(model, train["prompt"], train["chosen"], args, flag)
    if args.ref_model_name_or_path:  # another model than the policy
        check_layout(ref_model, train["prompt"], train["chosen"], args, "--ref_model_name_or_path")
    train_table = test_table = None
    if args.precompute_ref_logps:
        train_table = reference_table(ref_model, train, args)
        test_table = reference_table(ref_model, test, args) if test else None
        ref_model = None
        if rank == 0:
            print(f"reference log-probs computed for {len(train['prompt'])} training pairs and "
                  f"{len(test['prompt']) if test else 0} test pairs")

    # 4. optimizer and LR schedule (or both restored by --resume_from)
    optimizer, scheduler, start_step, state = make_optimizer(model, args)
    metrics_path, progress = open_metrics(args, start_step)

    # 5. training loop
    model.train()
    sums = collections.defaultdict(lambda: torch.zeros((), device=device))  # this rank's, since the last log
    logged, window_start = start_step, time.time()
    for step in range(start_step + 1, args.num_training_steps + 1):
        batch = global_batch(step - 1, len(train["prompt"]), args.batch_size, args.seed)
        step_loss = 0.0  # this rank's share of the global mean
        for micro in micro_batches(batch, args):
            chosen, rejected, lengths, tokens = pair_logps(model, train, micro, args)
            ref_chosen, ref_rejected = reference_logps(ref_model, train_table, train, micro, args)
            losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths,
                                                                args)
            # ALGO LOGIC: the mean over the global batch of pairs, whatever the split
            loss = losses.sum() / args.batch_size
            loss.backward()
            step_loss += loss.detach()
            pairs = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                     "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                     "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen,
                     "logps/rejected": rejected}
            for name, values in pairs.items():
                sums[name] += values.detach().sum() / args.batch_size
            sums["tokens"] += tokens
        lr, grad_norm, stop = optimizer_step(model, optimizer, scheduler, step_loss, step, args)
        sums["loss"] += step_loss
        progress.update(1)
        if is_due(step, args.log_every, args) or is_due(step, args.eval_every, args):
            w = reduce_sums(sums)  # each metric: the mean over the steps since the last line
            metrics = {"step": step, "episode": step * args.batch_size, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_second": w.pop("tokens") / (time.time() - window_start)}
            metrics |= {name: value / (step - logged) for name, value in w.items()}
            if is_due(step, args.eval_every, args) and test:
                metrics.update(evaluate(model, ref_model, test_table, test, args))
            log_metrics(metrics, metrics_path, args, progress)
            sums, logged, window_start = collections.defaultdict(sums.default_factory), step, time.time()
        if stop or (args.save_every > 0 and step % args.save_every == 0):
            save_checkpoint(model, optimizer, scheduler, step, args, state, stop)

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


def tokenize_prompt_completion(tokenizer, prompt, completion):
    """Prompt and completion ids from strings or messages (the completion: what the template adds after the
    generation prompt), EOS appended unless there."""
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt)["input_ids"]  # with BOS, if the tokenizer adds one
    else:
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise ScriptError("the chat template does not render the prompt as the start of the conversation")
        completion = full_text[len(prompt_text) :]
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]  # the template has them
    completion_ids, eos = tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id
    # a template ends the turn itself, maybe with text after EOS (Qwen's "\n")
    if not (completion_ids[-1:] == [eos] if isinstance(prompt, str) else eos in completion_ids):
        completion_ids = completion_ids + [eos]
    return prompt_ids, completion_ids


def tokenize_preference(dataset, tokenizer, args):
    """prompt/chosen/rejected rows (or two conversations differing in their last message) -> ids and
    margins; empty, over-long and identical pairs dropped and counted."""
    columns = dataset.column_names
    if "chosen" not in columns or "rejected" not in columns:
        raise ScriptError(f"dataset {args.dataset_name!r} has columns {columns}: preference data needs 'chosen' and "
                          "'rejected' columns")
    prompts = dataset["prompt"] if "prompt" in columns else [None] * len(dataset)
    margins = dataset["margin"] if "margin" in columns else [0.0] * len(dataset)
    data = {"prompt": [], "chosen": [], "rejected": [], "margin": []}
    dropped = dict.fromkeys(["empty completion", "prompt too long", "completion too long", "empty prompt",
                             "chosen equals rejected"], 0)
    for prompt, chosen, rejected, margin in zip(prompts, dataset["chosen"], dataset["rejected"], margins):
        if prompt is None:  # implicit prompt (trl-lib/ultrafeedback_binarized)
            if isinstance(chosen, str) or chosen[:-1] != rejected[:-1]:
                raise ScriptError(f"dataset {args.dataset_name!r} has no 'prompt' column, and its chosen/rejected "
                                  "are not conversations that differ only in their last message")
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        if any(not c or isinstance(c, list) and not c[-1]["content"] for c in (chosen, rejected)):
            dropped["empty completion"] += 1
            continue
        prompt_ids, chosen_ids = tokenize_prompt_completion(tokenizer, prompt, chosen)
        rejected_ids = tokenize_prompt_completion(tokenizer, prompt, rejected)[1]
        reason = ("empty prompt" if not prompt_ids else "prompt too long" if len(prompt_ids) > args.max_prompt_length
                  else "completion too long" if max(len(chosen_ids), len(rejected_ids)) > args.max_completion_length
                  else "chosen equals rejected" if chosen_ids == rejected_ids else None)
        if reason:
            dropped[reason] += 1
            continue
        for column, value in zip(data.values(), (prompt_ids, chosen_ids, rejected_ids, float(margin))):
            column.append(value)
    return data, dropped


def epochs_of(num_rows, args, dropped):
    """Set num_training_steps: --max_steps, or --num_train_epochs passes of whole global batches."""
    steps_per_epoch = num_rows // args.batch_size
    if steps_per_epoch == 0:
        raise ScriptError(f"{num_rows} training rows (dropped: {dropped}) cannot fill a global batch of "
                          f"{args.batch_size}: lower the batch sizes")
    args.num_training_steps = args.max_steps if args.max_steps > 0 else args.num_train_epochs * steps_per_epoch
    if dist.get_rank() == 0:
        print(f"{steps_per_epoch} steps of {args.batch_size} per epoch")


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
