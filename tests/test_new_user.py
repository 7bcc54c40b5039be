"""What a new user meets at the command line: addresses in use, one-line errors, quiet output."""

import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from services import ROOT, ServiceProcess, Stack
from tiny_chat import tiny_chat_target
from tiny_eagle import make_eagle_dir
from tiny_models import make_model_dir, tiny_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("new_user")
    return make_model_dir(root / "model", "llama3", seed=3, std=0.3), \
        make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=2)


def eagle3(*args: str, timeout: float = 120, stdin: str | None = None, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, input=stdin, env={**os.environ, **(env or {})})


def one_line_error(run: subprocess.CompletedProcess, *words: str) -> None:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    assert all(w in lines[0] for w in words), lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_service_on_an_address_in_use_refuses_to_start(dirs, tmp_path):
    model, draft = dirs
    port = free_port()
    first = ServiceProcess(["serve-verify", "--model", str(model), "--listen", f"127.0.0.1:{port}",
                            "--internal", f"unix:{tmp_path}/run/draft.sock", "--device", "cpu"], tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 60
        while "ready" not in first.log() and time.monotonic() < deadline:
            assert first.proc.poll() is None, first.log()
            time.sleep(0.2)
        base = ["serve-verify", "--model", str(model), "--device", "cpu"]
        # the public port, then the internal socket a live verify service answers on
        second = eagle3(*base, "--listen", f"127.0.0.1:{port}", "--internal", f"unix:{tmp_path}/other.sock")
        one_line_error(second, f"127.0.0.1:{port}", "in use")
        assert "ready" not in second.stdout
        third = eagle3(*base, "--listen", f"127.0.0.1:{free_port()}", "--internal", f"unix:{tmp_path}/run/draft.sock")
        one_line_error(third, "draft.sock", "another server")
        draft_run = eagle3("serve-draft", "--draft", str(draft), "--verify", f"unix:{tmp_path}/run/draft.sock",
                           "--listen", f"127.0.0.1:{port}", "--device", "cpu")
        one_line_error(draft_run, f"127.0.0.1:{port}", "in use")
    finally:
        first.stop()


def test_a_stale_socket_file_is_replaced(dirs, tmp_path):
    (tmp_path / "run").mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "run" / "draft.sock"))  # a socket file nobody listens on
    stale.close()
    stack = Stack(tmp_path, dirs[0], None)
    stack.close()


@pytest.mark.parametrize("args, words", [
    (["Hi", "--max-model-len", "100000000"], ["max_model_len 100000000", "GiB needed", "available"]),
    (["--prompt-file", "/nonexistent/prompt.txt"], ["prompt_file", "/nonexistent/prompt.txt"]),
    (["Hi", "--prompt-file", "-"], ["prompt", "not both"]),
    ([], ["prompt", "--prompt-file"]),
    (["Hi", "--device", "tpu"], ["device", "'tpu'"]),
    (["Hi", "--device", "cpu:7"], ["device", "'cpu:7'"]),
    pytest.param(["Hi", "--device", "cuda"], ["device", "CUDA is not available"],
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")),
])
def test_generate_refuses_with_one_line(dirs, args, words):
    one_line_error(eagle3("generate", "--model", str(dirs[0]), *args), *words)


@pytest.mark.slow
def test_generate_reads_the_prompt_from_stdin_and_says_speculation_is_off(tmp_path):
    model, _ = tiny_chat_target(tmp_path)  # a tokenizer: SmolLM2's
    run = eagle3("generate", "--model", str(model), "--raw", "--prompt-file", "-", "--max-tokens", "3", "--stats",
                 "--tree-depth", "2", "--max-model-len", "4096", stdin="word " * 2000)
    assert run.returncode == 0, run.stderr
    assert "warning: --tree-depth ignored without --draft" in run.stderr
    assert "[speculation: off (no --draft)]" in run.stderr
    assert "[2001 prompt tokens" in run.stderr  # every word arrived (with the begin-of-text token)


def test_the_draft_waits_quietly_and_a_normal_shutdown_is_no_warning(dirs, tmp_path):
    model, draft = dirs
    internal = f"unix:{tmp_path}/run/draft.sock"
    waiting = ServiceProcess(["serve-draft", "--draft", str(draft), "--verify", internal,
                              "--listen", f"unix:{tmp_path}/draft-health.sock", "--device", "cpu"], tmp_path / "d.log")
    time.sleep(3)  # dialing a verify service that is not there yet
    stack = Stack(tmp_path, model, None, start_draft=False)
    stack.internal = internal
    try:
        deadline = time.monotonic() + 60
        while "connected to the verify service" not in waiting.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        waiting.proc.send_signal(signal.SIGTERM)
        assert waiting.proc.wait(15) == 0
        time.sleep(0.5)
        log = waiting.log()
        assert log.count(f"waiting for the verify service at {internal}") == 1, log
        assert "connected to the verify service" in log and "WARNING" not in log, log
        assert "WARNING" not in stack.verify.log(), stack.verify.log()  # the draft closed its link
        assert stack.client.metrics()["draft_errors"] == 0  # a normal shutdown is no lost session
    finally:
        waiting.kill()
        stack.close()


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())  # Linux syscall numbers


def _signal_a_thread_other_than_main(pid: int, sig: int) -> None:
    """``sig`` to one thread of process ``pid`` that is not its main thread (tgkill): a process signal
    may land on any thread, and this is the case the main thread never sees by itself."""
    import ctypes
    tid = next(int(t) for t in sorted(os.listdir(f"/proc/{pid}/task"), key=int) if int(t) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_TGKILL, pid, tid, sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.skipif(_TGKILL is None or not Path("/proc/self/task").is_dir(), reason="Linux (tgkill, /proc) only")
def test_the_draft_stops_on_a_sigterm_that_lands_on_another_thread(dirs, tmp_path):
    """Python runs signal handlers on the main thread; the kernel may hand a process's SIGTERM to any of
    its threads. A connected draft with no steps to answer (its step socket idle) still stops at once
    and closes its link normally (its main thread does not sit in a read nothing interrupts)."""
    model, draft = dirs
    internal = f"unix:{tmp_path}/run/draft.sock"
    stack = Stack(tmp_path, model, None, start_draft=False)
    stack.internal = internal
    waiting = ServiceProcess(["serve-draft", "--draft", str(draft), "--verify", internal,
                              "--listen", f"unix:{tmp_path}/draft-health.sock", "--device", "cpu"], tmp_path / "d.log")
    try:
        deadline = time.monotonic() + 60
        while "connected to the verify service" not in waiting.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the session idle: the draft waits for a step
        _signal_a_thread_other_than_main(waiting.proc.pid, signal.SIGTERM)
        try:
            rc = waiting.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("the draft service did not stop within 15 s of a SIGTERM on another thread:\n" + waiting.log())
        assert rc == 0, waiting.log()
        time.sleep(0.5)
        assert "WARNING" not in stack.verify.log(), stack.verify.log()  # it closed its link
    finally:
        waiting.kill()
        stack.close()


@pytest.mark.slow
def test_up_once_prints_the_answer_and_one_status_line(request):
    """`up` speculates with the device's default tree (a chain of 3 on a CPU: measured faster there
    than plain decoding and than the dynamic tree), says so in one line, logs nothing at the
    default level, and leaves no temporary folder behind."""
    # a short TMPDIR: the run folder's socket path must fit a unix address (107 bytes), and pytest's
    # own folders run long (a worker's of pytest-xdist longer still)
    scratch = Path(tempfile.mkdtemp(prefix="e3-up-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    run = eagle3("up", "--once", "--listen", f"127.0.0.1:{free_port()}", "--device", "cpu",
                 "--prompt", "What is the capital of France?", timeout=300, env={"TMPDIR": str(scratch)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("> What is the capital of France?\n") and "Paris" in run.stdout
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("[verify + draft services; a chain of 3 (the CPU default): tau "), line
    assert not list(scratch.glob("eagle3-*"))  # the run folder (internal socket) is gone


def test_a_draft_whose_sessions_fail_stops_with_the_error(monkeypatch):
    """``serve`` runs the sessions on a thread of their own (the main thread polls for signals): what
    escapes them ends the service with that error on the main thread, as when the main thread ran them."""
    from types import SimpleNamespace

    from draft_service import server

    class Broken:
        stopped = 0

        def run(self):
            raise RuntimeError("the sessions broke")

        def stop(self):
            Broken.stopped += 1

    stops = []
    fake = SimpleNamespace(worker=Broken(), metrics=None, stop=lambda: stops.append(True))
    monkeypatch.setattr(server, "create_server", lambda cfg: fake)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(RuntimeError, match="the sessions broke"):
            server.serve(SimpleNamespace(verify="unix:/nowhere", listen="unix:/nowhere-health"))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert Broken.stopped == 1 and stops == [True]  # stopped and closed before the error is raised
