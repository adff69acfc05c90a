//! `kvroute tokenize`: ids equal vLLM's golden ids, keys equal the contract's keys.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvroute_core::{BlockKey, HashContract, RequestExtras};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

#[test]
fn chat_request_gives_golden_ids_and_contract_keys() {
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("chat/qwen3_cases.json")).unwrap())
            .unwrap();
    let case = cases["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "chat_shared_prefix_1")
        .expect("golden case");
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(&req, serde_json::to_vec(&case["request"]).unwrap()).unwrap();
    let spec = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--json", "--contract", spec, "--model-dir"])
        .arg(golden().join("tokenizers/qwen3"))
        .arg("--request")
        .arg(&req)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let prompt = &doc["engine_prompts"][0];
    assert_eq!(prompt["token_ids"], case["token_ids"]);
    assert_eq!(prompt["rendered_prompt"], case["rendered_prompt"]);

    let ids: Vec<u32> = serde_json::from_value(case["token_ids"].clone()).unwrap();
    let hasher = spec.parse::<HashContract>().unwrap().hasher().unwrap();
    let mut keys: Vec<BlockKey> = Vec::new();
    hasher
        .hash_prompt(&ids, &RequestExtras::default(), &mut keys)
        .unwrap();
    assert_eq!(keys.len(), ids.len() / 16);
    let printed: Vec<u64> = serde_json::from_value(prompt["block_keys_u64"].clone()).unwrap();
    assert_eq!(printed, keys.iter().map(|k| k.0).collect::<Vec<_>>());
}

#[test]
fn bad_contract_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "tokenize",
            "--contract",
            "vllm:sha512:block=16",
            "--model-dir",
        ])
        .arg(golden().join("tokenizers/qwen3"))
        .arg("--request")
        .arg(golden().join("chat/qwen3_cases.json"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--contract"));
}

/// A rule's configuration with a vLLM LoRA adapter, for `--config --rule`.
fn lora_config(dir: &Path) -> PathBuf {
    let config = dir.join("kvroute.toml");
    let text = format!(
        r#"
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[[models]]
slug = "qwen3"
dir = "{models}"

[[rules]]
name = "chat"
models = ["qwen3", "sql-lora"]
default = true
choice = "kv_exact"
contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0"

[[rules.lora]]
model = "sql-lora"
path = "/adapters/sql-lora"

[[rules.endpoints]]
url = "http://127.0.0.1:9"
engine = "vllm"
zmq = "tcp://127.0.0.1:9"
"#,
        models = golden().join("tokenizers/qwen3").display()
    );
    std::fs::write(&config, text).unwrap();
    config
}

/// `--config --rule` runs the rule's own prompt path: a request for a LoRA
/// adapter gets the adapter's keys, equal to the keys vLLM's own hashing gave
/// for the same ids and adapter (the golden vector); `--contract` alone
/// hashes without the adapter and gets other keys.
#[test]
fn config_rule_keys_are_the_rules_keys() {
    let vectors: serde_json::Value = serde_json::from_slice(
        &std::fs::read(golden().join("vllm/hash_vectors_v0.33.0.json")).unwrap(),
    )
    .unwrap();
    let case = vectors["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "sha256_cbor-bs16-seed0-lora")
        .expect("golden LoRA case");
    assert_eq!(case["lora"]["name"], "sql-lora");
    assert_eq!(case["lora"]["path"], "/adapters/sql-lora");
    let expected: Vec<u64> = case["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["event_key_u64"].as_u64().unwrap())
        .collect();
    assert_eq!(expected.len(), 3);

    let dir = tempfile::tempdir().unwrap();
    let config = lora_config(dir.path());
    let req = dir.path().join("req.json");
    let body = serde_json::json!({
        "model": "sql-lora",
        "prompt": case["token_ids"],
        "max_tokens": 1,
    });
    std::fs::write(&req, body.to_string()).unwrap();

    let run_on = |req: &Path, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .arg("tokenize")
            .args(args)
            .arg("--request")
            .arg(req)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let run = |args: &[&str]| run_on(&req, args);
    let config_arg = config.to_str().unwrap();
    let doc: serde_json::Value =
        serde_json::from_slice(&run(&["--json", "--config", config_arg, "--rule", "chat"]))
            .unwrap();
    assert_eq!(doc["rule"], "chat");
    assert_eq!(doc["lora"]["name"], "sql-lora");
    assert_eq!(doc["engine_prompts"][0]["token_ids"], case["token_ids"]);
    let keys: Vec<u64> =
        serde_json::from_value(doc["engine_prompts"][0]["block_keys_u64"].clone()).unwrap();
    assert_eq!(keys, expected, "the rule's keys vs vLLM's LoRA keys");
    assert_eq!(doc["truncated"], false);

    // `truncate_prompt_tokens` keeps the last 16 ids: shown as truncated.
    let cut = dir.path().join("cut.json");
    let mut body = body.clone();
    body["truncate_prompt_tokens"] = 16.into();
    std::fs::write(&cut, body.to_string()).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&run_on(
        &cut,
        &["--json", "--config", config_arg, "--rule", "chat"],
    ))
    .unwrap();
    assert_eq!(doc["truncated"], true, "{doc}");
    assert_eq!(
        doc["engine_prompts"][0]["token_ids"]
            .as_array()
            .unwrap()
            .len(),
        16
    );

    let model_dir = golden().join("tokenizers/qwen3");
    let plain: serde_json::Value = serde_json::from_slice(&run(&[
        "--json",
        "--contract",
        "vllm@0.33.0:sha256_cbor:block=16:seed=0",
        "--model-dir",
        model_dir.to_str().unwrap(),
    ]))
    .unwrap();
    let plain_keys: Vec<u64> =
        serde_json::from_value(plain["engine_prompts"][0]["block_keys_u64"].clone()).unwrap();
    assert_eq!(plain_keys.len(), 3);
    assert!(plain_keys.iter().all(|k| !expected.contains(k)));

    let text = String::from_utf8(run(&["--config", config_arg, "--rule", "chat"])).unwrap();
    assert!(text.contains("rule: chat"), "{text}");
    assert!(
        text.contains("lora: sql-lora (/adapters/sql-lora)"),
        "{text}"
    );
}

#[test]
fn unknown_rule_names_the_rules() {
    let dir = tempfile::tempdir().unwrap();
    let config = lora_config(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--rule", "nope", "--config"])
        .arg(&config)
        .arg("--request")
        .arg(golden().join("chat/qwen3_cases.json"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(r#"--rule "nope""#) && err.contains(r#"["chat"]"#),
        "{err}"
    );
}

/// An engine's `/tokenize` answered by transformers as vLLM answers it
/// (`tests/python/tokenize_server.py`), serving the model directory `dir`;
/// killed on drop.
struct TokenizeServer {
    child: std::process::Child,
    url: String,
}

impl TokenizeServer {
    fn start(dir: &Path) -> Self {
        use std::io::BufRead;
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let python = repo.join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} is missing: run scripts/python-env.sh",
            python.display()
        );
        let mut child = Command::new(python)
            .arg(repo.join("tests/python/tokenize_server.py"))
            .arg("--model-dir")
            .arg(dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("tokenize_server.py said {line:?}"))
            .trim()
            .to_owned();
        Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for TokenizeServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kvroute tokenize --engine URL --model-dir <staged Qwen3> --request
/// <request> ARGS...`.
fn tokenize_against(url: &str, request: &serde_json::Value, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(&req, serde_json::to_vec(request).unwrap()).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--engine", url])
        .args(args)
        .arg("--model-dir")
        .arg(golden().join("tokenizers/qwen3"))
        .arg("--request")
        .arg(&req)
        .output()
        .unwrap()
}

/// `kvroute tokenize --json --engine URL` of `request` with the staged Qwen3
/// directory and a vLLM contract: exit status and document.
fn against_engine(url: &str, request: &serde_json::Value) -> (bool, serde_json::Value) {
    let out = tokenize_against(
        url,
        request,
        &[
            "--json",
            "--contract",
            "vllm@0.33.0:sha256_cbor:block=16:seed=0",
        ],
    );
    let doc = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), doc)
}

fn golden_chat_request() -> serde_json::Value {
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("chat/qwen3_cases.json")).unwrap())
            .unwrap();
    cases["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "chat_shared_prefix_1")
        .expect("golden case")["request"]
        .clone()
}

#[test]
fn engine_ids_that_agree_pass() {
    let engine = TokenizeServer::start(&golden().join("tokenizers/qwen3"));
    let chat = golden_chat_request();
    let (ok, doc) = against_engine(&engine.url, &chat);
    assert!(ok, "{doc:#}");
    let n = doc["engine_prompts"][0]["num_tokens"].as_u64().unwrap();
    assert!(n > 16, "{doc:#}");
    assert_eq!(doc["engine"]["identical"], true, "{doc:#}");
    assert_eq!(doc["engine"]["num_tokens"], n);
    assert_eq!(doc["engine"]["blocks_keyed_alike"], n / 16);
    let completion = serde_json::json!({"model": "m", "prompt": "Größe of 12345 <|im_start|> 👩‍👩‍👧"});
    let (ok, doc) = against_engine(&engine.url, &completion);
    assert!(ok, "{doc:#}");
    assert_eq!(doc["engine"]["identical"], true, "{doc:#}");
}

/// An engine whose tokenizer differs: here transformers' `Qwen2Tokenizer`
/// taking `add_prefix_space` from the configuration, which the staged
/// `tokenizer.json` does not do. The command fails and says where.
#[test]
fn engine_ids_that_differ_fail_and_say_where() {
    let dir = tempfile::tempdir().unwrap();
    let staged = golden().join("tokenizers/qwen3");
    std::fs::copy(
        staged.join("tokenizer.json.gz"),
        dir.path().join("tokenizer.json.gz"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(staged.join("tokenizer_config.json")).unwrap())
            .unwrap();
    config["add_prefix_space"] = true.into();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();
    let engine = TokenizeServer::start(dir.path());
    let (ok, doc) = against_engine(&engine.url, &golden_chat_request());
    assert!(!ok, "{doc:#}");
    let e = &doc["engine"];
    assert_eq!(e["identical"], false, "{doc:#}");
    // "<|im_start|>" matches alike; the word after it gains a space.
    assert_eq!(e["first_difference"], 1, "{doc:#}");
    assert_eq!(e["blocks_keyed_alike"], 0, "{doc:#}");
    let near = &e["token_ids_near_difference"];
    assert_eq!(near["kvroute"][0], near["engine"][0]);
    assert_ne!(near["kvroute"][1], near["engine"][1]);
}

#[test]
fn an_engine_that_cannot_be_reached_is_a_clear_error() {
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = tokenize_against(
        &format!("http://127.0.0.1:{port}"),
        &serde_json::json!({"model": "m", "prompt": "hello"}),
        &[],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--engine") && err.contains("/tokenize"),
        "{err}"
    );
}

/// An engine's `/tokenize` does not truncate: a truncated request's ids are
/// not compared (they would differ from the first id on).
#[test]
fn a_truncated_request_is_not_compared() {
    let out = tokenize_against(
        "http://127.0.0.1:9",
        &serde_json::json!({"model": "m", "prompt": "one two three four five six",
            "truncate_prompt_tokens": 3}),
        &["--max-model-len", "64"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("truncate_prompt_tokens"), "{err}");
}

/// `--content-format` sets the engines' `--chat-template-content-format`:
/// the Qwen3 template calls string methods on a user message's content, so
/// text parts render when joined into a string (what it detects) and fail as
/// a list of parts (`openai`), as they do in vLLM started that way.
#[test]
fn content_format_reaches_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]}"#,
    )
    .unwrap();
    let run = |format: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "tokenize",
                "--json",
                "--content-format",
                format,
                "--model-dir",
            ])
            .arg(golden().join("tokenizers/qwen3"))
            .arg("--request")
            .arg(&req)
            .output()
            .unwrap()
    };
    let string = run("string");
    assert!(
        string.status.success(),
        "{}",
        String::from_utf8_lossy(&string.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&string.stdout).unwrap();
    let rendered = doc["engine_prompts"][0]["rendered_prompt"]
        .as_str()
        .unwrap();
    assert!(
        rendered.contains("<|im_start|>user\nhi there<|im_end|>"),
        "{rendered}"
    );
    let openai = run("openai");
    assert!(!openai.status.success());
    let err = String::from_utf8_lossy(&openai.stderr);
    assert!(err.contains("template"), "{err}");
}
