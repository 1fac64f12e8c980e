"""The workload generator of the demo and the benchmarks: seeded chat traffic as "sessions",
each a list of chat bodies one client sends one after another (a single-request session is one
request of an open pool; a longer one is a conversation, each turn extending the last). The same
seed gives the same traffic, so every router of a run is measured on identical requests.

Two shapes, described by their parameters:
- SharedPrefix: groups of requests sharing long system prompts (evenly, or with Zipf
  popularity), optionally mixed with as many unique prompts;
- Conversations: multi-turn chats, each with a fixed system prompt or one of several shared ones
  (Zipf popularity).

Either shape may spread its traffic over `tenants`: each request (each conversation) then carries
one tenant's `cache_salt`, which vLLM mixes into the prompt's first block. Tenants send the same
text but share no KV blocks, so a router that matches text (an approximate prefix tree) sends a
tenant where another tenant's copy of the prompt is cached and misses, where one that follows
the engines' KV events does not: the workload where exactness matters."""

from __future__ import annotations

import random
from dataclasses import dataclass

# The system prompt of a conversation with no shared one.
ASSISTANT_SYSTEM = "You are a helpful assistant."


def words(rng: random.Random, tag: str, n: int, vocab: int = 100000) -> str:
    """n words `tag<k>`, k drawn below `vocab`."""
    return " ".join(f"{tag}{rng.randrange(vocab)}" for _ in range(n))


def chat_body(model: str, messages: list[dict], max_tokens: int, salt: str | None = None) -> dict:
    """A streaming chat-completion body (with `cache_salt` when given)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def tenant_salt(rng: random.Random, tenants: int) -> str | None:
    """One of `tenants` tenants' cache salts, or None without tenants (drawing nothing, so a
    shape without tenants gives the traffic it always gave)."""
    return f"tenant-{rng.randrange(tenants)}" if tenants > 0 else None


def as_completion(body: dict) -> dict:
    """The completions-API twin of a chat body: the messages written out as one text prompt
    (`role: content` lines), the other fields kept."""
    prompt = "".join(f"{m['role']}: {m['content']}\n" for m in body["messages"]) + "assistant:"
    return {**{k: v for k, v in body.items() if k != "messages"}, "prompt": prompt}


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity 1 / rank^exponent for ranks 1..n."""
    return [1.0 / (g + 1) ** exponent for g in range(n)]


@dataclass(frozen=True)
class SharedPrefix:
    """Single requests of `groups` system prompts of `system_words` words, each with a question
    of `question_words` (low, high) words: `per_group` requests per group, or with `zipf` set,
    `requests` requests drawn by Zipf popularity. With `unique_words`, as many requests again of
    one unique user prompt each. With `tenants`, each request carries one of that many tenants'
    cache salts. Shuffled; with `stagger` the groups begin one after another instead: group g's
    requests are spread at random over [g × stagger, g × stagger + 1) of the run, so that new
    system prompts keep arriving while earlier ones are still asked (at 0.25, about four at a
    time)."""

    groups: int
    system_words: int
    question_words: tuple[int, int] = (40, 120)
    per_group: int = 16
    zipf: float | None = None
    requests: int = 256
    unique_words: tuple[int, int] | None = None
    vocab: int = 100000
    tenants: int = 0
    stagger: float | None = None

    def __post_init__(self) -> None:
        # Refused when the shape is written, before any prompt is made.
        if self.stagger is not None and self.unique_words is not None:
            raise ValueError("SharedPrefix: stagger places groups' requests; unique prompts belong to no group")

    def sessions(self, rng: random.Random, model: str, max_tokens: int, n) -> list[list[dict]]:
        systems = [words(rng, f"g{g}s", self.system_words, self.vocab) for g in range(self.groups)]
        if self.zipf is not None:
            picks = rng.choices(range(self.groups), zipf_weights(self.groups, self.zipf), k=n(self.requests))
        else:
            per = n(self.per_group)
            picks = [g for g in range(self.groups) for _ in range(per)]
        sessions = []
        for g in picks:
            question = words(rng, "q", rng.randrange(*self.question_words), self.vocab)
            msgs = [{"role": "system", "content": systems[g]}, {"role": "user", "content": question}]
            sessions.append([chat_body(model, msgs, max_tokens, tenant_salt(rng, self.tenants))])
        if self.unique_words is not None:
            for _ in range(len(picks)):
                msgs = [{"role": "user", "content": words(rng, "u", rng.randrange(*self.unique_words), self.vocab)}]
                sessions.append([chat_body(model, msgs, max_tokens, tenant_salt(rng, self.tenants))])
        if self.stagger is not None:
            at = [g * self.stagger + rng.random() for g in picks]
            return [s for _, s in sorted(zip(at, sessions), key=lambda p: p[0])]
        rng.shuffle(sessions)
        return sessions


@dataclass(frozen=True)
class Conversations:
    """`conversations` chats of `turns` turns. The first user message has `first_user_words`
    (low, high) words, later ones `user_words`, tagged `user_tag` (formatted with c and t); the
    assistant answers `assistant_words` words tagged `c<c>t<t>a`, or with None a fixed reply.
    The system prompt is ASSISTANT_SYSTEM, or with `system_groups` one of that many shared
    prompts of `system_words` words picked per conversation by Zipf (exponent 1) popularity.
    Shuffled when `shuffle`. With `tenants`, each conversation carries one of that many tenants'
    cache salts."""

    conversations: int
    turns: int
    first_user_words: tuple[int, int]
    user_words: tuple[int, int]
    assistant_words: int | None
    user_tag: str = "c{c}t{t}u"
    system_groups: int = 0
    system_words: int = 0
    shuffle: bool = True
    vocab: int = 100000
    tenants: int = 0

    def sessions(self, rng: random.Random, model: str, max_tokens: int, n) -> list[list[dict]]:
        systems = [words(rng, f"s{g}x", self.system_words, self.vocab) for g in range(self.system_groups)]
        weights = zipf_weights(self.system_groups, 1.0)
        sessions = []
        for c in range(n(self.conversations)):
            system = systems[rng.choices(range(self.system_groups), weights)[0]] if systems else ASSISTANT_SYSTEM
            msgs: list[dict] = [{"role": "system", "content": system}]
            salt = tenant_salt(rng, self.tenants)
            conv = []
            for t in range(self.turns):
                lo_hi = self.first_user_words if t == 0 else self.user_words
                user = words(rng, self.user_tag.format(c=c, t=t), rng.randrange(*lo_hi), self.vocab)
                msgs = msgs + [{"role": "user", "content": user}]
                conv.append(chat_body(model, list(msgs), max_tokens, salt))
                msgs = msgs + [{"role": "assistant", "content": self.reply(rng, c, t)}]
            sessions.append(conv)
        if self.shuffle:
            rng.shuffle(sessions)
        return sessions

    def reply(self, rng: random.Random, c: int, t: int) -> str:
        if self.assistant_words is None:
            return f"reply {c} {t} " + " ".join(f"a{c}x{t}x{i}" for i in range(8))
        return words(rng, f"c{c}t{t}a", self.assistant_words, self.vocab)


def make_sessions(shape: SharedPrefix | Conversations, seed, model: str, max_tokens: int,
                  scale: float = 1.0) -> list[list[dict]]:
    """The sessions of `shape` for `seed` (anything random.Random takes), every count scaled by
    `scale` (at least 1)."""
    def n(x: int) -> int:
        return max(1, int(round(x * scale)))
    return shape.sessions(random.Random(seed), model, max_tokens, n)
