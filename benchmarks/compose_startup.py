"""`docker compose up` for real, on the CPU: startup time, and a streamed answer checked token for token.

Builds the CPU image (compose.cpu.yaml), runs `compose up -d`, times it until both services'
health checks pass (``compose_ci_startup_s``), streams a greedy chat answer from the host through
the published port with the project's client (after the draft has connected, so it speculates),
checks it token for token against the same request answered in-process (``tools.inprocess``),
and runs `compose down -v` whatever happened::

    python benchmarks/compose_startup.py --out benchmarks/results/compose_startup_cpu.json
    python benchmarks/compose_startup.py --wheels-only      # only fill .docker-wheels/ (a manual build)

Needs a running Docker engine, docker-compose 1.29 or `docker compose`, and the local base image
(``$EAGLE3_CPU_BASE_IMAGE``, default eagle3-base:bookworm): ``.ci/docker-setup`` provides all three
on a Debian machine. What the machine lacks raises ``Unavailable`` (exit status 3 here; the test,
tests/test_compose_up.py, skips with the reason). The image needs no network to build: the host's
pip fills .docker-wheels/ with the CPU torch build (the host's own version), the package's
dependencies and its build backend, for the base image's Python; the model comes from the host's
cache (``eagle3 fetch-default``), mounted read-only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMPOSE_FILE = ROOT / "compose.cpu.yaml"
WHEELS = ROOT / ".docker-wheels"
PROJECT = "eagle3ci"  # compose project name: containers, volume and network are eagle3ci_*
PORT = 50051  # published by compose.cpu.yaml on 127.0.0.1
IMAGE = "eagle3-serve:cpu"  # compose.cpu.yaml's image
PROMPT = "Why is the sky blue?"  # a 32-token answer: several speculative steps, some drafts rejected
# DOCKER_BUILDKIT=0: the classic builder, which ignores the Dockerfile's `# syntax=` line (BuildKit
# would pull that frontend from a registry). COMPOSE_DOCKER_CLI_BUILD=0: docker-compose 1.29
# builds through its own API client, whatever the docker CLI on PATH is.
BUILD_ENV = {"DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}


class Unavailable(Exception):
    """This machine cannot run it (no engine, no compose, no base image, ...): a reason, not a failure."""


def _run(cmd: list[str], timeout: float = 120, env: dict | None = None, check: bool = False
         ) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode}:\n{_tail(proc)}")
    return proc


def _tail(proc: subprocess.CompletedProcess, lines: int = 30) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


def base_image() -> str:
    return os.environ.get("EAGLE3_CPU_BASE_IMAGE", "eagle3-base:bookworm")


def compose_command() -> list[str]:
    """``docker compose`` (v2) when the plugin is there, else ``docker-compose`` (1.29)."""
    if shutil.which("docker") is None:
        raise Unavailable("the docker CLI is not installed (.ci/docker-setup installs docker.io)")
    try:
        if _run(["docker", "compose", "version"], timeout=30).returncode == 0:
            return ["docker", "compose"]
    except subprocess.TimeoutExpired:
        pass
    exe = shutil.which("docker-compose")
    if exe is None:
        raise Unavailable("neither `docker compose` nor docker-compose is installed (.ci/docker-setup installs it)")
    return [exe]


def check_engine() -> str:
    """The engine's version; Unavailable when it cannot be reached."""
    try:
        proc = _run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=30)
    except subprocess.TimeoutExpired:
        raise Unavailable("the Docker engine did not answer `docker version` in 30 s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise Unavailable(f"the Docker engine is not reachable ({last}); .ci/docker-setup starts dockerd (as root)")
    base = base_image()
    if _run(["docker", "image", "inspect", base], timeout=30).returncode != 0:
        raise Unavailable(f"the base image {base} does not exist (no registry to pull from); "
                          ".ci/docker-setup builds it with debootstrap")
    return proc.stdout.strip()


def image_python(image: str) -> str:
    """The base image's Python version, "3.11": the wheels must be built for it."""
    proc = _run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                 "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"], timeout=120)
    if proc.returncode != 0:
        raise Unavailable(f"python3 does not run in the base image {image}: {_tail(proc, 3)}")
    return proc.stdout.strip()


def torch_requirement() -> str:
    """$EAGLE3_DOCKER_TORCH, else the host's own torch when it is a CPU build (torch==2.13.0+cpu)."""
    spec = os.environ.get("EAGLE3_DOCKER_TORCH")
    if spec:
        return spec
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise Unavailable("torch is not installed on the host: no CPU build to put in the image "
                          "(set EAGLE3_DOCKER_TORCH=torch==VERSION+cpu)") from None
    if not version.endswith("+cpu"):
        raise Unavailable(f"the host's torch {version} is not a CPU build (set EAGLE3_DOCKER_TORCH=torch==VERSION+cpu "
                          "to a build the host's pip can fetch)")
    return f"torch=={version}"


def wheel_requirements() -> list[str]:
    """What the CPU image installs: torch, the package's dependencies and engine extra, its build backend."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise Unavailable("reading pyproject.toml needs Python 3.11+ (tomllib)") from None

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [torch_requirement(), *project["project"]["dependencies"],
            *project["project"]["optional-dependencies"]["engine"], *project["build-system"]["requires"]]
    return [r for r in reqs if not r.replace(" ", "").startswith("torch>")]  # the pinned build stands for it


def prepare_wheels(python_version: str, dest: Path = WHEELS) -> dict:
    """Fill ``dest`` with wheels for ``python_version`` through the host's pip (its index, find-links and
    certificates); kept while the requirements are unchanged."""
    reqs = wheel_requirements()
    stamp = dest / "requirements.json"
    wanted = {"python": python_version, "requirements": reqs}
    try:
        if json.loads(stamp.read_text()) == wanted and any(dest.glob("*.whl")):
            return {"cached": True, "seconds": 0.0}
    except (OSError, ValueError):
        pass
    dest.mkdir(exist_ok=True)  # in the repository with its README; kept for another checkout's sake
    for old in dest.glob("*.whl"):
        old.unlink()
    stamp.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "--progress-bar", "off", "-d", str(dest), *reqs]
    proc = _run(cmd, timeout=900)
    if proc.returncode != 0:
        raise Unavailable(f"the host's pip could not fetch the image's wheels ({' '.join(reqs)}):\n{_tail(proc, 8)}")
    stamp.write_text(json.dumps(wanted, indent=1) + "\n")
    return {"cached": False, "seconds": round(time.monotonic() - t0, 1)}


def _image_id(image: str) -> str | None:
    proc = _run(["docker", "image", "inspect", "--format", "{{.Id}}", image], timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _container(service: str) -> str | None:
    proc = _run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}",
                 "--filter", f"label=com.docker.compose.service={service}"], timeout=30)
    ids = proc.stdout.split()
    return ids[0] if ids else None


def _health(container: str) -> str:
    """"starting", "healthy", "unhealthy"; or the container's state when it is not running."""
    proc = _run(["docker", "inspect", "--format", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                 container], timeout=30)
    state, _, health = proc.stdout.strip().partition(" ")
    return health if state == "running" and health else state or "gone"


def inprocess_answer(model_dir: str, prompt: str, max_tokens: int) -> list[int]:
    """The reference: the same chat request, greedy, target only, in this process."""
    from common.sampling_params import SamplingParams
    from tools.inprocess import build_engine
    from verify_service.config import EngineConfig

    engine = build_engine(EngineConfig(model_dir, device="cpu", max_model_len=1024, max_num_seqs=4, kv_cache_gib=0.25))
    ids = engine.target.encode(messages=[{"role": "user", "content": prompt}])
    [result] = engine.generate([ids], SamplingParams(max_tokens=max_tokens))
    return list(result.token_ids)


def run(prompt: str = PROMPT, max_tokens: int = 32, health_timeout_s: float = 240, log=print) -> dict:
    """Everything above, once. Returns the measurements; the answers' comparison is the caller's to judge
    (``answer_token_ids`` vs ``inprocess_token_ids``). Raises Unavailable before starting anything
    the machine cannot run."""
    compose = compose_command()
    server_version = check_engine()
    from client.eagle3_client import Eagle3Client
    from hub.default_model import default_cache_dir, ensure_default_model

    env = {**BUILD_ENV, "EAGLE3_CACHE": str(default_cache_dir()), "EAGLE3_CPU_BASE_IMAGE": base_image()}
    base = [*compose, "-p", PROJECT, "-f", str(COMPOSE_FILE)]
    _run([*base, "down", "-v", "--remove-orphans"], timeout=120, env=env)  # what a run killed earlier left
    if not _port_free(PORT):
        raise Unavailable(f"127.0.0.1:{PORT}, the port compose.cpu.yaml publishes, is in use")

    python_version = image_python(base_image())
    wheels = prepare_wheels(python_version)
    log(f"wheels for Python {python_version}: " + ("cached" if wheels["cached"] else f"fetched in {wheels['seconds']} s"))
    model_dir = str(ensure_default_model(progress=False))  # on the host: the containers mount this cache
    t0 = time.monotonic()
    reference = inprocess_answer(model_dir, prompt, max_tokens)
    inprocess_s = time.monotonic() - t0
    log(f"in-process answer: {len(reference)} tokens in {inprocess_s:.1f} s")

    result = {"compose": " ".join(Path(c).name for c in compose), "compose_version": "",
              "docker_server": server_version, "base_image": base_image(), "image_python": python_version,
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                       "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}, "wheels": wheels,
              "prompt": prompt, "max_tokens": max_tokens, "inprocess_s": round(inprocess_s, 2),
              "inprocess_token_ids": reference}
    result["compose_version"] = _run([*compose, "version", "--short"], timeout=30).stdout.strip()
    try:
        # One build: both services run this image (building draft too would only repeat it).
        before = _image_id(IMAGE)
        t0 = time.monotonic()
        _run([*base, "build", "verify"], timeout=1200, env=env, check=True)
        result["build_s"] = round(time.monotonic() - t0, 1)
        if before and before != _image_id(IMAGE):  # the image it replaced, now untagged (kept if in use)
            _run(["docker", "image", "rm", before], timeout=120)
        log(f"image built in {result['build_s']} s")

        # Startup: from `up -d` until both health checks pass (docker's own health status).
        t0 = time.monotonic()
        up = subprocess.Popen([*base, "up", "-d"], cwd=ROOT, env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        healthy: dict[str, float] = {}
        status: dict[str, str] = {}
        while len(healthy) < 2:
            elapsed = time.monotonic() - t0
            if elapsed > health_timeout_s:
                raise RuntimeError(f"not healthy after {health_timeout_s:.0f} s: {status}\n{_logs(base, env)}")
            if up.poll() not in (None, 0):
                raise RuntimeError(f"`compose up -d` exited with status {up.returncode}:\n{up.stdout.read()}\n"
                                   f"{_logs(base, env)}")
            for service in ("verify", "draft"):
                if service in healthy:
                    continue
                cid = _container(service)
                status[service] = _health(cid) if cid else "not created"
                if status[service] == "healthy":
                    healthy[service] = elapsed
                elif status[service] in ("unhealthy", "exited", "dead"):
                    raise RuntimeError(f"{service} is {status[service]}:\n{_logs(base, env)}")
            time.sleep(0.25)
        result["compose_ci_startup_s"] = round(max(healthy.values()), 1)
        result["verify_healthy_s"] = round(healthy["verify"], 1)
        result["draft_healthy_s"] = round(healthy["draft"], 1)
        up.wait(120)
        log(f"both healthy {result['compose_ci_startup_s']} s after `up -d` (verify at {result['verify_healthy_s']} s)")

        # The answer, through the published port, once the draft is connected (speculation SERVING).
        with Eagle3Client(f"127.0.0.1:{PORT}", timeout_s=300) as client:
            client.wait_until_healthy(60, "eagle3.speculation")
            t0 = time.monotonic()
            ids, text, first, last = [], [], None, None
            for event in client.generate([{"role": "user", "content": prompt}], max_tokens=max_tokens):
                if event.token_ids and first is None:
                    first = time.monotonic() - t0
                ids += event.token_ids
                text.append(event.text)
                last = event
            result["answer_s"] = round(time.monotonic() - t0, 2)
            result["first_token_s"] = round(first or 0.0, 2)
            result["answer_text"] = "".join(text)
            result["answer_token_ids"] = ids
            result["speculation"] = last.speculation if last is not None else None
            result["server_info"] = client.server_info()
        log(f"answer through 127.0.0.1:{PORT}: {result['answer_text']!r}")
    finally:
        t0 = time.monotonic()
        down = _run([*base, "down", "-v", "--remove-orphans"], timeout=180, env=env)
        result["down_s"] = round(time.monotonic() - t0, 1)
        if down.returncode != 0:
            log(f"WARNING: compose down exited with status {down.returncode}:\n{_tail(down)}")
    result["matches_inprocess"] = result["answer_token_ids"] == reference
    return result


def _logs(base: list[str], env: dict) -> str:
    proc = _run([*base, "logs", "--no-color", "--tail", "40"], timeout=60, env=env)
    return "--- compose logs (last lines) ---\n" + (proc.stdout + proc.stderr).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the measurements as JSON here")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--health-timeout-s", type=float, default=240)
    ap.add_argument("--wheels-only", action="store_true", help="only fill .docker-wheels/ for the base image's Python")
    args = ap.parse_args()
    try:
        if args.wheels_only:
            check_engine()
            print(prepare_wheels(image_python(base_image())))
            return 0
        result = run(args.prompt, args.max_tokens, args.health_timeout_s)
    except Unavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 3
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"compose_ci_startup_s={result['compose_ci_startup_s']} matches_inprocess={result['matches_inprocess']}")
    return 0 if result["matches_inprocess"] else 1


if __name__ == "__main__":
    sys.exit(main())
