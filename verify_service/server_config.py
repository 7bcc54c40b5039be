"""Configuration of the verify service process (flags -> frozen config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from common.auth import TOKEN_ENV, check_key_pair, check_token, env_token, read_pem, read_token
from common.devices import device_type
from common.errors import InvalidRequestError
from common.listen import default_internal_address
from common.tree_settings import TreeSettings, add_tree_arguments, tree_settings_from_args
from verify_service.config import KERNEL_CHOICES, SAMPLING_ACCEPTANCE, EngineConfig

DEFAULT_PUBLIC = "127.0.0.1:50051"  # loopback unless configured otherwise
DEFAULT_INTERNAL = default_internal_address()  # the draft channel never leaves the host, nor this user
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
DEFAULT_STREAM_INTERVAL_MS = 10.0
DEFAULT_STREAM_MESSAGES_PER_S = 400.0
RESERVED_WORKERS = 16


@dataclass(frozen=True, slots=True)
class VerifyServerConfig:
    engine: EngineConfig
    limits: TreeSettings | None  # None: never speculate (no draft accepted)
    adaptive_speculation: bool = False  # pick each step's tree size (or plain decoding) from measured costs
    cost_table: str | None = None  # JSON cost table: read when it exists, else measured at start-up and written
    listen: str = DEFAULT_PUBLIC
    internal: str = DEFAULT_INTERNAL
    draft_timeout_s: float = 10.0  # a draft answering slower than this is dropped (plain decoding)
    chain_min_seqs: int = 1  # chained steps through the draft link for steps of at least this many sequences
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_tokens_default: int = 256
    max_open_streams: int = 256  # Generate streams at once; more get RESOURCE_EXHAUSTED at once
    max_queued_requests: int = 256  # requests waiting for a batch slot; more get RESOURCE_EXHAUSTED
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS  # a stream's tokens gather this long after a message
    # the streams sending tokens together send about this many messages a second at most (each one's interval grows)
    stream_messages_per_s: float = DEFAULT_STREAM_MESSAGES_PER_S
    shutdown_grace_s: float = 30.0  # on SIGTERM: how long streams in flight may take to finish
    metrics_port: int | None = None  # Prometheus /metrics on the --listen host (None: off; 0: any free port)
    tls_cert: str | None = None  # PEM files: TLS on the public API (None: plaintext)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: clients must present a certificate this CA signed
    api_token: str | None = field(default=None, repr=False)  # required as a bearer token (None: no token)

    def __post_init__(self):
        if self.draft_timeout_s <= 0:
            raise InvalidRequestError("draft_timeout_s", f"must be > 0, got {self.draft_timeout_s}")
        if not 1 <= self.chain_min_seqs <= 65536:
            raise InvalidRequestError("chain_min_seqs", f"must be in [1, 65536], got {self.chain_min_seqs}")
        if not 1024 <= self.max_message_bytes <= 1 << 30:
            raise InvalidRequestError("max_message_bytes", f"must be in [1 KiB, 1 GiB], got {self.max_message_bytes}")
        if self.max_tokens_default <= 0:
            raise InvalidRequestError("max_tokens_default", f"must be > 0, got {self.max_tokens_default}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidRequestError("metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        for name in ("max_open_streams", "max_queued_requests"):
            if not 1 <= getattr(self, name) <= 65536:
                raise InvalidRequestError(name, f"must be in [1, 65536], got {getattr(self, name)}")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise InvalidRequestError("stream_interval_ms", f"must be in [0, 1000], got {self.stream_interval_ms}")
        if not 0 <= self.stream_messages_per_s <= 1e6:
            raise InvalidRequestError("stream_messages_per_s",
                                      f"must be in [0, 1000000] (0: no bound), got {self.stream_messages_per_s}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise InvalidRequestError("shutdown_grace_s", f"must be in [0, 3600], got {self.shutdown_grace_s}")
        if self.adaptive_speculation and self.limits is None:
            raise InvalidRequestError("adaptive_speculation", "needs speculation (it was turned off)")
        self._check_security()

    @property
    def workers(self) -> int:
        """Public server threads: one per open stream, plus a reserve streams cannot take, so health,
        metrics and refusals always find a thread."""
        return self.max_open_streams + RESERVED_WORKERS

    def _check_security(self) -> None:
        """The TLS files exist and hold PEM (checked before the model loads); the token can travel in a header."""
        check_key_pair(self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidRequestError("tls_client_ca", "verifying clients (mutual TLS) needs TLS: tls_cert and tls_key")
        for path, name, kind in ((self.tls_cert, "tls_cert", "CERTIFICATE"), (self.tls_key, "tls_key", "PRIVATE KEY"),
                                 (self.tls_client_ca, "tls_client_ca", "CERTIFICATE")):
            if path is not None:
                read_pem(path, name, kind)
        if self.api_token is not None:
            check_token(self.api_token, "api_token")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache budget (default: 90%% of free GPU memory)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides --kv-cache-gib)")
    add_kernel_arguments(p)


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES),
                   help="triton: the Triton kernels; reference: the pure-torch references (eager, for "
                        "debugging and parity checks); auto: Triton on CUDA, the references on the CPU")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eagerly (graphs need CUDA and the Triton kernels)")
    p.add_argument("--sampling-acceptance", default="seeded", choices=list(SAMPLING_ACCEPTANCE),
                   help="how sampled requests verify draft trees: seeded (default) accepts a node iff it is the "
                        "target's own sample there, so a seed gives the same text with or without a draft; "
                        "residual: the SpecInfer/EAGLE residual rule (same distribution, other text per seed)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant target numerics, so greedy output with a draft is token-for-token the "
                        "target-only output in bf16 too (default: on on CUDA, off with --kernels reference and on "
                        "a CPU, where float32 already gives it); --no-exact: the fastest kernels (the mode costs about "
                        "10%% of speculative tok/s at batch 1: README, Exact mode)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--listen", default=DEFAULT_PUBLIC, help="public gRPC address (host:port or unix:PATH)")
    p.add_argument("--internal", default=DEFAULT_INTERNAL, help="address the draft service dials (unix:PATH)")
    p.add_argument("--no-speculation", action="store_true", help="serve without a draft, one token per step")
    add_tree_arguments(p, limits=True, static_file=False)
    p.add_argument("--adaptive-speculation", default="auto", choices=["auto", "on", "off"],
                   help="pick each step's tree size, or plain decoding, for the batch from measured costs and "
                        "the acceptance seen (on), or always verify the configured tree (off); auto (the "
                        "default): on with CUDA, off on a CPU")
    p.add_argument("--cost-table", metavar="FILE", default=None,
                   help="adaptive speculation's cost table (JSON): read when FILE exists and was measured on this "
                        "device, dtype and model; else measured at start-up (seconds) and written to FILE")
    p.add_argument("--draft-timeout-s", type=float, default=10.0)
    p.add_argument("--chain-min-seqs", type=int, default=1, metavar="N",
                   help="chained steps through the draft link (the draft's work queued on the GPU behind acceptance) "
                        "for steps of at least N sequences; smaller ones pass through the hosts")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--max-tokens-default", type=int, default=256)
    p.add_argument("--max-open-streams", type=int, default=256,
                   help="Generate streams open at once; one more gets RESOURCE_EXHAUSTED at once")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting for a batch slot (beyond --max-num-seqs running); more get RESOURCE_EXHAUSTED")
    p.add_argument("--stream-interval-ms", type=float, default=DEFAULT_STREAM_INTERVAL_MS,
                   help="after a response message, a stream lets its tokens gather this long and sends them in the "
                        "next one (its first tokens and its end go at once); every message costs the engine thread "
                        "time, so fewer of them keep throughput up under load. 0: a message as soon as tokens are in")
    p.add_argument("--stream-messages-per-s", type=float, default=DEFAULT_STREAM_MESSAGES_PER_S,
                   help="the streams together send about this many response messages a second at most: with more "
                        "streams sending tokens (open ones, at most the running requests) than this times "
                        "--stream-interval-ms, each stream's interval grows to those streams / this (250 ms at "
                        "most). 0: no bound")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM: NOT_SERVING and no new requests at once; streams in flight get this long")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on PORT, on the --listen host (127.0.0.1 for a unix socket; "
                        "0: any free port); needs eagle3-serve[metrics]")
    add_security_arguments(p)


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    sec = p.add_argument_group("securing the public API (off by default; README: Securing the public API)")
    sec.add_argument("--tls-cert", metavar="PEM", default=None, help="serve --listen over TLS with this certificate")
    sec.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")
    sec.add_argument("--tls-client-ca", metavar="PEM", default=None,
                     help="mutual TLS: clients must present a certificate signed by this CA")
    sec.add_argument("--api-token-file", metavar="FILE", default=None,
                     help="require 'authorization: Bearer TOKEN' (TOKEN: this file's content) on Generation and "
                          f"reflection; health stays open (default: ${TOKEN_ENV} when set, else no token)")


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    return EngineConfig(model_dir, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                        kv_cache_gib=args.kv_cache_gib, num_kv_blocks=args.num_kv_blocks,
                        kernels=args.kernels, enforce_eager=args.enforce_eager,
                        sampling_acceptance=args.sampling_acceptance, exact=args.exact)


def from_args(args: argparse.Namespace, model_dir: str) -> VerifyServerConfig:
    engine = engine_config(args, model_dir)  # checks --device first
    kind = device_type(args.device)
    limits = None if args.no_speculation else tree_settings_from_args(args, kind)
    adaptive = limits is not None and (args.adaptive_speculation == "on" or
                                       (args.adaptive_speculation == "auto" and kind == "cuda"))
    return VerifyServerConfig(engine, limits, adaptive_speculation=adaptive, cost_table=args.cost_table,
                              listen=args.listen, internal=args.internal,
                              draft_timeout_s=args.draft_timeout_s, chain_min_seqs=args.chain_min_seqs,
                              max_message_bytes=args.max_message_bytes,
                              max_tokens_default=args.max_tokens_default, metrics_port=args.metrics_port,
                              max_open_streams=args.max_open_streams, max_queued_requests=args.max_queued_requests,
                              stream_interval_ms=args.stream_interval_ms,
                              stream_messages_per_s=args.stream_messages_per_s,
                              shutdown_grace_s=args.shutdown_grace_s,
                              tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                              api_token=read_token(args.api_token_file, "api_token_file") if args.api_token_file
                              else env_token())
