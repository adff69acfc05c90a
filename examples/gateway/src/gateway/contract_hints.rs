//! Every hash-contract error tells the operator what to set. These tests make
//! each refusal happen, take every `backticked` setting its message names and
//! check that the setting exists: a contract spec or `key=value` the contract
//! parser accepts, a rule line the gateway's config accepts, an engine flag, an
//! algorithm or a request-extra name. (A hint once said `pythonhashseed = "0"`,
//! a key no rule has.)

use std::path::PathBuf;

use kvroute_core::{BlockHasher, HashContract, HashError, LoraAdapter, RequestExtras};

use super::config::ServeConfig;

/// Engine settings the hints may name, with where they are defined.
const ENGINE_SETTINGS: [&str; 5] = [
    // vLLM CLI (vllm/engine/arg_utils.py).
    "--block-size",
    "--prefix-caching-hash-algo",
    // SGLang CLI (sglang/srt/server_args.py).
    "--page-size",
    // TensorRT-LLM KvCacheConfig field.
    "tokens_per_block",
    // The environment variable vLLM seeds NONE_HASH from.
    "PYTHONHASHSEED",
];

/// Request-extra names (`RequestExtras` fields) an `ExtraNotSupported` names.
const EXTRAS: [&str; 8] = [
    "lora",
    "mm_features",
    "cache_salt",
    "prompt_embeds",
    "sglang_extra_key",
    "trtllm_lora_task_id",
    "trtllm_cache_salt_id",
    "trtllm_token_extra_ids",
];

fn contract_err(spec: &str) -> String {
    let err = spec
        .parse::<HashContract>()
        .and_then(|c| BlockHasher::new(&c).map(|_| ()))
        .expect_err(spec);
    err.to_string()
}

fn extra_err(spec: &str, extras: &RequestExtras) -> String {
    let c: HashContract = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
    let h = BlockHasher::new(&c).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let tokens: Vec<u32> = (0..64).collect();
    let err: HashError = h
        .hash_prompt(&tokens, extras, &mut Vec::new())
        .expect_err(spec);
    err.to_string()
}

/// Every refusal a contract or a request extra can meet.
fn messages() -> Vec<String> {
    let mut out: Vec<String> = [
        "vllm@0.33.0:nope:block=16:seed=0",         // unknown algorithm
        "vllm@0.33.0:sha256_cbor:block=0",          // zero block size
        "vllm@0.33.0:xxhash:block=16",              // random root (xxhash)
        "vllm@0.28.0:sha256_cbor:block=16",         // random root (< 0.29)
        "vllm@0.33.0:sha256_cbor:block=16:seed=-1", // seed CPython refuses
        "vllm@0.10.1:sha256:block=16:seed=0",       // unsupported version
        "vllm@0.12.0:xxhash:block=16:seed=0",       // algorithm too new
        "sglang@0.4.7:sha256_page_chain:block=16",
        "sglang@0.5.5:sha256_page_chain:block=16",
        "sglang@0.5.23:legacy_pyhash:block=16",
        "sglang@0.5.21:sha256_page_chain:block=16:format=dynamo",
        "vllm@0.33.0:sha256_cbor", // bad spec
        "sglang@0.5.23:sha256_page_chain:block=16:seed=0",
    ]
    .iter()
    .map(|s| contract_err(s))
    .collect();
    let salt = RequestExtras {
        cache_salt: Some("s".into()),
        ..RequestExtras::NONE
    };
    let lora = RequestExtras {
        lora: Some(LoraAdapter {
            name: "a".into(),
            path: "/a".into(),
        }),
        ..RequestExtras::NONE
    };
    let sglang_key = RequestExtras {
        sglang_extra_key: Some("k".into()),
        ..RequestExtras::NONE
    };
    for (spec, extras) in [
        ("vllm@0.30.0:sha256_cbor:block=16:seed=0", &salt),
        ("sglang@0.5.5:legacy_pyhash:block=16", &salt),
        ("rekey:xxh3_64_chain:block=16:seed=1337", &salt),
        ("trtllm@1.1.0:v1_block_key:block=16", &lora),
        ("sglang@0.5.17:sha256_page_chain:block=16", &salt),
        ("sglang@0.5.21:sha256_page_chain:block=16", &sglang_key),
    ] {
        out.push(extra_err(spec, extras));
    }
    out.push(HashError::PickleTooLarge { len: 1 << 30 }.to_string());
    out
}

fn backticked(msg: &str) -> Vec<&str> {
    msg.split('`').skip(1).step_by(2).collect()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `line` (e.g. `contract = "rekey:..."`) inside an otherwise valid KV rule.
fn rule_line_accepted(line: &str) -> Result<(), String> {
    let key = line.split('=').next().unwrap_or_default().trim();
    let mut rule = vec![
        "name = \"r\"".to_owned(),
        "models = [\"m\"]".to_owned(),
        "choice = \"kv_exact\"".to_owned(),
        "contract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"".to_owned(),
    ];
    rule.retain(|l| !l.starts_with(&format!("{key} ")));
    rule.push(line.to_owned());
    let text = format!(
        "listen = \"127.0.0.1:0\"\n[[models]]\nslug = \"m\"\ndir = \"golden/tokenizers/qwen3\"\n\
         [[rules]]\n{}\n[[rules.endpoints]]\nurl = \"http://127.0.0.1:8001\"\nengine = \"vllm\"\nzmq = \"tcp://*:5557\"\n",
        rule.join("\n")
    );
    ServeConfig::from_toml(&text, &repo())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Why `setting` is real, or `Err` saying it is not.
fn real(setting: &str) -> Result<&'static str, String> {
    if ENGINE_SETTINGS.contains(&setting) {
        return Ok("engine setting");
    }
    if EXTRAS.contains(&setting) {
        return Ok("request extra");
    }
    if setting.contains(" = ") {
        return rule_line_accepted(setting).map(|()| "rule line");
    }
    if setting.contains(':') {
        let c: HashContract = setting.parse().map_err(|e| format!("{e}"))?;
        BlockHasher::new(&c).map_err(|e| format!("{e}"))?;
        return Ok("contract spec");
    }
    if let Some((key, _)) = setting.split_once('=') {
        let base = match key {
            "format" => "sglang@0.5.23:sha256_page_chain:block=16",
            "block" | "page" | "seed" | "lookahead" => "vllm@0.33.0:sha256_cbor:block=16",
            _ => return Err(format!("{key}= is no contract key")),
        };
        let spec = format!("{base}:{setting}");
        let spec = if setting.ends_with('=') {
            // "omit `seed=`": the key itself is what is named.
            spec.replace(":seed=", ":seed=0")
        } else {
            spec
        };
        spec.parse::<HashContract>()
            .map_err(|e| format!("{spec}: {e}"))?;
        return Ok("contract key");
    }
    for base in [
        "vllm@0.33.0:{}:block=16:seed=0",
        "sglang@0.5.23:{}:block=16",
        "sglang@0.5.5:{}:block=16",
    ] {
        if base.replace("{}", setting).parse::<HashContract>().is_ok() {
            return Ok("algorithm");
        }
    }
    Err("neither a contract, a rule line, an engine setting nor an extra".to_owned())
}

#[test]
fn every_contract_hint_names_a_real_setting() {
    let mut named = 0;
    for msg in messages() {
        for setting in backticked(&msg) {
            if let Err(why) = real(setting) {
                panic!("`{setting}` in {msg:?} is not a real setting: {why}");
            }
            named += 1;
        }
    }
    // Each refusal above names at least one setting except the parse errors.
    assert!(named >= 20, "only {named} settings named");
}

#[test]
fn the_checker_refuses_settings_that_do_not_exist() {
    for fake in [
        "pythonhashseed = \"0\"",
        "engine = \"rekey\"",
        "algorithm = \"legacy_pyhash\"",
        "kv_events_format = \"dynamo\"",
        "pythonhashseed",
        "hash_seed=0",
        "--no-such-flag",
    ] {
        assert!(real(fake).is_err(), "{fake} passed as real");
    }
}
