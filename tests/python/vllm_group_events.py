"""vLLM 0.33's own event classes and encoder, for events kvroute's tests need
that the stand-in's single-group block pool does not publish: stores of a
hybrid model's groups (each annotated with its group's `kv_cache_spec_kind`,
as `KVCacheManager.take_events` does) and the offloading connector's
placeholder stores.

    python vllm_group_events.py --kinds          -> JSON list of KVCacheSpecKind values
    python vllm_group_events.py < batches.json   -> JSON list of payload hex strings

`batches.json` is a list of batches, each a list of events:

    {"type": "stored", "hashes": [int], "parent": int | null, "tokens": [int],
     "block_size": int, "medium": "GPU" | "CPU" | "STORAGE", "group": int,
     "kind": str | null}
    {"type": "placeholder", "hash": int, "medium": "CPU" | "STORAGE", "group": int}
    {"type": "removed", "hashes": [int], "medium": ..., "group": int}

What runs from the wheel: `vllm.distributed.kv_events` (`BlockStored`,
`BlockRemoved`, `KVEventBatch`, the `MEDIUM_*` names), loaded by
`vllm_loader.py`, and msgspec's encoder as `ZmqEventPublisher` uses it. A
placeholder has the field values of
`OffloadingEventsTracker._placeholder_stored`
(`distributed/kv_transfer/kv_connector/v1/offloading/events.py`, without
self-describing events): no parent, no token ids, block size 0, no spec kind.
`KVCacheSpecKind` is compiled from `v1/kv_cache_interface.py`'s source (the
module imports torch).
"""

from __future__ import annotations

import ast
import enum
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import msgspec  # noqa: E402

import vllm_loader  # noqa: E402


def spec_kinds(root: str) -> list[str]:
    path = os.path.join(root, "v1", "kv_cache_interface.py")
    tree = ast.parse(Path(path).read_text(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "KVCacheSpecKind":
            scope = {"Enum": enum.Enum}
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), scope)
            return [k.value for k in scope["KVCacheSpecKind"]]
    raise RuntimeError(f"vllm_group_events: no KVCacheSpecKind in {path}")


def main() -> None:
    v = vllm_loader.load()
    if sys.argv[1:] == ["--kinds"]:
        json.dump(spec_kinds(v.root), sys.stdout)
        sys.stdout.write("\n")
        return
    ev = v.kv_events
    media = {"GPU": ev.MEDIUM_GPU, "CPU": ev.MEDIUM_CPU, "STORAGE": ev.MEDIUM_STORAGE}
    encoder = msgspec.msgpack.Encoder()
    out = []
    for batch in json.load(sys.stdin):
        events = []
        for e in batch:
            if e["type"] == "stored":
                events.append(ev.BlockStored(
                    block_hashes=e["hashes"], parent_block_hash=e["parent"],
                    token_ids=e["tokens"], block_size=e["block_size"], lora_id=None,
                    medium=media[e["medium"]], lora_name=None, group_idx=e["group"],
                    kv_cache_spec_kind=e["kind"]))
            elif e["type"] == "placeholder":
                events.append(ev.BlockStored(
                    block_hashes=[e["hash"]], parent_block_hash=None, token_ids=[],
                    lora_id=None, block_size=0, medium=media[e["medium"]], lora_name=None,
                    group_idx=e["group"], kv_cache_spec_kind=None,
                    kv_cache_spec_sliding_window=None, locality=None, ownership=None))
            elif e["type"] == "removed":
                events.append(ev.BlockRemoved(
                    block_hashes=e["hashes"], medium=media[e["medium"]], group_idx=e["group"]))
            else:
                raise SystemExit(f"vllm_group_events: unknown event {e!r}")
        out.append(encoder.encode(ev.KVEventBatch(ts=0.0, events=events, data_parallel_rank=None)).hex())
    vllm_loader.check()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
