"""Running the real services as subprocesses on temporary unix sockets, for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from client.eagle3_client import Eagle3Client
from tiny_models import TEST_DEVICE, TEST_DTYPE

ROOT = Path(__file__).resolve().parent.parent


class ServiceProcess:
    def __init__(self, args: list[str], log_path: Path, program: list[str] | None = None):
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "w")
        program = program or [sys.executable, "-m", "cli.main"]
        self.proc = subprocess.Popen([*program, *args], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class Stack:
    """A verify service (and optionally a draft service) in a temp dir; clients connect by socket.

    Both run on the test device and dtype (EAGLE3_TEST_DEVICE / EAGLE3_TEST_DTYPE) unless a test
    names its own: on a GPU host the buffers travel by CUDA IPC, on the CPU through shared memory.
    """

    def __init__(self, tmp: Path, model_dir: Path, draft_dir: Path | None, verify_args=(), draft_args=(),
                 start_draft: bool = True, internal: str | None = None, device: str = TEST_DEVICE,
                 dtype: str = TEST_DTYPE):
        """``internal``: the draft link's address (default: a unix socket in ``tmp``/run)."""
        self.tmp = tmp
        self.public = f"unix:{tmp}/public.sock"
        self.internal = internal or f"unix:{tmp}/run/draft.sock"
        self.draft_health = f"unix:{tmp}/draft-health.sock"
        self.draft_dir, self.draft_args, self.device = draft_dir, list(draft_args), device
        # The fixed tree unless a test asks for adaptive speculation (auto turns it on on a GPU).
        self.verify_args = ["serve-verify", "--model", str(model_dir), "--listen", self.public, "--internal",
                            self.internal, "--device", device, "--dtype", dtype,
                            "--adaptive-speculation", "off", *verify_args]
        self.verify = self.draft = None
        self.client = Eagle3Client(self.public, timeout_s=120)
        try:
            self._start_verify(tmp / "verify.log")
            if draft_dir is not None and start_draft:
                self.start_draft()
        except BaseException:
            self.close()  # never leave service processes behind
            raise

    def _start_verify(self, log_path: Path) -> None:
        self.verify = ServiceProcess(self.verify_args, log_path)
        self._wait(lambda: self.client.health() == "SERVING", 120, self.verify)

    def restart_verify(self, kill: bool = False) -> None:
        """Stop the verify service (SIGTERM, or SIGKILL with ``kill``), start a new one on the same sockets
        and wait for the draft service, if one runs, to reconnect."""
        (self.verify.kill if kill else self.verify.stop)()
        self._start_verify(self.tmp / f"verify-{time.monotonic_ns()}.log")
        if self.draft is not None:
            self._wait(lambda: self.client.health("eagle3.speculation") == "SERVING", 60, self.draft)

    def start_draft(self, program: list[str] | None = None) -> None:
        """Start the draft service (or ``program``, a stand-in taking the same flags)."""
        args = ["--draft", str(self.draft_dir), "--verify", self.internal, "--listen", self.draft_health,
                "--device", self.device, *self.draft_args]
        self.draft = ServiceProcess(args if program else ["serve-draft", *args],
                                    self.tmp / f"draft-{time.monotonic_ns()}.log", program)
        self._wait(lambda: self.client.health("eagle3.speculation") == "SERVING", 120, self.draft)

    def _wait(self, ready, timeout_s: float, proc: ServiceProcess) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{proc.log()}")
            try:
                if ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"service not ready in {timeout_s}s:\n{proc.log()}")

    def close(self) -> None:
        self.client.close()
        for p in (self.draft, self.verify):
            if p is not None:
                p.stop()
