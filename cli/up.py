"""``eagle3 up``: both services as child processes, a health wait, then a streamed answer.

The embedded default target is used (fetched and converted on first use) with the EAGLE-3
head shipped for it (``--draft`` names another). With ``--no-draft`` only the verify service
starts: it decodes one token per step and says so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client.eagle3_client import Eagle3Client
from hub.default_model import ensure_default_model


def spawn(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``eagle3 ARGS`` as a child process (output to ``log`` when given)."""
    out = open(log, "w") if log is not None else None
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=out,
                            stderr=subprocess.STDOUT if out else None)


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
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="eagle3-"))
    internal = f"unix:{run_dir}/draft.sock"
    procs = [spawn(["serve-verify", "--model", model, "--listen", args.listen, "--internal", internal,
                     "--device", args.device])]
    try:
        with Eagle3Client(args.listen, timeout_s=600) as client:
            wait_healthy(client, "", procs[0], "verify service")
            if not args.no_draft:
                procs.append(spawn(["serve-draft", "--draft", args.draft, "--verify", internal,
                                     "--listen", f"unix:{run_dir}/draft-health.sock", "--device", args.device]))
                wait_healthy(client, "eagle3.speculation", procs[1], "draft service")
                print("[verify + draft services healthy; speculating]", file=sys.stderr)
            else:
                print("[verify service healthy; --no-draft: decoding one token per "
                      "step, health reports eagle3.speculation NOT_SERVING]", file=sys.stderr)
            _answer(client, args.prompt)
            if not args.once:
                print(f"[serving on {args.listen}; Ctrl-C stops both services]", file=sys.stderr)
                procs[0].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(30)
    return 0


def _answer(client: Eagle3Client, prompt: str) -> None:
    print(f"> {prompt}", flush=True)
    last = None
    for event in client.generate([{"role": "user", "content": prompt}], max_tokens=256):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        last = event
    print(flush=True)
    if last is not None and last.speculation and last.speculation.get("speculated"):
        s = last.speculation
        print(f"[speculation: tau {s['mean_acceptance_length']:.2f}, {s['accepted_tokens']} of "
              f"{s['draft_tokens']} draft tokens accepted]", file=sys.stderr)
