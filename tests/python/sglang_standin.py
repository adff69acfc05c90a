#!/usr/bin/env python3
"""An SGLang engine stand-in whose KV-cache path is SGLang 0.5.23's own code.

What runs from the installed SGLang wheel (loaded by `sglang_loader.py`,
which documents exactly which package `__init__`s and leaf modules are
replaced and why none of them is on this path; `load()` fails if any
placeholder is touched):

* the cache: one `RadixCache` (built with `RadixCache.create_simulated`, the
  wheel's constructor for a tree without GPU pools) with its `RadixKey`
  (`cache_salt or None`, page alignment, `extra_key` namespaces), prefix
  match with node splits, insert, lock refs and LRU eviction of evictable
  leaves; `POST /flush_cache` calls `RadixCache.reset` (`AllBlocksCleared`);
* block hashes: the tree's `KVCacheEventRecorder` (`--kv-events-config`
  `format` "default" or "dynamo", `uses_dynamo_format`), SGLang's page chain
  (`get_hash_str` -> its `hash_binding.cpp`, compiled from the wheel),
  `namespaced_block_hash` for salted / LoRA namespaces; `KvEventLoraNames`
  built from the adapters as `Scheduler.init_kv_event_lora_names` does, each
  adapter's `lora_id` from `LoRARef.deterministic_id` (`--lora-paths name=path`);
* events: `RadixCache.take_events()` once per scheduler step, published as
  `KVEventBatch(ts, events)` through the publisher `EventPublisherFactory`
  builds from the `--kv-events-config` JSON (`ZmqEventPublisher`: PUB,
  replay ROUTER, replay buffer), as `SchedulerKvEventsPublisher` does.

What is this file's own (the parts of SGLang that need torch, a GPU or its
whole server, replaced by the smallest equivalent):

* `SlotAllocator`: the token-to-KV pool (`--max-total-tokens` slots) the
  tree frees evicted and duplicate slots into;
* the scheduler loop, following `mem_cache/common.py` and
  `RadixCache.checkpoint`: admission FCFS when the pool can hold the whole
  request (prompt + `max_tokens`, evicting LRU leaves; so no retraction);
  `match_prefix` with `limit = len(ids) - 1` (`Req._compute_max_prefix_len`);
  `cached_tokens` = the matched prefix; the prompt is inserted after its
  prefill (`checkpoint_kv_cache`) and prompt + output at finish
  (`release_kv_cache`, owned KV = all tokens but the last sampled one, with
  the prompt split as `_insert_cache(split_prompt=True)` does); one decode
  token per running request per step; output tokens are a fixed word cycle;
* request fields: `extra_key` / `cache_salt` go through the wheel's own
  `GenerateReqInput._normalize_single_inputs` ("" is None; see
  `sglang_loader.request_normalizer`); what `Req.__init__` does with them is
  this file's (`schedule_batch.py` needs torch): `cache_salt or None`, and a
  LoRA adapter (`model` "base:adapter" or `lora_path`) appends its `lora_id`
  to `extra_key`;
* the OpenAI server: `/v1/completions`, `/v1/chat/completions` (non-streamed
  and SSE; `usage.prompt_tokens_details.cached_tokens` as SGLang reports it
  with `--enable-cache-report`), `/health`, `/v1/models`. A chat body goes
  through SGLang's own chat preprocessing, run by `sglang_chat_render.py`
  from the wheel (`ChatCompletionRequest` validation, `serving_chat.py`'s
  `_validate_request` -> `_convert_to_internal_request` -> `_process_messages`
  -> `_apply_jinja_template`, the template rendered by transformers'
  `apply_chat_template` with the model's template and its bos/eos/pad/unk
  tokens, content format "auto"); a request it refuses is a 400 with its
  message, a body with `input_ids` uses them as they are, otherwise the ids
  are the rendered text encoded without special tokens, plus, for
  `continue_final_message`, the continued assistant text encoded on its own
  with special tokens and one leading BOS dropped
  (`_append_assistant_prefix_to_prompt_ids`). The tokenizer, and the
  rendering of `/v1/completions` prompts, are `vllm_standin.Frontend`'s (the
  Qwen3 tokenizer). `sglang_chat_render.load()` runs after
  `sglang_loader.load()` and joins its empty packages (`sglang`,
  `sglang.srt`, `sglang.srt.utils`, `sglang.srt.arg_groups`) instead of
  replacing them; both share `sglang.srt.environ` and `PLACEHOLDER_CALLS`
  (see `ChatRenderer`);
* `POST /tokenize` (and `/v1/tokenize`): the wheel's `TokenizeRequest`
  (`to_chat_completion_request`, which passes `add_generation_prompt` and
  `add_special_tokens` to the template path when given) and
  `OpenAIServingTokenize._tokenize_chat_request` (compiled from
  `serving_tokenize.py`) over the same chat serving object; a `prompt`
  string is encoded with the request's `add_special_tokens` (default true);
* debug endpoints: `GET /debug/cached_blocks` (every page key the tree holds,
  as its recorder publishes it: `_node_event_hash_values`, `_namespace_seed`,
  `namespaced_block_hash`; u64), `GET /debug/stats`.

Sockets: PUB `tcp://*:P` (SGLang binds a wildcard endpoint, its default
form) and replay ROUTER `tcp://127.0.0.1:R`; HTTP binds 127.0.0.1.
On start it prints one line to stdout:
  `sglang-standin: http=127.0.0.1:H zmq=P replay=R format=... page=N tokens=N`
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from array import array
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_loader  # noqa: E402
from vllm_standin import DEFAULT_MODEL_DIR, REPLY_WORDS, Frontend, free_port  # noqa: E402

U64 = (1 << 64) - 1


class SlotAllocator:
    """The KV pool: `size` token slots (what `TokenToKVPoolAllocator` hands out)."""

    device = "cpu"

    def __init__(self, size: int):
        self.size = size
        self.free: deque[int] = deque(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"pool exhausted: {n} > {len(self.free)}")
        return [self.free.popleft() for _ in range(n)]

    def free_segment(self, values, start_pos: int = 0) -> None:
        self.free.extend(int(v) for v in values)


class StandinReq:
    """What the tree and the scheduler read from `Req`."""

    def __init__(self, rid, ids, max_tokens, extra_key, cache_salt, lora_id, lora_name):
        self.rid = rid
        self.origin_input_ids = list(ids)
        self.output_ids: list[int] = []
        self.max_tokens = max_tokens
        # Req.__init__: the adapter's id is appended to the caller's extra_key.
        if lora_id is not None:
            extra_key = (extra_key or "") + lora_id
        self.extra_key = extra_key
        self.cache_salt = cache_salt or None
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.row: list[int] = []  # KV slots of every token computed so far
        self.protected_len = 0  # the tree-owned prefix of `row`
        self.cache_inserted_len = 0
        self.last_node = None
        self.reserved = 0  # slots still promised to decode
        self.cached_tokens = 0
        self.done = False
        self.out: deque = deque()
        self.cv = threading.Condition()

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class Engine:
    def __init__(self, s, args, reply_ids):
        self.s = s
        self.args = args
        self.page = args.page_size
        config = {
            "publisher": "zmq",
            # SGLang's default form: a wildcard host binds (the gateway's
            # endpoint table reads bind vs connect from this string).
            "endpoint": f"tcp://*:{args.zmq_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{args.replay_port}",
            "buffer_steps": args.buffer_steps,
            "topic": args.topic,
            "format": args.format,
        }
        self.kv_events_config = json.dumps(config)
        kv = s.kv_events
        self.dynamo = kv.uses_dynamo_format(self.kv_events_config)
        # `--lora-paths name=path`: ids as the server's lora hook derives them.
        LoRARef = s.lora_registry.LoRARef
        self.loras = {
            name: LoRARef(lora_id=LoRARef.deterministic_id(name, path), lora_name=name, lora_path=path)
            for name, path in (a.split("=", 1) for a in args.lora)
        }
        self.lora_names = s.events.KvEventLoraNames.from_lora_refs(self.loras.values())
        self.alloc = SlotAllocator(args.max_total_tokens)
        self.tree = s.radix.RadixCache.create_simulated(
            mock_allocator=self.alloc,
            page_size=self.page,
            enable_kv_cache_events=True,
            dynamo_kv_event_format=self.dynamo,
            kv_event_lora_names=self.lora_names,
        )
        self.publisher = kv.EventPublisherFactory.create(self.kv_events_config, attn_dp_rank=0)
        self.reply_ids = reply_ids
        self.lock = threading.Condition()
        self.waiting: deque[StandinReq] = deque()
        self.running: list[StandinReq] = []
        self.reserved = 0
        self.stats = {
            "steps": 0,
            "batches": 0,
            "stored_blocks": 0,
            "removed_blocks": 0,
            "cleared": 0,
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "salted_requests": 0,
            "lora_requests": 0,
        }
        # The tree's construction recorded AllBlocksCleared (RadixCache.reset):
        # published as the first batch, as the scheduler's first step would.
        self._publish_step_events()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
        self.thread.start()

    # -- the tree's API, as mem_cache/common.py drives it ---------------------------

    def _key(self, req: StandinReq, token_ids, limit=None):
        return self.s.radix.RadixKey(
            array("q", token_ids), req.extra_key, limit=limit, cache_salt=req.cache_salt
        )

    def _checkpoint(self, req: StandinReq, up_to: int, split_prompt: bool) -> None:
        """`RadixCache.checkpoint` without the req-to-token pool: insert the
        page-aligned computed tokens, free the slots the tree already had,
        adopt the tree's slots and move the lock to the new last node."""
        B = self.s.base
        torch = sys.modules["torch"]
        token_ids = req.all_ids()[:up_to]
        key = self._key(req, token_ids).page_aligned(self.page)
        values = torch.tensor(req.row[: len(key)])
        result = self.tree.insert(
            B.InsertParams(key=key, value=values, inserted_len=req.cache_inserted_len, priority=0)
        )
        req.cache_inserted_len = max(req.cache_inserted_len, len(key))
        if split_prompt:
            prompt_key = self._key(req, token_ids[: len(req.origin_input_ids)]).page_aligned(self.page)
            if 0 < len(prompt_key) < len(key):
                self.tree.insert(
                    B.InsertParams(
                        key=prompt_key,
                        value=values[: len(prompt_key)],
                        inserted_len=len(prompt_key),
                        priority=1,
                    )
                )
        self.alloc.free_segment(req.row[req.protected_len : result.prefix_len])
        match = self.tree.match_prefix(B.MatchPrefixParams(key=key))
        new_last = match.last_device_node
        new_indices = self.tree.path_device_indices(new_last).tolist()
        assert len(new_indices) == len(key), (len(new_indices), len(key))
        req.row[req.protected_len : len(new_indices)] = new_indices[req.protected_len :]
        req.protected_len = len(new_indices)
        self.tree.dec_lock_ref(req.last_node)
        self.tree.inc_lock_ref(new_last)
        req.last_node = new_last

    def _ensure_free(self, n: int) -> None:
        short = n - self.alloc.available_size()
        if short > 0:
            self.tree.evict(self.s.base.EvictParams(num_tokens=short))

    def _admit(self, req: StandinReq) -> bool:
        B = self.s.base
        ids = req.origin_input_ids
        match = self.tree.match_prefix(B.MatchPrefixParams(key=self._key(req, ids, limit=len(ids) - 1)))
        prefix = match.device_prefix_len
        self.tree.inc_lock_ref(match.last_device_node)
        need_now = len(ids) - prefix
        # The whole request must fit, so no running request is ever retracted.
        if need_now + req.max_tokens + self.reserved > self.alloc.available_size() + self.tree.evictable_size():
            self.tree.dec_lock_ref(match.last_device_node)
            return False
        self._ensure_free(need_now)
        req.last_node = match.last_device_node
        req.row = self.tree.path_device_indices(match.last_device_node).tolist() + self.alloc.alloc(need_now)
        req.protected_len = prefix
        req.cached_tokens = prefix
        req.reserved = req.max_tokens
        self.reserved += req.reserved
        s = self.stats
        s["requests"] += 1
        s["prompt_tokens"] += len(ids)
        s["cached_tokens"] += prefix
        s["salted_requests"] += req.cache_salt is not None
        s["lora_requests"] += req.lora_id is not None
        # The prefill computed every prompt token: checkpoint_kv_cache.
        self._checkpoint(req, len(ids), split_prompt=False)
        return True

    def _decode(self, req: StandinReq) -> None:
        n = len(req.origin_input_ids) + len(req.output_ids)
        tok = self.reply_ids[n % len(self.reply_ids)]
        req.output_ids.append(tok)
        # The new token's KV slot (written when it is fed back next step).
        self._ensure_free(1)
        req.row.extend(self.alloc.alloc(1))
        req.reserved -= 1
        self.reserved -= 1
        with req.cv:
            req.out.append(tok)
            req.cv.notify_all()

    def _finish(self, req: StandinReq) -> None:
        # release_kv_cache: the last sampled token has no KV yet.
        owned = len(req.origin_input_ids) + len(req.output_ids) - 1
        self._checkpoint(req, owned, split_prompt=True)
        self.alloc.free_segment(req.row[req.protected_len :])
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = None
        self.reserved -= req.reserved
        req.reserved = 0
        with req.cv:
            req.done = True
            req.cv.notify_all()

    def _publish_step_events(self) -> None:
        events = self.tree.take_events()
        if not events:
            return
        for e in events:
            name = type(e).__name__
            if name == "BlockStored":
                self.stats["stored_blocks"] += len(e.block_hashes)
            elif name == "BlockRemoved":
                self.stats["removed_blocks"] += len(e.block_hashes)
            elif name == "AllBlocksCleared":
                self.stats["cleared"] += 1
        self.publisher.publish(self.s.kv_events.KVEventBatch(ts=time.time(), events=events))
        self.stats["batches"] += 1

    def submit(self, req: StandinReq) -> None:
        with self.lock:
            self.waiting.append(req)
            self.lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.running:
                    self.lock.wait()
                prefill_tokens = 0
                while self.waiting:
                    req = self.waiting[0]
                    if not self._admit(req):
                        break
                    self.waiting.popleft()
                    prefill_tokens += len(req.origin_input_ids) - req.cached_tokens
                    self.running.append(req)
                still = []
                for req in self.running:
                    self._decode(req)
                    if len(req.output_ids) >= req.max_tokens:
                        self._finish(req)
                    else:
                        still.append(req)
                self.running = still
                self._publish_step_events()
                self.stats["steps"] += 1
            delay = self.args.step_ms / 1000.0 + prefill_tokens * self.args.prefill_us_per_token / 1e6
            if delay > 0:
                time.sleep(delay)

    # -- debug / admin ----------------------------------------------------------------

    def cached_keys(self) -> list[int]:
        """Every page key the tree holds, as its recorder publishes it."""
        rec = self.tree.kv_events
        kv = self.s.kv_events
        to_i64 = self.s.utils.hash_str_to_int64
        keys = set()
        with self.lock:
            stack = list(self.tree.root_node.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                seed = rec._namespace_seed(node)
                for h in rec._node_event_hash_values(node):
                    keys.add(kv.namespaced_block_hash(to_i64(h), namespace_seed=seed) & U64)
        return sorted(keys)

    def flush_cache(self) -> bool:
        """`/flush_cache`: only when idle, as `Scheduler.flush_cache`."""
        with self.lock:
            if self.waiting or self.running:
                return False
            self.tree.reset()
            self.alloc = SlotAllocator(self.args.max_total_tokens)
            self.tree.token_to_kv_pool_allocator = self.alloc
            self._publish_step_events()
        return True


class ChatRenderFailure(Exception):
    """`sglang_chat_render` failed on a request (not a refusal SGLang makes)."""


class ChatRenderer:
    """`/v1/chat/completions` prompts: SGLang's own chat preprocessing
    (`sglang_chat_render`, the wheel's `serving_chat.py` code), encoded by the
    stand-in's tokenizer as `OpenAIServingChat` encodes them."""

    SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")

    def __init__(self, frontend: Frontend, model_dir: Path, served_model_name: str):
        self.frontend = frontend
        self.R, self.chat = self._load()
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        # What transformers passes the template: the tokenizer's special tokens
        # (Frontend's strings from tokenizer_config.json).
        special = {k: v for k, v in frontend.special.items() if k in self.SPECIAL}
        self.serving = self.R.make_serving(
            self.chat,
            {
                "template": cfg["chat_template"],
                "special_tokens": special,
                "content_format": "auto",
                "served_model_name": served_model_name,
            },
        )
        # tokenizer.bos_token_id (None when the config has no bos_token).
        bos = special.get("bos_token")
        self.bos_token_id = frontend.tokenizer.token_to_id(bos) if bos else None
        # The wheel's serving object and its tokenizer stand-in are used from
        # one asyncio thread in SGLang; here handler threads take turns.
        self.lock = threading.Lock()

    @staticmethod
    def _load():
        """`sglang_chat_render.load()` after `sglang_loader.load()`. Both
        install empty packages over the wheel's directories; the second load
        joins the first's (`sglang_loader._shell_package`), and modules both
        import (`sglang.srt.environ`) load once. Afterwards no module the KV
        path loaded may have been replaced."""
        L = sglang_loader
        if L._LOADED is None:
            raise RuntimeError("sglang-standin: sglang_loader.load() must run first")
        before = {
            name: mod for name, mod in sys.modules.items() if name in ("sglang", "torch") or name.startswith("sglang.")
        }
        import sglang_chat_render as R

        chat = R.load()
        replaced = sorted(n for n, m in before.items() if sys.modules.get(n) is not m)
        if replaced:
            raise RuntimeError(f"sglang-standin: the chat path replaced {replaced}")
        if R.PLACEHOLDER_CALLS is not L.PLACEHOLDER_CALLS:
            raise RuntimeError("sglang-standin: the two loaders record placeholders apart")
        L.check()
        return R, chat

    def render(self, body: dict) -> dict:
        """`render_one`'s answer for `body`. It empties `PLACEHOLDER_CALLS`
        (shared with the KV path) to check its own calls: what was recorded
        before is put back, so `sglang_loader.check()` still sees it."""
        calls = sglang_loader.PLACEHOLDER_CALLS
        with self.lock:
            saved = list(calls)
            try:
                return self.R.render_one(self.chat, self.serving, body)
            except Exception as e:  # its own checks (placeholders, prompt shape)
                raise ChatRenderFailure(f"{type(e).__name__}: {e}") from e
            finally:
                calls[:0] = saved

    def _ids_of(self, parts) -> list[int]:
        """The ids of what the chat path asked to encode: the rendered text
        with its encode arguments (specials only when asked), then a
        continued assistant text (specials, one leading BOS dropped)."""
        ids: list[int] = []
        for part in parts:
            if isinstance(part, self.R._Rendered):
                add = bool(part.encode_kwargs.get("add_special_tokens", False))
                ids += self.frontend.encode(part.text, add_special_tokens=add)
            elif isinstance(part, self.R._Prefix):
                extra = self.frontend.encode(part.text, add_special_tokens=True)
                if extra and extra[0] == self.bos_token_id:
                    extra = extra[1:]
                ids += extra
            elif type(part) is int:
                ids.append(part)
            else:
                raise ChatRenderFailure(f"unexpected prompt part {part!r}")
        return ids

    def tokenize_ids(self, body: dict) -> list[int]:
        """SGLang's `POST /tokenize` for `body`; ValueError for a request it
        refuses."""
        from pydantic import TypeAdapter, ValidationError

        protocol = self.chat.protocol
        try:
            request = TypeAdapter(protocol.TokenizeRequest).validate_python(body, from_attributes=True)
        except ValidationError as e:
            raise ValueError(str(e)) from e
        if request.messages is None:
            if not isinstance(request.prompt, str):
                raise ValueError("the stand-in tokenizes one prompt string")
            return self.frontend.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        calls = sglang_loader.PLACEHOLDER_CALLS
        with self.lock:
            saved = list(calls)
            del calls[:]
            try:
                tok = self.tokenize_serving(request)
            except ValueError:
                raise
            except Exception as e:
                raise ChatRenderFailure(f"{type(e).__name__}: {e}") from e
            finally:
                used = list(calls)
                calls[:] = saved
            if used:
                raise ChatRenderFailure(f"placeholders used: {used}")
        if isinstance(tok, str):
            return self.frontend.encode(tok, add_special_tokens=False)
        return self._ids_of(tok)

    def tokenize_serving(self, request):
        """`OpenAIServingTokenize._tokenize_chat_request` from the wheel, bound
        to this renderer's chat serving object (built once)."""
        if not hasattr(self, "_tokenize"):
            methods = self.R.wheel_methods(
                "srt/entrypoints/openai/serving_tokenize.py",
                "OpenAIServingTokenize",
                ["_tokenize_chat_request"],
                # The module's annotations are evaluated at definition.
                {"List": list, "TokenizeRequest": self.chat.protocol.TokenizeRequest},
            )
            cls = type("OpenAIServingTokenize", (self.R._Strict,), methods)
            self._tokenize = cls(
                chat_serving=self.serving,
                tokenizer_manager=self.R._Strict(
                    # A text answer is encoded by the caller (tokenize_ids).
                    tokenizer=self.R._Strict(encode=lambda text, **kw: text),
                    model_config=self.R._Strict(is_multimodal=False),
                ),
            )
        return self._tokenize._tokenize_chat_request(request)

    def prompt_ids(self, body: dict) -> list[int]:
        """The ids SGLang's `/v1/chat/completions` schedules; ValueError for a
        request SGLang refuses (the message is its own)."""
        out = self.render(body)
        if "err" in out:
            raise ValueError(out["err"])
        if "input_ids" in out:
            ids = out["input_ids"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise ValueError("input_ids must be a non-empty list of token ids")
            return list(ids)
        # _render_and_encode_chat_template: specials are in the rendered text.
        ids = self.frontend.encode(out["ok"])
        prefix = out.get("assistant_prefix")
        if prefix:
            # _append_assistant_prefix_to_prompt_ids: tokenizer.encode(prefix)
            # (add_special_tokens defaults to True), one leading BOS dropped.
            extra = self.frontend.encode(prefix, add_special_tokens=True)
            if extra and extra[0] == self.bos_token_id:
                extra = extra[1:]
            ids += extra
        return ids


def usage(req: StandinReq) -> dict:
    n_in = len(req.origin_input_ids)
    n_out = len(req.output_ids)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def make_handler(engine: Engine, frontend: Frontend, chat_renderer: ChatRenderer, model: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            return

        def _json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._json(status, {"object": "error", "message": message, "type": "BadRequestError", "code": status})

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            elif path == "/v1/models":
                data = [{"id": model, "object": "model"}]
                data += [{"id": f"{model}:{n}", "object": "model", "parent": model} for n in engine.loras]
                self._json(200, {"object": "list", "data": data})
            elif path == "/debug/cached_blocks":
                keys = engine.cached_keys()
                self._json(200, {"page_size": engine.page, "count": len(keys), "keys": keys})
            elif path == "/debug/stats":
                with engine.lock:
                    st = dict(engine.stats)
                    st["free_slots"] = engine.alloc.available_size()
                    st["evictable_tokens"] = engine.tree.evictable_size()
                st["format"] = engine.args.format
                st["kv_events_config"] = engine.kv_events_config
                st["lora_ids"] = {n: r.lora_id for n, r in engine.loras.items()}
                self._json(200, st)
            else:
                self._error(404, f"no route {path}")

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            if path == "/flush_cache":
                if engine.flush_cache():
                    self.send_response(200)
                    self.send_header("content-length", "0")
                    self.end_headers()
                else:
                    self._error(400, "Cache not flushed: there are running or waiting requests")
                return
            if path not in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/tokenize"):
                self._error(404, f"no route {path}")
                return
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("body must be an object")
            except ValueError as e:
                self._error(400, f"invalid JSON: {e}")
                return
            if path in ("/tokenize", "/v1/tokenize"):
                try:
                    ids = chat_renderer.tokenize_ids(body)
                except ChatRenderFailure as e:
                    self._error(500, f"sglang-standin: {e}")
                    return
                except ValueError as e:
                    self._error(400, str(e))
                    return
                self._json(200, {"tokens": ids, "count": len(ids), "max_model_len": engine.args.max_total_tokens})
                return
            chat = path == "/v1/chat/completions"
            try:
                if chat:
                    ids = chat_renderer.prompt_ids(body)
                else:
                    prompt = body.get("prompt")
                    if isinstance(prompt, str) and prompt:
                        ids = frontend.encode(prompt, add_special_tokens=True)
                    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                        ids = list(prompt)
                    else:
                        raise ValueError("prompt must be a non-empty string or token list")
                cache_salt, extra_key = engine.s.normalize_request(body.get("cache_salt"), body.get("extra_key"))
                # OpenAIServingBase._resolve_lora_path: "base:adapter" wins over lora_path.
                name = body.get("model") or model
                adapter = name.split(":", 1)[1].strip() if ":" in name and name != model else None
                adapter = adapter or body.get("lora_path") or None
                lora = None
                if adapter is not None:
                    lora = engine.loras.get(adapter)
                    if lora is None:
                        raise ValueError(f"LoRA adapter {adapter!r} is not loaded")
            except ChatRenderFailure as e:  # the harness, not the request
                self._error(500, f"sglang-standin: {e}")
                return
            except Exception as e:
                self._error(400, str(e))
                return
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if not isinstance(max_tokens, int) or max_tokens < 1:
                self._error(400, "max_tokens must be a positive integer")
                return
            if len(ids) + max_tokens > engine.args.max_total_tokens:
                self._error(400, f"prompt ({len(ids)} tokens) + max_tokens exceeds the KV pool")
                return
            req = StandinReq(
                rid=uuid.uuid4().hex,
                ids=ids,
                max_tokens=max_tokens,
                extra_key=extra_key,
                cache_salt=cache_salt,
                lora_id=lora.lora_id if lora else None,
                lora_name=lora.lora_name if lora else None,
            )
            with engine.lock:
                # Scheduler._record_kv_event_lora_name, at admission of the request.
                if req.lora_id is not None:
                    engine.lora_names.register(req, req.lora_name)
            engine.submit(req)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(req, chat, include_usage, name)
            else:
                self._whole(req, chat, name)

        def _tokens(self, req: StandinReq):
            deadline = time.monotonic() + 600
            while True:
                with req.cv:
                    while not req.out and not req.done:
                        if not req.cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                            raise TimeoutError("engine did not answer")
                    toks = list(req.out)
                    req.out.clear()
                    done = req.done
                if toks:
                    yield toks
                if done:
                    return

        def _whole(self, req: StandinReq, chat: bool, name: str) -> None:
            ids = [t for chunk in self._tokens(req) for t in chunk]
            text = frontend.decode(ids)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                obj = "text_completion"
            self._json(
                200,
                {
                    "id": req.rid,
                    "object": obj,
                    "created": int(time.time()),
                    "model": name,
                    "choices": [choice],
                    "usage": usage(req),
                },
            )

        def _chunk(self, payload: str) -> None:
            data = payload.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _stream(self, req: StandinReq, chat: bool, include_usage: bool, name: str) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            obj = "chat.completion.chunk" if chat else "text_completion"
            base = {"id": req.rid, "object": obj, "created": int(time.time()), "model": name}
            first = True
            for toks in self._tokens(req):
                for t in toks:
                    text = frontend.decode([t])
                    if chat:
                        delta = {"role": "assistant", "content": text} if first else {"content": text}
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                    first = False
                    self._chunk("data: " + json.dumps({**base, "choices": [choice]}) + "\n\n")
            last = (
                {"index": 0, "delta": {}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
            )
            self._chunk("data: " + json.dumps({**base, "choices": [last]}) + "\n\n")
            if include_usage:
                self._chunk("data: " + json.dumps({**base, "choices": [], "usage": usage(req)}) + "\n\n")
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0 = ephemeral)")
    ap.add_argument("--zmq-port", type=int, default=0, help="KV-event PUB port (0 = pick a free one)")
    ap.add_argument("--replay-port", type=int, default=0, help="replay ROUTER port (0 = pick a free one)")
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--page-size", type=int, default=16, help="--page-size (tokens per page)")
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool size in tokens")
    ap.add_argument("--format", default="default", choices=["default", "dynamo"], help="--kv-events-config format")
    ap.add_argument("--topic", default="", help="--kv-events-config topic")
    ap.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer (SGLang's default 10000)")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="--lora-paths entry")
    ap.add_argument("--step-ms", type=float, default=1.0, help="time per scheduler step")
    ap.add_argument("--prefill-us-per-token", type=float, default=0.0, help="extra delay per uncached prompt token")
    args = ap.parse_args()

    frontend = Frontend(args.model_dir)
    if args.zmq_port == 0:
        args.zmq_port = free_port()
    if args.replay_port == 0:
        args.replay_port = free_port()
    s = sglang_loader.load()
    chat_renderer = ChatRenderer(frontend, args.model_dir, args.model)
    engine = Engine(s, args, frontend.encode(REPLY_WORDS))
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), make_handler(engine, frontend, chat_renderer, args.model)
    )
    server.daemon_threads = True
    sglang_loader.check()
    print(
        f"sglang-standin: http=127.0.0.1:{server.server_address[1]} zmq={args.zmq_port} "
        f"replay={args.replay_port} format={args.format} page={args.page_size} "
        f"tokens={args.max_total_tokens} sglang={s.root}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        engine.publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
