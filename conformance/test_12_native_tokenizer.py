"""The agent's native tokenizer (`[tokenizer]`) against the real `vllm serve`: the filter's
profile names the agent's tokenizer listener as `tokenizer_address`, so every request's
`/tokenize` is answered by the agent from the model's own files, and every answer among the
first `verify_first` is checked against the replica's `/tokenize`.

* Parity: a corpus of completions and chats (system prompts, several turns, list-of-parts
  content, unicode, a long prompt, `continue_final_message`, tools the template ignores) routes
  through Envoy as it does with the replica's tokenizer (outcome `exact`, the blocks credited are
  the blocks vLLM reports as cached), every one was answered natively and checked with no
  difference, and the agent's `/tokenize` equals vLLM's for each body.
* The proof catches a difference: vLLM serves the model with a chat template that differs from
  the agent's model directory by one space (`--chat-template`). The first chat's check finds the
  difference, the model is switched off (`llmgw_native_tokenizer_up` 0, both token lists in the
  agent's log), and from then on the agent declines (421) and the filter asks the replica: every
  request still gets its answer, routed by the replica's tokens.

This module starts its own two replicas, agents and Envoys (the session fleet is not needed):
`-k native_tokenizer`."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import llmgw_testkit as kit
from conftest import (AGENT, BLOCK, ENVOY, MODEL, MODEL_DIR, WASM, Envoy, Fleet, Replica, agent_hash, wait_healthy,
                      wait_until, words)
from llmgw_testkit import free_port, http_json

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# The fields of a request that vLLM's /tokenize takes (the rest are generation parameters).
TOKENIZE_FIELDS = ("prompt", "messages", "add_generation_prompt", "continue_final_message", "tools",
                   "add_special_tokens")
VOCAB_WORDS = ["the", "cache", "block", "prefix", "replica", "router", "token", "prompt", "engine", "event"]
DIFFERS = "native tokenizer differs from the replica's"


class TemplateReplica(Replica):
    """A replica started with its own `--chat-template` (None: the model's)."""

    def __init__(self, *a, chat_template=None, **kw):
        super().__init__(*a, **kw)
        self.chat_template = chat_template

    def serve_args(self, with_events: bool = True) -> list[str]:
        args = super().serve_args(with_events)
        return args + ["--chat-template", str(self.chat_template)] if self.chat_template else args


class NativeFleet(Fleet):
    """One replica behind an agent serving `/tokenize` natively and an Envoy whose profile
    sends the filter's tokenizer calls there."""

    def __init__(self, procs, logdir, name: str):
        super().__init__(procs, logdir)
        self.name = name
        self.tokenizer = free_port()

    def start_agent(self) -> None:
        r = next(iter(self.replicas.values()))
        text = kit.agent_config(
            self.feed, self.http, [r.agent_entry()],
            hash={"algo": "sha256_cbor", "seed": "0", "block_size": BLOCK}, parity={"min_verified": 1},
            load={"down_after_ms": 300000}, zmq={"down_after_disconnect_ms": 300000},
            tokenizer={"listen": f"127.0.0.1:{self.tokenizer}",
                       "models": [{"names": [MODEL], "dir": str(MODEL_DIR)}]})
        (self.logdir / f"agent-{self.name}.toml").write_text(text)
        self.agent_proc = self.procs.start(
            [AGENT, "run", "--config", self.logdir / f"agent-{self.name}.toml", "--log-level", "info"],
            f"agent-{self.name}")
        self.agent.log_path = self.agent_proc.log_path

        def listening():
            if self.agent_proc.poll() is not None:
                raise RuntimeError(f"agent-{self.name} exited with {self.agent_proc.returncode}:\n{self.agent.log()}")
            return http_json(f"http://127.0.0.1:{self.tokenizer}/health", timeout=2)[0] == 200
        wait_until(listening, 30, f"agent-{self.name}'s tokenizer listener")

    def start_envoy(self, name: str = "envoy") -> Envoy:
        listen, admin = free_port(), free_port()
        # Every request is routed on its own tokens, the native tokenizer's (the subject here):
        # a chat routed at once on what it shares with an earlier one (a sibling with the same
        # system prompt, a next turn) is credited with that share only, by design.
        cfg = kit.filter_config({"name": "conformance", "block_size": BLOCK, "tokenizer_timeout_ms": 5000,
                                 "tokenizer_address": f"127.0.0.1:{self.tokenizer}"},
                                destination_header="x-gateway-destination-endpoint", explain_header=True,
                                route_on_shared_prefixes=False, route_on_earlier_turns=False)
        (self.logdir / f"{name}.yaml").write_text(kit.shipped_config(WASM, listen, admin, self.feed, cfg))
        self.envoy_proc = kit.start_envoy(self.procs, ENVOY, self.logdir / f"{name}.yaml", name)
        self.envoy = Envoy(listen, admin)
        self.envoy.wait_ready(60, proc=self.envoy_proc)
        self.envoy.wait_feed(60)
        return self.envoy

    # ------------------------------------------------------------------------------------------

    def native(self, name: str) -> int:
        """The agent's llmgw_native_tokenizer_{name}{model="tiny"}."""
        m = re.search(rf'^llmgw_native_tokenizer_{name}{{model="{MODEL}"}} (\d+)$', self.agent.metrics(), re.M)
        assert m, f"llmgw_native_tokenizer_{name} not on the agent's /metrics"
        return int(m.group(1))

    def native_tokenize(self, body: dict):
        return http_json(f"http://127.0.0.1:{self.tokenizer}/tokenize", tokenize_body(body), timeout=30)

    def replica_tokens(self, r: Replica, body: dict) -> list[int]:
        return self.tokenize(r, tokenize_body(body))

    def send(self, r: Replica | None, path: str, body: dict):
        """`body` sent to replica r (None: through Envoy); every answer must be a 200."""
        url = (f"http://127.0.0.1:{self.envoy.listen}" if r is None else r.url) + path
        status, headers, reply = http_json(url, {"model": MODEL, **body}, timeout=60)
        assert status == 200, (path, body, status, reply)
        return headers, reply


def tokenize_body(body: dict) -> dict:
    return {"model": MODEL, **{k: v for k, v in body.items() if k in TOKENIZE_FIELDS}}


def corpus() -> list[tuple[str, str, dict]]:
    """(label, path, body) of completions and chats; each prompt's token count is no multiple
    of the block size, so an identical request can be credited with every full block."""
    rng = random.Random("native-tokenizer")
    system = {"role": "system", "content": "You answer briefly. " + words(rng, 30, "sy")}
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    long_text = " ".join(rng.choice(VOCAB_WORDS) for _ in range(380))
    turn1 = [system, {"role": "user", "content": words(rng, 20, "q1")}]
    return [
        ("completion", COMPLETIONS, {"prompt": words(rng, 45, "pc"), "max_tokens": 2}),
        ("completion unicode", COMPLETIONS,
         {"prompt": "naïve café — 日本語のテキスト 🙂 Ωmega ß∂ƒ " + words(rng, 30, "pu"), "max_tokens": 2}),
        ("completion long", COMPLETIONS, {"prompt": long_text, "max_tokens": 2}),
        ("chat system", CHAT, {"messages": turn1, "max_tokens": 2}),
        ("chat multi-turn", CHAT, {"messages": turn1 + [
            {"role": "assistant", "content": words(rng, 12, "a1")},
            {"role": "user", "content": words(rng, 15, "q2")},
            {"role": "assistant", "content": words(rng, 9, "a2")},
            {"role": "user", "content": words(rng, 11, "q3")}], "max_tokens": 2}),
        ("chat parts", CHAT, {"messages": [system, {"role": "user", "content": [
            {"type": "text", "text": words(rng, 20, "pa")}, {"type": "text", "text": words(rng, 17, "pb")}]}],
            "max_tokens": 2}),
        ("chat unicode", CHAT, {"messages": [
            {"role": "system", "content": "Réponds en français, s'il te plaît. ✓"},
            {"role": "user", "content": "Grüße aus Zürich — 東京 🚄 " + words(rng, 25, "uc")}], "max_tokens": 2}),
        ("chat continue_final_message", CHAT, {"messages": [
            {"role": "user", "content": words(rng, 30, "cf")},
            {"role": "assistant", "content": "The answer starts " + words(rng, 6, "cp")}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}),
        ("chat tools", CHAT, {"messages": [system, {"role": "user", "content": words(rng, 22, "tl")}],
                              "tools": tools, "tool_choice": "none", "max_tokens": 2}),
        ("chat no generation prompt", CHAT, {"messages": [{"role": "user", "content": words(rng, 33, "ng")}],
                                             "add_generation_prompt": False, "max_tokens": 2}),
    ]


def start_fleets(procs, logdir, fleets: list[NativeFleet]) -> None:
    for f in fleets:
        for r in f.replicas.values():
            f.start_replica(r)
    with ThreadPoolExecutor(len(fleets)) as ex:
        list(ex.map(lambda f: [wait_healthy(r, r.proc) for r in f.replicas.values()], fleets))
    for f in fleets:
        f.start_agent()
        for r in f.replicas.values():
            f.agent.wait_up(r.name)
        f.start_envoy(f"envoy-{f.name}")


@pytest.fixture(scope="module")
def native_fleets(procs, logdir):
    d = logdir / "native-tokenizer"
    d.mkdir(exist_ok=True)
    # The replica of the proof serves the model with its template changed by one space.
    template = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    changed = template.replace("<|end|>\n", "<|end|> \n")
    assert changed != template
    (d / "changed-template.jinja").write_text(changed)
    same = NativeFleet(procs, d, "same")
    same.replicas = {"n": Replica("n", "connect", blocks=256)}
    other = NativeFleet(procs, d, "other")
    other.replicas = {"t": TemplateReplica("t", "connect", blocks=128, chat_template=d / "changed-template.jinja")}
    start_fleets(procs, d, [same, other])
    yield same, other


def wait_checked(f: NativeFleet, answered: int) -> None:
    """Until the agent counts `answered` native answers and as many checks made."""
    wait_until(lambda: f.native("answered_total") == answered and f.native("verified_total") == answered, 30,
               f"agent-{f.name} to have checked its {answered} answers against the replica")


def test_native_tokenizer_parity_through_the_gateway(native_fleets):
    f, _ = native_fleets
    n = f.replicas["n"]
    assert f.native("up") == 1
    answered = f.native("answered_total")
    assert answered == 0
    for label, path, body in corpus():
        # The agent's /tokenize and vLLM's, directly.
        status, _, native = f.native_tokenize(body)
        assert status == 200, (label, status, native)
        tokens = f.replica_tokens(n, body)
        assert native["tokens"] == tokens, (label, native["tokens"], tokens)
        assert len(tokens) % BLOCK and len(tokens) < 500, (label, len(tokens))
        answered += 1
        # vLLM serves it once (its KV events reach the agent and the filter), then the same
        # request through Envoy is routed to n with every full block credited.
        f.send(n, path, body)
        keys = agent_hash(tokens)
        f.wait_mirrored(n, keys)
        headers, reply = f.send(None, path, body)
        answered += 1
        outcome, served, matched, cached = f.routed(headers, reply)
        assert (outcome, served.name, matched) == ("exact", "n", len(keys)), (label, headers.get(kit.DECISION_HEADER))
        assert cached == len(keys) * BLOCK, (label, cached, len(keys))
        # The filter's tokenizer call was answered natively (not declined) and checked.
        wait_checked(f, answered)
    assert answered <= 200  # every answer fell within verify_first
    assert f.native("mismatches_total") == 0
    assert (f.native("declined_total"), f.native("disabled_total")) == (0, 0)
    assert (f.native("verify_errors_total"), f.native("verify_skipped_total")) == (0, 0)
    assert f.native("up") == 1
    assert f.envoy.metric("llmgw_tokenizer_failures_total") == 0
    assert DIFFERS not in f.agent.log()


def test_native_tokenizer_proof_catches_a_different_template(native_fleets):
    _, f = native_fleets
    t = f.replicas["t"]
    rng = random.Random("native-proof")
    # A completion does not go through the template: answered natively and checked, no difference.
    f.send(None, COMPLETIONS, {"prompt": words(rng, 40, "pp"), "max_tokens": 2})
    wait_checked(f, 1)
    assert (f.native("mismatches_total"), f.native("up")) == (0, 1)
    # The first chat: the agent renders the model directory's template, vLLM its own.
    first = {"messages": [{"role": "system", "content": words(rng, 20, "ps")},
                          {"role": "user", "content": words(rng, 20, "pq")}], "max_tokens": 2}
    f.send(None, CHAT, first)
    wait_until(lambda: f.native("up") == 0, 30, "the check to switch the native tokenizer off")
    assert f.native("mismatches_total") == 1 and f.native("verified_total") == 2
    # The agent's log says so once, with both token lists.
    lines = [ln for ln in f.agent.log().splitlines() if DIFFERS in ln]
    assert len(lines) == 1, lines
    native = json.loads(re.search(r"native=(\[[\d, ]*\])", lines[0]).group(1))
    replica = json.loads(re.search(r"replica_tokens=(\[[\d, ]*\])", lines[0]).group(1))
    assert replica == f.replica_tokens(t, first) and native != replica, lines[0]
    # From now on the agent declines, and the filter asks the replica: same answers, no 5xx.
    status, _, reply = f.native_tokenize(first)
    assert status == 421, (status, reply)
    declined = f.envoy.metric("llmgw_tokenizer_failures_total", 'reason="declined"')
    disabled = f.native("disabled_total")
    for i in range(3):
        chat = {"messages": [{"role": "user", "content": words(rng, 25, f"pd{i}")}], "max_tokens": 2}
        f.send(None, CHAT, chat)
    f.send(None, COMPLETIONS, {"prompt": words(rng, 30, "pe"), "max_tokens": 2})
    wait_until(lambda: f.envoy.metric("llmgw_tokenizer_failures_total", 'reason="declined"') == declined + 4, 10,
               'llmgw_tokenizer_failures_total{reason="declined"} to count the declined calls')
    assert f.native("disabled_total") == disabled + 4
    assert f.native("answered_total") == 2 and f.native("mismatches_total") == 1
    # Routed by the replica's tokens: a chat vLLM served before is credited with every full block.
    warm = {"messages": [{"role": "system", "content": words(rng, 30, "pw")},
                         {"role": "user", "content": words(rng, 21, "px")}], "max_tokens": 2}
    f.send(t, CHAT, warm)
    tokens = f.replica_tokens(t, warm)
    assert len(tokens) % BLOCK, len(tokens)
    keys = agent_hash(tokens)
    f.wait_mirrored(t, keys)
    headers, reply = f.send(None, CHAT, warm)
    outcome, served, matched, cached = f.routed(headers, reply)
    assert (outcome, served.name, matched) == ("exact", "t", len(keys)), headers.get(kit.DECISION_HEADER)
    assert cached == len(keys) * BLOCK, (cached, len(keys))
    assert f.envoy.metric("llmgw_tokenizer_failures_total", 'reason="declined"') == declined + 5
