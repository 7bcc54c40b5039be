"""The folder tree is the architecture: imports only run downward, never between the services.

Every module of every project package is parsed (imports inside functions included) and each
import of another project package must name a lower layer. The checker itself is tested on
imports that break the rule, so a checker that lets everything through fails here.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lower number = lower layer. A package may import its own modules and lower layers only, so
# packages on one layer (the two services among them) never import each other.
LAYERS = {
    "protos": 0, "kernels": 0, "common": 0,  # generated stubs; GPU kernels; errors, configs, tree settings
    "runtime": 1, "hub": 1,  # layers, paged KV cache, step layout, trees; getting models
    "link": 2, "client": 2,  # the verify <-> draft link; the public API's client
    "verify_service": 3, "draft_service": 3,  # the two services
    "tools": 4,  # in-process wiring, training, evaluation
    "cli": 5,  # the eagle3 command, `up`
    "benchmarks": 6,
}


def imported_packages(source: str, module: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in ``source``, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[:-node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((node.lineno, name.split(".")[0]))
    return found


def violations(source: str, module: str) -> list[str]:
    """Imports in ``module`` (dotted name) of a project package on its own layer or above."""
    own = module.split(".")[0]
    bad = []
    for line, package in imported_packages(source, module):
        if package in LAYERS and package != own and LAYERS[package] >= LAYERS[own]:
            bad.append(f"{module}:{line} imports {package} (layer {LAYERS[package]} >= {own}'s {LAYERS[own]})")
    return bad


def project_modules() -> list[tuple[str, Path]]:
    modules = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


def test_every_project_folder_is_a_layer():
    """A new top-level package must be placed in LAYERS (or it would escape the check)."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} == set(LAYERS)


def test_imports_only_run_downward():
    modules = project_modules()
    assert len(modules) > 60  # every package was walked
    bad = [v for module, path in modules for v in violations(path.read_text(), module)]
    assert bad == []


@pytest.mark.parametrize("module, source", [
    ("draft_service.eagle_net", "from verify_service.model import RMSNorm"),  # between the services
    ("verify_service.engine", "def f():\n    import draft_service.drafter"),  # inside a function
    ("runtime.kv_cache", "from verify_service.target import Target"),  # upward
    ("kernels.rope", "from common.config import RopeScaling"),  # sideways on the lowest layer
    ("verify_service.server", "from cli.up import up"),  # a service importing the CLI
    ("link.protocol", "from . import shared_buffers\nfrom ..tools import evaluate"),  # relative, upward
])
def test_the_checker_flags_a_bad_import(module, source):
    assert len(violations(source, module)) == 1


def test_the_checker_allows_downward_and_own_imports():
    source = "from runtime.layers import MLP\nfrom kernels import KernelSet\nfrom verify_service.model import CausalLM"
    assert violations(source, "verify_service.loader") == []
