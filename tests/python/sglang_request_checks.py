"""SGLang 0.5.23's own request checks, as an oracle: an OpenAI chat or
completions body, and the token count of each of its prompts -> whether
SGLang serves it, and the `cache_salt` each prompt is cached under.

    python sglang_request_checks.py < job.json

`job.json` is

    {"context_length": int,           the model's context length (TokenizerManager.context_len)
     "template": str,                 the chat template (chat requests, as sglang_chat_render.py)
     "special_tokens": {name: str},
     "requests": [{"api": "chat" | "completions",
                   "body": <raw request body object>,
                   "prompt_tokens": [int, ...]}]}   each prompt's length in tokens,
                                                    in the order of the body's prompts

and the output is a JSON list, one entry per request:

    {"ok": [{"cache_salt": str | null}, ...]}   one entry per prompt of the body
    {"err": "Type: message"}                    SGLang refuses the request

What runs, all from the installed wheel (`pip install --no-deps sglang==0.5.23`):

* the request models of `protocol.py` and, for chat, everything
  `sglang_chat_render.py` runs (up to `_convert_to_internal_request`);
* for completions, `OpenAIServingCompletion._validate_request`,
  `_convert_to_internal_request` and `_build_sampling_params`, compiled from
  `serving_completions.py`;
* `GenerateReqInput` (the dataclass and all its methods), compiled from
  `managers/io_struct.py`: `normalize_batch_and_arguments` splits a batch,
  expands `n`, and checks and spreads `cache_salt`; `__getitem__` gives each
  prompt's request;
* `TokenizerManager._validate_one_request` and `_validate_token_ids_logprob`,
  compiled from `managers/tokenizer_manager.py`: the context-length and
  total-token checks, run on each prompt with the given token count.

The server assumed: sglang_chat_render.py's (no `--allow-auto-truncate`, no
speculative decoding: `num_reserved_tokens` 0, no joint-schema heads, no
hidden states or custom logit processors enabled). Stand-ins: the prompt's
ids are `prompt_tokens` zeros (only their count is checked here; the ids
themselves are checked against SGLang's rendering and hashing elsewhere).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import logging
import os
import sys
import types
import uuid
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_chat_render as R  # noqa: E402
import sglang_loader as L  # noqa: E402

PLACEHOLDER_CALLS = L.PLACEHOLDER_CALLS


def _features():
    """`get_exec().features` of the assumed server."""
    return R._Strict(
        enable_encoder_swa_bounded_replay=False,
        return_hidden_states_mode=None,
        enable_return_hidden_states=False,
        enable_custom_logit_processor=False,
    )


def load():
    s = R.load()
    logger = logging.getLogger("sglang_request_checks")
    # io_struct's dataclass needs its module registered (dataclasses looks
    # the class's module up); it imports torch, so only definitions are
    # compiled into it.
    io = types.ModuleType("sglang.srt.managers.io_struct")
    sys.modules[io.__name__] = io
    scope = io.__dict__
    scope.update({
        "dataclass": dataclasses.dataclass, "field": dataclasses.field, "uuid": uuid,
        "copy": copy, "Counter": Counter, "IntEnum": enum.IntEnum,
        "total_ordering": functools.total_ordering, "logger": logger,
        "get_exec": lambda: R._Strict(features=_features()),
        "decode_kv_hints_envelope": L._placeholder_fn("decode_kv_hints_envelope"),
        "EmbeddingReqInput": type("EmbeddingReqInput", (), {}),
        "supports_sampling_mask": L._placeholder_fn("supports_sampling_mask"),
    })
    R.wheel_defs("srt/model_executor/forward_batch_info.py", ["CaptureHiddenMode"], scope)
    R.wheel_defs("srt/managers/schedule_batch.py", ["get_return_hidden_states_mode"], scope)
    R.wheel_defs("srt/managers/io_struct.py", ["GenerateReqInput"], scope)
    scope["get_request_return_hidden_states_mode"] = scope["get_return_hidden_states_mode"]
    scope["get_server_return_hidden_states_mode"] = lambda: scope["CaptureHiddenMode"].NULL
    manager = R.wheel_methods("srt/managers/tokenizer_manager.py", "TokenizerManager", [
        "_validate_one_request", "_validate_token_ids_logprob"], scope)

    completions = {
        "__name__": "sglang.srt.entrypoints.openai.serving_completions",
        "logger": logger, "GenerateReqInput": scope["GenerateReqInput"],
        "convert_json_schema_to_str": sys.modules["sglang.utils"].convert_json_schema_to_str,
        "generate_completion_prompt_from_request":
            L._placeholder_fn("generate_completion_prompt_from_request"),
    }
    methods = R.wheel_methods("srt/entrypoints/openai/serving_completions.py",
                              "OpenAIServingCompletion", [
                                  "_validate_request", "_convert_to_internal_request",
                                  "_build_sampling_params"], completions)
    for name in ("extract_custom_labels", "extract_routing_key",
                 "extract_routed_dp_rank_from_header", "_resolve_lora_path",
                 "_parse_model_parameter"):
        methods[name] = s.methods[name]
    return types.SimpleNamespace(s=s, io=scope, manager=manager, completion_methods=methods)


def make_completion_serving(c):
    cls = type("OpenAIServingCompletion", (R._Strict,), dict(c.completion_methods))
    return cls(
        template_manager=R._Strict(completion_template_name=None),
        tokenizer_manager=R._Strict(served_model_name="Qwen/Qwen3-8B"),
        allowed_custom_labels=None,
    )


def make_manager(c, context_length: int):
    cls = type("TokenizerManager", (R._Strict,), dict(c.manager))
    return cls(
        context_len=context_length,
        num_reserved_tokens=0,
        allow_auto_truncate=False,
        validate_total_tokens=True,
        is_generation=True,
        model_config=R._Strict(joint_head_config=None, pointer_head=None, vocab_size=151936),
        _validate_joint_schema_request=lambda obj, ids: None,
    )


def adapted_kwargs(c, chat, completion, api: str, body: dict) -> dict:
    """The `GenerateReqInput` arguments SGLang's OpenAI layer builds for `body`."""
    from pydantic import TypeAdapter

    protocol = c.s.protocol
    model = protocol.ChatCompletionRequest if api == "chat" else protocol.CompletionRequest
    request = TypeAdapter(model).validate_python(copy.deepcopy(body), from_attributes=True)
    serving = chat if api == "chat" else completion
    error_msg = serving._validate_request(request)
    if error_msg:
        raise ValueError(f"BadRequest: {error_msg}")
    adapted, _ = serving._convert_to_internal_request(request, None)
    if api == "chat":
        return dict(adapted.kwargs)
    return {f.name: getattr(adapted, f.name) for f in dataclasses.fields(adapted)}


def check_one(c, chat, completion, manager, job_request: dict) -> dict:
    from pydantic import ValidationError

    api, body = job_request["api"], job_request["body"]
    lengths = list(job_request["prompt_tokens"])
    del PLACEHOLDER_CALLS[:]
    try:
        kwargs = adapted_kwargs(c, chat, completion, api, body)
        # The prompt's ids, by count: chat encodes one rendered text; a
        # completions prompt is one text or id list, or a batch of them.
        single = api == "chat" or isinstance(body.get("prompt"), str) or (
            isinstance(body.get("prompt"), list) and body["prompt"]
            and isinstance(body["prompt"][0], int))
        ids = [[0] * n for n in lengths]
        kwargs.pop("text", None)
        kwargs["input_ids"] = ids[0] if single else ids
        obj = c.io["GenerateReqInput"](**kwargs)
        obj.normalize_batch_and_arguments()
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        out = []
        for item in items:
            manager._validate_one_request(item, list(item.input_ids))
            out.append({"cache_salt": item.cache_salt})
    except ValidationError as e:
        return {"err": f"ValidationError: {e}"}
    except ValueError as e:
        return {"err": f"{type(e).__name__}: {e}"}
    finally:
        if PLACEHOLDER_CALLS:
            raise RuntimeError(f"sglang_request_checks: placeholders used: {PLACEHOLDER_CALLS}")
    return {"ok": out}


def main() -> None:
    job = json.load(sys.stdin)
    c = load()
    chat = R.make_serving(c.s, {**job, "template": job.get("template", "")})
    completion = make_completion_serving(c)
    manager = make_manager(c, int(job["context_length"]))
    out = [check_one(c, chat, completion, manager, r) for r in job["requests"]]
    json.dump(out, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
