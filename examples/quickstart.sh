#!/usr/bin/env bash
# The whole pipeline on the offline toy task, on CPU, in minutes: toy task -> SFT -> reward model, DPO on pairs made from
# the SFT model's own mistakes, GRPO with the exact-match verifier, PPO with the reward model (trained on toy/preference
# plus those pairs). Ends with a table (exact match per stage, the reward model's pair accuracy, wall time, peak memory)
# and, if matplotlib is installed, the learning curves in $OUT/curves.png. SFT stops at 150 steps (exact match about
# 0.68), so that the later stages have something left to fix.
#   bash examples/quickstart.sh        # NPROC=1: one process; OUT=...: output folder; TOY=...: toy task folder
#   FAST=1 bash examples/quickstart.sh # a few steps per stage: checks the pipeline runs, not that it learns
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/quickstart}
TOY=${TOY:-toy}
NPROC=${NPROC:-2}
FAST=${FAST:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MB=$((32 / NPROC))  # global batch 32 whatever the number of processes
steps() { if [ "$FAST" = 1 ]; then echo "$2"; else echo "$1"; fi; }  # steps FULL FAST
mkdir -p "$OUT"
: > "$OUT/times.tsv"
stage() {  # stage NAME COMMAND...: run it, its output also in $OUT/NAME.log, its wall time in $OUT/times.tsv
    local name=$1 start=$SECONDS
    shift
    "$@" 2>&1 | tee "$OUT/$name.log"
    echo "$name $((SECONDS - start))" >> "$OUT/times.tsv"
}
run() { torchrun --standalone --nproc_per_node "$NPROC" "$@"; }

[ -d "$TOY/model" ] || python examples/toy_task.py --out "$TOY"
begin=$SECONDS
stage sft run sft.py --model_name_or_path "$TOY/model" --dataset_name "$TOY/sft" --output_dir "$OUT/sft" --learning_rate 2e-3 \
    --max_steps "$(steps 150 20)" --warmup_ratio 0.05 --lr_scheduler_type cosine --per_device_train_batch_size $MB --log_every 10
stage pairs python examples/toy_task.py --mistakes_of "$OUT/sft" --data "$TOY/prompts" --out "$OUT/pairs" --max_prompts "$(steps 4000 400)"
# the reward model: toy/preference plus the pairs on the SFT model's own mistakes (what PPO will sample)
mkdir -p "$OUT/preference_mix"
for split in train test; do cat "$TOY/preference/$split.jsonl" "$OUT/pairs/$split.jsonl" > "$OUT/preference_mix/$split.jsonl"; done
stage reward run reward.py --model_name_or_path "$OUT/sft" --dataset_name "$OUT/preference_mix" --output_dir "$OUT/reward" \
    --learning_rate 1e-3 --max_steps "$(steps -1 10)" --num_train_epochs 1 --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $MB --log_every 20
stage dpo run dpo.py --model_name_or_path "$OUT/sft" --dataset_name "$OUT/pairs" --output_dir "$OUT/dpo" --learning_rate 1e-4 \
    --beta 0.1 --rpo_alpha 1.0 --max_steps "$(steps -1 5)" --num_train_epochs 1 --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $MB --log_every 10
stage grpo run grpo.py --model_name_or_path "$OUT/sft" --dataset_name "$TOY/prompts" --output_dir "$OUT/grpo" --reward_fn exact_match \
    --learning_rate 3e-5 --max_steps "$(steps 100 2)" --warmup_ratio 0.1 --per_device_train_batch_size $MB --gradient_accumulation_steps 4 \
    --num_generations 8 --max_completion_length 12 --per_device_eval_batch_size 100 --log_every 10
stage ppo run ppo.py --model_name_or_path "$OUT/sft" --reward_model_path "$OUT/reward" --dataset_name "$TOY/prompts" --output_dir "$OUT/ppo" \
    --optimizer adam_tf --adam_epsilon 1e-5 --learning_rate 5e-5 --max_steps "$(steps 120 4)" --warmup_ratio 0.1 --num_ppo_epochs 2 \
    --num_mini_batches 2 --per_device_train_batch_size $MB --gradient_accumulation_steps 4 --max_completion_length 12 \
    --local_rollout_forward_batch_size 128 --per_device_eval_batch_size 100 --log_every 10
echo "total $((SECONDS - begin))" >> "$OUT/times.tsv"

python examples/quickstart_report.py "$OUT" "$TOY"  # the table (also in $OUT/results.md) and $OUT/curves.png
