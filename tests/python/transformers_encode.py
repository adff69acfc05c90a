"""Encodes texts the way vLLM 0.33's tokenizer does, with the transformers
release it runs (vLLM pins transformers >= 5.16.1, < 5.21; SGLang 0.5.23 pins
5.19.0, the one scripts/python-env.sh installs).

vLLM loads a model's tokenizer with `AutoTokenizer.from_pretrained` (its
`vllm/tokenizers/hf.py`, `CachedHfTokenizer.from_pretrained`), passing
`truncation_side="left"` for generation models (`vllm/tokenizers/registry.py`,
`resolve_tokenizer_args`) and `mistral_format=False` in "hf" mode; it encodes a
prompt with `tokenizer.encode(text, truncation=..., max_length=...,
add_special_tokens=...)` (`vllm/renderers/params.py`, `get_encode_kwargs`).
vLLM's own modules import torch at package level, so this script calls the
same transformers entry points with the same arguments.

transformers 5 rebuilds the pipeline of a tokenizer class that has its own
`__init__` (Qwen2Tokenizer, LlamaTokenizer...) from tokenizer.json's vocabulary
and merges, and applies `tokenizer_config.json` settings such as
`split_special_tokens`: what this script returns is what the engine hashes,
whatever tokenizer.json alone would give.

    python transformers_encode.py MODEL_DIR < cases.json

`cases.json` is a list of `{"text": str, "add_special_tokens": bool,
"max_length": int | null}`; the output is the list of id lists, in order.
"""

import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    model_dir = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, truncation_side="left", mistral_format=False
    )
    out = []
    for case in json.load(sys.stdin):
        max_length = case.get("max_length")
        out.append(
            tokenizer.encode(
                case["text"],
                truncation=max_length is not None,
                max_length=max_length,
                add_special_tokens=case["add_special_tokens"],
            )
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
