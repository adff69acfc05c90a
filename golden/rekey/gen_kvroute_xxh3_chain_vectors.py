#!/usr/bin/env python3
"""Generates kvroute_xxh3_chain_vectors.json: kvroute's re-key contract
(chained XXH3-64 over u32 little-endian tokens, Dynamo's LocalBlockHash scheme)
computed independently of the Rust code with the python `xxhash` package.

    local[i] = xxh3_64(b"".join(t.to_bytes(4, "little") for t in block_i), seed)
    key[0]   = local[0]
    key[i]   = xxh3_64(key[i-1].to_bytes(8, "little") + local[i].to_bytes(8, "little"), seed)

Run: python3 gen_kvroute_xxh3_chain_vectors.py > kvroute_xxh3_chain_vectors.json
"""
import json
import random
import sys

import xxhash


def vector(tokens, block_size, seed):
    local, seq = [], []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        h = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in block), seed=seed)
        local.append(h)
        if seq:
            seq.append(xxhash.xxh3_64_intdigest(seq[-1].to_bytes(8, "little") + h.to_bytes(8, "little"), seed=seed))
        else:
            seq.append(h)
    return {"kv_block_size": block_size, "tokens": tokens,
            "local_block_hash_u64": local, "seq_hash_u64": seq}


def main():
    rng = random.Random(20260509)
    seed = 1337
    vectors = [
        vector(list(range(16)), 16, seed),
        vector([rng.randrange(152064) for _ in range(16 * 5 + 3)], 16, seed),
        vector([rng.randrange(152064) for _ in range(64 * 3)], 64, seed),
        vector([rng.randrange(152064) for _ in range(7)], 1, seed),
        vector([0, 1, 0xFFFFFFFF, 0x80000000, 2**31 - 1, 65535, 65536, 255], 4, seed),
        vector([rng.randrange(2**32) for _ in range(300)], 100, seed),
        vector([rng.randrange(152064) for _ in range(32 * 4)], 32, seed),
        vector([], 16, seed),
    ]
    out = {
        "rule": __doc__.strip(),
        "generator": "golden/rekey/gen_kvroute_xxh3_chain_vectors.py, python xxhash %s" % xxhash.VERSION,
        "xxh3_seed": seed,
        "vectors": vectors,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
