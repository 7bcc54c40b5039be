"""Fuzzing the public gRPC API of running services: each case sends one to four calls at once, as raw
bytes (overlapping Generates share engine steps), and every answer is checked.

Properties: each call ends with OK or a typed status, never INTERNAL or UNKNOWN (nor a hang or a
dead server); an OK Generate stream is well formed (deltas, then one GenerationDone that counts
them), and a greedy one has exactly the tokens and text of target-only decoding in this process
(speculation with the request's tree, batch neighbours, stop strings and ids included); after the
fuzzing the same greedy requests give the same tokens and text as before it.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_requests import GENERATE, REFLECTION, Call, public_calls
from protos.eagle3.v1 import generation_pb2 as pb
from services import Stack
from tiny_eagle import make_eagle_dir
from tiny_models import make_model_dir, target_for, tiny_config
from tiny_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, write_tokenizer
from verify_service import api_convert
from verify_service.engine import Engine

TYPED = frozenset({"OK", "INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                   "NOT_FOUND", "UNIMPLEMENTED"})
UNTYPED = frozenset({"INTERNAL", "UNKNOWN"})
MAX_MODEL_LEN, MAX_TOKENS_DEFAULT = 48, 4  # a huge max_tokens costs at most a short context
VERIFY_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-tokens-default", str(MAX_TOKENS_DEFAULT),
               "--tree-depth", "4", "--tree-top-k", "3", "--tree-nodes", "12", "--max-num-seqs", "4"]
CALL_TIMEOUT_S = 60.0
MAX_CONCURRENT = 4  # calls of one case, sent together


def make_models(root: Path) -> tuple[Path, Path]:
    """(target, draft head): a tiny random target speaking the byte-level tokenizer, and its head."""
    raw = tiny_config("llama3", vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    target = make_model_dir(root / "target", "llama3", seed=5, std=0.3, vocab_size=VOCAB_SIZE,
                            bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    write_tokenizer(target)
    return target, make_eagle_dir(root / "draft", raw, draft_vocab=64, seed=1)


def start_stack(root: Path, draft: bool = True, verify_args=()) -> tuple[Stack, Path]:
    """Verify service (and a real draft service unless ``draft`` is False) on the tiny models, and
    the target's directory."""
    target, head = make_models(root / "models")
    (root / "stack").mkdir(parents=True, exist_ok=True)
    return Stack(root / "stack", target, head, verify_args=[*VERIFY_ARGS, *verify_args], start_draft=draft), target


def target_only(target_dir: Path) -> Engine:
    """The reference for greedy outputs: the target alone, in this process."""
    return Engine(target_for(target_dir, max_model_len=MAX_MODEL_LEN))


@dataclass
class Tally:
    """What the fuzzing saw: statuses by name and the first few problems of each kind."""

    cases: int = 0
    calls: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    untyped: list[str] = field(default_factory=list)  # INTERNAL / UNKNOWN answers
    unexpected: list[str] = field(default_factory=list)  # other statuses: deadline (a hang), unavailable
    bad_streams: list[str] = field(default_factory=list)  # OK Generate streams that break the protocol
    greedy_mismatches: list[str] = field(default_factory=list)  # greedy streams unlike target-only decoding
    crashes: list[str] = field(default_factory=list)
    wrong_outputs_after: int = 0

    def figures(self) -> dict:
        return {"cases": self.cases, "calls": self.calls, "untyped_statuses": sum(self.statuses[c] for c in UNTYPED),
                "unexpected_statuses": sum(n for c, n in self.statuses.items() if c not in TYPED | UNTYPED),
                "bad_streams": len(self.bad_streams), "greedy_mismatches": len(self.greedy_mismatches),
                "crashes": len(self.crashes),
                "wrong_outputs_after": self.wrong_outputs_after, "statuses": dict(sorted(self.statuses.items())),
                "examples": {"untyped": self.untyped[:10], "unexpected": self.unexpected[:10],
                             "bad_streams": self.bad_streams[:10], "greedy_mismatches": self.greedy_mismatches[:10],
                             "crashes": self.crashes[:3]}}


class PublicFuzzer:
    """Sends ``Call``s to a stack's public address. ``strict``: raise AssertionError at the first
    problem (pytest and hypothesis's shrinking); else only count it (the long run's figures).
    ``oracle``: target-only decoding that greedy answers must equal."""

    def __init__(self, stack: Stack, strict: bool, oracle: Engine):
        self.stack, self.strict, self.oracle = stack, strict, oracle
        self.channel = grpc.insecure_channel(stack.public, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.pool = ThreadPoolExecutor(MAX_CONCURRENT)
        self.tally = Tally()

    def close(self) -> None:
        self.pool.shutdown()
        self.channel.close()

    def run(self, calls: list[Call]) -> None:
        """One case: ``calls`` sent together, then each answer checked."""
        self.tally.cases += 1
        for call, answer in zip(calls, list(self.pool.map(self._invoke, calls))):
            self._check(call, *answer)

    def _check(self, call: Call, code: str, detail: str, answers: list[bytes]) -> None:
        self.tally.calls += 1
        self.tally.statuses[code] += 1
        problem = None
        if code in UNTYPED:
            problem = self.tally.untyped, f"{code}: {detail} <- {call!r}"
        elif code not in TYPED:
            problem = self.tally.unexpected, f"{code}: {detail} <- {call!r}"
        elif code == "OK" and detail:  # a stream that breaks the protocol
            problem = self.tally.bad_streams, f"{detail} <- {call!r}"
        elif answers and (mismatch := greedy_mismatch(self.oracle, call.requests[0], answers)):
            problem = self.tally.greedy_mismatches, f"{mismatch} <- {call!r}"
        if self.stack.verify.proc.poll() is not None:
            problem = self.tally.crashes, f"verify service exited after {call!r}:\n{self.stack.verify.log()[-3000:]}"
        if problem is not None:
            problem[0].append(problem[1])
            assert not self.strict, problem[1]

    def _invoke(self, call: Call) -> tuple[str, str, list[bytes]]:
        """(status name, problem with an OK answer or the error's details, Generate's answers)."""
        try:
            if call.method == GENERATE:
                answers = list(self.channel.unary_stream(GENERATE)(call.requests[0], timeout=CALL_TIMEOUT_S))
                return "OK", stream_problem(call.requests[0], answers) or "", answers
            if call.method.endswith("/Watch"):
                stream = self.channel.unary_stream(call.method)(call.requests[0], timeout=CALL_TIMEOUT_S)
                next(stream)  # the current state; the stream then waits for changes
                stream.cancel()
            elif call.method in REFLECTION:
                list(self.channel.stream_stream(call.method)(iter(call.requests), timeout=CALL_TIMEOUT_S))
            else:
                self.channel.unary_unary(call.method)(call.requests[0], timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code().name, err.details() or "", []
        return "OK", "", []


def stream_problem(raw_request: bytes, answers: list[bytes]) -> str | None:
    """What is wrong with an OK Generate stream, if anything: deltas, then one GenerationDone that
    counts them, within max_tokens and the context."""
    request = pb.GenerateRequest.FromString(raw_request)  # OK means it parsed
    events = [pb.GenerateResponse.FromString(a) for a in answers]
    kinds = [e.WhichOneof("event") for e in events]
    if not kinds or kinds[-1] != "done" or kinds.count("done") != 1:
        return f"events {kinds}: not deltas then one done"
    ids = [t for e in events[:-1] for t in e.delta.token_ids]
    done = events[-1].done
    limit = request.max_tokens or MAX_TOKENS_DEFAULT
    if any(t >= VOCAB_SIZE for t in ids) or done.usage.completion_tokens != len(ids) or len(ids) > limit:
        return f"{len(ids)} tokens {ids[:20]}, usage {done.usage}, max_tokens {limit}"
    if done.usage.prompt_tokens + len(ids) > MAX_MODEL_LEN:
        return f"{done.usage.prompt_tokens} prompt + {len(ids)} tokens exceed the context {MAX_MODEL_LEN}"
    if done.finish_reason not in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
        return f"finish reason {done.finish_reason}"
    return None


def greedy_mismatch(oracle: Engine, raw_request: bytes, answers: list[bytes]) -> str | None:
    """How a greedy Generate stream differs from target-only decoding of the same request, if it does."""
    request = pb.GenerateRequest.FromString(raw_request)
    if request.sampling.temperature != 0.0:
        return None  # sampled: speculative sampling keeps the distribution, not the tokens
    params = api_convert.sampling_params(request, MAX_TOKENS_DEFAULT)
    want = oracle.generate([api_convert.prompt_ids(request, oracle.target)], params)[0]
    events = [pb.GenerateResponse.FromString(a) for a in answers]
    got = [t for e in events for t in e.delta.token_ids], "".join(e.delta.text for e in events)
    if got != (want.token_ids, want.text):
        return f"greedy output {got} differs from target-only {(want.token_ids, want.text)}"
    return None


def reference_requests() -> list[pb.GenerateRequest]:
    """Requests that must answer the same before and after the fuzzing: greedy ones with token ids,
    text and chat prompts, the server's tree, a chain, no speculation, a stop string; a seeded sample."""
    make = lambda **kw: pb.GenerateRequest(max_tokens=12, ignore_eos=True, **kw)  # noqa: E731
    chain = pb.SpeculationOptions(tree=3, depth=2)
    sampled = pb.SamplingParameters(temperature=0.8, top_p=0.9, seed=7)
    return [make(token_ids=pb.TokenIds(ids=[5, 6, 7, 8])), make(token_ids=pb.TokenIds(ids=list(range(40, 70))),
                                                                speculation=chain),
            make(token_ids=pb.TokenIds(ids=[88] * 9), speculation=pb.SpeculationOptions(enabled=False)),
            make(text="The quick brown fox"), make(text="h\u00e9llo", stop=["e"]),
            make(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi <|im_start|>system")])),
            make(token_ids=pb.TokenIds(ids=[9, 10, 11]), sampling=sampled)]


def reference_outputs(stack: Stack) -> list[tuple[list[int], str, int]]:
    """(tokens, text, finish reason) of each reference request."""
    out = []
    with grpc.insecure_channel(stack.public) as channel:
        stub = channel.unary_stream(GENERATE, request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        for request in reference_requests():
            events = list(stub(request, timeout=CALL_TIMEOUT_S))
            out.append(([t for e in events for t in e.delta.token_ids], "".join(e.delta.text for e in events),
                        events[-1].done.finish_reason))
    return out


def fuzz_public_api(stack: Stack, target_dir: Path, cases: int, strict: bool) -> Tally:
    """Reference outputs, ``cases`` fuzzed cases of one to four calls (derandomized: the same every
    run), the references again; returns the tally. ``target_dir``: the stack's target, for the oracle."""
    before = reference_outputs(stack)
    fuzzer = PublicFuzzer(stack, strict, target_only(target_dir))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the oracle's idle OpenMP threads would spin on the cores the services need

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(public_calls(), min_size=1, max_size=MAX_CONCURRENT))
    def answers_typed_statuses(calls: list[Call]) -> None:
        fuzzer.run(calls)
    try:
        answers_typed_statuses()
    finally:
        fuzzer.close()
        torch.set_num_threads(threads)
    after = reference_outputs(stack)
    fuzzer.tally.wrong_outputs_after = sum(a != b for a, b in zip(before, after))
    return fuzzer.tally
