#!/usr/bin/env python3
"""Regenerates the generated bodies of golden/engine-metrics/ (see README.md).

The text bodies are rendered by Python's `prometheus_client` — the library vLLM
and SGLang serve `/metrics` with — from the metric definitions (name, help text,
label names, multiprocess mode) of vLLM 0.33.0 `vllm/v1/metrics/loggers.py` and
SGLang 0.5.23 `sglang/srt/observability/metrics_collector.py`, and TensorRT-LLM's
`tensorrt_llm/metrics/collector.py`. The TensorRT-LLM JSON bodies use the
iteration-stats keys of `tests/unittest/llmapi/apps/_test_openai_metrics.py`.

    python3 -m venv /tmp/promvenv && /tmp/promvenv/bin/pip install prometheus_client==0.26.0
    /tmp/promvenv/bin/python golden/engine-metrics/generate.py

Writes the files next to this script; the expected reports are in cases.json.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def write(name, text):
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
        f.write(text)


# vLLM 0.33.0 CacheConfig fields in declaration order (vllm/config/cache.py);
# metrics_info() renders every one with str().
def cache_config(num_gpu_blocks, skip_layers):
    return {
        "block_size": "16",
        "user_specified_block_size": "False",
        "kv_cache_layout": "None",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": "0.9",
        "cache_dtype": "fp8_e4m3",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": "sha256_cbor",
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": str(skip_layers),
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": "None",
        "simple_cpu_offload_num_blocks": "None",
        "effective_attention_block_size": "16",
        "kv_cache_size_tokens": "None" if num_gpu_blocks is None else str(num_gpu_blocks * 16),
        "kv_cache_max_concurrency": "None" if num_gpu_blocks is None else "13.5",
        "hash_block_size": "16",
        "cache_hit_alignment_tokens": "16",
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": "None",
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
    }


def vllm_body(engines, model, num_gpu_blocks):
    """engines: list of (running, waiting_capacity, waiting_deferred, kv_usage)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    labelnames = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    labelnames, multiprocess_mode="mostrecent", registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    labelnames, multiprocess_mode="mostrecent", registry=reg)
    by_reason = Gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
        "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        labelnames + ["reason"], multiprocess_mode="mostrecent", registry=reg)
    sleep = Gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        labelnames + ["sleep_state"], multiprocess_mode="mostrecent", registry=reg)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  labelnames, multiprocess_mode="mostrecent", registry=reg)
    queries = Counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      labelnames, registry=reg)
    hits = Counter("vllm:prefix_cache_hits",
                   "Prefix cache hits, in terms of number of cached tokens.",
                   labelnames, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds",
                     "Histogram of time to first token in seconds.", labelnames,
                     buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                              1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
                     registry=reg)
    # vllm/v1/metrics/buckets.py: REQUEST_LATENCY_BUCKETS, and the 1-2-5 series up
    # to max_model_len (40 960 for Qwen3) for the token family.
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
    tokens = [m * 10 ** e for e in range(5) for m in (1, 2, 5) if m * 10 ** e <= 40960]
    prefill_time = Histogram("vllm:request_prefill_time_seconds",
                             "Histogram of time spent in PREFILL phase for request.", labelnames,
                             buckets=latency, registry=reg)
    prefill_kv = Histogram("vllm:request_prefill_kv_computed_tokens",
                           "Histogram of new KV tokens computed during prefill "
                           "(excluding cached tokens).", labelnames,
                           buckets=tokens, registry=reg)
    for idx, (run, cap, deferred, kv) in enumerate(engines):
        lv = [model, str(idx)]
        running.labels(*lv).set(run)
        waiting.labels(*lv).set(cap + deferred)
        by_reason.labels(*lv, "capacity").set(cap)
        by_reason.labels(*lv, "deferred").set(deferred)
        for state in ["awake", "weights_offloaded", "discard_all"]:
            sleep.labels(engine=idx, model_name=model, sleep_state=state).set(
                1 if state == "awake" else 0)
        usage.labels(*lv).set(kv)
        queries.labels(*lv).inc(48_000 * (idx + 1))
        hits.labels(*lv).inc(30_000 * (idx + 1))
        for t in (0.03, 0.2, 1.7):
            ttft.labels(*lv).observe(t)
        # Finished requests: (prefill seconds, uncached tokens). An engine that has
        # finished nothing exports the histograms with zero sums.
        done = [] if run == 0 else [(0.125, 2500), (0.5, 10000), (0.0625, 1250)][: idx + 2]
        for secs, toks in done:
            prefill_time.labels(*lv).observe(secs)
            prefill_kv.labels(*lv).observe(toks)
        if not done:
            prefill_time.labels(*lv)
            prefill_kv.labels(*lv)
    info_labels = list(cache_config(None, []).keys()) + ["engine"]
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 info_labels, multiprocess_mode="mostrecent", registry=reg)
    for idx in range(len(engines)):
        # A list-valued label (commas, quotes) exercises the label-value grammar.
        cfg = cache_config(num_gpu_blocks, ["model.layers.0.self_attn", "lm_head"])
        cfg["engine"] = str(idx)
        info.labels(**cfg).set(1)
    return generate_latest(reg).decode()


def sglang_body():
    """Two DP ranks under priority scheduling, rendered through the multiprocess
    collector as SGLang does (PROMETHEUS_MULTIPROC_DIR); rank 0 is also exported by
    a second TP scheduler (--enable-metrics-for-all-schedulers)."""
    # prometheus_client picks its multiprocess value store at import time, so this
    # runs in a child process started with PROMETHEUS_MULTIPROC_DIR set.
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        tmp = tempfile.mkdtemp()
        try:
            env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=tmp)
            out = subprocess.run([sys.executable, __file__, "--sglang"], env=env, check=True,
                                 capture_output=True, text=True)
            return out.stdout
        finally:
            shutil.rmtree(tmp)
    if True:
        from prometheus_client import CollectorRegistry, Gauge, generate_latest, multiprocess

        names = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "priority",
                 "dp_rank"]

        def gauge(name, doc):
            return Gauge(name, doc, names, multiprocess_mode="mostrecent")

        running = gauge("sglang:num_running_reqs", "The number of running requests.")
        queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        usage = gauge("sglang:token_usage", "The token usage.")
        used = gauge("sglang:num_used_tokens", "The number of used tokens.")
        max_total = gauge("sglang:max_total_num_tokens",
                          "Maximum total number of tokens in the KV cache pool.")
        page = gauge("sglang:page_size", "KV cache page size in tokens.")
        pages = gauge("sglang:num_pages", "Number of KV cache pages.")
        ranks = [
            # (dp_rank, tp_rank, running by priority, queue by priority, usage)
            (0, 0, {0: 9, 5: 3}, {0: 4, 5: 1}, 0.71),
            (0, 1, {0: 9, 5: 3}, {0: 4, 5: 1}, 0.71),
            (1, 2, {0: 2}, {}, 0.15),
        ]
        for dp, tp, run, q, u in ranks:
            base = dict(model_name="Qwen/Qwen3-8B", engine_type="unified", tp_rank=tp,
                        pp_rank=0, moe_ep_rank=0, dp_rank=dp)
            running.labels(**base, priority="").set(sum(run.values()))
            queue.labels(**base, priority="").set(sum(q.values()))
            for p in sorted(set(run) | set(q)):
                running.labels(**base, priority=str(p)).set(run.get(p, 0))
                queue.labels(**base, priority=str(p)).set(q.get(p, 0))
            usage.labels(**base, priority="").set(u)
            used.labels(**base, priority="").set(int(u * 393216))
            max_total.labels(**base, priority="").set(393216)
            page.labels(**base, priority="").set(64)
            pages.labels(**base, priority="").set(6144)
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return generate_latest(reg).decode()


def trtllm_prometheus_body():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = {"model_name": "undefined", "engine_type": "undefined"}
    values = [
        ("num_requests_running", "Number of active requests", 5),
        ("num_requests_waiting", "Number of queued requests", 3),
        ("max_num_active_requests", "Maximum number of active requests", 10),
        ("kv_cache_hit_rate", "KV cache hit rate", 0.85),
        ("kv_cache_utilization", "KV cache utilization", 0.6),
        ("kv_cache_max_blocks", "Maximum number of KV cache blocks", 1000),
        ("kv_cache_free_blocks", "Number of free KV cache blocks", 400),
        ("kv_cache_used_blocks", "Number of used KV cache blocks", 600),
        ("kv_cache_tokens_per_block", "Number of tokens per KV cache block", 64),
    ]
    for name, doc, v in values:
        Gauge("trtllm_" + name, doc, labels.keys(), registry=reg).labels(**labels).set(v)
    Counter("trtllm_kv_cache_reused_blocks",
            "Cumulative number of KV cache blocks reused (cache hits)", labels.keys(),
            registry=reg).labels(**labels).inc(420)
    return generate_latest(reg).decode()


def trtllm_row(it, rank, active, queued, used, max_blocks, queued_ctx):
    # Every key _test_openai_metrics.py asserts, plus attentionDpRank (attention DP).
    return {
        "attentionDpRank": rank,
        "cpuMemUsage": 0,
        "gpuMemUsage": 58941767680,
        "inflightBatchingStats": {
            "avgNumDecodedTokensPerIter": 1.0,
            "microBatchId": 0,
            "numContextRequests": 1,
            "numCtxKvTokens": 0,
            "numCtxTokens": 512,
            "numGenKvTokens": 9000,
            "numGenRequests": active - 1,
            "numPausedKvTokens": 0,
            "numPausedRequests": 0,
            "numQueuedContextRequests": queued,
            "numQueuedCtxTokens": queued_ctx,
            "numQueuedGenKvTokens": 0,
            "numQueuedGenRequests": 0,
            "numScheduledRequests": active,
        },
        "iter": it,
        "iterLatencyMS": 21.5,
        "kvCacheStats": {
            "allocNewBlocks": 96,
            "allocTotalBlocks": 128,
            "cacheHitRate": 0.25,
            "freeNumBlocks": max_blocks - used,
            "maxNumBlocks": max_blocks,
            "missedBlocks": 96,
            "reusedBlocks": 32,
            "tokensPerBlock": 32,
            "usedNumBlocks": used,
        },
        "maxBatchSizeRuntime": 64,
        "maxBatchSizeStatic": 64,
        "maxBatchSizeTunerRecommended": 0,
        "maxNumActiveRequests": 64,
        "maxNumTokensRuntime": 8192,
        "maxNumTokensStatic": 8192,
        "maxNumTokensTunerRecommended": 0,
        "newActiveRequestsQueueLatencyMS": 0.0007503032684326172,
        "numActiveRequests": active,
        "numCompletedRequests": 0,
        "numNewActiveRequests": 1,
        "numQueuedRequests": queued,
        "pinnedMemUsage": 0,
        "staticBatchingStats": {"emptyGenSlots": 0, "numContextRequests": 0,
                                "numCtxTokens": 0, "numGenTokens": 0,
                                "numScheduledRequests": 0},
        "timestamp": "12-01-2026 09:30:00",
    }


def main():
    if sys.argv[1:] == ["--sglang"]:
        sys.stdout.write(sglang_body())
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        sys.exit("generate.py: needs prometheus_client==0.26.0 (see the docstring)")
    write("vllm-0.33.0-dp2.txt", vllm_body([(7, 2, 1, 0.62), (5, 0, 0, 0.18)], "Qwen/Qwen3-8B",
                                           27000))
    write("vllm-0.33.0-starting.txt", vllm_body([(0, 0, 0, 0.0)], "Qwen/Qwen3-0.6B", None))
    write("sglang-0.5.23-dp2-priority.txt", sglang_body())
    write("trtllm-prometheus.txt", trtllm_prometheus_body())
    # Two iterations of a two-rank attention-DP engine; the drain returns both
    # (the parser must use iteration 42 of each rank). Rank 1 has no queued work.
    rows = [
        trtllm_row(41, 0, 6, 3, 900, 5358, 1536),
        trtllm_row(41, 1, 4, 0, 700, 5358, 0),
        trtllm_row(42, 0, 7, 2, 1000, 5358, 1024),
        trtllm_row(42, 1, 5, 0, 800, 5358, 0),
    ]
    write("trtllm-adp2-drain.json", json.dumps(rows, indent=1) + "\n")
    write("trtllm-idle-drain.json", "[]")


if __name__ == "__main__":
    main()
