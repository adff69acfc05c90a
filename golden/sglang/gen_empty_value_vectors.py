#!/usr/bin/env python3
"""Generates `hash_vectors_v0.5.23_empty_values.json`: SGLang 0.5.23's page
keys for requests whose optional namespace inputs are empty strings, next to
their non-empty neighbours, in both `--kv-events-config` formats.

Every value comes from SGLang's own code in the `sglang==0.5.23` wheel, loaded
without torch by `tests/python/sglang_loader.py`:

1. the request's `cache_salt` / `extra_key` go through
   `GenerateReqInput._normalize_single_inputs` (io_struct.py; "" -> None);
2. `RadixKey(tokens, extra_key, cache_salt=...)` (`cache_salt or None`);
3. one `RadixCache.create_simulated(page_size, events on, dynamo format or
   not, KvEventLoraNames)` insert: its `KVCacheEventRecorder` publishes the
   `BlockStored` whose `block_hashes` are the expected keys;
4. `namespace_seed_hex` is the recorder's own `_namespace_seed(node)`;
   `salt_seed_hex` is the chain seed `compute_node_event_hash_values` uses,
   `SHA256("sglang-cache-salt-v1\\0" + node.key.cache_salt)`, present only when
   the tree node kept a salt.

A non-empty `extra_key` stands for a LoRA request's radix extra key (SGLang
appends the adapter's `lora_id`); it is registered in `KvEventLoraNames` as
the scheduler does for an adapter, so the default format namespaces it too
(the meaning kvroute's `RequestExtras::sglang_extra_key` has).

    .venv/bin/python golden/sglang/gen_empty_value_vectors.py > golden/sglang/hash_vectors_v0.5.23_empty_values.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "python"))

import sglang_loader  # noqa: E402

U64 = (1 << 64) - 1
TOKENS = [128000, 128006, 9125, 128007, 271, 2675, 527, 264, 11190, 18328, 13, 128009]
PAGE = 4
# A LoRA request's extra key: SGLang appends the adapter's lora_id (32 hex).
LORA_ID = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"

CASES = [
    # (format, request cache_salt, request extra_key)
    ("default", "", None),
    ("dynamo", "", None),
    ("dynamo", None, ""),
    ("dynamo", "", ""),
    ("default", None, ""),
    ("default", "", ""),
    ("dynamo", "tenant-a", ""),
    ("dynamo", "", LORA_ID),
    ("default", "", LORA_ID),
    ("default", "tenant-a", ""),
]


def vector(s, fmt: str, cache_salt, extra_key) -> dict:
    salt, key = s.normalize_request(cache_salt, extra_key)
    names = s.events.KvEventLoraNames()
    if key is not None:
        names.register(lora_id=key, lora_name="adapter")
        names.register(types_req(key), "adapter")
    tree = s.radix.RadixCache.create_simulated(
        page_size=PAGE,
        enable_kv_cache_events=True,
        dynamo_kv_event_format=fmt == "dynamo",
        kv_event_lora_names=names,
    )
    tree.take_events()  # the constructor's AllBlocksCleared
    radix_key = s.radix.RadixKey(array("q", TOKENS), key, cache_salt=salt)
    tree.insert(s.base.InsertParams(key=radix_key))
    stored = [e for e in tree.take_events() if type(e).__name__ == "BlockStored"]
    hashes = [h for e in stored for h in e.block_hashes]
    node = next(iter(tree.root_node.children.values()))
    seed = tree.kv_events._namespace_seed(node)
    kept_salt = node.key.cache_salt
    return {
        "format": fmt,
        "cache_salt": cache_salt,
        "extra_key": extra_key,
        "page_size": PAGE,
        "tokens": TOKENS,
        "normalized_cache_salt": kept_salt,
        "normalized_extra_key": node.key.extra_key,
        "salt_seed_hex": (
            hashlib.sha256(b"sglang-cache-salt-v1\0" + kept_salt.encode("utf-8")).hexdigest()
            if kept_salt is not None
            else None
        ),
        "namespace_seed_hex": seed.hex() if seed is not None else None,
        "block_hash_i64": hashes,
        "block_hash_u64": [h & U64 for h in hashes],
    }


def types_req(extra_key: str):
    """What `KvEventLoraNames.register(req, name)` reads from a `Req`."""
    import types

    return types.SimpleNamespace(extra_key=extra_key, lora_id=extra_key)


def main() -> int:
    s = sglang_loader.load()
    out = {
        "engine": "sglang",
        "engine_version": "0.5.23",
        "algorithm": "page_i = SHA256(page_{i-1} digest || u32le tokens); salt seed and dynamo / LoRA namespaces; empty request values",
        "source_functions": [
            "sglang.srt.managers.io_struct.GenerateReqInput._normalize_single_inputs",
            "sglang.srt.mem_cache.radix_cache.RadixKey / RadixCache.insert",
            "sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store / _namespace_seed",
            "sglang.srt.mem_cache.utils.get_hash_str (native hash_binding.cpp), compute_node_event_hash_values",
            "sglang.srt.disaggregation.kv_events.kv_event_namespace_seed / namespaced_block_hash",
        ],
        "generator": "golden/sglang/gen_empty_value_vectors.py",
        "unsalted": [],
        "namespaced": [vector(s, *c) for c in CASES],
    }
    sglang_loader.check()
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
