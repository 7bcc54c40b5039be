"""Configuration of the draft service process (flags -> frozen config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.devices import check_device, device_type
from common.errors import InvalidRequestError
from common.listen import default_internal_address
from common.tree_settings import add_tree_arguments, tree_settings_from_args

if TYPE_CHECKING:  # spec_config reaches hub (numpy); the flags are parsed without it
    from draft_service.spec_config import SpecConfig

DEFAULT_VERIFY = default_internal_address()
DEFAULT_HEALTH = "127.0.0.1:50052"
STEP_TRANSPORTS = ("socket", "stream")


@dataclass(frozen=True, slots=True)
class DraftServerConfig:
    spec: SpecConfig
    verify: str = DEFAULT_VERIFY  # the verify service's internal address
    listen: str = DEFAULT_HEALTH  # this service's health / metrics / reflection endpoint
    device: str = "auto"  # must be the verify service's GPU (checked at the handshake)
    reconnect_max_s: float = 5.0  # backoff cap between reconnection attempts
    max_message_bytes: int = 4 << 20
    metrics_port: int | None = None  # Prometheus /metrics on the --listen host (None: off; 0: any free port)
    step_transport: str = "socket"  # socket: the unix step socket when offered, else the stream; stream: always
    enforce_eager: bool = False  # no CUDA graphs for the tree levels
    chained_steps: bool = True  # take chained steps on the step socket when offered (off: debugging, A/B)

    def __post_init__(self):
        check_device(self.device)
        if self.step_transport not in STEP_TRANSPORTS:
            raise InvalidRequestError("step_transport", f"must be one of {', '.join(STEP_TRANSPORTS)}, "
                                                        f"got {self.step_transport!r}")
        if self.reconnect_max_s <= 0:
            raise InvalidRequestError("reconnect_max_s", f"must be > 0, got {self.reconnect_max_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidRequestError("metrics_port", f"must be in [0, 65535], got {self.metrics_port}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="default",
                   help="EAGLE-3 head directory (config.json + weights); default: the head shipped for SmolLM2")
    p.add_argument("--verify", default=DEFAULT_VERIFY, help="the verify service's internal address")
    p.add_argument("--listen", default=DEFAULT_HEALTH, help="health / metrics address of this service")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (the verify service's device)")
    add_tree_arguments(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every tree level runs eagerly (graphs need CUDA and the Triton kernels)")
    p.add_argument("--reconnect-max-s", type=float, default=5.0)
    p.add_argument("--max-message-bytes", type=int, default=4 << 20)
    p.add_argument("--step-transport", default="socket", choices=STEP_TRANSPORTS,
                   help="how each step travels: socket (a unix socket beside the verify service's, when it offers "
                        "one: its internal address is a unix socket; else the gRPC session stream) or stream "
                        "(always the gRPC session stream)")
    p.add_argument("--chained-steps", default="on", choices=["on", "off"],
                   help="on the step socket, take chained steps when the verify service offers them (the draft's "
                        "work queued on the device behind acceptance, no host waiting for the other's GPU work); "
                        "off: every step's rows and trees pass through the host (debugging, comparisons)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on PORT, on the --listen host (127.0.0.1 for a unix socket; "
                        "0: any free port); needs eagle3-serve[metrics]")


def from_args(args: argparse.Namespace) -> DraftServerConfig:
    from draft_service.spec_config import SpecConfig

    check_device(args.device)
    tree = tree_settings_from_args(args, device_type(args.device))
    spec = SpecConfig(args.draft, tree.tree, tree.depth, tree.top_k, tree.max_nodes, static_tree_file=args.static_tree)
    return DraftServerConfig(spec, verify=args.verify, listen=args.listen, device=args.device,
                             reconnect_max_s=args.reconnect_max_s, max_message_bytes=args.max_message_bytes,
                             metrics_port=args.metrics_port, step_transport=args.step_transport,
                             enforce_eager=args.enforce_eager, chained_steps=args.chained_steps == "on")
