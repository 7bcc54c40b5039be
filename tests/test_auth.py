"""TLS, mutual TLS and the bearer token on the public API, through real in-process verify servers.

Certificates are made with the openssl command line: a CA signing a server and a client
certificate, and a self-signed one made with the README's own command. Three servers (tiny
random target, no speculation): a token on a unix socket, TLS with the self-signed certificate,
and mutual TLS plus a token, the last two on 127.0.0.1 port 0.
"""

import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli import main as cli
from client.eagle3_client import ClientError, Eagle3Client
from common.auth import TOKEN_ENV, exposure_warning, is_local
from common.errors import InvalidRequestError
from tiny_models import TEST_DEVICE, TEST_DTYPE, make_model_dir
from verify_service import server_config
from verify_service.config import EngineConfig
from verify_service.server import _public_server, create_server
from verify_service.server_config import VerifyServerConfig

README = Path(__file__).resolve().parent.parent / "README.md"
TOKEN = "eagle3-test-token_0123456789abcdef"
WRONG = "not-the-token-fedcba9876543210"
PROMPT = [5, 6, 7]

if shutil.which("openssl") is None:
    pytest.skip("the openssl command is not installed (it makes the test certificates)", allow_module_level=True)


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def _readme_openssl() -> list[str]:
    """The README's self-signed certificate command (its bash block in "Securing the public API")."""
    section = README.read_text().split("### Securing the public API", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return shlex.split(next(line for line in block.splitlines() if line.startswith("openssl req")))[1:]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """ca.crt signing server.crt (127.0.0.1, localhost) and client.crt; self-signed server.crt
    in self/ (the README's command), which is no CA of the others."""
    d = tmp_path_factory.mktemp("certs")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *key, "-days", "1", "-subj", "/CN=eagle3-test-ca", "-keyout", "ca.key",
             "-out", "ca.crt")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(d, "req", *key, "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-out", f"{name}.crt", *(["-extfile", "san.ext"] if name == "server" else []))
    (d / "self").mkdir()
    _openssl(d / "self", *_readme_openssl())
    (d / "token").write_text(TOKEN + "\n")
    (d / "wrong").write_text(WRONG)
    return d


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> EngineConfig:
    model = make_model_dir(tmp_path_factory.mktemp("auth") / "target", "llama3", seed=5, std=0.3)
    return EngineConfig(str(model), device=TEST_DEVICE, dtype=TEST_DTYPE, num_kv_blocks=64)


def _serve(cfg: VerifyServerConfig):
    server = create_server(cfg)
    address = cfg.listen if cfg.listen.startswith("unix:") else f"127.0.0.1:{server.public_port}"
    yield address
    server.stop(0)


@pytest.fixture(scope="module")
def token_server(engine, tmp_path_factory):
    yield from _serve(VerifyServerConfig(engine, None, listen=f"unix:{tmp_path_factory.mktemp('t')}/api.sock",
                                         api_token=TOKEN))


@pytest.fixture(scope="module")
def tls_server(engine, certs):
    yield from _serve(VerifyServerConfig(engine, None, listen="127.0.0.1:0", tls_cert=str(certs / "self/server.crt"),
                                         tls_key=str(certs / "self/server.key")))


@pytest.fixture(scope="module")
def mtls_server(engine, certs):
    yield from _serve(VerifyServerConfig(engine, None, listen="127.0.0.1:0", tls_cert=str(certs / "server.crt"),
                                         tls_key=str(certs / "server.key"), tls_client_ca=str(certs / "ca.crt"),
                                         api_token=TOKEN))


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _generates(client: Eagle3Client) -> bool:
    answer = client.complete(PROMPT, max_tokens=3, ignore_eos=True)
    return answer.finish_reason == "length" and len(answer.token_ids) == 3


def _code(call) -> str:
    with pytest.raises(ClientError) as info:
        call()
    assert TOKEN not in str(info.value) and WRONG not in str(info.value)  # never echoed
    return info.value.code


def _reflection(address: str, metadata=()) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            metadata=metadata, timeout=10)
        return [s.name for r in replies for s in r.list_services_response.service]


# -- the token ---------------------------------------------------------------------------------

def test_missing_or_wrong_token_is_unauthenticated(token_server):
    for token in (None, WRONG):
        with Eagle3Client(token_server, timeout_s=10, token=token) as client:
            assert _code(lambda: client.complete(PROMPT, max_tokens=3)) == "UNAUTHENTICATED"  # server-streaming
            assert _code(client.server_info) == "UNAUTHENTICATED"  # unary
            assert client.health() == "SERVING" and client.health("eagle3.v1.Generation") == "SERVING"  # open


def test_right_token_generates(token_server):
    with Eagle3Client(token_server, timeout_s=30, token=TOKEN) as client:
        assert _generates(client)
        assert client.server_info()["speculation_configured"] is False


def test_token_from_the_environment(token_server, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with Eagle3Client(token_server, timeout_s=30) as client:
        assert _generates(client)


def test_reflection_needs_the_token(token_server):
    with pytest.raises(grpc.RpcError) as info:
        _reflection(token_server)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "eagle3.v1.Generation" in _reflection(token_server, [("authorization", f"Bearer {TOKEN}")])


@pytest.mark.parametrize("header", [f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer "])
def test_only_the_exact_bearer_token_passes(token_server, header):
    with pytest.raises(grpc.RpcError) as info:
        _reflection(token_server, [("authorization", header)])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cli_token_file_and_environment(token_server, certs, capsys, monkeypatch):
    args = ["client", "generate", "--server", token_server, "--token-ids", "5,6", "--max-tokens", "2"]
    assert cli.main([*args, "--token-file", str(certs / "token")]) == 0
    assert cli.main([*args, "--token-file", str(certs / "wrong")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: UNAUTHENTICATED: missing or invalid API token") and WRONG not in err
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert cli.main(args) == 0
    assert cli.main(["health", "--server", token_server]) == 0  # health needs no token


def test_the_token_is_never_logged_nor_in_the_config_repr(engine, token_server, caplog):
    caplog.set_level(logging.DEBUG)
    with Eagle3Client(token_server, timeout_s=10, token=WRONG) as client:
        _code(client.server_info)
    cfg = VerifyServerConfig(engine, None, api_token=TOKEN)
    assert TOKEN not in repr(cfg) and TOKEN not in caplog.text and WRONG not in caplog.text


# -- TLS ---------------------------------------------------------------------------------------

def test_tls_with_the_right_ca(tls_server, certs, capsys):
    with Eagle3Client(tls_server, timeout_s=30, tls_ca=str(certs / "self/server.crt")) as client:
        assert client.health() == "SERVING" and _generates(client)
    assert cli.main(["health", "--server", tls_server, "--tls-ca", str(certs / "self/server.crt")]) == 0
    assert capsys.readouterr().out == "SERVING\n"


@pytest.mark.parametrize("how", ["plaintext", "another CA", "system roots"])
def test_tls_refuses_plaintext_and_unknown_certificates(tls_server, certs, how):
    options = {"plaintext": {}, "another CA": {"tls_ca": str(certs / "ca.crt")}, "system roots": {"tls": True}}[how]
    with Eagle3Client(tls_server, timeout_s=10, **options) as client:
        assert _code(client.health) == "UNAVAILABLE"


def test_mutual_tls_needs_a_client_certificate_the_ca_signed(mtls_server, certs):
    ca = str(certs / "ca.crt")
    for client_cert in (None, certs / "self/server"):  # none; self-signed, not signed by ca.crt
        pair = {} if client_cert is None else {"tls_cert": f"{client_cert}.crt", "tls_key": f"{client_cert}.key"}
        with Eagle3Client(mtls_server, timeout_s=10, token=TOKEN, tls_ca=ca, **pair) as client:
            assert _code(client.health) == "UNAVAILABLE"
    with Eagle3Client(mtls_server, timeout_s=30, token=TOKEN, tls_ca=ca, tls_cert=str(certs / "client.crt"),
                      tls_key=str(certs / "client.key")) as client:
        assert client.health() == "SERVING" and _generates(client)


def test_mutual_tls_still_needs_the_token(mtls_server, certs):
    with Eagle3Client(mtls_server, timeout_s=10, tls_ca=str(certs / "ca.crt"), tls_cert=str(certs / "client.crt"),
                      tls_key=str(certs / "client.key")) as client:
        assert client.health() == "SERVING"
        assert _code(client.server_info) == "UNAUTHENTICATED"


def test_cli_mutual_tls_and_token(mtls_server, certs, capsys):
    tls = ["--tls-ca", str(certs / "ca.crt"), "--tls-cert", str(certs / "client.crt"),
           "--tls-key", str(certs / "client.key")]
    assert cli.main(["client", "info", "--server", mtls_server, *tls, "--token-file", str(certs / "token")]) == 0
    assert "speculation_configured" in capsys.readouterr().out
    assert cli.main(["client", "info", "--server", mtls_server, *tls]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


# -- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("given, field, message", [
    ({"tls_cert": "server.crt"}, "tls_key", "needs its private key"),
    ({"tls_key": "server.key"}, "tls_cert", "needs its certificate"),
    ({"tls_client_ca": "ca.crt"}, "tls_client_ca", "needs TLS"),
    ({"tls_cert": "missing.crt", "tls_key": "server.key"}, "tls_cert", "cannot read"),
    ({"tls_cert": "server.key", "tls_key": "server.key"}, "tls_cert", "holds no PEM certificate"),
    ({"tls_cert": "server.crt", "tls_key": "server.crt"}, "tls_key", "holds no PEM private key"),
    ({"api_token": ""}, "api_token", "empty"),
    ({"api_token": "two words"}, "api_token", "printable ASCII without spaces"),
])
def test_server_config_errors(engine, certs, given, field, message):
    given = {k: (str(certs / v) if k.startswith("tls") else v) for k, v in given.items()}
    with pytest.raises(InvalidRequestError, match=message) as info:
        VerifyServerConfig(engine, None, **given)
    assert info.value.field == field


def test_a_key_of_another_certificate_is_refused_before_the_model_loads(engine, certs):
    cfg = VerifyServerConfig(engine, None, listen="127.0.0.1:0", tls_cert=str(certs / "server.crt"),
                             tls_key=str(certs / "client.key"))
    with pytest.raises(InvalidRequestError, match="do not go together") as info:
        _public_server(cfg)
    assert info.value.field == "tls_cert"


def _server_args(engine, *flags) -> server_config.VerifyServerConfig:
    args = cli.build_parser().parse_args(["serve-verify", "--model", engine.model_dir, "--device", TEST_DEVICE,
                                          "--no-speculation", *flags])
    return server_config.from_args(args, engine.model_dir)


def test_token_flags_file_then_environment(engine, certs, monkeypatch, tmp_path):
    assert _server_args(engine).api_token is None
    monkeypatch.setenv(TOKEN_ENV, f"  {WRONG}\n")
    assert _server_args(engine).api_token == WRONG
    assert _server_args(engine, "--api-token-file", str(certs / "token")).api_token == TOKEN  # the file wins
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidRequestError, match="empty") as info:
        _server_args(engine, "--api-token-file", str(tmp_path / "empty"))
    assert info.value.field == "api_token_file"
    monkeypatch.setenv(TOKEN_ENV, "two words")
    with pytest.raises(InvalidRequestError, match=TOKEN_ENV):
        _server_args(engine)


def test_serve_verify_flag_errors_are_one_line_and_status_2(engine, certs, capsys):
    assert cli.main(["serve-verify", "--model", engine.model_dir, "--tls-cert", str(certs / "server.crt")]) == 2
    assert capsys.readouterr().err == "error: tls_key: a certificate (tls_cert) needs its private key (tls_key)\n"


@pytest.mark.parametrize("given, message", [
    ({"tls_cert": "client.crt"}, "tls_key: a certificate"),
    ({"tls_ca": "nope.crt"}, "tls_ca: cannot read"),
    ({"token": "a b"}, "token: the API token must be printable"),
])
def test_client_argument_errors(certs, given, message):
    given = {k: (str(certs / v) if k.startswith("tls") else v) for k, v in given.items()}
    with pytest.raises(ValueError, match=message):
        Eagle3Client("127.0.0.1:1", **given)


# -- the exposure warning ----------------------------------------------------------------------

@pytest.mark.parametrize("listen, local", [
    ("127.0.0.1:50051", True), ("127.8.0.1:1", True), ("localhost:50051", True), ("[::1]:50051", True),
    ("unix:/tmp/eagle3/api.sock", True), ("0.0.0.0:50051", False), ("[::]:50051", False), (":50051", False),
    ("10.1.2.3:50051", False), ("api.example.com:443", False),
])
def test_what_counts_as_local(listen, local):
    assert is_local(listen) is local


def test_exposure_warning_names_what_is_missing():
    assert exposure_warning("127.0.0.1:50051", tls=False, token=False) is None
    assert exposure_warning("0.0.0.0:50051", tls=True, token=True) is None
    both = exposure_warning("0.0.0.0:50051", tls=False, token=False)
    assert "beyond loopback" in both and "without TLS" in both and "without an API token" in both
    assert "without TLS" not in exposure_warning("[::]:1", tls=True, token=False)
    assert "without an API token" not in exposure_warning(":1", tls=False, token=True)


def test_start_up_warns_when_listening_beyond_loopback_without_auth(engine, caplog):
    for listen, warned in (("0.0.0.0:0", True), ("127.0.0.1:0", False)):
        caplog.clear()
        public, _ = _public_server(VerifyServerConfig(engine, None, listen=listen, api_token=TOKEN))
        public.stop(None)  # never started: nothing was served on the wide address
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == warned and all("without TLS" in w and TOKEN not in w for w in warnings)


def test_readme_client_and_server_commands_parse():
    section = README.read_text().split("### Securing the public API", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line.split("eagle3 ", 1)[1].split("  #")[0] for line in block.splitlines() if "eagle3 " in line]
    assert len(commands) == 4
    for command in commands:
        cli.build_parser().parse_args(shlex.split(command))
