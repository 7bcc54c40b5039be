"""compose.yaml and compose.tls.yaml checked against the real command line: no drift from the flags.

Every service command and healthcheck is parsed by ``eagle3``'s own parser; the wiring between
the two services (unix socket on a shared volume, shared IPC/PID namespaces, one GPU, loopback
port) is checked on the parsed values. ``docker-compose config`` validates the file itself when
the binary is installed (.ci/run installs Debian's docker-compose); no Docker engine is needed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from cli.main import build_parser

# PyYAML comes with tokenizers -> huggingface_hub; skip loudly rather than fail if that changes.
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (normally pulled in by tokenizers)")

COMPOSE = Path(__file__).resolve().parents[1] / "compose.yaml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _parse(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit:  # argparse printed the reason to stderr
        pytest.fail(f"eagle3 rejects {argv}")


def _health_argv(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "eagle3"], test  # exec form: no shell in between
    return test[2:]


def _mounts(service: dict) -> list[tuple[str, str, str, bool]]:
    """(type, source, target, read_only) of each volume entry, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            kind = "bind" if source.startswith((".", "/", "~", "$")) else "volume"
            out.append((kind, source, target, mode == ["ro"]))
        else:
            out.append((v["type"], v["source"], v["target"], bool(v.get("read_only"))))
    return out


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


@pytest.mark.parametrize("name", ["verify", "draft"])
def test_command_and_healthcheck_parse(services, name):
    svc = services[name]
    args = _parse(svc["command"])
    assert args.command == f"serve-{name}"
    health = _parse(_health_argv(svc))
    assert health.command == "health"
    # The probe runs inside the service's own container and dials its own listening port.
    assert health.server == f"127.0.0.1:{_port(args.listen)}"
    hc = svc["healthcheck"]
    assert {"interval", "timeout", "retries", "start_period"} <= hc.keys()


def test_internal_socket_lies_on_the_shared_volume(services):
    verify, draft = _parse(services["verify"]["command"]), _parse(services["draft"]["command"])
    assert verify.internal == draft.verify
    assert verify.internal.startswith("unix:")
    sock_dir = PurePosixPath(verify.internal.removeprefix("unix:")).parent
    shared = [{(src, tgt) for kind, src, tgt, _ in _mounts(services[n]) if kind == "volume"}
              for n in ("verify", "draft")]
    common = shared[0] & shared[1]
    assert any(PurePosixPath(tgt) == sock_dir for _, tgt in common), (sock_dir, common)
    top_level = yaml.safe_load(COMPOSE.read_text()).get("volumes") or {}
    assert all(src in top_level for src, _ in common)  # named volumes, declared once


def test_draft_joins_verify_ipc_and_pid_namespaces(services):
    # CUDA IPC handles only open in a process sharing the exporter's IPC and PID namespaces.
    assert services["verify"]["ipc"] == "shareable"
    assert services["draft"]["ipc"] == "service:verify"
    assert services["draft"]["pid"] == "service:verify"


def test_public_port_is_loopback_only(services):
    listen = _parse(services["verify"]["command"]).listen
    assert services["verify"]["ports"] == [f"127.0.0.1:{_port(listen)}:{_port(listen)}"]
    assert "ports" not in services["draft"]  # the draft's endpoint is for its healthcheck only


def test_both_reserve_the_same_single_gpu(services):
    devices = [services[n]["deploy"]["resources"]["reservations"]["devices"] for n in ("verify", "draft")]
    assert devices[0] == devices[1]
    [gpu] = devices[0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert gpu.get("count") == 1 or len(gpu.get("device_ids", [])) == 1, gpu
    verify, draft = _parse(services["verify"]["command"]), _parse(services["draft"]["command"])
    assert draft.device == verify.device and verify.device.startswith("cuda")


def test_draft_uses_the_shipped_head_unless_overridden(services):
    draft = _parse(services["draft"]["command"])
    assert draft.draft == "${EAGLE3_DRAFT:-default}"  # "default": the head inside the image


def test_draft_starts_after_verify_is_healthy(services):
    assert services["draft"]["depends_on"]["verify"]["condition"] == "service_healthy"
    assert services["draft"]["restart"] == "unless-stopped"


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_docker_compose_validates_the_file(name):
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    # `config` only loads, interpolates and validates: no Docker engine is contacted.
    proc = subprocess.run([exe, "-f", str(COMPOSE.with_name(name)), "config", "-q"], cwd=COMPOSE.parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_token_is_passed_from_the_environment_and_health_stays_open(services):
    assert services["verify"]["environment"] == ["EAGLE3_API_TOKEN"]  # no value: taken from the shell, never written
    assert "--api-token-file" not in services["verify"]["command"]
    assert "--token-file" not in _health_argv(services["verify"])  # health needs no token


def test_tls_overlay_mounts_the_certificates_and_its_healthcheck_verifies_them(services):
    tls = yaml.safe_load(COMPOSE.with_name("compose.tls.yaml").read_text())["services"]["verify"]
    args, health = _parse(tls["command"]), _parse(_health_argv(tls))
    base = _parse(services["verify"]["command"])
    assert (args.listen, args.internal, args.device) == (base.listen, base.internal, base.device)
    [(kind, _, target, read_only)] = _mounts(tls)
    assert kind == "bind" and read_only
    assert all(PurePosixPath(p).parent == PurePosixPath(target) for p in (args.tls_cert, args.tls_key))
    assert health.server == f"127.0.0.1:{_port(args.listen)}" and health.tls_ca == args.tls_cert


def test_docker_compose_validates_the_tls_overlay():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    proc = subprocess.run([exe, "-f", str(COMPOSE), "-f", str(COMPOSE.with_name("compose.tls.yaml")), "config", "-q"],
                          cwd=COMPOSE.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# compose.cpu.yaml: compose.yaml for a CPU-only machine (CI starts it for real: tests/test_compose_up.py).
# A whole file, since an overlay cannot drop the GPU reservation in docker-compose 1.29; these checks keep
# it compose.yaml with exactly the differences its header lists.
CPU_COMPOSE = COMPOSE.with_name("compose.cpu.yaml")


@pytest.fixture(scope="module")
def cpu_services() -> dict:
    return yaml.safe_load(CPU_COMPOSE.read_text())["services"]


@pytest.mark.parametrize("name", ["verify", "draft"])
def test_cpu_file_is_compose_yaml_without_the_gpu(services, cpu_services, name):
    gpu, cpu = services[name], cpu_services[name]
    assert "deploy" not in cpu  # no GPU reservation: Docker refuses it on a host without one
    gpu_args, cpu_args = _parse(gpu["command"]), _parse(cpu["command"])
    assert vars(cpu_args) == {**vars(gpu_args), "device": "cpu"}  # the same command, on the CPU
    # The same probe and limits; only the interval differs (a CPU model loads in seconds).
    assert _health_argv(cpu) == _health_argv(gpu)
    assert {k: v for k, v in cpu["healthcheck"].items() if k != "interval"} == \
        {k: v for k, v in gpu["healthcheck"].items() if k != "interval"}
    # The GPU file's volumes, plus (verify only) the host's converted model, read-only.
    assert all(m in _mounts(cpu) for m in _mounts(gpu))
    extra = [m for m in _mounts(cpu) if m not in _mounts(gpu)]
    if name == "verify":
        [(kind, source, target, read_only)] = extra
        assert kind == "bind" and read_only and target == "/cache/models" and source.endswith("/models")
    else:
        assert extra == []
    # Everything else as in compose.yaml: ports, environment, namespaces, init, depends_on, restart.
    same = set(gpu) - {"deploy", "image", "build", "command", "healthcheck", "volumes"}
    assert {k: cpu.get(k) for k in same} == {k: gpu[k] for k in same}
    assert set(cpu) - set(gpu) <= {"shm_size"}


def test_cpu_file_builds_the_cpu_image_with_the_model_mounted(cpu_services):
    verify, draft = cpu_services["verify"], cpu_services["draft"]
    assert verify["image"] == draft["image"] == "eagle3-serve:cpu"  # never the GPU image's tag
    assert verify["build"] == draft["build"]
    args = verify["build"]["args"]
    assert args["EXTRAS"] == "engine" and args["FETCH_DEFAULT"] == "0"  # no cupy; the model is mounted
    assert args["LOCAL_WHEELS"] == "1"  # .docker-wheels/ only: the CPU torch build, no network
    # The draft maps verify's shared memory (its IPC namespace): past Docker's 64 MB default /dev/shm.
    assert verify["shm_size"] == "1gb" and "shm_size" not in draft
    dockerfile = COMPOSE.with_name("Dockerfile").read_text()
    assert all(f"ARG {arg}=" in dockerfile for arg in args)
