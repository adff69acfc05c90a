"""Loads vLLM's own KV-cache modules from the installed wheel without torch.

`pip install --no-deps vllm==0.33.0` puts the real sources in site-packages.
The modules this harness runs are executed from those files, unchanged:

* `vllm.v1.core.kv_cache_utils`  request block hasher, `init_none_hash`
  (PYTHONHASHSEED / fixed-root rules), `KVCacheBlock`, `FreeKVCacheBlockQueue`
  (the LRU free list), `maybe_convert_block_hash` (64-bit event keys);
* `vllm.v1.core.block_pool`      `BlockPool`: prefix lookup, allocation,
  `cache_full_blocks`, eviction, `reset_prefix_cache`, the event queue;
* `vllm.distributed.kv_events`   `ZmqEventPublisher` (PUB + replay ROUTER,
  replay buffer), `KVEventBatch`, `BlockStored` / `BlockRemoved` /
  `AllBlocksCleared`;
* `vllm.utils.hashing` (sha256 pickle, sha256_cbor, xxhash...),
  `vllm.utils.math_utils`, `vllm.utils.network_utils`, `vllm.envs`,
  `vllm.logger`, `vllm.logging_utils`, `vllm.config.utils` and
  `vllm.config.kv_events` (the pydantic `KVEventsConfig` the publisher builds),
  `vllm.v1.kv_cache_spec_registry`, `vllm.v1.core.kv_cache_metrics`.

What is NOT executed, and why that leaves the path above untouched:

* Package `__init__` files of `vllm`, `vllm.utils`, `vllm.config`,
  `vllm.distributed`, `vllm.v1`, `vllm.v1.core`, `vllm.v1.metrics`,
  `vllm.multimodal`: they only re-export (and import torch, CUDA platform
  probing, the whole config tree). Each is replaced by an empty package whose
  `__path__` is the real directory, so submodules still load from the wheel.
* `torch`: an empty module. Only `vllm.config.utils` imports it at module
  level (for tensor-typed config fields this path never builds); any
  attribute access on it raises, so a use would fail loudly.
* Leaf modules whose names the loaded files import but whose code only runs
  for features this harness does not use; every placeholder raises when called
  or instantiated:
  - `vllm.config.VllmConfig` (annotations of the KV-cache sizing helpers);
  - `vllm.v1.kv_cache_interface` (torch-typed specs, used by the sizing helpers
    only; a single full-attention group is the default the pool already uses);
  - `vllm.v1.request.Request` (annotations only; `StandinRequest` in
    `vllm_standin.py` carries the attributes the hasher and pool read);
  - `vllm.multimodal.utils.get_mm_features_in_window` (multimodal inputs only);
  - `vllm.v1.utils.tensor_data` (prompt embeddings only);
  - `vllm.v1.metrics.stats.KVCacheEvictionEvent` (the optional metrics
    collector, which the pool is built without, as with `--kv-cache-metrics` off).

`load()` asserts afterwards that no placeholder was touched (`PLACEHOLDER_CALLS`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

PLACEHOLDER_CALLS: list[str] = []


class _Placeholder:
    """Stands for a class the loaded code names but this path never builds."""

    _name = "placeholder"

    def __init__(self, *args, **kwargs):
        PLACEHOLDER_CALLS.append(self._name)
        raise RuntimeError(f"vllm_loader: placeholder {self._name} was instantiated")


def _placeholder_class(name: str) -> type:
    return type(name, (_Placeholder,), {"_name": name})


def _placeholder_fn(name: str):
    def fn(*args, **kwargs):
        PLACEHOLDER_CALLS.append(name)
        raise RuntimeError(f"vllm_loader: placeholder {name} was called")

    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


class _LoudModule(types.ModuleType):
    """A stub module: names not defined on it raise instead of existing."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        PLACEHOLDER_CALLS.append(f"{self.__name__}.{item}")
        raise AttributeError(f"vllm_loader: stub module {self.__name__} has no {item!r}")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = _LoudModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def _shell_package(name: str, directory: str, **attrs) -> types.ModuleType:
    """An empty package over a real directory: submodules load from the wheel."""
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


class Vllm(types.SimpleNamespace):
    """The loaded modules."""


def vllm_root() -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "vllm_loader: vllm is not installed in this interpreter; run scripts/python-env.sh"
        )
    return list(spec.submodule_search_locations)[0]


def load() -> Vllm:
    if "torch" in sys.modules and not isinstance(sys.modules["torch"], _LoudModule):
        raise RuntimeError("vllm_loader: a real torch is already imported")
    root = vllm_root()
    _stub("torch")
    _shell_package("vllm", root)
    for pkg in ("utils", "distributed", "v1", "multimodal"):
        _shell_package(f"vllm.{pkg}", os.path.join(root, pkg))
    _shell_package("vllm.config", os.path.join(root, "config"), VllmConfig=_placeholder_class("VllmConfig"))
    _shell_package("vllm.v1.core", os.path.join(root, "v1", "core"))
    _shell_package("vllm.v1.metrics", os.path.join(root, "v1", "metrics"))
    _stub(
        "vllm.v1.kv_cache_interface",
        **{
            n: _placeholder_class(n)
            for n in (
                "KVCacheConfig",
                "KVCacheGroupSpec",
                "KVCacheSpec",
                "MambaSpec",
                "UniformTypeKVCacheSpecs",
            )
        },
        iter_layer_specs=_placeholder_fn("iter_layer_specs"),
    )
    _stub("vllm.v1.request", Request=_placeholder_class("Request"))
    _stub("vllm.v1.utils", tensor_data=_placeholder_fn("tensor_data"))
    _stub(
        "vllm.multimodal.utils",
        get_mm_features_in_window=_placeholder_fn("get_mm_features_in_window"),
    )
    _stub("vllm.v1.metrics.stats", KVCacheEvictionEvent=_placeholder_class("KVCacheEvictionEvent"))

    imp = importlib.import_module
    v = Vllm(
        envs=imp("vllm.envs"),
        hashing=imp("vllm.utils.hashing"),
        kv_cache_utils=imp("vllm.v1.core.kv_cache_utils"),
        block_pool=imp("vllm.v1.core.block_pool"),
        kv_events=imp("vllm.distributed.kv_events"),
        root=root,
    )
    for name in ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_utils", "vllm.distributed.kv_events"):
        f = sys.modules[name].__file__ or ""
        if not f.startswith(root):
            raise RuntimeError(f"vllm_loader: {name} did not load from the wheel ({f})")
    check()
    return v


def check() -> None:
    if PLACEHOLDER_CALLS:
        raise RuntimeError(f"vllm_loader: placeholders used: {PLACEHOLDER_CALLS}")


if __name__ == "__main__":
    v = load()
    print("vllm_loader: ok", v.root)
