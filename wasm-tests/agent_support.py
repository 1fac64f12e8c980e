"""Helpers for the agent's interop tests: publishers that copy vLLM's ZMQ framing (live PUB frames
[topic, seq u64 BE, msgpack payload]; replay ROUTER answering [id, "", seq8] with
[id, "", topic, seq8, payload] per buffered batch and [id, "", "", ff*8, ""] at the end), vLLM 0.33.0
captured payloads and a Python model of the mirror. The agent runner and the feed subscriber are
in the test kit (llmgw_testkit.agent, llmgw_testkit.feed)."""

import json
import threading
import time

import msgpack
import zmq

from llmgw_testkit import VLLM_DATA as DATA

END_SEQ = b"\xff" * 8


def capture(name: str = "batches_native_seed0.jsonl"):
    """[(seq, payload bytes, decoded events)] of a real vLLM 0.33.0 capture (events decoded from
    the native file, whose events the legacy file re-encodes)."""
    native = [json.loads(line) for line in (DATA / "batches_native_seed0.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
    return [(r["seq"], bytes.fromhex(r["payload_hex"]), n["decoded"][1]) for r, n in zip(rows, native)]


def stored(hashes, ts=1.0, rank=0) -> bytes:
    # No token ids: the agent cannot recompute these made-up keys and credits them unverified
    # (token ids that do not hash to them would have the claims rejected).
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
          "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    return msgpack.packb([ts, [ev], rank])


def removed(hashes, ts=1.0, rank=0) -> bytes:
    ev = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}
    return msgpack.packb([ts, [ev], rank])


def cleared(ts=1.0, rank=0) -> bytes:
    return msgpack.packb([ts, [{"type": "AllBlocksCleared"}], rank])


class Model:
    """What a mirror should hold: a refcounted multiset of GPU, group-0 block keys."""

    def __init__(self):
        self.count: dict[int, int] = {}

    def apply(self, events):
        for ev in events:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                for h in ev["block_hashes"]:
                    self.count[h] = self.count.get(h, 0) + 1
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    if h in self.count:
                        self.count[h] -= 1
                        if self.count[h] == 0:
                            del self.count[h]
            elif kind == "AllBlocksCleared":
                self.count.clear()

    def apply_payload(self, payload: bytes):
        self.apply(msgpack.unpackb(payload, strict_map_key=False)[1])

    def keys(self):
        return sorted(self.count)


class Publisher:
    """A vLLM-like publisher. The live socket is an XPUB (same wire behaviour as vLLM's PUB) so the
    test can wait until the agent's subscription arrived instead of sleeping; the replay socket is
    a ROUTER served from a thread, like vLLM's."""

    def __init__(self, endpoint: str, bind: bool, topic: bytes = b"", replay_endpoint: str | None = None,
                 legacy_replay: bool = False, buffer: list | None = None):
        self.ctx = zmq.Context()
        self.topic = topic
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 100000)
        self.pub.setsockopt(zmq.LINGER, 2000)
        (self.pub.bind if bind else self.pub.connect)(endpoint)
        self.buffer: list[tuple[int, bytes]] = list(buffer or [])
        self.replay_requests: list[int] = []
        # vLLM before 0.29 replied without the topic frame.
        self.legacy_replay = legacy_replay
        self._stop = threading.Event()
        self._thread = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 20.0):
        """Blocks until a subscriber's subscription reached the publisher (an earlier
        subscriber's unsubscription, which starts with 0, is passed over)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                raise TimeoutError("no subscriber subscribed")
            msg = self.pub.recv()
            if msg[:1] == b"\x01":
                return
            assert msg[:1] == b"\x00", msg

    def send(self, seq: int, payload: bytes, live: bool = True, buffered: bool = True):
        """Publishes batch `seq`; `live=False` keeps it only in the replay buffer (a lost message)."""
        if buffered:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            topic = [] if self.legacy_replay else [self.topic]
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    self.router.send_multipart([ident, b"", *topic, seq.to_bytes(8, "big"), payload])
            end = [] if self.legacy_replay else [b""]
            self.router.send_multipart([ident, b"", *end, END_SEQ, b""])

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()
