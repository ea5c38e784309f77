"""Host memory of every process while the scripts load a model: a random 359M-parameter Qwen2 (the toy model's config
with hidden 1024, intermediate 4096, 24 layers, 16 heads, 2 KV heads; the toy vocabulary and tokenizer; stored in
bf16 as hub checkpoints are, 1.34 GiB once loaded in fp32) on N processes. Two measures per process, peak RSS:
- load: after sft.py's load_pretrained and shard_model alone (what stays on the host when the training state is on
  GPUs), from the scripts in --scripts (another checkout: another revision);
- step: sft.py itself, one step at micro-batch 1 (on CPU the training state is on the host too).

    python bench/load_memory.py --toy toy --nproc 8 --out runs/load_memory [--scripts /path/to/other/checkout]
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
parser = argparse.ArgumentParser()
parser.add_argument("--toy", default="toy")
parser.add_argument("--nproc", type=int, default=8)
parser.add_argument("--out", default="runs/load_memory")
parser.add_argument("--scripts", default=ROOT, help="the checkout whose sft.py is measured")
parser.add_argument("--worker", action="store_true", help="(internal) one process of the load measure")
args = parser.parse_args()
model_dir = os.path.abspath(os.path.join(args.out, "model_359m"))

if args.worker:  # under torchrun: load and shard as sft.py does, then report this process's peak
    import types

    import torch
    import torch.distributed as dist

    sys.path.insert(0, args.scripts)
    import sft

    dist.init_process_group("gloo")
    flags = types.SimpleNamespace(trust_remote_code=False, gradient_checkpointing=False, bf16=True, cpu_offload=False,
                                  reshard_after_forward=True, shard_degree=-1)
    loaded = sft.load_pretrained(sft.AutoModelForCausalLM, model_dir, flags, "--model_name_or_path")
    mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),))
    sft.shard_model(loaded[0] if isinstance(loaded, tuple) else loaded, flags, mesh)
    dist.barrier()
    print(f"peak_rss_kb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
    config = AutoConfig.from_pretrained(os.path.join(args.toy, "model"))
    config.update(dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=2, layer_types=["full_attention"] * 24))
    model = AutoModelForCausalLM.from_config(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.to(torch.bfloat16).save_pretrained(model_dir)  # as hub checkpoints are: the scripts load them in fp32
    AutoTokenizer.from_pretrained(os.path.join(args.toy, "model")).save_pretrained(model_dir)
env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
torchrun = ["torchrun", "--standalone", "--nproc_per_node", str(args.nproc)]
measures = {
    "load": torchrun + [os.path.abspath(__file__), "--worker", "--out", args.out, "--scripts", args.scripts],
    "step": torchrun + ["--no-python", "/usr/bin/time", "-f", "peak_rss_kb %M", sys.executable, "sft.py",
                        "--model_name_or_path", model_dir, "--dataset_name", os.path.join(args.toy, "sft"),
                        "--output_dir", os.path.join(args.out, "sft"), "--max_steps", "1",
                        "--per_device_train_batch_size", "1", "--log_every", "1"],
}
peaks = {}
shutil.rmtree(os.path.join(args.out, "sft"), ignore_errors=True)  # the step's run starts afresh
for name, command in measures.items():
    result = subprocess.run(command, cwd=args.scripts, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    peaks[name] = sorted(int(kb) / 2**20 for kb in re.findall(r"peak_rss_kb (\d+)", output))
    if result.returncode or len(peaks[name]) != args.nproc:
        sys.exit(output[-5000:])
    print(f"{name}: {args.nproc} processes, peak RSS GiB, sorted: {', '.join(f'{p:.2f}' for p in peaks[name])}")
json.dump({"nproc": args.nproc, "scripts": args.scripts, "peak_gib": peaks},
          open(os.path.join(args.out, "peaks.json"), "w"))
