//! `limits.tokenizer_threads`: a gateway that splits long prompts across
//! tokenizer threads routes exactly like one that does not. Two real gateways
//! (1 and 2 threads) follow the same two mock engines; after a long document
//! is cached on one engine, a fresh follow-up chat on that document (new to
//! both gateways' span caches) must get the same endpoint and the same
//! predicted cached tokens from both, and the engine must deliver them.

mod gateway_support;

use gateway_support::*;
use serde_json::Value;

const WORDS: [&str; 24] = [
    "the",
    "router",
    "keeps",
    "prefix",
    "blocks",
    "of",
    "every",
    "prompt",
    "and",
    "sends",
    "it",
    "engine",
    "that",
    "holds",
    "cache",
    "for",
    "long",
    "documents",
    "when",
    "tenants",
    "share",
    "system",
    "instructions",
    "quarterly",
];

/// About 40 KB of prose (well above the 16 KiB split threshold), with the
/// `letter space letter` seams the parallel encoder cuts at.
fn document(words: usize) -> String {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut out = String::from("Report.");
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        if i % 11 == 10 {
            out.push_str(if i % 110 == 109 { ".\n\n" } else { "," });
        }
    }
    out
}

fn chat_body(doc: &str, question: &str) -> Value {
    serde_json::json!({
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": format!("{doc}\n\nQuestion: {question}")},
        ],
    })
}

/// (endpoint header, predicted cached tokens header, delivered cached
/// tokens, prompt tokens).
async fn chat(gw: &Gateway, body: &Value) -> (String, u64, u64, u64) {
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{:?}", resp.headers());
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let endpoint = header("x-kvroute-endpoint");
    let predicted = header("x-kvroute-predicted-cached-tokens")
        .parse()
        .unwrap_or_else(|_| panic!("no predicted header: {:?}", resp.headers()));
    let v: Value = resp.json().await.unwrap();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    (endpoint, predicted, cached_tokens(&v), prompt_tokens)
}

/// Threads of the gateway process named by the parallel encoder's pool
/// (`kvroute-tokenize-N`, cut to 15 bytes by the kernel).
fn tokenizer_pool_threads(gw: &Gateway) -> usize {
    let dir = format!("/proc/{}/task", gw.proc.child.id());
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with("kvroute-tokeni"))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tokenizer_threads_route_a_fresh_long_prompt_like_one() {
    let engines = [Engine::start("both"), Engine::start("both")];
    let gateway = |threads: usize| {
        let mut toml = config_head(&format!("[limits]\ntokenizer_threads = {threads}\n"));
        toml.push_str(&kv_rule("kv", "converged"));
        for e in &engines {
            toml.push_str(&e.endpoint_toml("both"));
        }
        Gateway::start(&toml)
    };
    let (one, two) = (gateway(1), gateway(2));
    assert_eq!(tokenizer_pool_threads(&one), 0, "1 thread: no pool");
    assert_eq!(tokenizer_pool_threads(&two), 2, "2 threads: a pool of 2");
    wait_subscribed(&one).await;
    wait_subscribed(&two).await;

    let doc = document(7_000);
    assert!(doc.len() > 32 << 10, "{}", doc.len());
    // The document lands on one engine; both gateways see its blocks.
    let (first, predicted, _, tokens) = chat(&one, &chat_body(&doc, "who keeps the cache?")).await;
    assert_eq!(predicted, 0, "a fresh document predicts nothing");
    assert!(tokens > 6_000, "{tokens} prompt tokens");
    let stored = tokens / 16;
    eventually("both gateways see the stored blocks", || async {
        let (a, b) = (inventory(&one).await, inventory(&two).await);
        (a.iter().sum::<u64>() == stored && a == b).then_some(())
    })
    .await;

    // A follow-up neither gateway tokenized before (the span caches miss on
    // the user message); the two-thread gateway splits it across its pool.
    let (ep2, pred2, got2, _) = chat(&two, &chat_body(&doc, "what do tenants share?")).await;
    let (ep1, pred1, got1, _) = chat(&one, &chat_body(&doc, "where are blocks sent?")).await;
    assert_eq!(ep2, first, "the engine holding the document");
    assert_eq!(ep1, ep2);
    assert_eq!(pred2, pred1, "same keys, same prediction");
    // Every block of the shared document: all of the first request's blocks
    // but the last one or two, which hold its question.
    assert!(
        pred1 <= stored * 16 && pred1 + 2 * 16 >= stored * 16,
        "{pred1} tokens predicted of {stored} stored blocks"
    );
    assert_eq!(got2, pred2, "the engine delivered what was predicted");
    assert_eq!(got1, pred1);
}
