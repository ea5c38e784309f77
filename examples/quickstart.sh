#!/usr/bin/env bash
# The whole pipeline on the offline toy task, on CPU, in minutes. The SFT data come from a flawed demonstrator: on the
# prompts whose digits include a 0 it writes the sorted digits as a number (leading 0 dropped) 70% of the time. SFT
# trained to convergence copies it and stops at its ceiling; the reward model, DPO (plain sigmoid, on pairs that prefer
# the right answer), GRPO (exact-match verifier) and PPO (the reward model) each go past it, all from the same SFT model.
# Ends with a table (exact match per stage, on the flawed subset and elsewhere, the reward model's pair accuracy, wall
# time, peak memory) and, with matplotlib, $OUT/curves.png: exact match over training against the imitation ceiling.
#   bash examples/quickstart.sh        # NPROC=1: one process; OUT=...: output folder; TOY=...: toy task folder
#   FAST=1 bash examples/quickstart.sh # a few steps per stage (a new toy: 512 training, 50 test rows): checks the
#                                      # pipeline runs, not that it learns
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
rm -rf "$OUT/sft" "$OUT/reward" "$OUT/dpo" "$OUT/grpo" "$OUT/ppo"  # a new run replaces the last
: > "$OUT/times.tsv"
stage() {  # stage NAME COMMAND...: run it, its output also in $OUT/NAME.log, its wall time in $OUT/times.tsv
    local name=$1 start=$SECONDS
    shift
    "$@" 2>&1 | tee "$OUT/$name.log"
    echo "$name $((SECONDS - start))" >> "$OUT/times.tsv"
}
run() { torchrun --standalone --nproc_per_node "$NPROC" "$@"; }

[ -d "$TOY/model" ] || python examples/toy_task.py --out "$TOY" \
    --num_train "$(steps 4000 512)" --num_test "$(steps 200 50)"
begin=$SECONDS
# each stage keeps a checkpoint every few steps (--save_every): the report scores them for the curves
stage sft run sft.py --model_name_or_path "$TOY/model" --dataset_name "$TOY/sft" --output_dir "$OUT/sft" \
    --learning_rate 2e-3 --max_steps "$(steps 300 10)" --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $MB --log_every 25 --save_every "$(steps 50 5)"
stage reward run reward.py --model_name_or_path "$OUT/sft" --dataset_name "$TOY/preference" --output_dir "$OUT/reward" \
    --learning_rate 3e-4 --num_train_epochs 2 --max_steps "$(steps -1 5)" --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $MB --log_every 25 --eval_every "$(steps 25 5)"
stage dpo run dpo.py --model_name_or_path "$OUT/sft" --dataset_name "$TOY/preference" --output_dir "$OUT/dpo" \
    --beta 1.0 --learning_rate 1e-4 --max_steps "$(steps 60 4)" --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $MB --log_every 10 --save_every "$(steps 10 2)"
stage grpo run grpo.py --model_name_or_path "$OUT/sft" --dataset_name "$TOY/prompts" --output_dir "$OUT/grpo" \
    --reward_fn exact_match --learning_rate 1e-4 --max_steps "$(steps 30 2)" --warmup_ratio 0.1 \
    --per_device_train_batch_size $MB --gradient_accumulation_steps 4 --num_generations 8 --max_completion_length 10 \
    --per_device_eval_batch_size 100 --log_every 5 --save_every "$(steps 5 1)"
stage ppo run ppo.py --model_name_or_path "$OUT/sft" --reward_model_path "$OUT/reward" --dataset_name "$TOY/prompts" \
    --output_dir "$OUT/ppo" --optimizer adam_tf --adam_epsilon 1e-5 --learning_rate 5e-5 --max_steps "$(steps 40 4)" \
    --warmup_ratio 0.1 --num_ppo_epochs 2 --num_mini_batches 2 --per_device_train_batch_size $MB \
    --gradient_accumulation_steps 4 --max_completion_length 10 --local_rollout_forward_batch_size 128 \
    --per_device_eval_batch_size 100 --log_every 8 --save_every "$(steps 8 4)"
echo "total $((SECONDS - begin))" >> "$OUT/times.tsv"

python examples/quickstart_report.py "$OUT" "$TOY"  # the table (also in $OUT/results.md) and $OUT/curves.png
