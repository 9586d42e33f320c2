"""A few steps of data-parallel training of a compress module (run by test_distributed).

Under torchrun (gloo on 127.0.0.1), each rank trains a DistributedDataParallel copy
on its own batches, whose sequence counts and lengths differ by rank and by step,
and writes its final parameters, and the thread counts its kernel launches used,
to ``OUT_DIR/rank<r>.pt``. ``reference(world_size)`` trains the same steps in one
process: each step's loss is the mean of the ranks' losses, which is what DDP's
averaged gradients differentiate.

    python -m torch.distributed.run --nproc-per-node 2 ... ddp_train.py OUT_DIR
"""

import os
import sys

import numpy as np
import torch

from nsa_numba.torch import npu_nsa_compress

HEADS, DIM, BLOCK, STRIDE, STEPS = 4, 64, 32, 16, 4


class Compress(torch.nn.Module):
    """Keys scaled per head and element, then compressed with a learned weight."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(HEADS, DIM, generator=gen))
        self.w = torch.nn.Parameter(torch.randn(BLOCK, HEADS, generator=gen) / BLOCK)

    def forward(self, x, seq, target):
        k = npu_nsa_compress(x * self.scale, self.w, BLOCK, STRIDE, actual_seq_len=seq)
        return ((k - target) ** 2).mean()


def batch(rank, step):
    """Rank ``rank``'s batch of step ``step``: 2-4 packed sequences of 100-400 tokens."""
    rng = np.random.default_rng(1000 * step + rank)
    lengths = rng.integers(100, 400, size=int(rng.integers(2, 5)))
    ends = np.cumsum(lengths)
    windows = int(sum((n - BLOCK) // STRIDE + 1 for n in lengths))
    x = torch.from_numpy(rng.standard_normal((int(ends[-1]), HEADS, DIM)).astype(np.float32))
    target = torch.from_numpy(rng.standard_normal((windows, HEADS, DIM)).astype(np.float32))
    return x, ends.tolist(), target


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def reference(world_size):
    """The final parameters of the same training in one process."""
    model = Compress()
    opt = optimizer(model)
    for step in range(STEPS):
        opt.zero_grad()
        losses = [model(*batch(rank, step)) for rank in range(world_size)]
        (sum(losses) / world_size).backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def record_launch_threads():
    """A list that receives, for every training kernel launch this process makes from
    now on, (the threads the launch could use, the threads its work could have used:
    ``Recipe.useful``)."""
    from nsa_numba._ops import dispatch as _dispatch
    from nsa_numba._core import launch as _launch
    seen = []
    run_recipe, run_kept, run = _dispatch.launch, _dispatch.run_prepared, _launch.run

    def recording_recipe(recipe, *args, **kwargs):
        seen.append([None, recipe.useful])
        return run_recipe(recipe, *args, **kwargs)

    def recording_kept(prepared, threads, *views):      # a call that came again
        seen.append([None, prepared.useful])
        return run_kept(prepared, threads, *views)

    def recording_run(kernel, threads, chunk, *args, **options):
        count = _launch.count()
        seen[-1][0] = count if threads is None else min(threads, count)
        return run(kernel, threads, chunk, *args, **options)

    _dispatch.launch, _dispatch.run_prepared = recording_recipe, recording_kept
    _launch.run = recording_run
    return seen


def main(out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seen = record_launch_threads()
    model = DistributedDataParallel(Compress())
    opt = optimizer(model)
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(rank, step)).backward()
        opt.step()
    params = {name.removeprefix("module."): p.detach().clone()
              for name, p in model.named_parameters()}
    torch.save(dict(params=params, launches=seen, torch_threads=torch.get_num_threads(),
                    omp=os.environ.get("OMP_NUM_THREADS"), world_size=world_size),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
