#!/usr/bin/env bash
# Creates (or reuses) the Python virtualenv that the interop tests use as real
# ZeroMQ / HTTP peers: pyzmq (libzmq) and msgspec, the libraries vLLM and SGLang
# publish their KV events with. Idempotent; fails loudly.
#
#   scripts/python-env.sh            # -> .venv/bin/python at the repo root
#   KVROUTE_PYTHON=python3.12 scripts/python-env.sh
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${repo_root}/.venv"
python="${KVROUTE_PYTHON:-python3}"
# Versions the golden fixtures were generated with (see golden/vllm-events/README.md).
requirements=("pyzmq==27.3.0" "msgspec==0.23.0")

if ! command -v "${python}" >/dev/null 2>&1; then
    echo "python-env: '${python}' not found; install Python >= 3.9 or set KVROUTE_PYTHON" >&2
    exit 1
fi

if [ ! -x "${venv}/bin/python" ]; then
    echo "python-env: creating ${venv}" >&2
    "${python}" -m venv "${venv}"
fi

if "${venv}/bin/python" - "${requirements[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for req in sys.argv[1:]:
    name, want = req.split("==")
    if version(name) != want:
        sys.exit(1)
PY
then
    echo "python-env: ${venv} already has ${requirements[*]}" >&2
else
    "${venv}/bin/python" -m pip install --disable-pip-version-check --quiet "${requirements[@]}"
fi

"${venv}/bin/python" -c 'import zmq, msgspec; print("python-env: ok, libzmq", zmq.zmq_version(), "pyzmq", zmq.__version__, "msgspec", msgspec.__version__)'
