"""Issue 15, item 3: multimodal prompts. A tiny LLaVA-style model directory is built locally
(`build_mm_model.py`: config, tokenizer, image processor, chat template; no weights, nothing
downloaded) and served by the real `vllm serve` (render on, `--enable-scale-out`; the forward
pass replaced by the conformance executor): vLLM's own processor turns each image into
placeholder tokens and hashes the blocks they fall in with the image's hash.

The filter sends a chat with an image to the replica's `/v1/chat/completions/render` (the
profile says `/tokenize`), hashes its blocks with the media items of the answer's features,
and credits the replica with exactly what vLLM then reports as cached:

* a follow-up with the same image: every block of the first turn;
* the same text with another image: only the blocks before the image.

With the media items left out of the filter's hashing, the follow-up failed: the filter
credited 15 blocks (those before the image), vLLM served 400 cached tokens (25 blocks).

This module starts its own replica, agent and Envoy (the session fleet is not needed)."""

import random
import subprocess

import pytest

from conftest import (AGENT, BLOCK, HERE, MODEL_DIR, VLLM_VENV, Fleet, Replica, agent_toml, decision, wait_healthy,
                      wait_until, words)
from llmgw_testkit import http_json
from llmgw_testkit.vllm_serve import vllm_env

MM_MODEL = "tiny-vision"


class VisionReplica(Replica):
    def __init__(self, *a, model_dir, **kw):
        super().__init__(*a, **kw)
        self.model_dir = model_dir

    def serve_args(self, with_events: bool = True) -> list[str]:
        args = super().serve_args(with_events)
        args[args.index(str(MODEL_DIR))] = str(self.model_dir)
        return args + ["--enable-scale-out"]


def png(rgb: tuple[int, int, int]) -> str:
    """A 40x40 one-colour PNG as a data URL (PIL, from vLLM's environment)."""
    code = ("import base64, io, sys; from PIL import Image; b = io.BytesIO(); "
            f"Image.new('RGB', (40, 40), {rgb!r}).save(b, 'PNG'); "
            "sys.stdout.write(base64.b64encode(b.getvalue()).decode())")
    out = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    return "data:image/png;base64," + out.stdout


@pytest.fixture(scope="module")
def vision_fleet(procs, logdir):
    d = logdir / "vision"
    d.mkdir(exist_ok=True)
    model_dir = MODEL_DIR.parent / "llmgw-vision-model"
    subprocess.run([str(VLLM_VENV / "bin" / "python"), str(HERE / "build_mm_model.py"), str(MODEL_DIR),
                    str(model_dir)], check=True, timeout=300, env=vllm_env(None))
    f = Fleet(procs, d)
    r = VisionReplica("vis", "bind", blocks=128, model=MM_MODEL, model_dir=model_dir)
    f.replicas = {r.name: r}
    (d / "agent.toml").write_text(agent_toml([r], f.feed, f.http))
    f.agent_proc = procs.start([AGENT, "run", "--config", d / "agent.toml", "--log-level", "info"], "agent-vision")
    wait_until(lambda: http_json(f"{f.agent.base}/healthz", timeout=2)[0] in (200, 503), 30, "the agent's HTTP")
    f.start_replica(r)
    wait_healthy(r, r.proc)
    f.agent.wait_up(r.name)
    f.start_envoy("envoy-vision")
    yield f, r


def chat(f: Fleet, r: Replica | None, messages: list[dict]):
    url = (f"http://127.0.0.1:{f.envoy.listen}" if r is None else r.url) + "/v1/chat/completions"
    status, headers, reply = http_json(url, {"model": MM_MODEL, "messages": messages, "max_tokens": 2}, timeout=120)
    assert status == 200, (status, reply)
    return headers, reply


def render(r: Replica, messages: list[dict]) -> dict:
    status, _, reply = http_json(f"{r.url}/v1/chat/completions/render", {"model": MM_MODEL, "messages": messages},
                                 timeout=120)
    assert status == 200, reply
    return reply[0] if isinstance(reply, list) else reply


def test_image_prompts_are_credited_as_vllm_hashes_them(vision_fleet):
    f, r = vision_fleet
    rng = random.Random("vision")
    red, blue = png((200, 30, 30)), png((30, 30, 200))
    before_image = words(rng, 45, "va")

    def turn(image: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": before_image},
                                             {"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": words(random.Random("after"), 30, "vb")}]}]

    first = turn(red)
    rendered = render(r, first)
    (place,) = rendered["features"]["mm_placeholders"]["image"]
    full_blocks = len(rendered["token_ids"]) // BLOCK
    image_block = place["offset"] // BLOCK
    assert 2 <= image_block < full_blocks - 2, (place, full_blocks)
    chat(f, r, first)
    wait_until(lambda: f.agent.replica(r.name)["blocks"] >= full_blocks, 30, "the agent to mirror the first turn")
    f.wait_index_converged()
    # vLLM published the image's blocks with its hash and offset (the agent verified them).
    assert f.agent.replica(r.name)["parity"]["mismatched"] == 0

    # A follow-up with the same image: every block of the first turn.
    followup = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": words(rng, 8, "vc")}]
    headers, reply = chat(f, None, followup)
    outcome, _, matched, _ = decision(headers)
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert outcome == "exact" and matched * BLOCK == cached and matched >= full_blocks - 1, (
        headers.get("x-llmgw-decision"), cached)

    # The same words around another image: only the blocks before the image are shared.
    headers, reply = chat(f, None, turn(blue))
    outcome, _, matched, _ = decision(headers)
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == BLOCK * image_block, (cached, image_block)
    assert matched * BLOCK == cached, f"filter credited {matched} blocks, vLLM served {cached} cached tokens"
