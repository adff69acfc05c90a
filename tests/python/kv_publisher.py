#!/usr/bin/env python3
"""A real ZeroMQ KV-event publisher (pyzmq/libzmq + msgspec) for kvroute's interop tests.

It speaks the wire contract of vLLM 0.33 (`--engine vllm`) or SGLang 0.5.23
(`--engine sglang`) as documented in golden/vllm-events/README.md and
golden/sglang-events/README.md: PUB multipart `[topic, seq u64 BE, payload]`,
payload = msgspec-encoded `KVEventBatch`, plus the ROUTER replay socket
(`[b"", start_seq]` in, `[b"", topic, seq, payload]`... + end marker out; or the
older layout without the topic frame with `--replay-layout legacy`).

The events are msgspec Structs that mirror the engines' own declarations (field
names, order, defaults, omit_defaults, tagging), so the bytes match the engines'.
`--selfcheck FIXTURE.json...` re-encodes golden fixtures' decoded payloads and
compares them byte for byte with the recorded payload.

Behaviour is scripted: a JSON list of steps (argv `--script` or stdin), e.g.
  [{"op": "wait_subscriber"},
   {"op": "publish", "count": 10, "rate": 1000},
   {"op": "skip", "count": 5},
   {"op": "restart", "down_ms": 200},
   {"op": "serve", "ms": 500}]
Progress lines go to stdout (`READY ...`, `PUBLISHED seq=...`, `RESTARTED`, `DONE`), flushed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

# ---------------------------------------------------------------------------------------
# vLLM 0.33 declarations (vllm/distributed/kv_events.py): tagged map events, array batch.


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class VllmKVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list] = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


# ---------------------------------------------------------------------------------------
# SGLang 0.5.23 declarations (sglang/srt/disaggregation/kv_events.py).


class SglangEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


class SglangKVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    pass


class SglangBlockStored(SglangKVCacheEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class SglangBlockRemoved(SglangKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = None


class SglangAllBlocksCleared(SglangKVCacheEvent, tag="AllBlocksCleared"):
    pass


ENGINES = {
    "vllm": (VllmEventBatch, VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared),
    "sglang": (SglangEventBatch, SglangBlockStored, SglangBlockRemoved, SglangAllBlocksCleared),
}

ENCODER = msgspec.msgpack.Encoder()
END_SEQ = (2**64 - 1).to_bytes(8, "big")


def from_json(value: Any) -> Any:
    """Undo the fixtures' generic JSON rendering (`{"bytes_hex": ...}` for bin)."""
    if isinstance(value, dict) and set(value) == {"bytes_hex"}:
        return bytes.fromhex(value["bytes_hex"])
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def rebuild_batch(engine: str, decoded: list) -> Any:
    batch_cls, stored, removed, cleared = ENGINES[engine]
    by_tag = {"BlockStored": stored, "BlockRemoved": removed, "AllBlocksCleared": cleared}
    events = []
    for ev in decoded[1]:
        fields = {k: from_json(v) for k, v in ev.items() if k != "type"}
        events.append(by_tag[ev["type"]](**fields))
    return batch_cls(decoded[0], events, decoded[2])


def selfcheck(engine: str, paths: list[str]) -> int:
    bad = 0
    for path in paths:
        with open(path) as f:
            fixture = json.load(f)
        encoded = ENCODER.encode(rebuild_batch(engine, fixture["decoded_payload"]))
        with open(path[: -len(".json")] + ".msgpack", "rb") as f:
            ok = encoded == f.read()
        bad += not ok
        print(("OK " if ok else "MISMATCH ") + path, flush=True)
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------
# Synthetic batches: deterministic keys from (epoch, seq) so the receiver can check them.


def synthetic_batch(engine: str, kind: str, epoch: int, seq: int, dp_rank: Optional[int], block_size: int) -> bytes:
    batch_cls, stored, removed, cleared = ENGINES[engine]
    key = ((epoch + 1) << 40) | (seq + 1)
    tokens = [(seq * block_size + i) % 150000 for i in range(block_size)]
    if kind == "cleared":
        events = [cleared()]
    elif kind == "removed":
        events = [removed(block_hashes=[key], medium="GPU")]
    elif engine == "vllm":
        events = [
            stored(
                block_hashes=[key], parent_block_hash=None, token_ids=tokens, block_size=block_size,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        ]
    else:
        events = [
            stored(
                block_hashes=[key], parent_block_hash=None, token_ids=tokens, block_size=block_size,
                lora_id=None, medium="GPU",
            )
        ]
    return ENCODER.encode(batch_cls(time.time(), events, dp_rank))


# ---------------------------------------------------------------------------------------


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The engines' `offset_endpoint_port`: tcp port + rank."""
    if rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class Publisher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = zmq.Context.instance()
        self.topic = args.topic.encode()
        self.epoch = 0
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub: Optional[zmq.Socket] = None
        self.router: Optional[zmq.Socket] = None
        self.open()

    def open(self) -> None:
        a = self.args
        self.pub = self.ctx.socket(zmq.XPUB if a.socket == "xpub" else zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, a.hwm)
        if a.socket == "xpub":
            # Report every subscription, also repeated topics (one per subscriber).
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        endpoint = offset_endpoint(a.endpoint, a.dp_rank)
        if a.mode == "bind":
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.router = None
        self.subscribers = 0
        if a.replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(offset_endpoint(a.replay_endpoint, a.dp_rank))
        say(f"READY epoch={self.epoch} endpoint={endpoint}")

    def close(self) -> None:
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.router = None

    def restart(self, down_ms: int) -> None:
        self.close()
        time.sleep(down_ms / 1000)
        self.epoch += 1
        self.seq = 0
        self.buffer.clear()
        self.open()
        say(f"RESTARTED epoch={self.epoch}")

    def send(self, kind: str) -> None:
        a = self.args
        payload = synthetic_batch(a.engine, kind, self.epoch, self.seq, a.dp_rank_in_payload, a.block_size)
        self.send_payload(payload)

    def send_payload(self, payload: bytes) -> None:
        seq_bytes = self.seq.to_bytes(8, "big")
        assert self.pub is not None
        self.pub.send_multipart([self.topic, seq_bytes, payload], copy=False)
        self.buffer.append((self.seq, payload))
        del self.buffer[: max(0, len(self.buffer) - self.args.buffer_steps)]
        self.seq += 1

    def service(self, until: float) -> None:
        """Serves replay requests (and XPUB subscriptions) until the monotonic deadline."""
        poller = zmq.Poller()
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        if self.args.socket == "xpub" and self.pub is not None:
            poller.register(self.pub, zmq.POLLIN)
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            if not poller.sockets:
                time.sleep(remaining)
                return
            for sock, _ in poller.poll(timeout=remaining * 1000):
                if sock is self.router:
                    self.serve_replay_request()
                else:
                    self.read_subscription()

    def read_subscription(self) -> bool:
        assert self.pub is not None
        msg = self.pub.recv()
        subscribed = bool(msg) and msg[0] == 1
        if subscribed:
            self.subscribers += 1
            say(f"SUBSCRIBED {self.subscribers}")
        return subscribed

    subscribers = 0

    def wait_subscriber(self, count: int, timeout_s: float) -> None:
        assert self.args.socket == "xpub", "wait_subscriber needs --socket xpub"
        deadline = time.monotonic() + timeout_s
        while self.subscribers < count:
            if time.monotonic() > deadline:
                fail(f"no subscriber within {timeout_s}s")
            self.service(min(deadline, time.monotonic() + 0.01))

    def serve_replay_request(self) -> None:
        assert self.router is not None
        frames = self.router.recv_multipart()
        if len(frames) != 3:
            say(f"REPLAY_INVALID frames={len(frames)}")
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        sent = 0
        for seq, payload in self.buffer:
            if seq >= start_seq:
                body = [self.topic, seq.to_bytes(8, "big"), payload]
                if self.args.replay_layout == "legacy":
                    body = body[1:]
                self.router.send_multipart([identity, b""] + body)
                sent += 1
        end = [b"", END_SEQ, b""] if self.args.replay_layout == "topic" else [END_SEQ, b""]
        self.router.send_multipart([identity, b""] + end)
        say(f"REPLAYED from={start_seq} count={sent}")

    def publish(self, count: int, rate: float, kind: str) -> None:
        interval = 1.0 / rate if rate > 0 else 0.0
        next_at = time.monotonic()
        for _ in range(count):
            if interval:
                self.service(next_at)
                next_at = max(next_at + interval, time.monotonic() - 0.05)
            self.send(kind)
        say(f"PUBLISHED epoch={self.epoch} next_seq={self.seq}")


def say(line: str) -> None:
    print(line, flush=True)


def fail(msg: str) -> None:
    print(f"ERROR {msg}", flush=True)
    sys.exit(2)


def run_script(pub: Publisher, steps: list[dict]) -> None:
    for step in steps:
        op = step["op"]
        if op == "publish":
            pub.publish(int(step.get("count", 1)), float(step.get("rate", 0)), step.get("kind", "stored"))
        elif op == "publish_fixture":
            with open(step["path"], "rb") as f:
                pub.send_payload(f.read())
            say(f"PUBLISHED epoch={pub.epoch} next_seq={pub.seq}")
        elif op == "skip":
            pub.seq += int(step["count"])
            say(f"SKIPPED next_seq={pub.seq}")
        elif op == "restart":
            pub.restart(int(step.get("down_ms", 0)))
        elif op == "serve":
            pub.service(time.monotonic() + float(step["ms"]) / 1000)
        elif op == "wait_subscriber":
            pub.wait_subscriber(int(step.get("count", 1)), float(step.get("timeout_s", 10)))
        elif op == "wait_stdin":
            line = sys.stdin.readline()
            say(f"GOT {line.strip()}")
        else:
            fail(f"unknown op {op}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    p.add_argument("--selfcheck", nargs="*", help="golden fixture JSON files to re-encode and compare")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    p.add_argument("--mode", choices=["bind", "connect"], default="bind")
    p.add_argument("--socket", choices=["pub", "xpub"], default="pub")
    p.add_argument("--replay-endpoint", default=None)
    p.add_argument("--replay-layout", choices=["topic", "legacy"], default="topic")
    p.add_argument("--topic", default="")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--buffer-steps", type=int, default=10000)
    p.add_argument("--hwm", type=int, default=100000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--script", default=None, help="JSON steps (default: read from stdin)")
    p.add_argument("--watchdog-s", type=float, default=60.0, help="hard exit after this long")
    args = p.parse_args()
    args.dp_rank_in_payload = args.dp_rank

    if args.selfcheck is not None:
        return selfcheck(args.engine, args.selfcheck)

    # Bounded lifetime even if the test driving us dies.
    timer = threading.Timer(args.watchdog_s, lambda: (say("ERROR watchdog"), sys.stdout.flush(), __import__("os")._exit(3)))
    timer.daemon = True
    timer.start()

    steps = json.loads(args.script if args.script is not None else sys.stdin.readline())
    pub = Publisher(args)
    run_script(pub, steps)
    say("DONE")
    pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
