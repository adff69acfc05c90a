"""Renders chat templates with transformers' own template code, the code vLLM
0.33 renders Hugging Face chat templates with.

vLLM's `apply_hf_chat_template` (`vllm/renderers/hf.py`) calls
`tokenizer.apply_chat_template(conversation, tools=..., chat_template=...,
tokenize=False, **kwargs)`; transformers 5 passes the tokenizer's special
tokens as variables and renders with
`transformers.utils.chat_template_utils.render_jinja_template` (a jinja2
`ImmutableSandboxedEnvironment` with its `tojson`, `raise_exception` and
`strftime_now`). This script calls that function directly, so the template,
the variables and the error paths are the ones vLLM's renderer takes for
messages it has already normalised.

    python transformers_render.py < job.json

`job.json` is `{"template": str, "special_tokens": {name: str}, "cases":
[{"messages": [...], "tools": [...] | null, "documents": [...] | null,
"add_generation_prompt": bool, "continue_final_message": bool, "kwargs":
{...}}]}`; the output is one `{"ok": rendered}` or `{"err": message}` per case.
"""

import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template


def main() -> None:
    job = json.load(sys.stdin)
    out = []
    for case in job["cases"]:
        kwargs = dict(job.get("special_tokens") or {})
        kwargs.update(case.get("kwargs") or {})
        try:
            rendered, _ = render_jinja_template(
                conversations=[case["messages"]],
                tools=case.get("tools"),
                documents=case.get("documents"),
                chat_template=job["template"],
                continue_final_message=case.get("continue_final_message", False),
                add_generation_prompt=case.get("add_generation_prompt", False),
                **kwargs,
            )
            out.append({"ok": rendered[0]})
        except Exception as e:  # the engine answers these with a 400
            out.append({"err": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
