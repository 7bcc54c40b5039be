"""``eagle3 client ...`` and ``eagle3 health``: talk to a running verify service.

    eagle3 client generate --server 127.0.0.1:50051 "Once upon a time" --max-tokens 64
    eagle3 client generate --token-ids 1,2,3 --stats
    eagle3 client generate --prompt-file long_prompt.txt     # '-' reads stdin; an argument stops at 128 KiB
    eagle3 client chat --system "Be brief." "What is the capital of France?"
    eagle3 client chat --message user:Hi --message assistant:Hello! "How are you?"
    eagle3 client info --json                                # GetServerInfo; `client metrics`: GetMetrics
    eagle3 health --server 127.0.0.1:50051 --service eagle3.v1.Generation --wait-s 60
    eagle3 client info --server host:50051 --tls-ca server.crt --token-file token   # a secured server

Nothing here imports torch: these commands run on a client-only install.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from client.eagle3_client import TREE_KINDS, ClientError, Eagle3Client
from common.auth import TOKEN_ENV, read_token

DEFAULT_SERVER = "127.0.0.1:50051"


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    client = sub.add_parser("client", help="send a request to a running verify service")
    verbs = client.add_subparsers(dest="client_command", required=True)
    gen = verbs.add_parser("generate", help="complete a raw prompt (no chat template)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("prompt", nargs="?", help="prompt text, sent as is")
    _add_prompt_file(prompt, "the prompt text")
    prompt.add_argument("--token-ids", type=_token_ids, help="prompt token ids, comma separated: 1,2,3")
    _add_request_args(gen)
    chat = verbs.add_parser("chat", help="answer chat messages (the model's chat template)")
    user = chat.add_mutually_exclusive_group()
    user.add_argument("user", nargs="?", help="the last user message")
    _add_prompt_file(user, "the last user message")
    chat.add_argument("--system", default=None, help="system message (first)")
    chat.add_argument("--message", action="append", default=[], type=_message, metavar="ROLE:CONTENT",
                      help="an earlier turn, e.g. user:Hi or assistant:Hello (repeatable, in order)")
    _add_request_args(chat)
    _add_inspect_args(verbs.add_parser("info", help="the server's model, limits and draft (GetServerInfo)"))
    _add_inspect_args(verbs.add_parser("metrics", help="the server's counters (GetMetrics)"))
    health = sub.add_parser("health", help="exit 0 when the server reports SERVING, 1 otherwise")
    _add_server_args(health)
    health.add_argument("--service", default="", help='"" (overall), eagle3.v1.Generation, eagle3.speculation')
    health.add_argument("--wait-s", type=float, default=0.0, help="poll up to this long for SERVING")
    health.add_argument("--timeout-s", type=float, default=5.0, help="deadline of one health check")


def _add_prompt_file(group, what: str) -> None:
    group.add_argument("--prompt-file", metavar="FILE", default=None,
                       help=f"read {what} from FILE ('-': stdin), for prompts longer than a shell argument")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Where the server is, and how to reach a secured one (its --tls-* and --api-token-file)."""
    p.add_argument("--server", default=DEFAULT_SERVER, help='"host:port" or "unix:/path"')
    sec = p.add_argument_group("TLS and API token (for a server started with them)")
    sec.add_argument("--tls", action="store_true", help="TLS, the server verified against the system's root CAs")
    sec.add_argument("--tls-ca", metavar="PEM", default=None,
                     help="TLS, the server verified against this CA (or its self-signed certificate)")
    sec.add_argument("--tls-cert", metavar="PEM", default=None, help="mutual TLS: this client's certificate")
    sec.add_argument("--tls-key", metavar="PEM", default=None, help="mutual TLS: the private key of --tls-cert")
    sec.add_argument("--token-file", metavar="FILE", default=None,
                     help=f"send the API token in FILE (default: ${TOKEN_ENV}, if set)")


def _connect(args: argparse.Namespace) -> Eagle3Client:
    token = read_token(args.token_file, "token_file") if args.token_file is not None else None
    return Eagle3Client(args.server, timeout_s=args.timeout_s, token=token, tls=args.tls, tls_ca=args.tls_ca,
                        tls_cert=args.tls_cert, tls_key=args.tls_key)


def _add_inspect_args(p: argparse.ArgumentParser) -> None:
    _add_server_args(p)
    p.add_argument("--timeout-s", type=float, default=10.0, help="deadline of the call")
    p.add_argument("--json", action="store_true", help="print the reply as JSON (every field by its proto name)")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    _add_server_args(p)
    p.add_argument("--max-tokens", type=int, default=0, help="0 = the server default")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (the server default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of the whole request")
    p.add_argument("--stats", action="store_true", help="print usage and speculation metrics to stderr")
    spec = p.add_argument_group("speculation (within the server's limits)")
    spec.add_argument("--no-speculation", action="store_true", help="plain decoding for this request")
    spec.add_argument("--tree", default=None, choices=sorted(TREE_KINDS))
    spec.add_argument("--tree-depth", type=int, default=None)
    spec.add_argument("--tree-top-k", type=int, default=None)
    spec.add_argument("--tree-nodes", type=int, default=None)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _message(text: str) -> dict:
    role, sep, content = text.partition(":")
    if not sep or not role.strip():
        raise argparse.ArgumentTypeError(f"expected ROLE:CONTENT, got {text!r}")
    return {"role": role.strip(), "content": content}


def run(args: argparse.Namespace) -> int:
    """Runs ``client`` or ``health``; a ClientError prints its code, message and field violations (exit 2)."""
    try:
        if args.command == "health":
            return _health(args)
        if args.command == "client" and args.client_command in ("info", "metrics"):
            return _inspect(args)
        if args.command == "client":
            return _request(args, _prompt(args))
    except ClientError as err:
        _print_error(err)
        return 2
    except ValueError as err:  # a request the client refuses to send
        print(f"error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"client_cli cannot run command {args.command!r}")


def _prompt(args: argparse.Namespace) -> str | list:
    text = _read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    if args.client_command == "generate":
        if args.token_ids is not None:
            return args.token_ids
        return text if text is not None else args.prompt
    text = text if text is not None else args.user
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    user = [{"role": "user", "content": text}] if text is not None else []
    messages = [*system, *args.message, *user]
    if not messages:
        raise ValueError("chat needs a message: the user message, --system or --message")
    return messages


def _read_prompt_file(path: str) -> str:
    """The whole of ``path`` ('-': stdin), final newline included."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"--prompt-file: cannot read {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file: {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _request(args: argparse.Namespace, prompt: str | list) -> int:
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop=args.stop,
                   speculate=False if args.no_speculation else None, tree=args.tree, depth=args.tree_depth,
                   tree_top_k=args.tree_top_k, max_nodes=args.tree_nodes)
    start, n, last = time.perf_counter(), 0, None
    with _connect(args) as client:
        stream = client.generate(prompt, **options)
        try:
            for event in stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                n += len(event.token_ids)
                last = event
        finally:
            stream.close()  # cancels the RPC on Ctrl-C or a broken pipe
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        _print_stats(last, n, time.perf_counter() - start)
    return 0


def _print_stats(last, n: int, secs: float) -> None:
    reason = last.finish_reason if last is not None and last.finish_reason else "none"
    usage = last.usage if last is not None else None
    prompt = f"{usage.prompt_tokens} prompt tokens, " if usage else ""
    print(f"[{prompt}{n} generated in {secs:.2f}s ({n / max(secs, 1e-9):.1f} tok/s), finish: {reason}]",
          file=sys.stderr)
    m = last.speculation if last is not None else None
    if m and m["speculated"]:
        print(f"[speculation: {m['steps']} steps, tau {m['mean_acceptance_length']:.2f}, "
              f"acceptance {m['acceptance_rate']:.1%}, {m['draft_tokens']} draft / {m['accepted_tokens']} accepted / "
              f"{m['rewound_tokens']} rewound tokens, per depth {m['accepted_per_depth']}]", file=sys.stderr)
    elif m is not None:
        print("[speculation: none for this request]", file=sys.stderr)


def _inspect(args: argparse.Namespace) -> int:
    """``client info`` / ``client metrics``: one field per line (nested ones dotted), or JSON."""
    with _connect(args) as client:
        reply = client.server_info() if args.client_command == "info" else client.metrics()
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    rows = _flatten(reply)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {_show(value)}")
    return 0


def _flatten(reply: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for name, value in reply.items():
        nested = isinstance(value, dict) and value  # an empty map shows as one "-" line
        rows += _flatten(value, f"{prefix}{name}.") if nested else [(f"{prefix}{name}", value)]
    return rows


def _show(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    if value == {}:
        return "-"
    return str(value) if value != "" else "-"


def _health(args: argparse.Namespace) -> int:
    """Prints the status (stdout) and exits 0 only for SERVING; an unreachable server is 1 too."""
    with _connect(args) as client:
        try:
            if args.wait_s > 0:
                client.wait_until_healthy(args.wait_s, args.service)
                status = "SERVING"
            else:
                status = client.health(args.service)
        except TimeoutError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except ClientError as err:
            _print_error(err)
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _print_error(err: ClientError) -> None:
    print(f"error: {err}", file=sys.stderr)  # one line: code, message, field violations it does not repeat
