"""Capturing a CUDA graph: one way for every graph in the project."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture_graph(forward: Callable[[], T], device: torch.device, pool=None,
                  warm: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``warm`` (default: ``forward``) once eagerly on a side stream, which compiles the kernels and
    settles the allocator, then capture ``forward`` into a graph (in memory ``pool``, else the graph's
    own). Returns the graph and what ``forward`` returned during the capture: its outputs, rewritten by
    every replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        (warm or forward)()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs
