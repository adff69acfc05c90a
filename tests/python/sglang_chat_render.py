"""SGLang 0.5.23's own chat preprocessing, as an oracle: OpenAI chat request
body -> the prompt text SGLang's `/v1/chat/completions` tokenizes.

    python sglang_chat_render.py < job.json
    python sglang_chat_render.py --detect < templates.json
    python sglang_chat_render.py --fields

`job.json` is

    {"template": str,                  the Jinja chat template (tokenizer.chat_template)
     "special_tokens": {name: str},    tokenizer.special_tokens_map (transformers passes
                                       them to the template as variables)
     "content_format": "string" | "openai" | "auto",
                                       TemplateManager.jinja_template_content_format;
                                       "auto" runs SGLang's detect_jinja_template_content_format
     "requests": [<raw request body object>, ...],
     "context_length": int,            optional, get_model().context_length (default 40960)
     "served_model_name": str,         optional (default "Qwen/Qwen3-8B")
     "return_template_input": bool}    optional: add "template_input", the arguments
                                       apply_chat_template received (messages, tools,
                                       add_generation_prompt, template kwargs)

and the output is a JSON list, one entry per request:

    {"ok": rendered}                                  the text SGLang encodes
    {"ok": rendered, "assistant_prefix": prefix}      continue_final_message: SGLang
        encodes `rendered` and then appends the ids of `tokenizer.encode(prefix)`
        (`_append_assistant_prefix_to_prompt_ids`: default add_special_tokens=True,
        one leading BOS id dropped if the tokenizer prepends one; the two parts are
        tokenized separately, never as one string)
    {"err": "Type: message"}                          SGLang answers 400 (or 500 for an
        exception that is neither ValueError nor HTTPException: then the message
        ends in "(internal server error)")
    {"input_ids": [...]}                              the request carried `input_ids`:
        SGLang skips the template and uses them as they are

Packages beyond scripts/python-env.sh (pip install --no-deps into .venv):
`openai==2.8.0` (SGLang's pin; protocol.py imports `openai.types.responses`,
loaded without `openai/__init__`), `httpx` and `sniffio` (imported by
`openai._types` / `openai._utils`), `orjson` (serving_chat parses tool-call
arguments with it), `jsonschema`, `jsonschema-specifications`, `referencing`,
`rpds-py` (`_validate_request` checks tool `parameters` schemas with
`Draft202012Validator`).

What runs, all from the installed wheel (`pip install --no-deps sglang==0.5.23`):

* `sglang/srt/entrypoints/openai/protocol.py`, imported as a module: the real
  pydantic `ChatCompletionRequest` with all its validators, validated the way
  FastAPI validates a body (`TypeAdapter.validate_python(json, from_attributes=True)`);
  a pydantic error is SGLang's 400 (`http_server.py` `validation_exception_handler`).
* `sglang/srt/parser/jinja_template_utils.py` (`process_content_for_template_format`,
  `detect_jinja_template_content_format`, `jinja_template_may_reorder_tool_results`),
  `sglang/srt/parser/template_detection.py` (`detect_reasoning_pattern`, giving
  `TemplateManager.reasoning_config`), `sglang/srt/parser/hunyuan_reasoning.py`,
  `sglang/srt/environ.py`: imported as modules.
* From `serving_chat.py`, compiled from the wheel's source text (the module itself
  imports the whole server): module functions `normalize_tool_content`,
  `parse_tool_call_arguments`, `normalize_assistant_tool_call_arguments`,
  `_extract_max_dynamic_patch`, `_extract_video_question`, `_build_video_config`,
  `ThinkingMode`, `_CHAT_TEMPLATE_CLIENT_ERRORS`; and the `OpenAIServingChat`
  methods `_validate_request`, `_validate_media_content`, `_effective_tools`,
  `_convert_to_internal_request`, `_process_messages`, `_apply_jinja_template`,
  `_encode_messages`, `_handle_last_assistant_message`,
  `_render_and_encode_chat_template`, `_append_assistant_prefix_to_prompt_ids`,
  `_canonicalize_tool_message_order`, `_sort_tool_message_run`,
  `_thinking_requested`, `_get_reasoning_from_request`,
  `_patch_reasoning_skip_special_tokens`, `_takes_turn_grammar`,
  `_template_turn_grammar`, `_requires_response_template_detokenization`,
  `_engine_prompt`, `_can_reuse_text_only_prompt_ids`, `_should_return_input_ids`;
  from `serving_base.py` `_parse_model_parameter`, `_resolve_lora_path`,
  `extract_custom_labels`, `extract_routing_key`, `extract_routed_dp_rank_from_header`;
  from `function_call/utils.py` `normalize_json_schema_types` (it rewrites tool
  parameter types such as "int" -> "integer" in place, before rendering) and
  `get_json_schema_constraint`; from `utils/common.py` `ImageData`, `VideoData`,
  `GLM_MEDIA_CONFIG_KEYS`; from `sglang/utils.py` `convert_json_schema_to_str`.
  The driver calls them in the order `handle_request` does:
  `_validate_request` -> `_convert_to_internal_request` (-> `_process_messages` ->
  `_apply_jinja_template` -> `_render_and_encode_chat_template`).
* The template is rendered by transformers' own
  `PreTrainedTokenizerBase.apply_chat_template` (-> `render_jinja_template`),
  called with exactly the arguments SGLang passes (`tokenize=False`,
  `add_generation_prompt`, `tools`, `return_dict=False`, `**template_kwargs`),
  bound to a tokenizer stand-in that has the job's template and special tokens.

The server assumed: a text-only model served with the template's Jinja path
(no `--chat-template` name, no Python template, no dsv32/kimi/harmony encoder,
not MiniMax-M3/gpt-oss/Gemma4), no `--tool-call-parser` and no
`--reasoning-parser` (for the Qwen3 template neither changes the rendered text:
they only build output grammars and detectors), no `--default-chat-template-kwargs`,
no `--trust-request-chat-template`. Tokenizer facts the stand-in takes as given,
true for Qwen3's fast tokenizer: `encode("")` adds no special token (so the
prompt is encoded without `add_special_tokens`), rendering to text is lossless
(`_prompt_text_round_trip_is_lossy` False).

Stand-ins (nothing on the text path): `GenerateReqInput` records its arguments;
`parallel_prompt_encode` and `tokenizer.encode` record the text they are given
instead of tokenizing; `get_serving()` / `get_model()` are namespaces with the
defaults above; the parser / grammar / multimodal / alternative-encoder names
the compiled code references are placeholders that raise if reached
(`PLACEHOLDER_CALLS`, checked per request).
"""

from __future__ import annotations

import __future__ as _future
import ast
import copy
import enum
import importlib
import json
import logging
import os
import sys
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Type, Union

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_loader as L  # noqa: E402

logging.disable(logging.WARNING)

PLACEHOLDER_CALLS = L.PLACEHOLDER_CALLS


# -- compiling definitions from the wheel's source ---------------------------------


def _future_flags(tree: ast.Module) -> int:
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            if any(a.name == "annotations" for a in node.names):
                return _future.annotations.compiler_flag
    return 0


def _parse(relpath: str, root: str | None = None) -> tuple[str, ast.Module]:
    path = os.path.join(root or L.sglang_root(), relpath)
    return path, ast.parse(Path(path).read_text(), filename=path)


def _assigned_names(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            for t in sub.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
    return names


def wheel_defs(relpath: str, names: list[str], scope: dict) -> dict:
    """Top-level functions, classes and assignments (also inside a top-level
    `try`) named `names`, compiled from the wheel's `relpath` into `scope`,
    with the file's name, line numbers and `from __future__` flags."""
    path, tree = _parse(relpath)
    wanted = set(names)
    body = []
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in wanted:
                body.append(node)
                found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Try)):
            hit = _assigned_names(node) & wanted
            if hit:
                body.append(node)
                found |= hit
    missing = wanted - found
    if missing:
        raise RuntimeError(f"sglang_chat_render: {sorted(missing)} not found in {path}")
    code = compile(ast.Module(body=body, type_ignores=[]), path, "exec",
                   flags=_future_flags(tree), dont_inherit=True)
    exec(code, scope)
    return scope


def wheel_methods(relpath: str, class_name: str, names: list[str], scope: dict) -> dict:
    """Methods of `class_name` in the wheel's `relpath`, compiled one by one with
    `scope` as their globals; `classmethod` / `staticmethod` kept."""
    path, tree = _parse(relpath)
    flags = _future_flags(tree)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in names:
                    deco = [d.id for d in item.decorator_list if isinstance(d, ast.Name)]
                    item.decorator_list = []
                    code = compile(ast.Module(body=[item], type_ignores=[]), path, "exec",
                                   flags=flags, dont_inherit=True)
                    exec(code, scope)
                    fn = scope.pop(item.name)
                    if "classmethod" in deco:
                        fn = classmethod(fn)
                    elif "staticmethod" in deco:
                        fn = staticmethod(fn)
                    out[item.name] = fn
    missing = set(names) - set(out)
    if missing:
        raise RuntimeError(f"sglang_chat_render: {class_name}.{sorted(missing)} not in {path}")
    return out


# -- loading ------------------------------------------------------------------------


class _Strict(types.SimpleNamespace):
    """A namespace whose missing attributes raise (and are recorded)."""

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        PLACEHOLDER_CALLS.append(f"{type(self).__name__}.{item}")
        raise AttributeError(f"sglang_chat_render: stand-in has no {item!r}")


class ServingArgs(_Strict):
    pass


class ModelArgs(_Strict):
    pass


def _load_openai_types() -> None:
    """`openai` (2.8.0, SGLang's pin) as an empty package over its directory:
    its `__init__` builds the HTTP client; protocol.py only needs `openai.types`."""
    spec = importlib.util.find_spec("openai")
    if spec is None:
        raise SystemExit("sglang_chat_render: pip install --no-deps openai==2.8.0 httpx sniffio")
    if "openai" not in sys.modules:
        L._shell_package("openai", list(spec.submodule_search_locations)[0])


def load() -> types.SimpleNamespace:
    root = L.sglang_root()
    srt = os.path.join(root, "srt")
    L._shell_package("sglang", root)
    for pkg in ("srt", "srt/entrypoints", "srt/entrypoints/openai", "srt/parser",
                "srt/arg_groups", "srt/function_call", "srt/multimodal"):
        L._shell_package("sglang." + pkg.replace("/", "."), os.path.join(root, pkg))

    # sglang/utils.py imports IPython, requests, pybase64: only its
    # convert_json_schema_to_str is used (protocol.py's sampling params).
    from pydantic import BaseModel

    utils_scope = {"json": json, "BaseModel": BaseModel, "Union": Union, "Type": Type}
    wheel_defs("utils.py", ["convert_json_schema_to_str"], utils_scope)
    L._stub("sglang.utils", convert_json_schema_to_str=utils_scope["convert_json_schema_to_str"])

    # sglang.srt.utils re-exports utils/common.py (torch, PIL): the three names
    # jinja_template_utils imports are compiled from it.
    from dataclasses import dataclass
    from typing import Literal

    common_scope = {"dataclass": dataclass, "Optional": Optional, "Literal": Literal, "Dict": Dict}
    wheel_defs("srt/utils/common.py", ["ImageData", "VideoData", "GLM_MEDIA_CONFIG_KEYS"], common_scope)
    L._shell_package(
        "sglang.srt.utils",
        os.path.join(srt, "utils"),
        ImageData=common_scope["ImageData"],
        VideoData=common_scope["VideoData"],
        GLM_MEDIA_CONFIG_KEYS=common_scope["GLM_MEDIA_CONFIG_KEYS"],
    )
    # template_detection imports these for server-args resolution only.
    L._stub("sglang.srt.arg_groups.muse_spark_hook",
            muse_spark_chat_template_default=L._placeholder_fn("muse_spark_chat_template_default"))
    L._stub("sglang.srt.arg_groups.overrides",
            declare_resolution=L._placeholder_fn("declare_resolution"),
            resolving_view=L._placeholder_fn("resolving_view"))
    _load_openai_types()

    imp = importlib.import_module
    protocol = imp("sglang.srt.entrypoints.openai.protocol")
    jtu = imp("sglang.srt.parser.jinja_template_utils")
    detection = imp("sglang.srt.parser.template_detection")
    hunyuan = imp("sglang.srt.parser.hunyuan_reasoning")
    environ = imp("sglang.srt.environ")
    for mod in (protocol, jtu, detection, hunyuan, environ):
        if not (mod.__file__ or "").startswith(root):
            raise RuntimeError(f"sglang_chat_render: {mod.__name__} did not load from the wheel")

    import jinja2
    import orjson
    from jsonschema import Draft202012Validator, SchemaError
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    # function_call/utils.py imports partial_json_parser: the two functions used.
    fc_scope = {"Any": Any, "Dict": Dict, "List": List, "Tuple": Tuple, "Optional": Optional,
                "Union": Union, "Literal": Literal, "Tool": protocol.Tool,
                "ToolChoice": protocol.ToolChoice}
    wheel_defs("srt/function_call/utils.py", [
        "_STANDARD_JSON_SCHEMA_TYPES", "_JSON_SCHEMA_TYPE_ALIASES", "_PREFIX_BOUNDARY_CHARS",
        "_PREFIX_RULES", "_matches_type_prefix", "_normalize_single_type", "_normalize_type_list",
        "normalize_json_schema_types", "_get_tool_schema_defs", "_get_tool_schema",
        "get_json_schema_constraint"], fc_scope)

    class FunctionCallParser:
        """No --tool-call-parser: the registry lookups find nothing."""

        ToolCallParserEnum: dict = {}

        def __init__(self, *a, **k):
            PLACEHOLDER_CALLS.append("FunctionCallParser")
            raise RuntimeError("sglang_chat_render: FunctionCallParser instantiated")

    class _NeverInstance:
        """A detector class no object here is an instance of."""

    class GenerateReqInput:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    state = types.SimpleNamespace(serving=None, model=None)
    scope = {
        "__name__": "sglang.srt.entrypoints.openai.serving_chat",
        "copy": copy, "json": json, "orjson": orjson, "jinja2": jinja2, "Enum": enum.Enum,
        "OrderedDict": OrderedDict, "Any": Any, "Dict": Dict, "List": List,
        "Optional": Optional, "logger": logging.getLogger("sglang_chat_render"),
        "ChatCompletionRequest": protocol.ChatCompletionRequest,
        "ChatCompletionMessageGenericParam": protocol.ChatCompletionMessageGenericParam,
        "ChatCompletionMessageUserParam": protocol.ChatCompletionMessageUserParam,
        "ChatCompletionMessageContentTextPart": protocol.ChatCompletionMessageContentTextPart,
        "ChatCompletionMessageContentVideoPart": protocol.ChatCompletionMessageContentVideoPart,
        "MessageProcessingResult": protocol.MessageProcessingResult,
        "Tool": protocol.Tool, "ToolChoice": protocol.ToolChoice,
        "process_content_for_template_format": jtu.process_content_for_template_format,
        "MEDIA_URL_PART_TYPES": jtu.MEDIA_URL_PART_TYPES,
        "normalize_hunyuan_reasoning_effort": hunyuan.normalize_hunyuan_reasoning_effort,
        "uses_hunyuan_reasoning_effort": hunyuan.uses_hunyuan_reasoning_effort,
        "envs": environ.envs,
        "Draft202012Validator": Draft202012Validator, "SchemaError": SchemaError,
        "normalize_json_schema_types": fc_scope["normalize_json_schema_types"],
        "get_json_schema_constraint": fc_scope["get_json_schema_constraint"],
        "get_serving": lambda: state.serving,
        "get_model": lambda: state.model,
        "GenerateReqInput": GenerateReqInput,
        "FunctionCallParser": FunctionCallParser,
        "ResponseTemplateToolDetector": _NeverInstance,
        "ResponseTemplateReasoningDetector": _NeverInstance,
        "HTTPException": type("HTTPException", (Exception,), {}),
        # Reached only by features this server does not have.
        "strip_structural_tag_excludes": L._placeholder_fn("strip_structural_tag_excludes"),
        "configure_response_template_request": L._placeholder_fn("configure_response_template_request"),
        "set_request_reasoning_end_token_ids": lambda sampling_params, ids: None,
        "apply_header_overrides": L._placeholder_fn("apply_header_overrides"),
        "ReasoningParser": L._placeholder_class("ReasoningParser"),
        "IQuestQ1ReasoningDetector": L._placeholder_class("IQuestQ1ReasoningDetector"),
        "_normalize_minimax_m3_request": L._placeholder_fn("_normalize_minimax_m3_request"),
        "_validate_minimax_m3_request": L._placeholder_fn("_validate_minimax_m3_request"),
        "encoding_dsv32": L._stub("sglang_chat_render.encoding_dsv32"),
        "chat_encoding": L._stub("sglang_chat_render.chat_encoding"),
        "chat_encoding_adapters": L._stub("sglang_chat_render.chat_encoding_adapters"),
        "render_chat_segments": L._placeholder_fn("render_chat_segments"),
        "encode_prompt_segments": L._placeholder_fn("encode_prompt_segments"),
        "parallel_prompt_encode": lambda tokenizer, text, encode_kwargs: [_Rendered(text, dict(encode_kwargs))],
    }
    sc = "srt/entrypoints/openai/serving_chat.py"
    wheel_defs(sc, ["ThinkingMode", "_MISTRAL_COMMON_ERRORS", "_CHAT_TEMPLATE_CLIENT_ERRORS",
                    "_MEDIA_CONTENT_PART_TYPES", "_CHAT_TEMPLATE_CACHE_MAX_SIZE",
                    "normalize_tool_content", "parse_tool_call_arguments",
                    "normalize_assistant_tool_call_arguments", "_extract_max_dynamic_patch",
                    "_extract_video_question", "_build_video_config"], scope)
    methods = wheel_methods(sc, "OpenAIServingChat", [
        "_validate_request", "_validate_media_content", "_effective_tools",
        "_convert_to_internal_request", "_process_messages", "_apply_jinja_template",
        "_encode_messages", "_handle_last_assistant_message", "_render_and_encode_chat_template",
        "_append_assistant_prefix_to_prompt_ids", "_canonicalize_tool_message_order",
        "_sort_tool_message_run", "_thinking_requested", "_get_reasoning_from_request",
        "_patch_reasoning_skip_special_tokens", "_takes_turn_grammar", "_template_turn_grammar",
        "_requires_response_template_detokenization", "_engine_prompt",
        "_can_reuse_text_only_prompt_ids", "_should_return_input_ids"], scope)
    methods.update(wheel_methods("srt/entrypoints/openai/serving_base.py", "OpenAIServingBase", [
        "_parse_model_parameter", "_resolve_lora_path", "extract_custom_labels",
        "extract_routing_key", "extract_routed_dp_rank_from_header"], scope))
    return types.SimpleNamespace(
        protocol=protocol, jtu=jtu, detection=detection, scope=scope, methods=methods,
        state=state, PreTrainedTokenizerBase=PreTrainedTokenizerBase,
    )


class _Rendered:
    """What `parallel_prompt_encode` was asked to encode."""

    def __init__(self, text, encode_kwargs):
        self.text, self.encode_kwargs = text, encode_kwargs


class _Prefix:
    """What `tokenizer.encode` was asked to encode (the assistant prefix)."""

    def __init__(self, text, kwargs):
        self.text, self.kwargs = text, kwargs


class TokenizerStandIn(_Strict):
    pass


def make_serving(s, job: dict):
    """An `OpenAIServingChat` whose methods are the wheel's, with the state
    `OpenAIServingChat.__init__` / `TemplateManager.load_chat_template` would
    give a Jinja-template text model."""
    template = job["template"]
    fmt = job.get("content_format", "auto")
    if fmt == "auto":
        fmt = s.jtu.detect_jinja_template_content_format(template)
    _force, reasoning_config = s.detection.detect_reasoning_pattern(template)

    tok = TokenizerStandIn(
        chat_template=template,
        special_tokens_map=dict(job.get("special_tokens") or {}),
        bos_token_id=None,
    )
    tok.get_chat_template = s.PreTrainedTokenizerBase.get_chat_template.__get__(tok)
    real_apply = s.PreTrainedTokenizerBase.apply_chat_template.__get__(tok)

    def apply_chat_template(conversation, *args, **kwargs):
        # What reaches transformers (recorded for "return_template_input").
        tok.last_template_input = copy.deepcopy({"messages": conversation, "args": list(args), "kwargs": kwargs})
        return real_apply(conversation, *args, **kwargs)

    tok.apply_chat_template = apply_chat_template
    tok.last_template_input = None
    tok.encode = lambda text, **kw: [_Prefix(text, kw)]

    cls = type("OpenAIServingChat", (_Strict,), dict(s.methods))
    serving = cls(
        tokenizer_manager=_Strict(
            tokenizer=tok,
            model_config=_Strict(
                is_multimodal=False,
                hf_config=_Strict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
            ),
            served_model_name=job.get("served_model_name", "Qwen/Qwen3-8B"),
            config_value=lambda name: None,
        ),
        template_manager=_Strict(
            chat_template_name=None,
            python_chat_template=None,
            jinja_template_content_format=fmt,
            jinja_template_may_reorder_tool_results=s.jtu.jinja_template_may_reorder_tool_results(template),
            reasoning_config=reasoning_config,
        ),
        tool_call_parser=None,
        reasoning_parser=None,
        default_chat_template_kwargs={},
        _reasoning_detector=None,
        default_sampling_params={},
        is_gpt_oss=False,
        is_gemma4=False,
        is_minimax_m3=False,
        chat_encoding_spec=None,
        _encoding_adapter=None,
        _response_parser=None,
        _tokenizer_auto_adds_specials=False,
        _prompt_text_round_trip_is_lossy=False,
        _chat_template_cache=OrderedDict(),
        allowed_custom_labels=None,
    )
    s.state.serving = ServingArgs(
        default_chat_template_kwargs=None,
        trust_request_chat_template=False,
        allow_auto_truncate=False,
        return_input_ids=False,
        return_output_ids=False,
    )
    s.state.model = ModelArgs(context_length=job.get("context_length", 40960))
    return serving


def render_one(s, serving, body, return_template_input=False) -> dict:
    from pydantic import TypeAdapter, ValidationError

    del PLACEHOLDER_CALLS[:]
    serving.tokenizer_manager.tokenizer.last_template_input = None
    try:
        # FastAPI: json.loads(body) -> validate_python(from_attributes=True);
        # a validation error is a 400 (http_server.validation_exception_handler).
        request = TypeAdapter(s.protocol.ChatCompletionRequest).validate_python(
            copy.deepcopy(body), from_attributes=True
        )
    except ValidationError as e:
        return {"err": f"ValidationError: {e}"}
    try:
        # OpenAIServingBase.handle_request (serving_base.py:80-144).
        error_msg = serving._validate_request(request)
        if error_msg:
            return {"err": f"BadRequest: {error_msg}"}
        adapted, _ = serving._convert_to_internal_request(request, None)
    except ValueError as e:
        return {"err": f"{type(e).__name__}: {e}"}
    except Exception as e:  # SGLang: 500 "Internal server error: ..."
        return {"err": f"{type(e).__name__}: {e} (internal server error)"}
    finally:
        if PLACEHOLDER_CALLS:
            raise RuntimeError(f"sglang_chat_render: placeholders used: {PLACEHOLDER_CALLS}")
    ids = adapted.kwargs.get("input_ids")
    if body.get("input_ids") is not None:  # the request's own ids: no template
        return {"input_ids": ids}
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], _Rendered):
        raise RuntimeError(f"sglang_chat_render: unexpected prompt {adapted.kwargs!r}")
    if ids[0].encode_kwargs:
        raise RuntimeError(f"sglang_chat_render: unexpected encode kwargs {ids[0].encode_kwargs}")
    out = {"ok": ids[0].text}
    if return_template_input:
        out["template_input"] = serving.tokenizer_manager.tokenizer.last_template_input
    rest = ids[1:]
    if rest:
        if len(rest) != 1 or not isinstance(rest[0], _Prefix) or rest[0].kwargs:
            raise RuntimeError(f"sglang_chat_render: unexpected prompt tail {rest!r}")
        out["assistant_prefix"] = rest[0].text
    return out


def main() -> None:
    if sys.argv[1:] == ["--fields"]:
        # The fields of SGLang's chat and completions request models.
        s = load()
        json.dump(
            {
                "chat": sorted(s.protocol.ChatCompletionRequest.model_fields),
                "completions": sorted(s.protocol.CompletionRequest.model_fields),
            },
            sys.stdout,
        )
        sys.stdout.write("\n")
        return
    if sys.argv[1:] == ["--detect"]:
        # A JSON list of templates in, SGLang's content format of each out
        # (`jinja_template_utils.detect_jinja_template_content_format`).
        s = load()
        templates = json.load(sys.stdin)
        json.dump([s.jtu.detect_jinja_template_content_format(t) for t in templates], sys.stdout)
        sys.stdout.write("\n")
        return
    job = json.load(sys.stdin)
    s = load()
    serving = make_serving(s, job)
    trace = bool(job.get("return_template_input"))
    out = [render_one(s, serving, body, trace) for body in job["requests"]]
    json.dump(out, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
