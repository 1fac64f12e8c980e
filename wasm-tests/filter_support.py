"""Helpers for the filter's end-to-end tests: the stub vLLM replicas (a tokenizer of one token
per character, the OpenAI endpoints answering with their port). vLLM's block hash, the feed stub
and the Envoy bootstrap are in the test kit (llmgw_testkit.vllm_hash, .feed, .envoy)."""

from __future__ import annotations

import json
import threading
import time

from llmgw_testkit.stub import StubHandler, StubServer


# ---------------------------------------------------------------------------------------------
# The stub tokenizer every stub replica runs: one token per character (BOS = 1 when special
# tokens are added), chat messages rendered as "<role>content" plus "<assistant>" when a
# generation prompt is requested.


def tokenize_text(text: str, add_special_tokens: bool) -> list[int]:
    return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def render_chat(messages, add_generation_prompt: bool = True) -> str:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(f"<{m.get('role', '')}>{content or ''}")
    if add_generation_prompt:
        out.append("<assistant>")
    return "".join(out)


def completion_tokens(prompt: str) -> list[int]:
    return tokenize_text(prompt, True)


def chat_tokens(messages) -> list[int]:
    return tokenize_text(render_chat(messages, True), False)


# ---------------------------------------------------------------------------------------------
# Stub vLLM replica.


class Replica:
    """An HTTP server on 127.0.0.1 answering /tokenize and the OpenAI endpoints with its port."""

    def __init__(self, port: int, tokenize_status: int = 200):
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.tokenize_status = tokenize_status
        self.tokenize_delay = 0.0
        # Tokenizer calls whose body holds this marker wait this long (a media URL that hangs).
        self.slow_marker: bytes | None = None
        self.slow_delay = 0.0
        # What the generation endpoints answer (e.g. 503: an engine that died behind its server).
        self.generate_status = 200
        # Generation requests wait until this is set (cleared: they hang, like a busy engine).
        self.released = threading.Event()
        self.released.set()
        # Seconds before a generation endpoint answers (a replica slow to its first token).
        self.generate_delay = 0.0
        self.tokenize_calls: list[dict] = []
        self.requests: list[dict] = []
        replica = self

        class Handler(StubHandler):
            def do_GET(self):
                self.reply(200, json.dumps({"port": replica.port, "path": self.path}).encode())

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n)
                if replica.slow_marker and replica.slow_marker in raw and (
                        self.path == "/tokenize" or self.path.endswith("/render")):
                    time.sleep(replica.slow_delay)
                if self.path == "/tokenize":
                    try:
                        req = json.loads(raw)
                    except ValueError:
                        req = {"unparseable": True}
                    replica.tokenize_calls.append(req)
                    if replica.tokenize_delay:
                        time.sleep(replica.tokenize_delay)
                    if replica.tokenize_status != 200:
                        return self.reply(replica.tokenize_status, b'{"error":"tokenizer down"}')
                    if "messages" in req:
                        text = render_chat(req["messages"], req.get("add_generation_prompt", True))
                        toks = tokenize_text(text, req.get("add_special_tokens", False))
                    else:
                        toks = tokenize_text(req.get("prompt", ""), req.get("add_special_tokens", True))
                    return self.reply(200, json.dumps(
                        {"count": len(toks), "max_model_len": 1 << 20, "tokens": toks, "token_strs": None}).encode())
                if self.path.endswith("/render"):
                    # vLLM's render endpoints take the generation body and return token_ids.
                    req = json.loads(raw)
                    replica.tokenize_calls.append({"render": self.path, **req})
                    if replica.tokenize_status != 200:
                        return self.reply(replica.tokenize_status, b'{"error":"render down"}')
                    if "messages" in req:
                        toks = chat_tokens(req["messages"])
                    else:
                        toks = completion_tokens(req.get("prompt", ""))
                    return self.reply(200, json.dumps({"request_id": "r", "token_ids": toks}).encode())
                replica.requests.append({"path": self.path, "headers": dict(self.headers.items()), "size": len(raw)})
                replica.released.wait(60)
                if replica.generate_delay:
                    time.sleep(replica.generate_delay)
                if replica.generate_status != 200:
                    return self.reply(replica.generate_status, b'{"error":"engine dead"}')
                stream = False
                try:
                    stream = bool(json.loads(raw).get("stream"))
                except (ValueError, AttributeError):
                    pass
                if stream:
                    chunk = json.dumps({"port": replica.port, "choices": [{"text": "ok"}]})
                    return self.reply(200, f"data: {chunk}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")
                self.reply(200, json.dumps({"port": replica.port, "path": self.path, "bytes": len(raw)}).encode())

        self.stub = StubServer(port, Handler)

    def stop(self):
        self.stub.stop()
