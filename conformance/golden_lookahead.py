"""Writes golden block hashes for EAGLE-style lookahead hashing (vLLM 0.33
`num_hash_lookahead_tokens`), computed by vLLM's own functions: its request block hasher
(`get_request_block_hasher` with lookahead), its hash functions and its NONE_HASH
initialisation. Run with the vLLM 0.33.0 virtualenv and PYTHONHASHSEED=0:

    PYTHONHASHSEED=0 .venv-vllm/bin/python conformance/golden_lookahead.py OUT.json

The request is a stand-in carrying only the fields the hasher reads (tokens, LoRA, cache salt;
no multimodal items, no prompt embeddings)."""

import json
import os
import sys
from types import SimpleNamespace

import vllm
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu

BLOCK = 16
CASES = [
    # name, tokens, lookahead, cache_salt, lora (name, path)
    ("eagle_one_token", list(range(1, 51)), 1, None, None),
    ("eagle_exact_blocks_last_unhashed", list(range(100, 148)), 1, None, None),
    ("mtp_three_tokens", [(i * 37) % 5000 for i in range(70)], 3, None, None),
    ("eagle_cache_salt", list(range(7, 60)), 1, "salty", None),
    ("eagle_lora_two_tokens", list(range(300, 352)), 2, None, ("ad", "/adapters/ad")),
    ("no_lookahead_reference", list(range(1, 51)), 0, None, None),
]


def request(tokens, salt, lora):
    return SimpleNamespace(
        block_hashes=[], num_tokens=len(tokens), all_token_ids=list(tokens), mm_features=[],
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]),
        cache_salt=salt, prompt_embeds=None)


def main(out_path):
    assert os.environ.get("PYTHONHASHSEED") == "0", "run with PYTHONHASHSEED=0"
    algos = {}
    for algo in ("sha256_cbor", "sha256"):
        fn = get_hash_fn_by_name(algo)
        kcu.init_none_hash(fn)
        cases = []
        for name, tokens, la, salt, lora in CASES:
            hasher = kcu.get_request_block_hasher(BLOCK, fn, la)
            hashes = hasher(request(tokens, salt, lora))
            cases.append({
                "name": name, "token_ids": tokens, "lookahead_tokens": la, "cache_salt": salt,
                "lora": None if lora is None else {"name": lora[0], "path": lora[1]},
                "hash_hex": [bytes(h).hex() for h in hashes],
                "event_u64": [int.from_bytes(bytes(h), "big") & ((1 << 64) - 1) for h in hashes],
                # What a BlockStored event of these blocks carries beside them.
                "lookahead_token_ids": [tokens[(i + 1) * BLOCK:(i + 1) * BLOCK + la] for i in range(len(hashes))]
                if la else None,
            })
        algos[algo] = {"none_hash_hex": bytes(kcu.NONE_HASH).hex(), "cases": cases}
    doc = {"vllm_version": vllm.__version__, "PYTHONHASHSEED": "0", "block_size": BLOCK,
           "generator": "conformance/golden_lookahead.py (vLLM's get_request_block_hasher)", "algorithms": algos}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
