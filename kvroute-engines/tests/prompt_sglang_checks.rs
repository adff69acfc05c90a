//! kvroute's SGLang request checks against SGLang 0.5.23's own:
//! `tests/python/sglang_request_checks.py` validates each body with the
//! wheel's request models, builds its `GenerateReqInput` with the wheel's
//! serving code, normalises it (batches, `n`, `cache_salt`) with the wheel's
//! `GenerateReqInput`, and runs `TokenizerManager._validate_one_request` on
//! each prompt with the length kvroute tokenized it to.
//!
//! The corpus crosses prompt shapes and lengths around the context length
//! with `max_tokens` / `max_completion_tokens`, `n` and `cache_salt` values,
//! on chat and completions. A request SGLang refuses must be refused; one it
//! serves must be served, routed by its first prompt's salt.

mod interop_support;

use interop_support::transformers::{qwen3_tokenizer, run_json};
use kvroute_engines::prompt::{
    parse_json, prompt_tokens_as, ApiKind, Dialect, ModelOptions, ModelTokenizer, PromptLimits,
};
use serde_json::{json, Value};

const MODEL: &str = "Qwen/Qwen3-8B";

fn staged() -> (std::path::PathBuf, Value) {
    let (tokenizer, config) = qwen3_tokenizer();
    let dir = std::env::temp_dir().join(format!("kvroute-sglang-checks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    (dir, config)
}

fn api_of(r: &Value) -> ApiKind {
    match r["api"].as_str() {
        Some("chat") => ApiKind::Chat,
        _ => ApiKind::Completions,
    }
}

/// Bodies around a context of `context` tokens, for a chat whose rendered
/// prompt is `chat_len` tokens long.
fn corpus(context: usize, chat_len: usize) -> Vec<Value> {
    let ids = |n: usize| Value::from((0..n).map(|i| 100 + i as u64).collect::<Vec<_>>());
    let prompts = vec![
        json!("The quick brown fox"),
        ids(context.saturating_sub(17).max(1)),
        ids(context.saturating_sub(16).max(1)),
        ids(context - 1),
        ids(context),
        ids(context + 1),
        json!(["one prompt", "and another"]),
        json!(["just one"]),
        Value::Array(vec![ids(3), ids(context - 1)]),
        Value::Array(vec![ids(context.saturating_sub(20).max(1)), ids(4)]),
    ];
    let max_tokens = [
        None,
        Some(json!(null)),
        Some(json!(0)),
        Some(json!(-1)),
        Some(json!(1)),
        Some(json!(16)),
        Some(json!(17)),
        Some(json!(context)),
    ];
    let salts = [
        None,
        Some(json!(null)),
        Some(json!("")),
        Some(json!("tenant")),
        Some(json!([])),
        Some(json!(["a"])),
        Some(json!(["a", "b"])),
        Some(json!(["", "b"])),
        Some(json!([1, 2])),
        Some(json!(7)),
    ];
    let mut out = Vec::new();
    let with = |mut body: Value, key: &str, v: &Option<Value>| {
        if let Some(v) = v {
            body[key] = v.clone();
        }
        body
    };
    for (i, prompt) in prompts.iter().enumerate() {
        for (j, mt) in max_tokens.iter().enumerate() {
            // Every prompt with every max_tokens; salts and n on a diagonal.
            let salt = &salts[(i + j) % salts.len()];
            let n = (i * 7 + j) % 3 == 0;
            let mut body = json!({"model": MODEL, "prompt": prompt});
            body = with(body, "max_tokens", mt);
            body = with(body, "cache_salt", salt);
            if n {
                body["n"] = json!(2);
            }
            out.push(json!({"api": "completions", "body": body}));
        }
        for salt in &salts {
            let body = with(
                json!({"model": MODEL, "prompt": prompt}),
                "cache_salt",
                salt,
            );
            out.push(json!({"api": "completions", "body": body}));
        }
    }
    let room = context as i64 - chat_len as i64;
    let chat = || json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]});
    let fields = [
        ("max_tokens", json!(room)),
        ("max_tokens", json!(room + 1)),
        ("max_completion_tokens", json!(room)),
        ("max_completion_tokens", json!(room + 1)),
        ("max_completion_tokens", json!(0)),
        ("max_completion_tokens", json!(null)),
    ];
    for (k, v) in &fields {
        for other in [None, Some(json!(room)), Some(json!(room + 1))] {
            let mut body = chat();
            body[*k] = v.clone();
            if let Some(o) = &other {
                let o_key = if *k == "max_tokens" {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                body[o_key] = o.clone();
            }
            out.push(json!({"api": "chat", "body": body}));
        }
    }
    for salt in &salts {
        for n in [None, Some(json!(2))] {
            let mut body = with(chat(), "cache_salt", salt);
            if let Some(n) = n {
                body["n"] = n;
            }
            out.push(json!({"api": "chat", "body": body}));
        }
    }
    out.push(json!({"api": "chat", "body": chat()}));
    out
}

/// Runs `requests` through SGLang's checks and kvroute's SGLang path with a
/// context of `context` tokens; panics on any difference; returns (served,
/// refused) counts.
fn compare(
    dir: &std::path::Path,
    config: &Value,
    context: usize,
    requests: &[Value],
) -> (usize, usize) {
    let free = ModelTokenizer::load(dir, &ModelOptions::default()).unwrap();
    assert_eq!(
        free.max_model_len(),
        None,
        "the staged model has no context bound"
    );
    let bounded = ModelTokenizer::load(
        dir,
        &ModelOptions {
            max_model_len: Some(context),
            ..ModelOptions::default()
        },
    )
    .unwrap();
    // Each prompt's length as kvroute tokenizes it; a request kvroute
    // refuses for another reason gets one token per prompt (SGLang must
    // refuse it before its lengths matter).
    let mut job_requests = Vec::new();
    for r in requests {
        let body = parse_json(r["body"].to_string().as_bytes()).unwrap();
        let lengths: Vec<usize> = match prompt_tokens_as(
            &free,
            api_of(r),
            &body,
            PromptLimits::default(),
            Dialect::Sglang,
        ) {
            Ok(p) => p.engine_prompts.iter().map(|e| e.token_ids.len()).collect(),
            Err(_) => match &r["body"]["prompt"] {
                Value::Array(items) if items.iter().all(|v| !v.is_number()) => {
                    vec![1; items.len().max(1)]
                }
                _ => vec![1],
            },
        };
        job_requests.push(json!({"api": r["api"], "body": r["body"], "prompt_tokens": lengths}));
    }
    let job = json!({
        "context_length": context,
        "template": config["chat_template"],
        "special_tokens": {},
        "requests": job_requests,
    });
    let sglang: Vec<Value> =
        serde_json::from_value(run_json("sglang_request_checks.py", &[], &job)).unwrap();
    assert_eq!(sglang.len(), requests.len());
    let (mut served, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for (r, want) in requests.iter().zip(&sglang) {
        let body = parse_json(r["body"].to_string().as_bytes()).unwrap();
        let got = prompt_tokens_as(
            &bounded,
            api_of(r),
            &body,
            PromptLimits::default(),
            Dialect::Sglang,
        );
        match (got, want.get("ok")) {
            (Ok(p), Some(ok)) => {
                served += 1;
                let salt = ok[0]["cache_salt"].as_str().map(str::to_owned);
                if p.cache_salt != salt {
                    failures.push(format!(
                        "{}: salt {:?}, SGLang {salt:?}",
                        r["body"], p.cache_salt
                    ));
                }
                if p.engine_prompts.len() != ok.as_array().map_or(0, Vec::len) {
                    failures.push(format!(
                        "{}: {} prompts, SGLang {ok}",
                        r["body"],
                        p.engine_prompts.len()
                    ));
                }
            }
            (Err(_), None) => refused += 1,
            (Ok(_), None) => failures.push(format!(
                "{}: served, SGLang refuses: {}",
                r["body"], want["err"]
            )),
            (Err(e), Some(_)) => {
                failures.push(format!("{}: refused ({e}), SGLang serves it", r["body"]))
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        requests.len(),
        failures.join("\n")
    );
    (served, refused)
}

#[test]
fn sglang_request_checks_agree_with_sglangs_own() {
    let (dir, config) = staged();
    let free = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]});
    let chat_len = prompt_tokens_as(
        &free,
        ApiKind::Chat,
        &parse_json(chat.to_string().as_bytes()).unwrap(),
        PromptLimits::default(),
        Dialect::Sglang,
    )
    .unwrap()
    .engine_prompts[0]
        .token_ids
        .len();
    // A context of 64 tokens, and one exactly as long as the chat prompt.
    let mut totals = (0, 0);
    for context in [64, chat_len] {
        let requests = corpus(context, chat_len);
        let (served, refused) = compare(&dir, &config, context, &requests);
        totals = (totals.0 + served, totals.1 + refused);
    }
    eprintln!(
        "SGLang request checks: {} served, {} refused, all agree",
        totals.0, totals.1
    );
    assert!(
        totals.0 >= 40 && totals.1 >= 40,
        "{totals:?}: both outcomes covered"
    );
}
