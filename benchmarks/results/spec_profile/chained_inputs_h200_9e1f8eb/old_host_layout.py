"""Run a script with the parent commit's chained-step layout (fill_roots and write_trees from
old_static_layout.py, the parent's runtime/static_layout.py; the trees written launch by launch)."""
import importlib.util
import runpy
import sys

sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location("old_static_layout", "old_static_layout.py")
old = importlib.util.module_from_spec(spec)
sys.modules["old_static_layout"] = old
spec.loader.exec_module(old)
import runtime.static_layout as new  # noqa: E402
import verify_service.model_runner as runner  # noqa: E402

new.StaticLayout.fill_roots = old.StaticLayout.fill_roots
new.StaticLayout.write_trees = old.StaticLayout.write_trees
runner.ModelRunner.tree_inputs = lambda self, graph, B, n: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
