"""vLLM's sha256_cbor block hash in Python: canonical CBOR of (parent, tuple(tokens),
extra_keys or None), the first parent being the hash of the seed; a block's key is the low
64 bits of its digest (what vLLM publishes)."""

from __future__ import annotations

import hashlib


def _head(major: int, arg: int) -> bytes:
    m = major << 5
    if arg < 24:
        return bytes([m | arg])
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if arg < (1 << (8 * size)):
            return bytes([m | code]) + arg.to_bytes(size, "big")
    raise ValueError(arg)


def cbor(v) -> bytes:
    if v is None:
        return b"\xf6"
    if isinstance(v, bool):
        raise TypeError("bool")
    if isinstance(v, int):
        return _head(0, v) if v >= 0 else _head(1, -1 - v)
    if isinstance(v, bytes):
        return _head(2, len(v)) + v
    if isinstance(v, str):
        b = v.encode()
        return _head(3, len(b)) + b
    if isinstance(v, (list, tuple)):
        return _head(4, len(v)) + b"".join(cbor(x) for x in v)
    raise TypeError(type(v))


def block_keys(tokens: list[int], block_size: int, seed: str = "0", cache_salt: str | None = None,
               lora: tuple[str, str] | None = None) -> list[int]:
    """The u64 keys vLLM publishes for the full blocks of `tokens`."""
    parent = hashlib.sha256(cbor(seed)).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        extra = []
        if lora:
            extra.append(("lora", lora[0], lora[1]))
        if i == 0 and cache_salt:
            extra.append(("cache_salt", cache_salt))
        chunk = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(cbor((parent, tuple(chunk), tuple(extra) if extra else None))).digest()
        keys.append(int.from_bytes(parent[24:], "big"))
    return keys
