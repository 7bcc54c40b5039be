"""Eagle3Client and the ``eagle3 client`` / ``eagle3 health`` commands against a fake server.

The fake ``Generation`` servicer answers by prompt text: "invalid" aborts with a rich
INVALID_ARGUMENT, "forever" streams until cancelled, anything else streams "Hello, world".
"""

import io
import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from client.eagle3_client import ClientError, Completion, Eagle3Client, StreamEvent, Usage
from protos.eagle3.v1 import generation_pb2, generation_pb2_grpc, speculation_pb2
from cli import main as cli

DELTAS = [([15496], "Hello"), ([11], ","), ([995, 0], " world")]


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()  # set by the termination callback of a "forever" stream
        self.forever_context = None

    def Generate(self, request, context):
        self.requests.append(request)
        if request.text == "invalid":
            context.abort_with_status(rpc_status.to_status(_bad_request()))
        if request.text == "forever":
            yield from self._forever(context)
            return
        for ids, text in DELTAS:
            yield generation_pb2.GenerateResponse(delta=generation_pb2.TokenDelta(token_ids=ids, text=text))
        spec = generation_pb2.SpeculationMetrics(
            speculated=True, steps=2, draft_tokens=10, accepted_tokens=2, rewound_tokens=8,
            acceptance_rate=0.2, mean_acceptance_length=2.0, accepted_per_depth=[2, 0])
        yield generation_pb2.GenerateResponse(done=generation_pb2.GenerationDone(
            finish_reason=generation_pb2.FINISH_REASON_STOP,
            usage=generation_pb2.Usage(prompt_tokens=7, completion_tokens=4), speculation=spec))

    def _forever(self, context):
        self.forever_context = context
        context.add_callback(self.cancelled.set)
        while context.is_active():
            yield generation_pb2.GenerateResponse(delta=generation_pb2.TokenDelta(token_ids=[1], text="x"))
            time.sleep(0.01)

    def GetServerInfo(self, request, context):
        limits = speculation_pb2.SpeculationLimits(tree=speculation_pb2.TREE_KIND_DYNAMIC, max_depth=6,
                                                   max_top_k=8, max_nodes=59)
        return generation_pb2.ServerInfo(model_name="fake", vocab_size=49152, speculation_configured=True,
                                         limits=limits, max_tokens_default=256)

    def GetMetrics(self, request, context):
        return generation_pb2.ServerMetrics(running_requests=1, draft_tokens=2**40)


def _bad_request() -> status_pb2.Status:
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="sampling.temperature", description="must be >= 0"),
        error_details_pb2.BadRequest.FieldViolation(field="max_tokens", description="too many"),
    ])
    detail = any_pb2.Any()
    detail.Pack(bad)
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="invalid request", details=[detail])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    address = f"unix:{tmp_path_factory.mktemp('grpc')}/s.sock"
    fake = FakeGeneration()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, srv)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    for name in ("", "eagle3.v1.Generation"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("eagle3.speculation", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert srv.add_insecure_port(address)
    srv.start()
    yield address, fake
    srv.stop(grace=None)


@pytest.fixture
def client(server):
    with Eagle3Client(server[0], timeout_s=5.0) as c:
        yield c


def test_stream_events_and_text(client):
    events = list(client.generate("Hi", max_tokens=8))
    assert [e.text for e in events[:-1]] == ["Hello", ",", " world"]
    assert events[0] == StreamEvent(token_ids=(15496,), text="Hello")
    done = events[-1]
    assert done.done and done.finish_reason == "stop" and done.usage == Usage(7, 4)
    assert done.speculation["acceptance_rate"] == 0.2  # float32 shown as written
    assert done.speculation["accepted_per_depth"] == [2, 0]


def test_complete(client):
    answer = client.complete("Hi")
    assert answer == Completion("Hello, world", [15496, 11, 995, 0], "stop", Usage(7, 4), answer.speculation)
    assert answer.speculation["speculated"] and answer.speculation["mean_acceptance_length"] == 2.0


def test_prompt_kinds_and_options_reach_the_request(client, server):
    fake = server[1]
    client.complete("raw text")
    assert fake.requests[-1].WhichOneof("prompt") == "text" and fake.requests[-1].text == "raw text"
    client.complete([1, 2, 3])
    assert fake.requests[-1].WhichOneof("prompt") == "token_ids" and list(fake.requests[-1].token_ids.ids) == [1, 2, 3]
    client.complete([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                    temperature=0.5, seed=3, stop="END", speculate=False, tree="chain", depth=4)
    req = fake.requests[-1]
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "S"), ("user", "U")]
    assert req.sampling.HasField("temperature") and req.sampling.seed == 3
    assert not req.sampling.HasField("top_p") and not req.sampling.HasField("top_k")
    assert list(req.stop) == ["END"]
    assert req.speculation.HasField("enabled") and not req.speculation.enabled
    assert req.speculation.tree == speculation_pb2.TREE_KIND_CHAIN and req.speculation.depth == 4
    assert not req.speculation.HasField("max_nodes")
    with pytest.raises(ValueError):
        client.generate([])
    with pytest.raises(ValueError):
        client.generate("x", tree="bushy")


def test_invalid_argument_carries_field_violations(client):
    with pytest.raises(ClientError) as info:
        client.complete("invalid")
    err = info.value
    assert err.code == "INVALID_ARGUMENT" and err.message == "invalid request"
    assert err.field_violations == [("sampling.temperature", "must be >= 0"), ("max_tokens", "too many")]


def test_closing_the_stream_cancels_the_rpc(client, server):
    fake = server[1]
    fake.cancelled.clear()
    stream = client.generate("forever")
    assert next(stream).text == "x"
    assert fake.forever_context.is_active()
    stream.close()
    assert fake.cancelled.wait(2.0)
    assert not fake.forever_context.is_active()


def test_deadline_exceeded(client):
    with pytest.raises(ClientError) as info:
        client.complete("forever", timeout_s=0.2)
    assert info.value.code == "DEADLINE_EXCEEDED"


def test_server_info_and_metrics(client):
    info = client.server_info()
    assert info["model_name"] == "fake" and info["limits"]["tree"] == "dynamic"
    assert info["limits"]["max_nodes"] == 59 and info["draft_connected"] is False
    assert client.metrics()["draft_tokens"] == 2**40  # uint64 stays an int


def test_health(client):
    assert client.health() == "SERVING"
    assert client.health("eagle3.v1.Generation") == "SERVING"
    assert client.health("eagle3.speculation") == "NOT_SERVING"
    assert client.health("nope") == "SERVICE_UNKNOWN"
    client.wait_until_healthy(1.0, "eagle3.v1.Generation")
    with pytest.raises(TimeoutError, match="NOT_SERVING"):
        client.wait_until_healthy(0.3, "eagle3.speculation")


def test_wait_until_healthy_without_a_server(tmp_path):
    with Eagle3Client(f"unix:{tmp_path}/none.sock") as c:
        with pytest.raises(ClientError) as info:
            c.health()
        assert info.value.code == "UNAVAILABLE"
        with pytest.raises(TimeoutError, match="UNAVAILABLE"):
            c.wait_until_healthy(0.3)


def test_cli_generate(server, capsys):
    assert cli.main(["client", "generate", "--server", server[0], "Hi", "--max-tokens", "4", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello, world\n"
    assert "7 prompt tokens, 4 generated" in err and "finish: stop" in err and "tau 2.00" in err
    assert cli.main(["client", "generate", "--server", server[0], "--token-ids", "5,6", "--no-speculation",
                     "--tree", "static", "--tree-nodes", "9"]) == 0
    req = server[1].requests[-1]
    assert list(req.token_ids.ids) == [5, 6] and req.speculation.enabled is False
    assert req.speculation.tree == speculation_pb2.TREE_KIND_STATIC and req.speculation.max_nodes == 9


def test_cli_chat(server, capsys):
    argv = ["client", "chat", "--server", server[0], "--system", "Be brief.", "--message", "user:Hi",
            "--message", "assistant:Hello: there", "How are you?", "--temperature", "0.7", "--stop", "\n"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "Hello, world\n"
    req = server[1].requests[-1]
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello: there"), ("user", "How are you?")]
    assert list(req.stop) == ["\n"] and abs(req.sampling.temperature - 0.7) < 1e-6


def test_cli_error_prints_violations(server, capsys):
    assert cli.main(["client", "generate", "--server", server[0], "invalid"]) == 2
    assert capsys.readouterr().err == ("error: INVALID_ARGUMENT: invalid request "
                                       "(sampling.temperature: must be >= 0; max_tokens: too many)\n")


def test_client_error_is_one_line_without_repeats():
    # The server's message for one bad field is that field's violation: said once.
    err = ClientError("INVALID_ARGUMENT", "temperature: must be >= 0, got -1.0",
                      [("temperature", "must be >= 0, got -1.0")])
    assert str(err) == "INVALID_ARGUMENT: temperature: must be >= 0, got -1.0"
    err = ClientError("INVALID_ARGUMENT", "a: x", [("a", "x"), ("b", "y")])
    assert str(err) == "INVALID_ARGUMENT: a: x (b: y)"
    assert str(ClientError("UNAVAILABLE", "failed\n  to connect")) == "UNAVAILABLE: failed to connect"
    assert str(ClientError("UNKNOWN", "")) == "UNKNOWN"


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens: must be >= 0, got -1"),
    (dict(max_tokens=2**32), f"max_tokens: must be <= {2**32 - 1}, got {2**32}"),
    (dict(top_k=-1), "top_k: must be >= 0, got -1"),
    (dict(seed=-5), "seed: must be >= 0, got -5"),
    (dict(seed=2**64), f"seed: must be <= {2**64 - 1}, got {2**64}"),
    (dict(depth=-1), "depth: must be >= 0, got -1"),
    (dict(tree_top_k=-2), "tree_top_k: must be >= 0, got -2"),
    (dict(max_nodes=-3), "max_nodes: must be >= 0, got -3"),
    (dict(stop_token_ids=[2, -1]), "stop_token_ids\\[1\\]: must be >= 0, got -1"),
])
def test_unsigned_fields_are_checked_by_name(client, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        client.generate("x", **kwargs)


def test_prompt_token_ids_and_integer_types_are_checked(client):
    with pytest.raises(ValueError, match=r"^prompt\[1\]: must be >= 0, got -2$"):
        client.generate([1, -2])
    with pytest.raises(TypeError, match="^top_k: must be an integer, got 1.5$"):
        client.generate("x", top_k=1.5)
    assert client.complete("x", seed=2**64 - 1, max_tokens=2**32 - 1).text == "Hello, world"


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-1"], "max_tokens: must be >= 0, got -1"),
    (["--top-k", "-1"], "top_k: must be >= 0, got -1"),
    (["--seed", "-1"], "seed: must be >= 0, got -1"),
    (["--tree-depth", "-1"], "depth: must be >= 0, got -1"),
    (["--tree-top-k", "-1"], "tree_top_k: must be >= 0, got -1"),
    (["--tree-nodes", "-1"], "max_nodes: must be >= 0, got -1"),
])
def test_cli_refuses_negative_unsigned_values(server, capsys, flags, message):
    sent = len(server[1].requests)
    assert cli.main(["client", "chat", "--server", server[0], "Hi", *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert len(server[1].requests) == sent  # refused before sending


def test_cli_prompt_file(server, capsys, tmp_path):
    long_prompt = "word " * 50_000 + "\nend\n"  # 250 KB: more than one shell argument may hold
    path = tmp_path / "prompt.txt"
    path.write_text(long_prompt)
    assert cli.main(["client", "generate", "--server", server[0], "--prompt-file", str(path)]) == 0
    assert capsys.readouterr().out == "Hello, world\n"
    assert server[1].requests[-1].text == long_prompt
    assert cli.main(["client", "chat", "--server", server[0], "--system", "S", "--prompt-file", str(path)]) == 0
    messages = server[1].requests[-1].chat.messages
    assert [(m.role, m.content) for m in messages] == [("system", "S"), ("user", long_prompt)]


def test_cli_prompt_file_from_stdin(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    assert cli.main(["client", "generate", "--server", server[0], "--prompt-file", "-"]) == 0
    assert server[1].requests[-1].text == "from stdin\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("a question"))
    assert cli.main(["client", "chat", "--server", server[0], "--message", "user:Hi", "--prompt-file", "-"]) == 0
    messages = server[1].requests[-1].chat.messages
    assert [(m.role, m.content) for m in messages] == [("user", "Hi"), ("user", "a question")]
    assert capsys.readouterr().out == "Hello, world\n" * 2


def test_cli_prompt_file_errors(server, capsys, tmp_path):
    missing = tmp_path / "missing.txt"
    assert cli.main(["client", "generate", "--server", server[0], "--prompt-file", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --prompt-file: cannot read {str(missing)!r}: No such file or directory\n"
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    assert cli.main(["client", "chat", "--server", server[0], "--prompt-file", str(tmp_path / "bin")]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    for argv in (["generate", "x", "--prompt-file", "f"], ["generate", "--token-ids", "1", "--prompt-file", "f"],
                 ["generate"], ["chat", "x", "--prompt-file", "f"]):
        with pytest.raises(SystemExit) as info:  # argparse: exactly one prompt
            cli.main(["client", *argv, "--server", server[0]])
        assert info.value.code == 2
        assert "--prompt-file" in capsys.readouterr().err


def test_cli_health(server, capsys, tmp_path):
    assert cli.main(["health", "--server", server[0]]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    assert cli.main(["health", "--server", server[0], "--service", "eagle3.speculation"]) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"
    assert cli.main(["health", "--server", server[0], "--service", "eagle3.v1.Generation", "--wait-s", "1"]) == 0
    assert cli.main(["health", "--server", server[0], "--service", "eagle3.speculation", "--wait-s", "0.2"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert cli.main(["health", "--server", f"unix:{tmp_path}/none.sock"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
