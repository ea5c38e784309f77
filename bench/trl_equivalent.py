"""The TRL 1.16 equivalent of one of our scripts, for bench/compare_trl.py (not used by the scripts or the tests).
Run with torchrun like ours; writes the wall-clock time at the end of every optimizer step (rank 0) to
OUTPUT_DIR/step_times.txt and prints the peak memory of the busiest process (GPU allocations on a GPU, else the
resident set), the same two measures compare_trl.py and gpu.py take from our scripts."""

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback


class StepTimes(TrainerCallback):
    def __init__(self, path):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(f"{time.time()} {state.global_step}\n")


def exact_match(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("algo", choices=["sft", "reward", "dpo", "grpo"])
    for name in ("model", "data", "output_dir"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (grpo: completions per device per step)")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--max_length", type=int, default=128, help="sft, reward, dpo: prompt + completion tokens")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--beta", type=float, default=None, help="dpo 0.1, grpo 0.04 unless given")
    parser.add_argument(
        "--gradient_checkpointing", action="store_true", help="TRL 1.16's default is on; ours is off, so off here too"
    )
    parser.add_argument("--padding_free", action="store_true", help="sft: a batch in one row (no max_length then)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU too (bench/head_memory.py)")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    common = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available() or args.bf16,  # as ours: bf16 compute on GPU, fp32 on CPU
        seed=1,
        dataloader_num_workers=0,
        gradient_checkpointing=args.gradient_checkpointing,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )  # use_cpu: else no gloo DDP on CPU
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train = load_dataset("json", data_files=args.data, split="train")
    if args.algo == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.model),
            args=SFTConfig(**common, max_length=None if args.padding_free else args.max_length,
                           padding_free=args.padding_free),
            train_dataset=train,
            processing_class=tokenizer,
        )
    elif args.algo == "reward":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(
            model=model,
            args=RewardConfig(**common, max_length=args.max_length),
            train_dataset=train,
            processing_class=tokenizer,
        )
    elif args.algo == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.model),
            args=DPOConfig(**common, beta=0.1 if args.beta is None else args.beta, max_length=args.max_length),
            train_dataset=train,
            processing_class=tokenizer,
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(
            **common,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=1.0,
            beta=0.04 if args.beta is None else args.beta,
            num_iterations=1,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(args.model),
            reward_funcs=exact_match,
            args=config,
            train_dataset=train,
            processing_class=tokenizer,
        )
    trainer.add_callback(StepTimes(os.path.join(args.output_dir, "step_times.txt")))
    trainer.train()
    trainer.save_model(
        args.output_dir
    )  # as our scripts do at the end (their peak memory includes gathering the weights)
    on_gpu = torch.cuda.is_available()  # as our scripts measure it: GPU allocations, or the CPU resident set size
    peak = torch.tensor(
        torch.cuda.max_memory_allocated() if on_gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    )
    if dist.is_initialized():
        peak = peak.to("cuda") if on_gpu else peak
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"peak {'GPU' if on_gpu else 'CPU RSS'} memory per process {peak.item() / 2**30:.2f} GiB")
