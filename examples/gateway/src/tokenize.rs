//! `kvroute tokenize`: show what kvroute computes for one request — the rendered
//! prompt, the token ids and, under a chosen hash contract, the block keys. This is
//! the operator's tool for a 0 % hit rate: compare the keys with the engine's
//! `BlockStored` events, or (`--engine URL`) the ids with the ids the engine's own
//! `/tokenize` gives the same request.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bytes::Bytes;
use kvroute_core::{BlockKey, HashContract, RequestExtras};
use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{
    prompt_tokens_as, ApiKind, ContentFormat, Dialect, ModelOptions, ModelTokenizer, PromptLimits,
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
    #[arg(long, requires = "rule", conflicts_with_all = ["model_dir", "contract", "max_model_len", "content_format"])]
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
    /// The engine's `--chat-template-content-format` (`string` or `openai`),
    /// when it sets one; detected from the template otherwise. Without
    /// `--config` (whose `[[models]] content_format` applies).
    #[arg(long, value_parser = ["string", "openai"])]
    content_format: Option<String>,
    /// An engine (`http://host:port`, vLLM or SGLang) whose `POST /tokenize`
    /// the same request body is sent to: its ids are compared with kvroute's,
    /// and the command fails when they differ (the blocks before the first
    /// difference still key alike).
    #[arg(long)]
    engine: Option<String>,
    /// The model name the engine serves, when it is not the request's
    /// `model` (the body sent to `--engine` carries this one).
    #[arg(long, requires = "engine")]
    engine_model: Option<String>,
    /// Print machine-readable JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs the command.
pub fn run(args: &TokenizeArgs) -> ExitCode {
    match tokenize(args) {
        Ok((out, agrees)) => {
            println!("{out}");
            if agrees {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(msg) => {
            eprintln!("kvroute tokenize: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// The printed result, and false when `--engine` gave other ids.
fn tokenize(args: &TokenizeArgs) -> Result<(String, bool), String> {
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
) -> Result<(String, bool), String> {
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
    let prepared = runtime.block_on(router.prepare(api, &Bytes::from(body.clone())));
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
    let block = router.contract().map(|c| c.block_size().get());
    let dialect = router.prompt_options(Some(shown.model)).dialect;
    finish(args, &body, &shown, block, dialect)
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
    fn render(&self, json: bool, engine: Option<&Verdict<'_>>) -> Result<String, String> {
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
            if let Some(v) = engine {
                doc["engine"] = v.json();
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
        if let Some(v) = engine {
            out.push_str(&v.text());
        }
        Ok(out.trim_end().to_owned())
    }
}

/// The request tokenized with a model directory and, optionally, hashed
/// under a contract, outside any configuration.
fn standalone(
    args: &TokenizeArgs,
    model_dir: &Path,
    body: &[u8],
) -> Result<(String, bool), String> {
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
        content_format: args.content_format.as_deref().map(|f| match f {
            "openai" => ContentFormat::OpenAi,
            _ => ContentFormat::String,
        }),
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
    let shown = Shown {
        rule: None,
        model: &prompt.model,
        contract: contract.as_ref().map(ToString::to_string),
        cache_salt: prompt.cache_salt.as_deref(),
        lora: None,
        truncated: prompt.truncated,
        prompts,
    };
    let block = contract.as_ref().map(|c| c.block_size().get());
    finish(args, body, &shown, block, dialect)
}

/// Renders `shown`, with the engine's verdict when `--engine` is given
/// (`dialect`: the engine's, as the request was prepared).
fn finish(
    args: &TokenizeArgs,
    body: &[u8],
    shown: &Shown<'_>,
    block: Option<u32>,
    dialect: Dialect,
) -> Result<(String, bool), String> {
    let Some(url) = &args.engine else {
        return Ok((shown.render(args.json, None)?, true));
    };
    let [prompt] = shown.prompts.as_slice() else {
        return Err(format!(
            "--engine: the request has {} prompts; an engine's /tokenize takes one",
            shown.prompts.len()
        ));
    };
    if shown.truncated {
        return Err(
            "--engine: the request truncates its prompt (truncate_prompt_tokens), \
            which an engine's /tokenize does not do: the ids cannot be compared; \
            leave it out of the request to compare the rest"
                .to_owned(),
        );
    }
    let theirs = engine_ids(url, body, args.engine_model.as_deref(), dialect)?;
    let verdict = Verdict::new(url, prompt.ids, theirs, block);
    let agrees = verdict.first_difference.is_none();
    Ok((shown.render(args.json, Some(&verdict))?, agrees))
}

/// The ids the engine at `url` gives `body` (`POST /tokenize`, which vLLM
/// and SGLang both serve: for `messages` they render the chat template as
/// for a chat completion, for a `prompt` they encode it as a completion).
///
/// SGLang's chat and completions requests have neither
/// `add_generation_prompt` nor `add_special_tokens`, but its `/tokenize`
/// honours both when given: they are left out of what an `sglang` rule's
/// engine is sent, so that it answers with what a chat or completion runs.
fn engine_ids(
    url: &str,
    body: &[u8],
    model: Option<&str>,
    dialect: Dialect,
) -> Result<Vec<u32>, String> {
    let mut doc: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("request is not JSON: {e}"))?;
    if let Some(obj) = doc.as_object_mut() {
        if let Some(model) = model {
            obj.insert("model".to_owned(), model.into());
        }
        if dialect == Dialect::Sglang {
            obj.remove("add_generation_prompt");
            obj.remove("add_special_tokens");
        }
    }
    let endpoint = format!("{}/tokenize", url.trim_end_matches('/'));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        let resp = client
            .post(&endpoint)
            .json(&doc)
            .send()
            .await
            .map_err(|e| format!("--engine: POST {endpoint}: {e}"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| format!("--engine: POST {endpoint}: {e}"))?;
        if !status.is_success() {
            return Err(format!("--engine: POST {endpoint}: {status}: {text}"));
        }
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        serde_json::from_str::<Tokenized>(&text)
            .map(|t| t.tokens)
            .map_err(|e| format!("--engine: {endpoint} answered {text:?}: {e}"))
    })
}

/// kvroute's ids against the engine's.
struct Verdict<'a> {
    url: &'a str,
    ours: usize,
    theirs: Vec<u32>,
    /// First position where the ids differ (one list ending counts).
    first_difference: Option<usize>,
    /// Tokens per block, when a contract says.
    block: Option<u32>,
    /// kvroute's ids around the difference.
    ours_near: Vec<u32>,
}

impl<'a> Verdict<'a> {
    fn new(url: &'a str, ours: &[u32], theirs: Vec<u32>, block: Option<u32>) -> Self {
        let first_difference = ours
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a != b)
            .or_else(|| (ours.len() != theirs.len()).then(|| ours.len().min(theirs.len())));
        let ours_near = first_difference.map_or_else(Vec::new, |at| near(ours, at).to_vec());
        Self {
            url,
            ours: ours.len(),
            theirs,
            first_difference,
            block,
            ours_near,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "url": self.url,
            "num_tokens": self.theirs.len(),
            "identical": self.first_difference.is_none(),
            "first_difference": self.first_difference,
            "blocks_keyed_alike": self.blocks_alike(),
            "token_ids_near_difference": self.first_difference.map(|at| serde_json::json!({
                "kvroute": self.ours_near,
                "engine": near(&self.theirs, at),
            })),
        })
    }

    /// Whole blocks before the first difference (all of them when none).
    fn blocks_alike(&self) -> Option<usize> {
        let b = usize::try_from(self.block?).ok()?.max(1);
        Some(self.first_difference.unwrap_or(self.ours) / b)
    }

    fn text(&self) -> String {
        let Some(at) = self.first_difference else {
            return format!(
                "engine {}: {} token ids, identical",
                self.url,
                self.theirs.len()
            );
        };
        let blocks = self
            .blocks_alike()
            .map(|n| format!(" ({n} whole blocks before it key alike)"))
            .unwrap_or_default();
        format!(
            "engine {}: {} token ids; kvroute: {}; the first difference is at position \
             {at}{blocks}\n  kvroute: {:?}\n  engine:  {:?}",
            self.url,
            self.theirs.len(),
            self.ours,
            self.ours_near,
            near(&self.theirs, at),
        )
    }
}

/// Up to 8 ids from 2 before `at`.
fn near(ids: &[u32], at: usize) -> &[u32] {
    let start = at.saturating_sub(2).min(ids.len());
    ids.get(start..(start + 8).min(ids.len()))
        .unwrap_or_default()
}
