"""Loads SGLang's own KV-cache modules from the installed wheel without torch.

`pip install --no-deps sglang==0.5.23` puts the real sources in site-packages.
The modules the SGLang stand-in runs are executed from those files, unchanged:

* `sglang.srt.mem_cache.radix_cache`   `RadixCache` (`create_simulated`, the
  constructor SGLang provides for a tree without memory pools), `RadixKey`
  (`cache_salt or None`, page alignment), `TreeNode`: prefix match with node
  splits, insert, lock refs, evictable leaves, LRU eviction, `reset`;
* `sglang.srt.mem_cache.events`        `KVCacheEventRecorder` (store / remove /
  cleared events, coalescing, dynamo namespacing), `KvEventLoraNames`;
* `sglang.srt.mem_cache.utils`         page hashing (`get_hash_str`,
  `compute_node_hash_values`, `compute_node_event_hash_values`,
  `hash_str_to_int64`, `split_node_hash_value`, `storage_namespace_seed`);
* `sglang.srt.mem_cache.cpp_utils.native_hash` and the wheel's own
  `hash_binding.cpp` (the SHA-256 page chain), compiled here with g++,
  pybind11 and libcrypto (see `_build_native_hash`);
* `sglang.srt.mem_cache.evict_policy`  the LRU strategy;
* `sglang.srt.mem_cache.base_prefix_cache`, `cache_init_params`;
* `sglang.srt.disaggregation.kv_events` `ZmqEventPublisher` (PUB + replay
  ROUTER, replay buffer), `EventPublisherFactory`, `KVEventsConfig`
  (`--kv-events-config` JSON, `uses_dynamo_format`), `KVEventBatch`,
  `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
  `kv_event_namespace_seed`, `namespaced_block_hash`;
* `sglang.srt.lora.lora_registry`     `LoRARef.deterministic_id` (the
  `lora_id`, hence the radix `extra_key`, of a `--lora-paths name=path` adapter);
* `GenerateReqInput._normalize_single_inputs` (`managers/io_struct.py`, which
  imports the whole scheduler): that one method, compiled from the wheel's
  source (`wheel_method`): `extra_key` / `cache_salt` must be strings, "" is None;
* `sglang.srt.environ`, `sglang.srt.runtime_context`, `sglang.srt.utils.network`.

What is NOT executed, and why that leaves the path above untouched:

* Package `__init__` files of `sglang`, `sglang.srt`, `sglang.srt.utils`,
  `sglang.srt.mem_cache`, `sglang.srt.mem_cache.allocator`, ...: they re-export
  (and import torch, transformers, the frontend language). Each is replaced by
  an empty package whose `__path__` is the real directory.
* `torch`: SGLang's tree stores each node's KV-pool slot indices as an int64
  tensor, and the code above only builds, slices, clones, measures and
  concatenates them (`torch.tensor`, `value[:n]`, `.clone()`, `len`,
  `torch.cat`, `torch.empty((0,))`, `torch.device("cpu")`). `SlotTensor` below
  is a list-backed stand-in for exactly those operations; every other
  attribute of the `torch` module raises. Slot indices never enter a hash or
  an event.
* Leaf modules whose names the loaded files import but whose code only runs
  for features this harness does not use; every placeholder raises when called
  or instantiated:
  - `sglang.kernels.ops.kvcache.mla_buffer` (Triton MLA buffer kernels,
    imported by `mem_cache.utils` for the HiCache layouts);
  - `sglang.srt.mem_cache.allocator` / `memory_pool` (GPU pools: the tree is
    built with `create_simulated`, the stand-in's `SlotAllocator` holds the
    slots);
  - `sglang.srt.observability.metrics_collector` (`--enable-metrics` only);
  - `sglang.srt.utils.common.ceil_align` (sliding-window attention only);
  - `sglang.srt.utils.ConcurrentCounter` (`LoRARegistry`'s in-flight counter;
    only `LoRARef` is used);
  - `sglang.srt.utils.cpp_extension_loader` (torch's JIT extension builder):
    `load_extension_with_recovery` is replaced by `_build_native_hash`, which
    compiles the same `hash_binding.cpp` with the same flags (`-O3
    -std=c++17 -DNDEBUG [-mavx2]`, `-lcrypto`) without torch.

`load()` asserts afterwards that no placeholder was touched (`PLACEHOLDER_CALLS`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

PLACEHOLDER_CALLS: list[str] = []
REPO = Path(__file__).resolve().parents[2]
# Where the compiled hash extension is kept, keyed by the source's SHA-256.
NATIVE_CACHE = Path(os.environ.get("KVROUTE_SGLANG_NATIVE_DIR", REPO / "target" / "sglang-native"))


class _Placeholder:
    _name = "placeholder"

    def __init__(self, *args, **kwargs):
        PLACEHOLDER_CALLS.append(self._name)
        raise RuntimeError(f"sglang_loader: placeholder {self._name} was instantiated")


def _placeholder_class(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (_Placeholder,), {"_name": name})


def _placeholder_fn(name: str):
    def fn(*args, **kwargs):
        PLACEHOLDER_CALLS.append(name)
        raise RuntimeError(f"sglang_loader: placeholder {name} was called")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


class _LoudModule(types.ModuleType):
    """A stub module: names not defined on it raise instead of existing."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        PLACEHOLDER_CALLS.append(f"{self.__name__}.{item}")
        raise AttributeError(f"sglang_loader: stub module {self.__name__} has no {item!r}")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = _LoudModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], leaf, mod)
    return mod


class _KernelModule(types.ModuleType):
    """A stub of a GPU kernel module: every name is a placeholder function
    that raises (and is recorded) when called."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _placeholder_fn(f"{self.__name__}.{item}")


def _kernel_stub(name: str) -> types.ModuleType:
    mod = _KernelModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = mod
    return mod


def _shell_package(name: str, directory: str, **attrs) -> types.ModuleType:
    """An empty package over a real directory: submodules load from the wheel.

    One already installed over the same directory (another loader of this
    harness ran first, e.g. `sglang_chat_render.load()` after `load()`) is
    kept, with its submodules, and given `attrs`; an attribute both set
    differently is an error."""
    existing = sys.modules.get(name)
    if (
        type(existing) is types.ModuleType
        and getattr(existing, "__file__", None) is None
        and list(getattr(existing, "__path__", ())) == [directory]
    ):
        for k, v in attrs.items():
            if getattr(existing, k, v) is not v:
                raise RuntimeError(f"sglang_loader: {name}.{k} is set by two loaders")
            setattr(existing, k, v)
        return existing
    mod = types.ModuleType(name)
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [directory]
    mod.__spec__ = spec
    mod.__path__ = [directory]
    mod.__package__ = name
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], leaf, mod)
    return mod


# -- the torch stand-in -------------------------------------------------------------


class SlotTensor:
    """A 1-D int64 tensor of KV slot indices, as far as the tree uses one."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = list(data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return SlotTensor(self.data[idx])
        return self.data[idx]

    def __iter__(self):
        return iter(self.data)

    def clone(self) -> "SlotTensor":
        return SlotTensor(self.data)

    def to(self, *args, **kwargs) -> "SlotTensor":
        return SlotTensor(self.data)

    def tolist(self) -> list:
        return list(self.data)

    def numel(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"SlotTensor({self.data!r})"


def _torch_module() -> types.ModuleType:
    class _Device:
        def __init__(self, kind="cpu"):
            self.type = str(kind)

    class _IInfo:
        def __init__(self, dtype):
            self.max = (1 << 63) - 1
            self.min = -(1 << 63)

    def tensor(data, dtype=None, device=None):
        return SlotTensor(data)

    def empty(shape, dtype=None, device=None):
        n = shape[0] if isinstance(shape, tuple) else shape
        if n != 0:
            PLACEHOLDER_CALLS.append("torch.empty(n > 0)")
            raise RuntimeError("sglang_loader: torch.empty of a non-empty tensor")
        return SlotTensor([])

    def cat(values, dim=0):
        out = []
        for v in values:
            out.extend(v)
        return SlotTensor(out)

    return _stub(
        "torch",
        Tensor=SlotTensor,
        tensor=tensor,
        empty=empty,
        cat=cat,
        device=_Device,
        iinfo=_IInfo,
        int64="int64",
        int32="int32",
        __version__="0.0.0+sglang-loader",
    )


# -- the native page hash -----------------------------------------------------------


def _build_native_hash(name, sources, extra_cflags=(), extra_ldflags=(), with_cuda=False, **_):
    """Compiles SGLang's `hash_binding.cpp` (unchanged) and imports it.

    The arguments are those `native_hash._load_native_hash_module` passes to
    torch's JIT loader; the module is built once per source digest.
    """
    if with_cuda or len(sources) != 1:
        raise RuntimeError(f"sglang_loader: unexpected native build {name} {sources}")
    src = Path(sources[0])
    digest = hashlib.sha256(src.read_bytes() + " ".join(extra_cflags).encode()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out_dir = NATIVE_CACHE / f"{name}-{digest}"
    out = out_dir / f"{name}{suffix}"
    if not out.exists():
        import pybind11

        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.{os.getpid()}{suffix}"
        cmd = [
            os.environ.get("CXX", "g++"),
            "-shared",
            "-fPIC",
            *extra_cflags,
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            f"-DTORCH_EXTENSION_NAME={name}",
            "-o",
            str(tmp),
            str(src),
            *extra_ldflags,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(
                f"sglang_loader: building {src} failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}\n"
                "It needs g++, the pybind11 package and OpenSSL's headers (Debian: libssl-dev)."
            )
        os.replace(tmp, out)
    spec = importlib.util.spec_from_file_location(name, out)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"sglang_loader: cannot load {out}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- single functions of modules that cannot be imported -----------------------------


def wheel_method(relpath: str, class_name: str, name: str, **module_globals):
    """One method of a class in a wheel module too heavy to import (e.g.
    `managers/io_struct.py`, which pulls in the whole scheduler), compiled
    from the wheel's own source text with `module_globals` as the names it
    reads. The code object keeps the file name and line numbers."""
    import ast

    path = os.path.join(sglang_root(), relpath)
    tree = ast.parse(Path(path).read_text(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    code = compile(ast.Module(body=[item], type_ignores=[]), path, "exec")
                    scope = dict(module_globals)
                    exec(code, scope)
                    return scope[name]
    raise RuntimeError(f"sglang_loader: {class_name}.{name} not found in {path}")


def request_normalizer():
    """`GenerateReqInput._normalize_single_inputs` (io_struct.py): a single
    request's `extra_key` / `cache_salt` must be strings, and "" becomes None.

    Returns `normalize(cache_salt, extra_key) -> (cache_salt, extra_key)`.
    """
    import uuid

    method = wheel_method(
        "srt/managers/io_struct.py",
        "GenerateReqInput",
        "_normalize_single_inputs",
        uuid=uuid,
        decode_kv_hints_envelope=_placeholder_fn("decode_kv_hints_envelope"),
    )

    def normalize(cache_salt, extra_key):
        obj = types.SimpleNamespace(
            sampling_params=None,
            rid=None,
            return_logprob=None,
            logprob_start_len=None,
            top_logprobs_num=None,
            token_ids_logprob=None,
            return_sampling_mask=None,
            extra_key=extra_key,
            cache_salt=cache_salt,
            kv_hints=None,
        )
        method(obj)
        return obj.cache_salt, obj.extra_key

    return normalize


# -- loading ------------------------------------------------------------------------


class Sglang(types.SimpleNamespace):
    """The loaded modules."""


def sglang_root() -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "sglang_loader: sglang is not installed in this interpreter; run scripts/python-env.sh"
        )
    return list(spec.submodule_search_locations)[0]


_LOADED: Sglang | None = None


def load() -> Sglang:
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    if "torch" in sys.modules and not isinstance(sys.modules["torch"], _LoudModule):
        raise RuntimeError("sglang_loader: a real torch is already imported")
    root = sglang_root()
    srt = os.path.join(root, "srt")
    mem = os.path.join(srt, "mem_cache")
    _torch_module()
    _shell_package("sglang", root)
    for pkg in ("kernels", "kernels/ops", "kernels/ops/kvcache", "srt",
                "srt/disaggregation", "srt/lora", "srt/mem_cache", "srt/mem_cache/cpp_utils",
                "srt/mem_cache/unified_cache", "srt/observability", "srt/arg_groups",
                "srt/arg_groups/fields"):
        _shell_package("sglang." + pkg.replace("/", "."), os.path.join(root, pkg))
    # `sglang.srt.utils` re-exports utils.common (torch, triton, PIL...);
    # `lora_registry` takes its request counter from it.
    _shell_package(
        "sglang.srt.utils",
        os.path.join(srt, "utils"),
        ConcurrentCounter=_placeholder_class("sglang.srt.utils.ConcurrentCounter"),
    )
    _kernel_stub("sglang.kernels.ops.kvcache.mla_buffer")
    _stub("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=_placeholder_class("BaseTokenToKVPoolAllocator"))
    _stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=_placeholder_class("ReqToTokenPool"))
    _stub(
        "sglang.srt.observability.metrics_collector",
        STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
        RadixCacheMetricsCollector=_placeholder_class("RadixCacheMetricsCollector"),
        radix_cache_metric_labels=_placeholder_fn("radix_cache_metric_labels"),
        resolve_collector_class=_placeholder_fn("resolve_collector_class"),
    )
    _stub("sglang.srt.utils.common", ceil_align=_placeholder_fn("ceil_align"))
    _stub("sglang.srt.utils.cpp_extension_loader", load_extension_with_recovery=_build_native_hash)

    imp = importlib.import_module
    s = Sglang(
        kv_events=imp("sglang.srt.disaggregation.kv_events"),
        events=imp("sglang.srt.mem_cache.events"),
        utils=imp("sglang.srt.mem_cache.utils"),
        native_hash=imp("sglang.srt.mem_cache.cpp_utils.native_hash"),
        base=imp("sglang.srt.mem_cache.base_prefix_cache"),
        radix=imp("sglang.srt.mem_cache.radix_cache"),
        lora_registry=imp("sglang.srt.lora.lora_registry"),
        normalize_request=request_normalizer(),
        root=root,
    )
    for name in (
        "sglang.srt.mem_cache.radix_cache",
        "sglang.srt.mem_cache.events",
        "sglang.srt.mem_cache.utils",
        "sglang.srt.disaggregation.kv_events",
    ):
        f = sys.modules[name].__file__ or ""
        if not f.startswith(root):
            raise RuntimeError(f"sglang_loader: {name} did not load from the wheel ({f})")
    # Build (or load) the native hash now, so a missing compiler fails at start.
    s.native_hash._load_native_hash_module()
    check()
    _LOADED = s
    return s


def check() -> None:
    if PLACEHOLDER_CALLS:
        raise RuntimeError(f"sglang_loader: placeholders used: {PLACEHOLDER_CALLS}")


if __name__ == "__main__":
    s = load()
    # The wheel's page chain on a known vector (golden/sglang/hash_vectors_v0.5.23.json).
    h = s.utils.get_hash_str([1, 2, 3, 4, 5, 6, 7, 8], None, page_size=4)
    assert h[0].startswith("cf97adeedb59e05b"), h
    assert s.normalize_request("", "") == (None, None)
    assert s.normalize_request("t", "k") == ("t", "k")
    check()
    print("sglang_loader: ok", s.root)
