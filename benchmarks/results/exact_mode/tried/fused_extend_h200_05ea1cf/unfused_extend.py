"""Run a benchmark script with the draft extend on the layer's own forward (the path before
EagleNet.extend_logits took the fused projections): python unfused_extend.py SCRIPT ARGS..."""
import runpy
import sys

sys.path.insert(0, ".")
import draft_service.eagle_net as en  # noqa: E402


def unfused(self, ids, hidden, meta, kv, kernels, rows):
    last = self(ids, hidden, meta, kv, kernels)[rows]
    return last, self.compute_logits(last, kernels, float32=False)


en.EagleNet.extend_logits = unfused
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
