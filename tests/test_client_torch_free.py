"""A client-only install: the client, ``--help``, ``eagle3 health`` and ``eagle3 client`` work without
the engine's packages, and quickly; an engine verb says how to install them, in one line.

Each command runs in a subprocess whose ``sitecustomize`` makes importing any engine package fail
as if it were not installed, so an import of torch anywhere on these paths fails the test.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli.main import ENGINE_PACKAGES

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = (*ENGINE_PACKAGES, "triton")
FAST_S = 2.5

BLOCKER = textwrap.dedent(f"""\
    import sys

    class _NotInstalled:
        # What pip install eagle3-serve (no [engine]) gives: these packages cannot be imported.
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """)


@pytest.fixture(scope="module")
def client_only(tmp_path_factory):
    """Runs ``python ARGS`` from the repository root with the engine packages unimportable."""
    site = tmp_path_factory.mktemp("client_only")
    (site / "sitecustomize.py").write_text(BLOCKER)

    def run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(site)}
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        return proc, time.monotonic() - start
    return run


def test_the_engine_packages_are_really_blocked(client_only):
    for package in BLOCKED:
        proc, _ = client_only("-c", f"import {package}")
        assert proc.returncode == 1 and f"No module named '{package}'" in proc.stderr


@pytest.mark.parametrize("args", [
    ["-m", "cli.main", "--help"],
    ["-m", "cli.main", "client", "--help"],
    ["-m", "cli.main", "client", "generate", "--help"],
    ["-m", "cli.main", "serve-verify", "--help"],
    ["-m", "cli.main", "generate", "--help"],
    ["-c", "from client import Eagle3Client"],
])
def test_runs_without_the_engine(client_only, args):
    proc, secs = client_only(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert secs < FAST_S


@pytest.mark.parametrize("args", [
    ["health", "--server", "127.0.0.1:1", "--timeout-s", "0.5"],
    ["client", "info", "--server", "127.0.0.1:1", "--timeout-s", "0.5"],
    ["client", "generate", "--server", "127.0.0.1:1", "--timeout-s", "0.5", "Hi"],
])
def test_unreachable_server_is_one_line(client_only, args):
    proc, secs = client_only("-m", "cli.main", *args)
    assert proc.returncode in (1, 2)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: UNAVAILABLE: ") and proc.stderr.count("\n") == 1
    assert secs < FAST_S


def test_bad_arguments_are_quick(client_only):
    proc, secs = client_only("-m", "cli.main", "client", "generate", "--max-tokens", "-1", "Hi")
    assert (proc.returncode, proc.stderr) == (2, "error: max_tokens: must be >= 0, got -1\n")
    assert secs < FAST_S


@pytest.mark.parametrize("args", [
    ["generate", "Hi"],
    ["serve-verify", "--model", "/nowhere"],
    ["serve-draft"],
    ["fetch-default", "--quiet"],
])
def test_an_engine_verb_says_how_to_install_the_engine(client_only, args):
    proc, _ = client_only("-m", "cli.main", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: eagle3 {args[0]} needs the engine extra (")
    assert proc.stderr.rstrip().endswith("pip install 'eagle3-serve[engine]'")


def test_the_config_names_match_the_engine():
    """verify_service.config keeps these as names so that parsing needs no torch."""
    import torch

    from kernels import KERNEL_CHOICES
    from verify_service import config

    assert config.KERNEL_CHOICES == KERNEL_CHOICES
    for name in config.DTYPES:
        assert config.EngineConfig("m", dtype=name).torch_dtype(torch.device("cpu")) == getattr(torch, name)
    assert config.EngineConfig("m").torch_dtype(torch.device("cpu")) == torch.float32
    assert config.EngineConfig("m", device="cpu").torch_device() == torch.device("cpu")
