//! `kvroute tokenize`: show what kvroute computes for one request — the rendered
//! prompt, the token ids and, under a chosen hash contract, the block keys. This is
//! the operator's tool for a 0 % hit rate: compare the keys with the engine's
//! `BlockStored` events.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bytes::Bytes;
use kvroute_core::{BlockKey, HashContract, RequestExtras};
use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{
    prompt_tokens_as, ApiKind, Dialect, ModelOptions, ModelTokenizer, PromptLimits,
};

use crate::gateway::config::ServeConfig;
use crate::gateway::state::Gateway;

/// Arguments of `kvroute tokenize`.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// A `kvroute serve` configuration: the request goes through the prompt
    /// path of the rule `--rule` names (its models, limits, contract, LoRA
    /// adapters and engines' dialect), so the keys printed are the keys that
    /// rule routes on. Nothing is started or contacted.
    #[arg(long, requires = "rule", conflicts_with_all = ["model_dir", "contract", "max_model_len"])]
    config: Option<PathBuf>,
    /// The rule of `--config` whose prompt path to run.
    #[arg(long, requires = "config")]
    rule: Option<String>,
    /// Staged model directory (tokenizer.json[.gz], tokenizer_config.json);
    /// without `--config`.
    #[arg(long, required_unless_present = "config")]
    model_dir: Option<PathBuf>,
    /// OpenAI request body (JSON file; `-` reads standard input).
    #[arg(long)]
    request: PathBuf,
    /// `chat` or `completions`; detected from the body (`messages`) when omitted.
    #[arg(long)]
    endpoint: Option<String>,
    /// Hash contract, e.g. `vllm@0.33.0:sha256_cbor:block=16:seed=0`; without
    /// `--config`.
    #[arg(long)]
    contract: Option<String>,
    /// The engine's max_model_len (prompts longer than this are refused as
    /// vLLM does); without `--config`.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Print machine-readable JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs the command.
pub fn run(args: &TokenizeArgs) -> ExitCode {
    match tokenize(args) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("kvroute tokenize: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn tokenize(args: &TokenizeArgs) -> Result<String, String> {
    let body = if args.request.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf).map_err(|e| e.to_string())?;
        buf
    } else {
        std::fs::read(&args.request).map_err(|e| format!("{}: {e}", args.request.display()))?
    };
    match (&args.config, &args.rule, &args.model_dir) {
        (Some(config), Some(rule), _) => through_rule(args, config, rule, body),
        (_, _, Some(model_dir)) => standalone(args, model_dir, &body),
        _ => Err("give --config FILE --rule NAME, or --model-dir DIR".to_owned()),
    }
}

fn api_kind(
    args: &TokenizeArgs,
    value: &kvroute_engines::prompt::PyValue,
) -> Result<ApiKind, String> {
    match args.endpoint.as_deref() {
        None => Ok(ApiKind::detect(value)),
        Some("chat") => Ok(ApiKind::Chat),
        Some("completions") => Ok(ApiKind::Completions),
        Some(other) => Err(format!("--endpoint {other}: use chat or completions")),
    }
}

/// The request through the prompt path of one rule of a `kvroute serve`
/// configuration: the rule's router, built without background work, prepares
/// it exactly as it does before every decision.
fn through_rule(
    args: &TokenizeArgs,
    config: &Path,
    rule: &str,
    body: Vec<u8>,
) -> Result<String, String> {
    let config = ServeConfig::load(config).map_err(|e| e.to_string())?;
    let Some(spec) = config.rules.iter().find(|r| r.doc.name == rule) else {
        let names: Vec<&str> = config.rules.iter().map(|r| r.doc.name.as_str()).collect();
        return Err(format!(
            "--rule {rule:?}: the configuration's rules are {names:?}"
        ));
    };
    let gateway = Gateway::without_rules(&config, None).map_err(|e| e.to_string())?;
    let router = gateway
        .rule_router(spec)
        .build()
        .map_err(|e| format!("rule {rule:?}: {e}"))?;
    let value = parse_json(&body).map_err(|e| format!("request is not JSON: {e}"))?;
    let api = api_kind(args, &value)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let prepared = runtime.block_on(router.prepare(api, &Bytes::from(body)));
    let ids = prepared
        .tokens()
        .map_err(|miss| format!("{miss} ({})", miss.as_str()))?;
    let keys: Vec<u64> = prepared
        .keys()
        .map(|(k, _)| k.iter().map(|k| k.0).collect())
        .unwrap_or_default();
    let extras = prepared.extras();
    let shown = Shown {
        rule: Some(rule),
        model: prepared.model().unwrap_or_default(),
        contract: router.contract().map(ToString::to_string),
        cache_salt: extras.cache_salt.as_deref(),
        lora: extras
            .lora
            .as_ref()
            .map(|l| (l.name.as_str(), l.path.as_str())),
        truncated: prepared.truncated(),
        prompts: vec![ShownPrompt {
            rendered: prepared.text(),
            ids,
            keys,
        }],
    };
    shown.render(args.json)
}

/// What the command prints.
struct Shown<'a> {
    rule: Option<&'a str>,
    model: &'a str,
    contract: Option<String>,
    cache_salt: Option<&'a str>,
    lora: Option<(&'a str, &'a str)>,
    truncated: bool,
    prompts: Vec<ShownPrompt<'a>>,
}

struct ShownPrompt<'a> {
    rendered: Option<&'a str>,
    ids: &'a [u32],
    keys: Vec<u64>,
}

impl Shown<'_> {
    fn render(&self, json: bool) -> Result<String, String> {
        let prompts: Vec<serde_json::Value> = self
            .prompts
            .iter()
            .map(|p| {
                serde_json::json!({
                    "rendered_prompt": p.rendered,
                    "num_tokens": p.ids.len(),
                    "token_ids": p.ids,
                    "block_keys_u64": p.keys,
                })
            })
            .collect();
        if json {
            let mut doc = serde_json::json!({
                "model": self.model,
                "contract": self.contract,
                "cache_salt": self.cache_salt,
                "truncated": self.truncated,
                "engine_prompts": prompts,
            });
            if let Some(rule) = self.rule {
                doc["rule"] = rule.into();
                doc["lora"] = self
                    .lora
                    .map(|(name, path)| serde_json::json!({"name": name, "path": path}))
                    .into();
            }
            return serde_json::to_string_pretty(&doc).map_err(|e| e.to_string());
        }
        let mut out = String::new();
        if let Some(rule) = self.rule {
            out.push_str(&format!("rule: {rule}\n"));
        }
        out.push_str(&format!("model: {}\n", self.model));
        if let Some(c) = &self.contract {
            out.push_str(&format!("contract: {c}\n"));
        }
        if let Some(salt) = self.cache_salt {
            out.push_str(&format!("cache_salt: {salt:?}\n"));
        }
        if let Some((name, path)) = self.lora {
            out.push_str(&format!("lora: {name} ({path})\n"));
        }
        for (i, p) in self.prompts.iter().enumerate() {
            out.push_str(&format!("--- engine prompt {i}\n"));
            if let Some(text) = p.rendered {
                out.push_str(&format!(
                    "rendered ({} chars):\n{text}\n",
                    text.chars().count()
                ));
            }
            out.push_str(&format!("token ids ({}): {:?}\n", p.ids.len(), p.ids));
            if self.contract.is_some() {
                out.push_str(&format!("block keys: {:?}\n", p.keys));
            }
        }
        Ok(out.trim_end().to_owned())
    }
}

/// The request tokenized with a model directory and, optionally, hashed
/// under a contract, outside any configuration.
fn standalone(args: &TokenizeArgs, model_dir: &Path, body: &[u8]) -> Result<String, String> {
    let contract: Option<HashContract> = args
        .contract
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|e| format!("--contract: {e}"))?;
    let hasher = contract
        .as_ref()
        .map(HashContract::hasher)
        .transpose()
        .map_err(|e| format!("--contract: {e}"))?;
    let options = ModelOptions {
        max_model_len: args.max_model_len,
        ..ModelOptions::default()
    };
    let tok = ModelTokenizer::load(model_dir, &options).map_err(|e| e.to_string())?;
    let value = parse_json(body).map_err(|e| format!("request is not JSON: {e}"))?;
    let endpoint = api_kind(args, &value)?;
    // The contract's engine validates the request (SGLang serves an empty
    // `cache_salt` as no salt; vLLM refuses it), as the gateway does for a
    // pool of that engine.
    let dialect = match &contract {
        Some(HashContract::Sglang(_)) => Dialect::Sglang,
        _ => Dialect::Vllm,
    };
    let prompt = prompt_tokens_as(&tok, endpoint, &value, PromptLimits::default(), dialect)
        .map_err(|miss| format!("{} ({})", miss, miss.kind()))?;
    let extras = RequestExtras {
        cache_salt: prompt.cache_salt.clone(),
        ..RequestExtras::default()
    };
    let mut prompts = Vec::new();
    for p in &prompt.engine_prompts {
        let mut keys: Vec<BlockKey> = Vec::new();
        if let Some(h) = &hasher {
            h.hash_prompt(&p.token_ids, &extras, &mut keys)
                .map_err(|e| format!("hashing: {e}"))?;
        }
        prompts.push(ShownPrompt {
            rendered: p.rendered.as_deref(),
            ids: &p.token_ids,
            keys: keys.iter().map(|k| k.0).collect(),
        });
    }
    Shown {
        rule: None,
        model: &prompt.model,
        contract: contract.as_ref().map(ToString::to_string),
        cache_salt: prompt.cache_salt.as_deref(),
        lora: None,
        truncated: prompt.truncated,
        prompts,
    }
    .render(args.json)
}
