"""Diagnosis (not part of the project): host time of each CUDA graph replay inside real spec steps."""
import sys, time, statistics
from collections import defaultdict
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.profile_spec_step import SHIPPED_HEAD, prefilled, make_engine
from draft_service.drafter import EagleDrafter
from tools.evaluate import parse_config
from verify_service.engine import Engine

class A: pass
args = A(); args.batch = int(sys.argv[1]); args.context = 512; args.steps = 40
spec = parse_config("dynamic:7:10:59", SHIPPED_HEAD)
target = make_engine("smollm2", args.batch, args.context, 16 * args.steps + 128, torch.device("cuda"))
drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                       args.batch, target.max_model_len, "auto")
engine = Engine(target, drafter, spec.settings)
prefilled(engine, args)
for _ in range(10):
    engine.step()
names = {}
for k, g in target.runner._graphs.items():
    if g is not None: names[id(g.graph)] = f"target{k.seqs}x{k.tokens}"
for k, g in drafter.graphs._graphs.items():
    if g is not None: names[id(g.graph)] = f"extend{k}"
for k, p in drafter._proposals.items():
    if p.graph is not None: names[id(p.graph)] = "proposal"
times = defaultdict(list)
orig = torch.cuda.CUDAGraph.replay
def timed(self):
    t = time.perf_counter(); orig(self); times[names.get(id(self), "?")].append((time.perf_counter() - t) * 1e6)
torch.cuda.CUDAGraph.replay = timed
cpu_t = []
orig_cpu = torch.Tensor.cpu
def tcpu(self, *a, **k):
    t = time.perf_counter(); r = orig_cpu(self, *a, **k); cpu_t.append((time.perf_counter() - t) * 1e6); return r
torch.Tensor.cpu = tcpu
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(30):
    engine.step()
torch.cuda.synchronize()
print("batch", args.batch, "step ms", round((time.perf_counter() - t0) / 30 * 1e3, 3))
for n, v in times.items():
    print(f"  replay {n}: median {statistics.median(v):.1f} us  max {max(v):.1f}  n={len(v)}")
print(f"  .cpu(): median {statistics.median(cpu_t):.1f} us n={len(cpu_t)}")
