#!/usr/bin/env python3
"""Generates `hash_vectors_v0.33.0_empty_values.json` (schema
`vllm-block-hash-vectors/1`): vLLM 0.33.0's block hashes when an optional
hash input is empty: `cache_salt = ""`, `PYTHONHASHSEED=""` (sha256,
sha256_cbor, xxhash_cbor), a LoRA adapter named "" and a multimodal item whose
identifier is "".

Every value comes from vLLM's own code in the `vllm==0.33.0` wheel, loaded
without torch by `tests/python/vllm_loader.py`: `init_none_hash` (reads
`PYTHONHASHSEED` with `os.getenv`: "" is a seed, not unset),
`get_request_block_hasher` -> `generate_block_hash_extra_keys` (`cache_salt`
only when truthy; a LoRA request by presence; an mm identifier as given) ->
`hash_block_tokens` with `vllm.utils.hashing`'s functions;
`to_event_extra_keys` and `maybe_convert_block_hash` for the event view. The
bytes each hash function digests are recorded as vLLM hands them to
`hashlib.sha256` / `xxh3_128_digest` (`hash_input_hex`). The request object
carries the attributes of `vllm.v1.request.Request` the hasher reads, as
`tests/python/vllm_standin.py`'s `StandinRequest` does.

    .venv/bin/python golden/vllm/gen_empty_value_vectors.py > golden/vllm/hash_vectors_v0.33.0_empty_values.json
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "python"))

import vllm_loader  # noqa: E402

TOKENS = [39637 + 7 * i for i in range(40)]
BLOCK = 16


class Recorder:
    """Stands in for `hashlib` / `_xxhash_digest` inside `vllm.utils.hashing`,
    recording the exact bytes vLLM digests and delegating to the real ones."""

    def __init__(self, h):
        self.h = h
        self.inputs: list[bytes] = []
        self.real_xxhash_digest = h._xxhash_digest

    def sha256(self, data, *args, **kwargs):
        self.inputs.append(bytes(data))
        return hashlib.sha256(data, *args, **kwargs)

    def xxhash_digest(self, data):
        self.inputs.append(bytes(data))
        return self.real_xxhash_digest(data)

    def __getattr__(self, name):
        return getattr(hashlib, name)


def to_json(x):
    if isinstance(x, (tuple, list)):
        return [to_json(i) for i in x]
    if isinstance(x, bytes):
        return {"bytes_hex": x.hex()}
    return x


def request(hasher, lora, cache_salt, mm):
    r = types.SimpleNamespace(
        all_token_ids=list(TOKENS),
        num_tokens=len(TOKENS),
        block_hashes=[],
        mm_features=[
            types.SimpleNamespace(
                identifier=m["identifier"],
                mm_position=types.SimpleNamespace(offset=m["offset"], length=m["length"]),
            )
            for m in mm
        ],
        lora_request=(
            types.SimpleNamespace(lora_name=lora["name"], lora_int_id=lora["int_id"], lora_path=lora["path"])
            if lora
            else None
        ),
        cache_salt=cache_salt,
        prompt_embeds=None,
        _prompt_embeds_per_block_hashes={},
        session_id=None,
    )
    r.block_hashes.extend(hasher(r))
    return r


def case(v, rec, cid, algo, seed, lora=None, cache_salt=None, mm=()):
    kcu = v.kv_cache_utils
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    hash_fn = v.hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(hash_fn)
    none_hash = kcu.NONE_HASH
    rec.inputs.clear()
    r = request(kcu.get_request_block_hasher(BLOCK, hash_fn), lora, cache_salt, list(mm))
    inputs = list(rec.inputs)
    blocks = []
    parent = none_hash
    parent_key = None
    mm_idx = 0
    for i, digest in enumerate(r.block_hashes):
        start, end = i * BLOCK, (i + 1) * BLOCK
        extra, mm_idx = kcu.generate_block_hash_extra_keys(r, start, end, mm_idx)
        event_extra = kcu.to_event_extra_keys([extra])
        key = kcu.maybe_convert_block_hash(digest)
        blocks.append(
            {
                "index": i,
                "token_start": start,
                "token_end": end,
                "parent_hash_hex": bytes(parent).hex(),
                "extra_keys": to_json(extra),
                "hash_input_hex": inputs[i].hex(),
                "digest_hex": bytes(digest).hex(),
                "event_key_u64": key,
                "parent_event_key_u64": parent_key,
                "event_extra_keys": to_json(event_extra[0]) if event_extra else None,
            }
        )
        parent, parent_key = digest, key
    return {
        "id": cid,
        "hash_algo": algo,
        "serialization": "cbor_canonical" if algo.endswith("_cbor") else f"pickle_protocol_{pickle.HIGHEST_PROTOCOL}",
        "block_size": BLOCK,
        "num_hash_lookahead_tokens": 0,
        "pythonhashseed": seed,
        "none_hash_seed": kcu.get_none_hash_seed(),
        "none_hash_hex": bytes(none_hash).hex(),
        "token_ids": TOKENS,
        "lora": lora,
        "cache_salt": cache_salt,
        "mm_features": list(mm),
        "prompt_embeds_block_digests": None,
        "blocks": blocks,
    }


def main() -> int:
    v = vllm_loader.load()
    # Event keys as 64-bit ints (what `ZmqEventPublisher` sends with the
    # gateway's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` default).
    if not v.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        raise SystemExit("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is off")
    rec = Recorder(v.hashing)
    v.hashing.hashlib = rec
    v.hashing._xxhash_digest = rec.xxhash_digest
    lora_unnamed = {"name": "", "int_id": 1, "path": "/adapters/unnamed"}
    mm_unnamed = {"identifier": "", "offset": 4, "length": 8}
    cases = [
        case(v, rec, "sha256_cbor-bs16-seed0-empty_cache_salt", "sha256_cbor", "0", cache_salt=""),
        case(v, rec, "sha256-bs16-seed0-empty_cache_salt", "sha256", "0", cache_salt=""),
        case(v, rec, "sha256_cbor-bs16-seed_empty", "sha256_cbor", ""),
        case(v, rec, "sha256-bs16-seed_empty", "sha256", ""),
        case(v, rec, "xxhash_cbor-bs16-seed_empty", "xxhash_cbor", ""),
        case(v, rec, "sha256_cbor-bs16-seed0-lora_empty_name", "sha256_cbor", "0", lora=lora_unnamed),
        case(v, rec, "sha256_cbor-bs16-seed0-mm_empty_identifier", "sha256_cbor", "0", mm=[mm_unnamed]),
        case(
            v,
            rec,
            "sha256_cbor-bs16-seed_empty-all_empty",
            "sha256_cbor",
            "",
            lora=lora_unnamed,
            cache_salt="",
            mm=[mm_unnamed],
        ),
    ]
    vllm_loader.check()
    import cbor2
    import xxhash

    out = {
        "schema": "vllm-block-hash-vectors/1",
        "set": "empty_values",
        "vllm_version": "0.33.0",
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "cbor2_version": cbor2.__version__ if hasattr(cbor2, "__version__") else "6.3.0",
        "xxhash_version": xxhash.VERSION,
        "pickle_protocol": pickle.HIGHEST_PROTOCOL,
        "generator": "golden/vllm/gen_empty_value_vectors.py",
        "cases": cases,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
