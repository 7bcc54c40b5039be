"""``eagle3 up``: both services as child processes, a health wait, then a streamed answer.

The embedded default target is used (fetched and converted on first use) with the EAGLE-3 head
shipped for it (``--draft`` names another), and the device's default tree (a chain of 3 on a CPU,
the dynamic tree on a GPU: what was measured faster on each). With ``--no-draft`` only the verify
service starts. Children print warnings and errors only; their status lines stay quiet.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client.eagle3_client import Eagle3Client
from common.devices import device_type
from common.tree_settings import default_tree
from hub.default_model import ensure_default_model


def spawn(args: list[str], log: Path | None = None, quiet: bool = False, module: str = "cli.main",
          env: dict | None = None) -> subprocess.Popen:
    """``eagle3 ARGS`` as a child process: output to ``log`` when given; ``quiet`` drops its
    stdout (status lines) and keeps its stderr (warnings and errors). ``module``: another entry
    point taking the same arguments (a benchmark's instrumented one); ``env``: added to this
    process's environment."""
    out = open(log, "w") if log is not None else (subprocess.DEVNULL if quiet else None)
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                            stderr=subprocess.STDOUT if log is not None else None,
                            env=None if env is None else {**os.environ, **env})


def wait_healthy(client: Eagle3Client, service: str, proc: subprocess.Popen, what: str,
                 timeout_s: float = 300) -> None:
    """Poll ``service``'s health until SERVING; exit with a clear message if ``proc`` dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the {what} exited with status {proc.returncode} before becoming healthy")
        try:
            if client.health(service) == "SERVING":
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.25)
    raise SystemExit(f"error: the {what} was not healthy after {timeout_s:.0f}s")


def up(args: argparse.Namespace) -> int:
    model = str(ensure_default_model())
    draft = None if args.no_draft else args.draft
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="eagle3-"))
    internal = f"unix:{run_dir}/draft.sock"
    procs = [spawn(["serve-verify", "--model", model, "--listen", args.listen, "--internal", internal,
                     "--device", args.device], quiet=True)]
    try:
        with Eagle3Client(args.listen, timeout_s=600) as client:
            wait_healthy(client, "", procs[0], "verify service")
            if draft is not None:
                procs.append(spawn(["serve-draft", "--draft", draft, "--verify", internal, "--listen",
                                    f"unix:{run_dir}/draft-health.sock", "--device", args.device], quiet=True))
                wait_healthy(client, "eagle3.speculation", procs[1], "draft service")
            last = _answer(client, args.prompt)
            print(_status(args, draft, last), file=sys.stderr)
            if not args.once:
                print(f"[serving on {args.listen}; Ctrl-C stops both services]", file=sys.stderr)
                procs[0].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for p in reversed(procs):  # the draft first: it closes its link, a normal shutdown for the verify side
            p.terminate()
            p.wait(30)
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _status(args: argparse.Namespace, draft: str | None, last) -> str:
    """The one status line: what ran, and how speculation did on the answer."""
    if draft is None:
        return "[verify service only (--no-draft): one token per step]"
    kind = device_type(args.device)
    line = f"[verify + draft services; {default_tree(kind).describe()} (the {kind.upper()} default)"
    s = last.speculation if last is not None else None
    if s and s.get("speculated"):
        line += (f": tau {s['mean_acceptance_length']:.2f}, {s['accepted_tokens']} of {s['draft_tokens']} "
                 "draft tokens accepted")
    return line + "]"


def _answer(client: Eagle3Client, prompt: str):
    """Stream the answer to stdout; returns the last event (with the speculation summary)."""
    print(f"> {prompt}", flush=True)
    last = None
    for event in client.generate([{"role": "user", "content": prompt}], max_tokens=256):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        last = event
    print(flush=True)
    return last
