#!/usr/bin/env python3
"""Generates `hash_vectors_v1_block_key_empty_values.json`: TensorRT-LLM
`v1_block_key` chains whose optional inputs hold their "empty" values:
`lora_task_id = 0`, `cache_salt_id = 0`, both, and the `cache_salt_id` the LLM
API derives for `cache_salt = ""`.

TensorRT-LLM tests these inputs for presence, not value: `blockKey.cpp`
`BlockKeyHasher::hash` mixes `cacheSaltID` / `loraTaskId` when the
`std::optional` holds a value (0 included), and `LLM.generate_async` derives a
salt id whenever `cache_salt is not None` ("" included; its OpenAI server
refuses an empty or blank `cache_salt` first).

TensorRT-LLM cannot be installed here (CUDA wheel), so the values come from
its own Python port of the rule, `tensorrt_llm/runtime/kv_cache_hash.py`
(`hash_v1_block_key`, `get_cache_salt_id`), loaded from a path to that file:

    python3 golden/trtllm-events/gen_empty_value_vectors.py --kv-cache-hash PATH/kv_cache_hash.py \\
        > golden/trtllm-events/hash_vectors_v1_block_key_empty_values.json

Generated from NVIDIA/TensorRT-LLM@991de58c52acf039626cabc30e7c4f4106d222fd.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

TOKENS = [128000 + (i * 37) % 500 for i in range(45)]
BLOCK = 16
U64 = (1 << 64) - 1


def chain(mod, tokens, lora, salt, partial):
    keys, parent = [], 0
    for start in range(0, len(tokens), BLOCK):
        block = tokens[start : start + BLOCK]
        if len(block) < BLOCK and not partial:
            break
        parent = mod.hash_v1_block_key(block, parent, lora_task_id=lora, cache_salt_id=salt)
        keys.append(parent)
    return keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--kv-cache-hash", required=True, help="tensorrt_llm/runtime/kv_cache_hash.py")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("kv_cache_hash", args.kv_cache_hash)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    vectors = []
    for lora, salt in [(0, None), (None, 0), (0, 0), (None, mod.get_cache_salt_id(""))]:
        full = chain(mod, TOKENS, lora, salt, partial=False)
        v = {"tokens_per_block": BLOCK, "tokens": TOKENS}
        if lora is not None:
            v["lora_task_id"] = lora
        if salt is not None:
            v["cache_salt_id"] = salt
        v["full_block_hashes_u64"] = full
        v["with_partial_last_block_u64"] = chain(mod, TOKENS, lora, salt, partial=True)
        v["as_i64"] = [k - (1 << 64) if k >= 1 << 63 else k for k in full]
        vectors.append(v)
    out = {
        "engine": "tensorrt-llm",
        "hash_algo": "v1_block_key",
        "rule": "as hash_vectors_v1_block_key.json; an optional input is mixed whenever present, 0 included",
        "sources": [
            "cpp/tensorrt_llm/batch_manager/blockKey.cpp BlockKeyHasher::hash (std::optional presence)",
            "tensorrt_llm/runtime/kv_cache_hash.py hash_v1_block_key, get_cache_salt_id (values)",
            "tensorrt_llm/llmapi/llm.py generate_async: cache_salt_id when cache_salt is not None",
        ],
        "generator": "golden/trtllm-events/gen_empty_value_vectors.py",
        "vectors": vectors,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
