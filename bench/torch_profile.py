"""Runs one script (ours or bench/trl_equivalent.py) under torch.profiler and prints its kernels by GPU time.
    torchrun --standalone --nproc_per_node 1 bench/torch_profile.py OUT.txt sft.py --model_name_or_path ...
The whole run is profiled (loading and the first step included): compare totals of two runs of the same steps."""

import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

if __name__ == "__main__":
    out, script, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    open(out, "w").write(table)
    print(table)
