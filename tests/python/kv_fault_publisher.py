#!/usr/bin/env python3
"""kv_publisher.py plus fault-injection steps, for kvroute's tests/fault_*.rs.

Same CLI and script steps as kv_publisher.py (real pyzmq/libzmq PUB, msgspec
payloads with the engines' declarations), plus:

  {"op": "garbage", "count": n}          [topic, seq, random bytes]; seq advances
  {"op": "frames", "frames": [hex, ...]}  any multipart message as given (wrong frame
                                          counts, bad seq bytes); seq unchanged
  {"op": "oversized", "bytes": n}         [topic, seq, a valid vLLM/SGLang batch whose
                                          token list makes it >= n bytes]; seq advances
  {"op": "flood_random", "count": n, "keys": k, "rate": r}
                                          n batches of one BlockStored with k random
                                          64-bit keys each; prints FLOODED distinct=...
  {"op": "flood_big", "count": n, "tokens": t}
                                          n stored batches as fast as possible, each
                                          carrying t token ids (payload ~ 5*t bytes)
  {"op": "inject", "seq": s}              one live stored batch numbered s (the
                                          synthetic block of seq 999999); seq unchanged
  {"op": "poison_replay", "seq": s}       the replay buffer also answers that batch at
                                          seq s (a hostile or corrupted ROUTER)
Lines printed: the base ones plus `SENT_BAD seq=...` and `FLOODED ...`.
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_publisher  # noqa: E402
from kv_publisher import ENCODER, ENGINES, say  # noqa: E402

BASE_RUN_SCRIPT = kv_publisher.run_script


def stored_batch(pub: kv_publisher.Publisher, keys: list[int], tokens: list[int]) -> bytes:
    a = pub.args
    batch_cls, stored, _removed, _cleared = ENGINES[a.engine]
    fields = dict(
        block_hashes=keys, parent_block_hash=None, token_ids=tokens, block_size=max(1, len(tokens) // max(1, len(keys))),
        lora_id=None, medium="GPU",
    )
    if a.engine == "vllm":
        fields.update(lora_name=None, extra_keys=[None] * len(keys), group_idx=0, kv_cache_spec_kind="full_attention")
    return ENCODER.encode(batch_cls(time.time(), [stored(**fields)], a.dp_rank_in_payload))


def paced(count: int, rate: float):
    interval = 1.0 / rate if rate > 0 else 0.0
    next_at = time.monotonic()
    for i in range(count):
        if interval:
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at += interval
        yield i


def run_fault_script(pub: kv_publisher.Publisher, steps: list[dict]) -> None:
    rng = random.Random(0x5EED)
    for step in steps:
        op = step["op"]
        if op == "garbage":
            for _ in range(int(step.get("count", 1))):
                seq = pub.seq
                pub.send_payload(rng.randbytes(int(step.get("bytes", 64))))
                say(f"SENT_BAD seq={seq} kind=garbage")
        elif op == "frames":
            frames = [bytes.fromhex(f) for f in step["frames"]]
            pub.pub.send_multipart(frames)
            say(f"SENT_BAD frames={len(frames)} kind=raw")
        elif op == "oversized":
            want = int(step["bytes"])
            seq = pub.seq
            payload = stored_batch(pub, [rng.getrandbits(63)], [7] * (want // 1 + 16))
            assert len(payload) >= want
            pub.send_payload(payload)
            say(f"SENT_BAD seq={seq} kind=oversized bytes={len(payload)}")
        elif op == "flood_random":
            keys_per = int(step.get("keys", 64))
            distinct: set[int] = set()
            for _ in paced(int(step["count"]), float(step.get("rate", 0))):
                keys = [rng.getrandbits(64) for _ in range(keys_per)]
                distinct.update(keys)
                pub.send_payload(stored_batch(pub, keys, [1] * (16 * keys_per)))
            say(f"FLOODED next_seq={pub.seq} distinct={len(distinct)}")
        elif op == "flood_big":
            tokens = [100000 + i for i in range(int(step["tokens"]))]
            for _ in range(int(step["count"])):
                pub.send_payload(stored_batch(pub, [rng.getrandbits(63)], tokens))
            say(f"FLOODED next_seq={pub.seq} bytes_each={len(stored_batch(pub, [1], tokens))}")
        elif op in ("inject", "poison_replay"):
            seq = int(step["seq"])
            a = pub.args
            payload = kv_publisher.synthetic_batch(
                a.engine, "stored", pub.epoch, 999_999, a.dp_rank_in_payload, a.block_size
            )
            if op == "inject":
                pub.pub.send_multipart([pub.topic, seq.to_bytes(8, "big"), payload])
            else:
                pub.buffer.append((seq, payload))
            say(f"SENT_BAD seq={seq} kind={op}")
        else:
            BASE_RUN_SCRIPT(pub, [step])


if __name__ == "__main__":
    kv_publisher.run_script = run_fault_script
    sys.exit(kv_publisher.main())
