"""vLLM's own chat-template content-format detection, on templates from stdin.

Reads a JSON list of chat templates on stdin and prints a JSON list of
"string" / "openai": what vLLM 0.33 picks for each with
`--chat-template-content-format auto` (`vllm/renderers/hf.py`,
`_detect_content_format`). The detection functions are taken unchanged from
the installed wheel's source (the module itself imports torch, so it is not
imported): their definitions are compiled from the file and run on the
template's jinja2 AST, parsed by a sandboxed environment with the loop
controls extension, as transformers compiles chat templates.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

FUNCTIONS = [
    "_is_var_access",
    "_is_attr_access",
    "_is_var_or_elems_access",
    "_attr_dotted_name",
    "_iter_nodes_assign_var_or_elems",
    "_iter_nodes_assign_messages_item",
    "_iter_nodes_assign_content_item",
]


def load_detection():
    spec = importlib.util.find_spec("vllm")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    source = (root / "renderers" / "hf.py").read_text()
    tree = ast.parse(source)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
    missing = set(FUNCTIONS) - {d.name for d in defs}
    if missing:
        sys.exit(f"vllm/renderers/hf.py has no {sorted(missing)}")
    module = ast.Module(body=defs, type_ignores=[])
    namespace = {"jinja2": jinja2, "deque": collections.deque}
    exec(compile(module, str(root / "renderers" / "hf.py"), "exec"), namespace)
    return namespace["_iter_nodes_assign_content_item"]


def main() -> None:
    content_items = load_detection()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    out = []
    for template in json.load(sys.stdin):
        tree = env.parse(template)
        try:
            next(content_items(tree))
            out.append("openai")
        except StopIteration:
            out.append("string")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
