"""Time the collectives FSDP2 and DDP use, on gloo, for a 27.4M-parameter fp32 model (the bench model's size):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/gloo_collectives.py
DDP all-reduces the gradients; FSDP2 all-gathers the parameters (once or twice per micro-batch) and reduce-scatters
the gradients. Same bytes per rank, different gloo algorithms."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
numel = 27_400_000
full, shard = torch.randn(numel), torch.randn(numel // world_size)
out_full, out_shard = torch.empty(numel), torch.empty(numel // world_size)


def timed(name, fn, repeats=5):
    fn()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    if rank == 0:
        print(f"{name:45s} {(time.perf_counter() - start) / repeats * 1000:7.1f} ms")


timed("all_reduce (DDP)", lambda: dist.all_reduce(full))
timed("reduce_scatter_tensor (FSDP2, gradients)", lambda: dist.reduce_scatter_tensor(out_shard, full))
timed("all_gather_into_tensor (FSDP2, parameters)", lambda: dist.all_gather_into_tensor(out_full, shard))
timed("a copy of the same bytes", lambda: out_full.copy_(full))
dist.destroy_process_group()
