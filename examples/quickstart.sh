#!/usr/bin/env bash
# The pipeline on the offline toy task, on CPU, in minutes: toy task -> SFT (reward, DPO, PPO, GRPO stages to come).
#   bash examples/quickstart.sh            # NPROC=1 for one process, OUT=... for another output folder
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/quickstart}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

python examples/toy_task.py --out toy
start=$(date +%s)
torchrun --standalone --nproc_per_node "$NPROC" sft.py --model_name_or_path toy/model --dataset_name toy/sft \
    --output_dir "$OUT/sft" --learning_rate 2e-3 --max_steps 300 --warmup_ratio 0.05 --lr_scheduler_type cosine \
    --per_device_train_batch_size $((32 / NPROC)) --log_every 50
sft_seconds=$(( $(date +%s) - start ))

untrained=$(python examples/toy_task.py --eval toy/model --data toy/prompts/test.jsonl | tail -n 1 | cut -d' ' -f2)
sft=$(python examples/toy_task.py --eval "$OUT/sft" --data toy/prompts/test.jsonl | tail -n 1 | cut -d' ' -f2)
printf '\n| stage | exact match on toy test prompts | wall time |\n|---|---|---|\n'
printf '| untrained | %s | |\n| SFT | %s | %ss |\n' "$untrained" "$sft" "$sft_seconds"
