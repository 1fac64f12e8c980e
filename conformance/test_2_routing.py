"""Issue 6, item 2: after a prompt is served by replica B, a follow-up sharing its prefix is routed
to B through Envoy with outcome `exact`, and the number of blocks the filter matched is what B
reports as cached (usage.prompt_tokens_details.cached_tokens) for that follow-up."""

import random

import llmgw_testkit as kit
from conftest import MODEL, agent_hash, decision, sse_events, stream, wait_until, words


def test_completion_followup_routed_exact_to_the_replica_holding_its_prefix(fleet):
    b = fleet.replicas["b"]
    rng = random.Random("route-completion")
    prompt = words(rng, 50, "rc")
    fleet.completion(b, prompt, max_tokens=2)
    keys = agent_hash(fleet.tokenize(b, {"prompt": prompt}))
    fleet.wait_mirrored(b, keys)
    before = fleet.envoy.exact_decisions()
    headers, reply = fleet.completion(None, prompt + " " + words(rng, 15, "rd"), max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", "b"), headers.get("x-llmgw-decision")
    assert matched == len(keys) and cached == 16 * len(keys), (matched, cached, len(keys))
    wait_until(lambda: fleet.envoy.exact_decisions() == before + 1, 10,
               'llmgw_prefix_decisions_total{outcome="exact"} to count the decision')


def test_chat_followup_routed_exact_to_the_replica_holding_its_prefix(fleet):
    b = fleet.replicas["b"]
    rng = random.Random("route-chat")
    first = [{"role": "system", "content": words(rng, 40, "cs")}, {"role": "user", "content": words(rng, 15, "cu")}]
    _, reply = fleet.chat(b, first, max_tokens=3)
    keys = agent_hash(fleet.tokenize(b, {"messages": first}))
    fleet.wait_mirrored(b, keys)
    followup = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                        {"role": "user", "content": words(rng, 10, "cq")}]
    before = fleet.envoy.exact_decisions()
    headers, reply = fleet.chat(None, followup, max_tokens=2)
    outcome, served, matched, cached = fleet.routed(headers, reply)
    assert (outcome, served.name) == ("exact", "b"), headers.get("x-llmgw-decision")
    # The follow-up shares every full block of the first prompt (the generation prompt's tail
    # block may differ once the assistant turn is appended).
    assert matched >= len(keys) - 1 and matched * 16 == cached, (matched, cached, len(keys))
    wait_until(lambda: fleet.envoy.exact_decisions() == before + 1, 10,
               'llmgw_prefix_decisions_total{outcome="exact"} to count the decision')


def routed_at_once_reading_its_ids(fleet, path: str, body: dict) -> bytes:
    """`body` through Envoy: routed at once on an earlier prompt, its prompt's ids read from
    vLLM's answer, and the client's stream equal to the one the replica that served it sends
    unasked (field for field, id and time aside). The client's stream."""
    read = fleet.envoy.metric("llmgw_answer_tokens_total", 'result="read"')
    headers, through = stream(f"http://127.0.0.1:{fleet.envoy.listen}{path}", body)
    assert "scored_on=earlier_turn" in headers.get(kit.DECISION_HEADER, ""), headers
    served = fleet.by_address(decision(headers)[1])
    wait_until(lambda: fleet.envoy.metric("llmgw_answer_tokens_total", 'result="read"') == read + 1, 10,
               'llmgw_answer_tokens_total{result="read"} to count the ids read')
    _, direct = stream(f"{served.url}{path}", {**body, "model": served.model})
    assert b"token_ids\":[" not in through, through
    assert sse_events(through) == sse_events(direct), (through, direct)
    return through


def test_a_streamed_next_turn_reads_its_prompt_ids_from_vllms_answer_and_the_client_gets_vllms_own_stream(fleet):
    """A turn routed at once on the turn before asks vLLM for its prompt's token ids
    (`return_token_ids`) instead of calling /tokenize; the client gets the stream vLLM sends
    unasked, and the ids are kept: the turn after it goes at once too."""
    rng = random.Random("answer-ids")
    first = [{"role": "system", "content": words(rng, 40, "as")}, {"role": "user", "content": words(rng, 12, "au")}]
    headers, reply = fleet.chat(None, first, max_tokens=3)
    fleet.routed(headers, reply)
    second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": words(rng, 10, "aq")}]
    # One output token: vLLM's chunking of later tokens depends on timing, so only then are two
    # streams of the same request comparable event by event.
    body = {"model": MODEL, "messages": second, "max_tokens": 1, "stream": True}
    calls = tokenize_calls(fleet)
    through = routed_at_once_reading_its_ids(fleet, "/v1/chat/completions", body)
    # The ids were kept: the next turn goes at once as well.
    reply_text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(through)
                         if isinstance(e, dict) and e.get("choices"))
    third = second + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": words(rng, 8, "ar")}]
    headers, _ = stream(f"http://127.0.0.1:{fleet.envoy.listen}/v1/chat/completions", {**body, "messages": third})
    assert "scored_on=earlier_turn" in headers.get(kit.DECISION_HEADER, ""), headers
    assert tokenize_calls(fleet) == calls, "no tokenizer call for either turn"


def tokenize_calls(fleet) -> float:
    """/tokenize requests the replicas answered (vLLM's own HTTP metrics)."""
    return sum(kit.prom_sum(kit.get_text(f"{r.url}/metrics"), "http_requests_total", 'handler="/tokenize"')
               for r in fleet.replicas.values())


def test_a_streamed_text_prompt_extending_an_earlier_one_reads_its_ids_from_vllms_answer(fleet):
    """The same for the completions API: a text prompt that begins with an earlier one goes at
    once, asks vLLM for its ids, and the client gets vLLM's own stream."""
    rng = random.Random("answer-ids-text")
    first = words(rng, 60, "ct")
    headers, reply = fleet.completion(None, first, max_tokens=2)
    fleet.routed(headers, reply)
    body = {"model": MODEL, "prompt": first + " " + words(rng, 12, "cn"), "max_tokens": 1, "stream": True}
    calls = tokenize_calls(fleet)
    routed_at_once_reading_its_ids(fleet, "/v1/completions", body)
    assert tokenize_calls(fleet) == calls, "no tokenizer call for it"
