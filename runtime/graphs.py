"""Capturing a CUDA graph: one way for every graph in the project.

On a CPU the same call gives an ``EagerGraph``: each replay runs the forward again and writes what it
returns into the first run's outputs, which callers hold as a graph's static outputs. So the paths a
GPU takes through its graphs (static layouts, steps verified from the device, acceptance graphs) run
on a CPU too, where CI tests them against the eager paths (``EngineConfig.graphs_on_cpu``).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class EagerGraph:
    """A CUDA graph's stand-in on a CPU: ``replay`` reruns ``forward`` into ``outputs``."""

    def __init__(self, forward: Callable[[], T], outputs: T):
        self.forward, self.outputs = forward, outputs

    def replay(self) -> None:
        _copy_into(self.outputs, self.forward())


def _copy_into(dst, src) -> None:
    """Write ``src`` into ``dst`` in place: tensors, and tuples, lists and dataclasses of them."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))
    else:
        assert dst == src, f"a graph's output {dst!r} changed to {src!r} between replays"


def capture_graph(forward: Callable[[], T], device: torch.device, pool=None,
                  warm: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph | EagerGraph, T]:
    """Run ``warm`` (default: ``forward``) once eagerly on a side stream, which compiles the kernels and
    settles the allocator, then capture ``forward`` into a graph (in memory ``pool``, else the graph's
    own). Returns the graph and what ``forward`` returned during the capture: its outputs, rewritten by
    every replay. On a CPU: an ``EagerGraph`` and the outputs of one eager run."""
    if torch.device(device).type != "cuda":
        if warm is not None:
            warm()
        outputs = forward()
        return EagerGraph(forward, outputs), outputs
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        (warm or forward)()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection during the capture: a collection then may destroy an unreachable graph of
    # earlier work, a call CUDA refuses while a stream captures, and the capture fails ("operation
    # failed due to a previous error during capture" at a later launch). torch.cuda.graph no longer
    # collects before a capture (PyTorch pull request 161037 has the reproducer); this turned up as
    # one native test that failed only after others had run.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs
