"""KV events of SGLang's own radix cache in EAGLE mode (bigram keys).

SGLang 0.5.23's `RadixCache` (loaded from the wheel by `sglang_loader`, torch
replaced by its slot-index holder) with `is_eagle` set, as its scheduler sets it
for EAGLE / EAGLE3 speculative decoding: inserts the token ids given on the
command line (page size `--page`), takes the events its `KVCacheEventRecorder`
recorded and writes them as one `KVEventBatch`, encoded with msgspec as
`ZmqEventPublisher` does, to stdout. Nothing here is kvroute's code.
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_loader  # noqa: E402
from sglang_standin import SlotAllocator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page", type=int, default=4)
    ap.add_argument("tokens", type=int, nargs="+")
    args = ap.parse_args()
    s = sglang_loader.load()
    torch = sys.modules["torch"]
    alloc = SlotAllocator(4096)
    tree = s.radix.RadixCache.create_simulated(
        mock_allocator=alloc, page_size=args.page, enable_kv_cache_events=True
    )
    # What `CacheInitParams.is_eagle` sets (create_simulated has no argument for it).
    tree.is_eagle = True
    tree.take_events()  # the construction's AllBlocksCleared
    key = s.radix.RadixKey(array("q", args.tokens))
    values = torch.tensor(alloc.alloc(len(args.tokens)))
    tree.insert(s.base.InsertParams(key=key, value=values, inserted_len=0, priority=0))
    batch = s.kv_events.KVEventBatch(ts=time.time(), events=tree.take_events())
    sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(batch))


if __name__ == "__main__":
    main()
