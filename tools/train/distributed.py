"""Data-parallel training over several processes (``torchrun --nproc-per-node N``).

Every process holds the whole head and its own target engine, takes its share of each
global batch, and the gradients are summed across processes before the optimizer step, so
N processes follow the same trajectory as one process with the same global batch (the loss
is normalised by the global count of trained tokens, which the processes add up first).
Without torchrun's variables this is a group of one and every call is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class ProcessGroup:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, cuda: bool) -> "ProcessGroup":
        """Joins torchrun's group (NCCL on CUDA, gloo on the CPU) when WORLD_SIZE > 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        group = cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(group.local_rank)
            dist.init_process_group("nccl" if cuda else "gloo")
        return group

    @property
    def main(self) -> bool:
        """The process that logs, evaluates and writes files."""
        return self.rank == 0

    def share(self, items: list) -> list:
        """This process's share of a global batch (every process sees the same list)."""
        return items[self.rank::self.world]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: ``t`` summed over the processes."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """True when any process says so (e.g. past its time limit): all stop at the same step."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum_grads_(self, params: list[torch.nn.Parameter]) -> None:
        """In place: each gradient summed over the processes, in one flat all-reduce."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p)
            offset += g.numel()

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """In place: every process takes the main process's values (identical start)."""
        if self.world > 1:
            with torch.no_grad():  # a copy of values, not a step autograd should ever see
                for t in tensors:
                    dist.broadcast(t, 0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
