#!/usr/bin/env python3
"""An engine's `POST /tokenize`, answered by transformers as vLLM 0.33 answers it.

vLLM's `/tokenize` (`vllm/entrypoints/serve/tokenize`) runs its renderer: a
`prompt` is encoded with `add_special_tokens` (default true); `messages` are
rendered with the tokenizer's chat template (`apply_chat_template`,
`tokenize=False`, `add_generation_prompt` default true, the request's
`chat_template_kwargs`) and encoded with `add_special_tokens` (default false).
The tokenizer is transformers' `AutoTokenizer`, loaded as vLLM loads it
(`transformers_encode.py` says where). vLLM's own modules import torch at
package level, so this server calls those transformers entry points directly;
its messages must be plain (string contents), where vLLM's message
normalisation changes nothing. The answer has vLLM's shape:
`{"count", "max_model_len", "tokens"}`.

    python tokenize_server.py --model-dir DIR [--port PORT]

Port 0 (the default) takes a free one; prints `listening PORT` once it accepts
connections. A directory holding `tokenizer.json.gz` (as `golden/tokenizers`
stages it) is read through a decompressed copy.
"""

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from transformers import AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    model_dir = Path(args.model_dir)
    if not (model_dir / "tokenizer.json").exists() and (model_dir / "tokenizer.json.gz").exists():
        copy = Path(tempfile.mkdtemp(prefix="kvroute-tokenize-"))
        for f in model_dir.iterdir():
            if f.name != "tokenizer.json.gz" and f.is_file():
                shutil.copy(f, copy / f.name)
        (copy / "tokenizer.json").write_bytes(gzip.decompress((model_dir / "tokenizer.json.gz").read_bytes()))
        model_dir = copy
    tok = AutoTokenizer.from_pretrained(str(model_dir), truncation_side="left", mistral_format=False)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _json(self, status: int, doc) -> None:
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_POST(self):
            n = int(self.headers.get("content-length") or 0)
            try:
                body = json.loads(self.rfile.read(n))
                if self.path != "/tokenize":
                    self._json(404, {"error": f"no route {self.path}"})
                    return
                if "messages" in body:
                    text = tok.apply_chat_template(
                        body["messages"],
                        tokenize=False,
                        add_generation_prompt=body.get("add_generation_prompt", True),
                        **(body.get("chat_template_kwargs") or {}),
                    )
                    ids = tok.encode(text, add_special_tokens=body.get("add_special_tokens", False))
                else:
                    ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            except Exception as e:  # vLLM answers a bad request with 400
                self._json(400, {"error": str(e)})
                return
            self._json(200, {"count": len(ids), "max_model_len": tok.model_max_length, "tokens": ids})

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"listening {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
