"""What the benchmark drivers scripts/bench_replicas.py and scripts/bench_smg.py
share: their child processes (each in its own process group, listed in the
pidfile their shell wrapper cleans up from), small HTTP helpers, the
`kvroute mock-engine` processes both put behind the gateways, kvroute's
config, the seeded word generator and the client's streaming and statistics
helpers.

A driver calls `configure()` once before anything else (log prefix, pidfile).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

try:
    import uvloop
except ImportError:  # plain asyncio works too
    uvloop = None

MODEL = "qwen3"
ENGINES = 4
HOST = "127.0.0.1"
CONTRACT = "vllm@0.33.0:sha256_cbor:block=16:seed=0"
# The load generator, as the drivers' JSON records it.
CLIENT = "python asyncio+aiohttp" + ("+uvloop" if uvloop else "")

WORDS = (
    "policy customer account refund shipping invoice support ticket priority "
    "escalate verify identity order product warranty return window days manager "
    "approval discount loyalty member tier billing address payment card declined "
    "retry schedule delivery courier tracking number status delayed apology credit "
    "voucher always never politely confirm summarize answer briefly clearly"
).split()

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

PROCS: list[subprocess.Popen] = []

_name = "bench"
_pidfile_var = ""


def configure(name: str, pidfile_var: str) -> None:
    """`name` prefixes the log lines; `pidfile_var` is the environment variable
    in which the shell wrapper names the pidfile its cleanup trap reads."""
    global _name, _pidfile_var
    _name, _pidfile_var = name, pidfile_var


def log(msg: str) -> None:
    print(f"[{_name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def log_dir(logs: str | None) -> Path:
    """`logs` (created when missing), else a new temp dir; logged either way."""
    tmp = Path(logs) if logs else Path(tempfile.mkdtemp(prefix=f"{_name}."))
    tmp.mkdir(parents=True, exist_ok=True)
    log(f"logs in {tmp}")
    return tmp


def install_uvloop() -> None:
    if uvloop is not None:
        uvloop.install()


def add_engine_args(ap, prefill_us_per_token: int, prefill_step_us: int) -> None:
    """The mock engines' flags (the drivers' defaults differ in prefill cost)."""
    ap.add_argument("--capacity-blocks", type=int, default=4096)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--prefill-us-per-token", type=int, default=prefill_us_per_token)
    ap.add_argument("--prefill-step-us", type=int, default=prefill_step_us)
    ap.add_argument("--decode-us-per-token", type=int, default=500)


# ---------------------------------------------------------------- processes


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (bound then released together)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_pidfile() -> None:
    # The live groups only, so the shell's trap can end them even if this
    # process is killed, and never signals a recycled pid of an exited one.
    pidfile = os.environ.get(_pidfile_var) if _pidfile_var else None
    if pidfile:
        with open(pidfile, "w") as f:
            f.write("".join(f"{q.pid}\n" for q in PROCS))


def spawn(cmd: list[str], logfile: Path, env: dict | None = None) -> subprocess.Popen:
    out = open(logfile, "ab")
    # Own process group, so stop() takes the whole tree (e.g. smg's Python
    # launcher and its Rust child) and nothing else.
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    out.close()
    PROCS.append(p)
    write_pidfile()
    return p


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    if p in PROCS:
        PROCS.remove(p)
        write_pidfile()


def stop_all() -> None:
    for p in list(PROCS):
        stop(p)


def stop_all_on_signals() -> None:
    """SIGTERM and SIGINT end every child group, then exit 128 + the signal."""

    def on_signal(signum, _frame):
        stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def get_json(url: str, timeout: float = 5.0):
    status, body = http("GET", url, timeout=timeout)
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def wait_until(what: str, pred, procs: list[subprocess.Popen], timeout: float, logfile: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                tail = logfile.read_text(errors="replace")[-3000:] if logfile else ""
                raise RuntimeError(f"{what}: process exited with {p.returncode}\n{tail}")
        if pred():
            return
        time.sleep(0.1)
    tail = logfile.read_text(errors="replace")[-3000:] if logfile else ""
    raise RuntimeError(f"{what}: not ready within {timeout:.0f} s\n{tail}")


def warm_body() -> bytes:
    # Shorter than one 16-token block: loads tokenizers/connections, caches nothing.
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()


def proxy_answers(url: str) -> bool:
    """The gateway at `url` answers a (cache-neutral) chat completion."""
    return http("POST", f"{url}/v1/chat/completions", warm_body(), timeout=30)[0] == 200


def subscribers_connected(admin: str) -> bool:
    """kvroute's admin API at `admin` lists every engine's KV-event subscriber as connected."""
    rows = get_json(f"{admin}/admin/endpoints")
    if rows is None:
        return False
    text = json.dumps(rows)
    return text.count('"connected": true') >= ENGINES and '"connected": false' not in text


# ---------------------------------------------------------------- engines


@dataclass
class Engine:
    http: int
    zmq: int
    replay: int
    proc: subprocess.Popen | None = None
    request_log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http}"


def start_engines(args, tmp: Path, request_logs: bool) -> list[Engine]:
    """ENGINES mock engines with the flags of `add_engine_args`; with
    `request_logs`, each writes engine<i>.requests.jsonl in `tmp`."""
    ports = free_ports(3 * ENGINES)
    engines = [Engine(ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]) for i in range(ENGINES)]
    for i, e in enumerate(engines):
        cmd = [
            args.kvroute, "mock-engine",
            "--port", str(e.http), "--zmq-port", str(e.zmq), "--replay-port", str(e.replay),
            "--model-dir", args.model_dir, "--model", MODEL,
            "--capacity-blocks", str(args.capacity_blocks),
            "--max-running", str(args.max_running),
            "--prefill-us-per-token", str(args.prefill_us_per_token),
            "--prefill-step-us", str(args.prefill_step_us),
            "--decode-us-per-token", str(args.decode_us_per_token),
        ]
        if request_logs:
            # One line per admitted request: the engine's own time to first token,
            # beside which the client's shows what the gateways and the client add.
            e.request_log = tmp / f"engine{i}.requests.jsonl"
            cmd += ["--request-log", str(e.request_log)]
        e.proc = spawn(cmd, tmp / f"engine{i}.log")
    for i, e in enumerate(engines):
        wait_until(
            f"engine {i}", lambda e=e: http("GET", f"{e.url}/health")[0] == 200,
            [e.proc], 30, tmp / f"engine{i}.log",
        )
    return engines


def reset_engines(engines: list[Engine]) -> None:
    """Empties every engine's prefix cache (the mock restarts its publisher)."""
    for e in engines:
        status, body = http("POST", f"{e.url}/admin/restart-publisher", b"{}", timeout=10)
        if status != 200:
            raise RuntimeError(f"engine :{e.http} cache reset answered {status}: {body[:200]!r}")
        cached = (get_json(f"{e.url}/admin/cache") or {}).get("cached_blocks")
        if cached not in (0, None):
            raise RuntimeError(f"engine :{e.http} still holds {cached} blocks after reset")


def engine_requests(engines: list[Engine]) -> list[int]:
    """Requests each engine has admitted so far (the mock's own count)."""
    return [int((get_json(f"{e.url}/admin/cache") or {}).get("requests", -1)) for e in engines]


def engine_log_offsets(engines: list[Engine]) -> list[int]:
    return [e.request_log.stat().st_size if e.request_log and e.request_log.exists() else 0 for e in engines]


def engine_log_entries(engines: list[Engine], offsets: list[int]):
    """The engines' request-log lines written since `offsets`, each with its `engine` index."""
    for i, (e, off) in enumerate(zip(engines, offsets)):
        if not e.request_log or not e.request_log.exists():
            continue
        with open(e.request_log, "rb") as f:
            f.seek(off)
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                r["engine"] = i
                yield r


# ---------------------------------------------------------------- kvroute config


def toml_pairs(spec: str) -> str:
    """TOML lines from "k=v,k2=v2" (the values written as given)."""
    return "".join(
        f"{kv.split('=', 1)[0].strip()} = {kv.split('=', 1)[1].strip()}\n"
        for kv in spec.split(",") if kv.strip()
    )


def kvroute_toml(engines: list[Engine], listen: int, admin: int, model_dir: str, *, nats_url: str | None = None,
                 replicas_config: str = "", scorer: str | None = None, cost: str = "") -> str:
    """`kvroute serve`'s config: one default kv_exact rule for MODEL over `engines`;
    [replicas] over `nats_url` when given, a `scorer` line only when named (else
    the default policy), [rules.cost] overrides from `cost`."""
    s = (
        f'listen = "{HOST}:{listen}"\n[admin]\nlisten = "{HOST}:{admin}"\n'
        # health probes every second, like SMG's default-ish cadence; irrelevant here
        f'[health]\ninterval_ms = 1000\n\n'
    )
    if nats_url:
        s += f'[replicas]\nnats = "{nats_url}"\n' + toml_pairs(replicas_config) + "\n"
    s += (
        f'[[models]]\nslug = "{MODEL}"\ndir = {json.dumps(str(Path(model_dir).resolve()))}\n\n'
        f'[[rules]]\nname = "{MODEL}"\nmodels = ["{MODEL}"]\ndefault = true\nchoice = "kv_exact"\n'
        f'topology = "converged"\ncontract = "{CONTRACT}"\n'
    )
    if scorer:
        s += f'scorer = "{scorer}"\n'
    s += "\n"
    if cost:
        s += "[rules.cost]\n" + toml_pairs(cost) + "\n"
    for e in engines:
        s += (
            f'[[rules.endpoints]]\nurl = "{e.url}"\nengine = "vllm"\n'
            f'zmq = "tcp://*:{e.zmq}"\nreplay = "tcp://*:{e.replay}"\n\n'
        )
    return s


# ---------------------------------------------------------------- workload


class SplitMix:
    def __init__(self, seed: int) -> None:
        self.s = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
        return z % max(n, 1)

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def words(self, n: int) -> str:
        return " ".join(WORDS[self.below(len(WORDS))] for _ in range(n))


@dataclass
class Tally:
    samples: list = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    t0: float = 0.0  # perf_counter when sending began (read by bench_smg's traces)

    def fail(self, msg: str) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = msg


async def sse_json(resp):
    """The JSON payloads of a streamed chat completion's server-sent events, `[DONE]` left out."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            yield json.loads(payload)


# ---------------------------------------------------------------- statistics


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    rank = max(1, min(len(s), int(-(-p / 100.0 * len(s) // 1))))
    return s[rank - 1]


def median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else 0.0
