"""Run a script with the static tree builder of the parent commit (A/B of a change)."""
import importlib.util
import runpy
import sys

spec = importlib.util.spec_from_file_location("old_tree_builders", "old_tree_builders.py")
old = importlib.util.module_from_spec(spec)
sys.modules["old_tree_builders"] = old
spec.loader.exec_module(old)
import draft_service.drafter as drafter  # noqa: E402

drafter.StaticTreeBuilder = old.StaticTreeBuilder
sys.argv = sys.argv[1:]
sys.path.insert(0, ".")
runpy.run_path(sys.argv[0], run_name="__main__")
