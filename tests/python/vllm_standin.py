#!/usr/bin/env python3
"""A vLLM engine stand-in whose KV-cache path is vLLM 0.33.0's own code.

What runs from the installed vLLM wheel (loaded by `vllm_loader.py`, which
documents exactly which package `__init__`s and leaf modules are replaced by
placeholders and why none of them is on this path; `load()` fails if any
placeholder is touched):

* block hashing: `kv_cache_utils.init_none_hash` (NONE_HASH from
  PYTHONHASHSEED, or vLLM's fixed root for sha256/sha256_cbor when it is unset)
  and `get_request_block_hasher` with `vllm.utils.hashing.get_hash_fn_by_name`
  (`--hash sha256` = vLLM's default pickle hash, `sha256_cbor`, `xxhash`...);
* the cache: one `BlockPool` (`--num-blocks` including vLLM's null block) with
  its `FreeKVCacheBlockQueue` LRU; a prefix hit is the full-attention lookup
  of `FullAttentionManager.find_longest_cache_hit` (`get_cached_block` per
  block hash until the first miss, at most `num_tokens - 1` tokens), then
  `touch`, `get_new_blocks` (which evicts LRU cached blocks, emitting
  `BlockRemoved`), `cache_full_blocks` (emitting `BlockStored`), and at finish
  `free_blocks(reversed(blocks))` as `SingleTypeKVCacheManager.free` does;
  a request whose `vllm_xargs` set `kv_cache_report_mode: "full"` has its
  prefix hit announced by `BlockPool.emit_cached_block_events`, as
  `KVCacheManager.get_computed_blocks` does;
  `POST /reset_prefix_cache` calls `BlockPool.reset_prefix_cache`
  (`AllBlocksCleared`);
* events: the pool's `take_events()` once per engine step, published as one
  `KVEventBatch(ts, events)` through `ZmqEventPublisher` (PUB socket, replay
  ROUTER, `--buffer-steps` replay buffer), as `Scheduler.update_from_output` does.

What is this file's own (the parts of vLLM that are too heavy to run without
torch, replaced by the smallest equivalent):

* `StandinRequest`: the attributes of `vllm.v1.request.Request` that the hasher
  and the pool read (`all_token_ids`, `num_tokens`, `block_hashes`,
  `mm_features`, `lora_request`, `cache_salt`, `prompt_embeds`, `session_id`),
  with `update_block_hashes()` as `Request` calls it on creation and after
  each appended output token;
* the scheduler loop: FCFS admission when the pool has the blocks the request
  can ever need (so no preemption), one decode token per running request per
  step, full blocks cached up to the computed tokens (`num_tokens - 1`);
  output tokens are a fixed word cycle (no model);
* the OpenAI server: `/v1/completions`, `/v1/chat/completions` (non-streamed
  and SSE; usage with `prompt_tokens_details.cached_tokens` as vLLM reports
  with `--enable-prompt-tokens-details`: the prefix-hit tokens), `/health`,
  `/v1/models`, `POST /tokenize` (completions form: the ids a text prompt
  runs as); a completions `prompt` is a string (tokenized with
  `add_special_tokens`, default true, as vLLM's renderer does) or a list of
  token ids run verbatim; the chat template is rendered as transformers does
  (`ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks)`, loopcontrols,
  `tojson` = `json.dumps(ensure_ascii=False)`; string and text-part contents
  joined with "\\n", empty parts dropped), tokenized with the Qwen3
  `tokenizer.json` (`add_special_tokens=False` for chat). `--selfcheck-chat`
  compares this rendering and the ids with `golden/chat/qwen3_cases.json`
  (produced by vLLM's own renderer) for every plain-text chat case;
* P/D: a body with `kv_transfer_params.do_remote_decode` gets the
  `kv_transfer_params` vLLM's NixlConnector answers with (its blocks are freed at
  once, not held until the decode side reads them); one with `do_remote_prefill`
  reports the whole prompt as cached (the external tokens vLLM counts);
* debug endpoints: `GET /debug/cached_blocks` (the 64-bit event keys of every
  hash in the pool's `cached_block_hash_to_block`, via vLLM's
  `maybe_convert_block_hash`), `GET /debug/stats` (counters, and the form and
  ids of the last completions prompt: text or ids as received).

Sockets: vLLM's publisher binds its PUB socket only for endpoints containing
`*` (it connects otherwise), so PUB is `tcp://*:PORT` (vLLM's default form);
the replay ROUTER binds `tcp://127.0.0.1:PORT`; HTTP binds 127.0.0.1.
On start it prints one line to stdout:
  `vllm-standin: http=127.0.0.1:H zmq=P replay=R hash=... seed=... blocks=N`
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_loader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO / "golden" / "tokenizers" / "qwen3"
REPLY_WORDS = " The quick brown fox jumps over the lazy dog while seven wizards quietly hum old songs."


class StandinRequest:
    """What `BlockPool` and the block hasher read from `vllm.v1.request.Request`."""

    def __init__(self, request_id, prompt_token_ids, max_tokens, block_hasher, cache_salt=None, remote_prefill=False):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self._all_token_ids
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.mm_features: list = []
        self.lora_request = None
        self.cache_salt = cache_salt or None
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict = {}
        self.session_id = None
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()
        # Scheduler state (ours).
        self.blocks: list = []
        self.num_cached_tokens = 0
        self.remote_prefill = remote_prefill
        self.block_ids: list[int] = []
        self.reserved_blocks = 0
        self.done = False
        self.out: deque = deque()
        self.cv = threading.Condition()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def update_block_hashes(self) -> None:
        self.block_hashes.extend(self._block_hasher(self))

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.update_block_hashes()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Engine:
    def __init__(self, v, args, reply_ids):
        self.v = v
        self.args = args
        self.block_size = args.block_size
        self.hash_fn = v.hashing.get_hash_fn_by_name(args.hash)
        v.kv_cache_utils.init_none_hash(self.hash_fn)
        self.none_hash_seed = v.kv_cache_utils.get_none_hash_seed()
        self.hasher = v.kv_cache_utils.get_request_block_hasher(self.block_size, self.hash_fn)
        self.pool = v.block_pool.BlockPool(
            num_gpu_blocks=args.num_blocks,
            enable_caching=True,
            hash_block_size=self.block_size,
            enable_kv_cache_events=True,
        )
        self.publisher = v.kv_events.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=f"tcp://*:{args.zmq_port}",
            replay_endpoint=f"tcp://127.0.0.1:{args.replay_port}",
            buffer_steps=args.buffer_steps,
        )
        self.reply_ids = reply_ids
        self.lock = threading.Condition()
        self.waiting: deque[StandinRequest] = deque()
        self.running: list[StandinRequest] = []
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
            # /v1/completions prompts by the form they arrived in.
            "completion_prompts_text": 0,
            "completion_prompts_ids": 0,
        }
        # The last /v1/completions prompt: its form and the ids it ran.
        self.last_completion_prompt: dict | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="engine-core")
        self.thread.start()

    # -- scheduling -------------------------------------------------------------------

    def capacity_tokens(self) -> int:
        return (self.args.num_blocks - 1) * self.block_size

    def submit(self, req: StandinRequest) -> None:
        with self.lock:
            self.waiting.append(req)
            self.lock.notify_all()

    def _longest_cache_hit(self, req: StandinRequest) -> list:
        # FullAttentionManager.find_longest_cache_hit for one group, block size
        # == hash block size; the last token is always recomputed.
        max_length = req.num_tokens - 1
        hit = []
        for block_hash in req.block_hashes[: max_length // self.block_size]:
            cached = self.pool.get_cached_block(block_hash, [0])
            if not cached:
                break
            hit.append(cached[0])
        return hit

    def _admit(self, req: StandinRequest) -> bool:
        bs = self.block_size
        computed = self._longest_cache_hit(req)
        total = cdiv(req.num_prompt_tokens + req.max_tokens, bs)
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        need_now = cdiv(req.num_tokens, bs) - len(computed)
        need_total = total - len(computed)
        if need_total + evictable_hits + self.reserved > self.pool.get_num_free_blocks():
            return False
        if computed and getattr(req, "kv_cache_report_mode", "incremental") == "full":
            # KVCacheManager.get_computed_blocks: a request asking for full
            # reports announces the blocks it found cached, as BlockStored
            # events shaped like new stores (BlockPool.emit_cached_block_events).
            self.pool.emit_cached_block_events(req, len(computed), bs, 0)
        self.pool.touch(computed)
        new = self.pool.get_new_blocks(need_now) if need_now > 0 else []
        req.blocks = list(computed) + new
        req.reserved_blocks = need_total - need_now
        self.reserved += req.reserved_blocks
        req.num_cached_tokens = len(computed) * bs
        if req.remote_prefill:
            # The prompt's KV arrived from the prefill instance: vLLM counts
            # those external tokens as computed (and cached) too.
            req.num_cached_tokens = req.num_prompt_tokens
        req.block_ids = [b.block_id for b in req.blocks]
        num_full = req.num_tokens // bs
        self.pool.cache_full_blocks(
            request=req,
            blocks=req.blocks,
            num_cached_blocks=len(computed),
            num_full_blocks=num_full,
            block_size=bs,
            kv_cache_group_id=0,
        )
        req.num_cached_blocks = max(num_full, len(computed))
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += req.num_prompt_tokens
        self.stats["cached_tokens"] += req.num_cached_tokens
        return True

    def _decode(self, req: StandinRequest) -> None:
        bs = self.block_size
        tok = self.reply_ids[(req.num_prompt_tokens + len(req.output_token_ids)) % len(self.reply_ids)]
        req.append_output_token_ids(tok)
        # The sampled token's KV is computed in the next step: cache what is computed.
        computed_tokens = req.num_tokens - 1
        if len(req.blocks) * bs < req.num_tokens and req.reserved_blocks > 0:
            req.blocks.extend(self.pool.get_new_blocks(1))
            req.reserved_blocks -= 1
            self.reserved -= 1
        num_full = computed_tokens // bs
        if num_full > req.num_cached_blocks:
            self.pool.cache_full_blocks(
                request=req,
                blocks=req.blocks,
                num_cached_blocks=req.num_cached_blocks,
                num_full_blocks=num_full,
                block_size=bs,
                kv_cache_group_id=0,
            )
            req.num_cached_blocks = num_full
        with req.cv:
            req.out.append(tok)
            req.cv.notify_all()

    def _finish(self, req: StandinRequest) -> None:
        self.pool.free_blocks(reversed(req.blocks))
        self.reserved -= req.reserved_blocks
        req.reserved_blocks = 0
        req.blocks = []
        with req.cv:
            req.done = True
            req.cv.notify_all()

    def _publish_step_events(self) -> None:
        events = self.pool.take_events()
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
        self.publisher.publish(self.v.kv_events.KVEventBatch(ts=time.time(), events=events))
        self.stats["batches"] += 1

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
                    prefill_tokens += max(0, req.num_tokens - req.num_cached_tokens)
                    self.running.append(req)
                still = []
                for req in self.running:
                    self._decode(req)
                    if len(req.output_token_ids) >= req.max_tokens:
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
        kcu = self.v.kv_cache_utils
        with self.lock:
            keys = {
                kcu.maybe_convert_block_hash(kcu.get_block_hash(k))
                for k in self.pool.cached_block_hash_to_block._cache
            }
        return sorted(keys)

    def reset_prefix_cache(self) -> bool:
        with self.lock:
            ok = self.pool.reset_prefix_cache()
            self._publish_step_events()
        return ok


class Frontend:
    """Tokenizer and chat template of the served model."""

    def __init__(self, model_dir: Path):
        import jinja2.sandbox
        from jinja2.ext import loopcontrols
        from tokenizers import Tokenizer

        raw = (model_dir / "tokenizer.json.gz").read_bytes()
        self.tokenizer = Tokenizer.from_str(gzip.decompress(raw).decode("utf-8"))
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.special = {
            k: cfg.get(k)
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if isinstance(cfg.get(k), str)
        }
        self.special["additional_special_tokens"] = cfg.get("additional_special_tokens", [])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.template = env.from_string(cfg["chat_template"])

    @staticmethod
    def template_messages(messages: list) -> list:
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError("each message needs a string role")
            m = dict(m)
            content = m.get("content")
            if content is None:
                content = []
            if isinstance(content, list):
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") not in ("text", "input_text", "output_text"):
                        raise ValueError("only text content parts are supported by the stand-in")
                    t = p.get("text")
                    if t:
                        parts.append(t)
                content = "\n".join(parts)
            elif not isinstance(content, str):
                raise ValueError("content must be a string or a list of parts")
            m["content"] = content
            if "reasoning_content" in m and "reasoning" not in m:
                m["reasoning"] = m.pop("reasoning_content")
            if "reasoning" in m:
                m["reasoning_content"] = m["reasoning"]
            out.append(m)
        return out

    def render_chat(self, messages: list, add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        if not messages:
            raise ValueError("messages must not be empty")
        variables = dict(self.special)
        variables.update(extra or {})
        variables.update(
            messages=self.template_messages(messages),
            tools=None,
            add_generation_prompt=add_generation_prompt,
        )
        return self.template.render(**variables)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def selfcheck_chat(frontend: Frontend) -> int:
    cases = json.loads((REPO / "golden" / "chat" / "qwen3_cases.json").read_text())["cases"]
    checked = 0
    for c in cases:
        req = c.get("request")
        if c["endpoint"] != "chat" or c.get("error") or not req or c.get("rendered_prompt") is None:
            continue
        simple = set(req) <= {"model", "messages", "max_tokens"} and all(
            set(m) <= {"role", "content"} and m["role"] in ("system", "user", "assistant") for m in req["messages"]
        )
        if not simple:
            continue
        try:
            text = frontend.render_chat(req["messages"])
        except ValueError:
            continue
        if text != c["rendered_prompt"]:
            raise SystemExit(f"selfcheck: {c['id']}: rendered prompt differs from vLLM's")
        if frontend.encode(text) != c["token_ids"]:
            raise SystemExit(f"selfcheck: {c['id']}: token ids differ from vLLM's")
        checked += 1
    if checked < 5:
        raise SystemExit(f"selfcheck: only {checked} plain chat cases checked")
    return checked


def usage(req: StandinRequest) -> dict:
    n_out = len(req.output_token_ids)
    return {
        "prompt_tokens": req.num_prompt_tokens,
        "completion_tokens": n_out,
        "total_tokens": req.num_prompt_tokens + n_out,
        "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens},
    }


def make_handler(engine: Engine, frontend: Frontend, model: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: the test reads stdout
            return

        def _json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._json(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            elif path == "/debug/cached_blocks":
                keys = engine.cached_keys()
                self._json(
                    200,
                    {
                        "block_size": engine.block_size,
                        "num_blocks": engine.args.num_blocks,
                        "free_blocks": engine.pool.get_num_free_blocks(),
                        "count": len(keys),
                        "keys": keys,
                    },
                )
            elif path == "/debug/stats":
                with engine.lock:
                    s = dict(engine.stats)
                    s["last_completion_prompt"] = engine.last_completion_prompt
                s["none_hash_seed"] = engine.none_hash_seed
                s["hash"] = engine.args.hash
                s["publisher"] = {
                    k: v
                    for k, v in engine.publisher.get_publisher_config().__dict__.items()
                    if isinstance(v, (str, int, bool, type(None)))
                }
                self._json(200, s)
            else:
                self._error(404, f"no route {path}")

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            if path == "/reset_prefix_cache":
                ok = engine.reset_prefix_cache()
                if ok:
                    self.send_response(200)
                    self.send_header("content-length", "0")
                    self.end_headers()
                else:
                    self._error(500, "reset_prefix_cache failed: blocks in use")
                return
            if path == "/tokenize":
                # vLLM's /tokenize (completions form): the ids its renderer
                # would run for this prompt text.
                try:
                    body = json.loads(raw)
                    text = body["prompt"]
                    if not isinstance(text, str):
                        raise ValueError("prompt must be a string")
                    tokens = frontend.encode(text, add_special_tokens=body.get("add_special_tokens", True) is not False)
                except (ValueError, KeyError, TypeError) as e:
                    self._error(400, f"invalid request: {e}")
                    return
                self._json(200, {"count": len(tokens), "max_model_len": engine.capacity_tokens(), "tokens": tokens})
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._error(404, f"no route {path}")
                return
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("body must be an object")
            except ValueError as e:
                self._error(400, f"invalid JSON: {e}")
                return
            chat = path == "/v1/chat/completions"
            try:
                if chat:
                    ids = frontend.encode(
                        frontend.render_chat(
                            body.get("messages") or [],
                            add_generation_prompt=body.get("add_generation_prompt", True),
                            extra=body.get("chat_template_kwargs") or None,
                        )
                    )
                else:
                    prompt = body.get("prompt")
                    if isinstance(prompt, str) and prompt:
                        # vLLM: a string is tokenized with add_special_tokens
                        # (completions default true)...
                        ids = frontend.encode(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)
                        form = "text"
                    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                        # ...a token list is run verbatim (`prompt_token_ids`),
                        # each id >= 0 (the pydantic schema) and in the vocabulary.
                        vocab = frontend.tokenizer.get_vocab_size(with_added_tokens=True)
                        bad = [t for t in prompt if t < 0 or t >= vocab]
                        if bad:
                            raise ValueError(f"token id {bad[0]} is out of vocabulary")
                        ids = list(prompt)
                        form = "ids"
                    else:
                        raise ValueError("prompt must be a non-empty string or token list")
                    with engine.lock:
                        engine.stats[f"completion_prompts_{form}"] += 1
                        engine.last_completion_prompt = {"form": form, "token_ids": ids}
            except Exception as e:  # template errors are 400s in vLLM too
                self._error(400, str(e))
                return
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            if not isinstance(max_tokens, int) or max_tokens < 1:
                self._error(400, "max_tokens must be a positive integer")
                return
            if len(ids) + max_tokens > engine.capacity_tokens():
                self._error(
                    400,
                    f"prompt ({len(ids)} tokens) + max_tokens exceeds the KV capacity "
                    f"of {engine.capacity_tokens()} tokens",
                )
                return
            params = body.get("kv_transfer_params") or {}
            if not isinstance(params, dict):
                params = {}
            req = StandinRequest(
                request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                prompt_token_ids=ids,
                max_tokens=max_tokens,
                block_hasher=engine.hasher,
                cache_salt=body.get("cache_salt"),
                remote_prefill=bool(params.get("do_remote_prefill")) and engine.args.role != "prefill",
            )
            req.remote_decode = bool(params.get("do_remote_decode")) and engine.args.role != "decode"
            # vLLM's `vllm_xargs` become the request's sampling extra_args
            # (`Request.kv_cache_report_mode`, default "incremental").
            xargs = body.get("vllm_xargs") or {}
            req.kv_cache_report_mode = (
                xargs.get("kv_cache_report_mode", "incremental") if isinstance(xargs, dict) else "incremental"
            )
            engine.submit(req)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(req, chat, include_usage)
            else:
                self._whole(req, chat)

        def _tokens(self, req: StandinRequest):
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

        def _whole(self, req: StandinRequest, chat: bool) -> None:
            ids = [t for chunk in self._tokens(req) for t in chunk]
            text = frontend.decode(ids)
            created = int(time.time())
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                obj = "text_completion"
            answer = {
                "id": req.request_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(req),
            }
            if req.remote_decode:
                # What vLLM's NixlConnector hands back for the decode instance.
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": req.block_ids,
                    "remote_engine_id": f"standin-{self.server.server_address[1]}",
                    "remote_request_id": req.request_id,
                    "remote_host": "127.0.0.1",
                    "remote_port": self.server.server_address[1],
                    "tp_size": 1,
                }
            self._json(200, answer)

        def _chunk(self, payload: str) -> None:
            data = payload.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _stream(self, req: StandinRequest, chat: bool, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            created = int(time.time())
            obj = "chat.completion.chunk" if chat else "text_completion"
            base = {"id": req.request_id, "object": obj, "created": created, "model": model}
            first = True
            for toks in self._tokens(req):
                for t in toks:
                    text = frontend.decode([t])
                    if chat:
                        delta = {"content": text}
                        if first:
                            delta = {"role": "assistant", "content": text}
                        choice = {"index": 0, "delta": delta, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                    first = False
                    self._chunk("data: " + json.dumps({**base, "choices": [choice]}) + "\n\n")
            if chat:
                last = {"index": 0, "delta": {}, "finish_reason": "length"}
            else:
                last = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
            self._chunk("data: " + json.dumps({**base, "choices": [last]}) + "\n\n")
            if include_usage:
                self._chunk("data: " + json.dumps({**base, "choices": [], "usage": usage(req)}) + "\n\n")
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--port", type=int, default=0, help="HTTP port on 127.0.0.1 (0 = ephemeral)")
    ap.add_argument("--zmq-port", type=int, default=0, help="KV-event PUB port (0 = pick a free one)")
    ap.add_argument("--replay-port", type=int, default=0, help="replay ROUTER port (0 = pick a free one)")
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--hash", default="sha256_cbor", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
                    help="--prefix-caching-hash-algo (vLLM's default is sha256)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV capacity in blocks (incl. the null block)")
    ap.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer (vLLM's default 10000)")
    ap.add_argument("--step-ms", type=float, default=1.0, help="time per engine step")
    ap.add_argument("--prefill-us-per-token", type=float, default=0.0, help="extra delay per uncached prompt token")
    ap.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                    help="P/D role (as a NixlConnector kv_producer / kv_consumer / kv_both)")
    ap.add_argument("--selfcheck-chat", action="store_true", help="check chat rendering against golden/chat and exit")
    args = ap.parse_args()

    frontend = Frontend(args.model_dir)
    if args.selfcheck_chat:
        n = selfcheck_chat(frontend)
        print(f"vllm-standin: selfcheck ok, {n} chat cases match vLLM's renderer", flush=True)
        return 0
    # vLLM resolves a `tcp://*:0` bind through VLLM_HOST_IP; keep it on loopback.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if args.zmq_port == 0:
        args.zmq_port = free_port()
    if args.replay_port == 0:
        args.replay_port = free_port()
    v = vllm_loader.load()
    reply_ids = frontend.encode(REPLY_WORDS)
    engine = Engine(v, args, reply_ids)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine, frontend, args.model))
    server.daemon_threads = True
    vllm_loader.check()
    seed = os.environ.get("PYTHONHASHSEED", "unset")
    print(
        f"vllm-standin: http=127.0.0.1:{server.server_address[1]} zmq={args.zmq_port} "
        f"replay={args.replay_port} hash={args.hash} seed={seed} blocks={args.num_blocks} "
        f"vllm={v.root}",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        engine.publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
