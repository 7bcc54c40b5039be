"""The device time of a target decode graph's replay alone (CUDA events around replays of one filled
layout), with and without the draft's captured features in the graph, at a few batch sizes: what an
engine that keeps a draft attached adds to a decode step on the device::

    python benchmarks/graph_replay_time.py --batch 16 --batch 64 --batch 128 --context 300

Embedded SmolLM2 (or ``--model``), bf16, the Triton kernels; capture layers as a head's (1, 14, 26 by
default). Each setting is captured and timed twice, in turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hub.default_model import ensure_default_model  # noqa: E402
from runtime.step_layout import SeqChunk  # noqa: E402
from tools.inprocess import build_engine  # noqa: E402
from verify_service.config import EngineConfig  # noqa: E402


def replay_us(runner, chunks: list[SeqChunk], replays: int) -> float:
    """Mean device microseconds of one replay of the graph ``chunks`` take."""
    graph = runner.graphs.get(runner.graphs.bucket_for(chunks))
    graph.layout.fill(chunks)
    for _ in range(20):
        graph.graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: embedded SmolLM2)")
    ap.add_argument("--batch", type=int, action="append", help="batch sizes (default 16, 64, 128)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--layers", default="1,14,26", help="capture layers, comma-separated")
    ap.add_argument("--replays", type=int, default=300)
    args = ap.parse_args(argv)
    batches = sorted(set(args.batch or [16, 64, 128]))
    layers = tuple(int(x) for x in args.layers.split(","))
    cfg = EngineConfig(args.model or str(ensure_default_model(progress=False)), device="cuda", dtype="bfloat16",
                       max_model_len=4096, max_num_seqs=max(batches))
    target = build_engine(cfg).target
    runner = target.runner
    for seq in range(max(batches)):
        target.blocks.ensure_capacity(seq, args.context + 1)
    result: dict[str, list[float]] = {}
    with torch.inference_mode():
        for capture in [(), layers, (), layers]:
            runner.set_capture_layers(capture)
            for b in batches:
                chunks = [SeqChunk(np.zeros(1, np.int64), args.context, target.blocks.block_table(s), logits_rows=(0,))
                          for s in range(b)]
                key = f"batch {b}, {'captured features' if capture else 'no captured features'}"
                result.setdefault(key, []).append(round(replay_us(runner, chunks, args.replays), 1))
    out = {"device": torch.cuda.get_device_name(), "context": args.context, "capture_layers": list(layers),
           "us_per_replay": result}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
