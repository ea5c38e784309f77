#!/usr/bin/env bash
# The pipeline on the offline toy task, on CPU, in minutes: toy task -> SFT -> reward model, DPO on pairs made from the
# SFT model's own mistakes, GRPO with the exact-match verifier and PPO with the reward model (trained on toy/preference
# plus those pairs). SFT stops at 150 steps (exact match about 0.68), so that the later stages have something left to fix.
#   bash examples/quickstart.sh            # NPROC=1 for one process, OUT=... for another output folder
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MB=$((32 / NPROC))  # global batch 32 whatever the number of processes
run() { torchrun --standalone --nproc_per_node "$NPROC" "$@"; }
exact_match() { python examples/toy_task.py --eval "$1" --data toy/prompts/test.jsonl | tail -n 1 | cut -d' ' -f2; }
last_metric() { python -c "import json, sys; print(f\"{json.loads(open(sys.argv[1]).readlines()[-1])[sys.argv[2]]:.4f}\")" "$1/metrics.jsonl" "$2"; }

python examples/toy_task.py --out toy
start=$(date +%s)
run sft.py --model_name_or_path toy/model --dataset_name toy/sft --output_dir "$OUT/sft" --learning_rate 2e-3 \
    --max_steps 150 --warmup_ratio 0.05 --lr_scheduler_type cosine --per_device_train_batch_size $MB --log_every 50
sft_seconds=$(( $(date +%s) - start )); start=$(date +%s)
python examples/toy_task.py --mistakes_of "$OUT/sft" --data toy/prompts --out "$OUT/pairs"
pairs_seconds=$(( $(date +%s) - start )); start=$(date +%s)
# the reward model: toy/preference plus the pairs on the SFT model's own mistakes (what PPO will sample), 2 epochs
mkdir -p "$OUT/preference_mix"
for split in train test; do cat toy/preference/$split.jsonl "$OUT/pairs/$split.jsonl" > "$OUT/preference_mix/$split.jsonl"; done
run reward.py --model_name_or_path "$OUT/sft" --dataset_name "$OUT/preference_mix" --output_dir "$OUT/reward" --learning_rate 1e-3 \
    --num_train_epochs 2 --warmup_ratio 0.05 --lr_scheduler_type cosine --per_device_train_batch_size $MB --log_every 100
reward_seconds=$(( $(date +%s) - start )); start=$(date +%s)
run dpo.py --model_name_or_path "$OUT/sft" --dataset_name "$OUT/pairs" --output_dir "$OUT/dpo" --learning_rate 1e-4 --beta 0.1 \
    --rpo_alpha 1.0 --num_train_epochs 1 --warmup_ratio 0.05 --lr_scheduler_type cosine --per_device_train_batch_size $MB --log_every 20
dpo_seconds=$(( $(date +%s) - start )); start=$(date +%s)
run grpo.py --model_name_or_path "$OUT/sft" --dataset_name toy/prompts --output_dir "$OUT/grpo" --reward_fn exact_match \
    --learning_rate 3e-5 --max_steps 100 --warmup_ratio 0.1 --per_device_train_batch_size $MB --gradient_accumulation_steps 4 \
    --num_generations 8 --max_completion_length 12 --per_device_eval_batch_size 100 --log_every 20
grpo_seconds=$(( $(date +%s) - start )); start=$(date +%s)
run ppo.py --model_name_or_path "$OUT/sft" --reward_model_path "$OUT/reward" --dataset_name toy/prompts --output_dir "$OUT/ppo" \
    --optimizer adam_tf --adam_epsilon 1e-5 --learning_rate 3e-5 --max_steps 200 --warmup_ratio 0.1 --num_ppo_epochs 2 \
    --num_mini_batches 2 --per_device_train_batch_size $MB --gradient_accumulation_steps 4 --max_completion_length 12 \
    --local_rollout_forward_batch_size 64 --per_device_eval_batch_size 100 --log_every 20
ppo_seconds=$(( $(date +%s) - start ))

printf '\n| stage | exact match on toy test prompts | reward model: test pair accuracy | wall time |\n|---|---|---|---|\n'
printf '| untrained | %s | | |\n' "$(exact_match toy/model)"
printf '| SFT | %s | | %ss |\n' "$(exact_match "$OUT/sft")" "$sft_seconds"
printf '| reward model | | %s | %ss |\n' "$(last_metric "$OUT/reward" eval/accuracy)" "$reward_seconds"
printf '| on-policy pairs (SFT mistakes) | | | %ss |\n' "$pairs_seconds"
printf '| DPO (+RPO, on-policy pairs) | %s | | %ss |\n' "$(exact_match "$OUT/dpo")" "$dpo_seconds"
printf '| GRPO (exact-match verifier) | %s | | %ss |\n' "$(exact_match "$OUT/grpo")" "$grpo_seconds"
printf '| PPO (reward model) | %s | | %ss |\n' "$(exact_match "$OUT/ppo")" "$ppo_seconds"
