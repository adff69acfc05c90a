//! `kvroute tokenize`: show what kvroute computes for one request — the rendered
//! prompt, the token ids and, under a chosen hash contract, the block keys. This is
//! the operator's tool for a 0 % hit rate: compare the keys with the engine's
//! `BlockStored` events.

use std::path::PathBuf;
use std::process::ExitCode;

use kvroute_core::{BlockKey, HashContract, RequestExtras};
use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{
    prompt_tokens_as, ApiKind, Dialect, ModelOptions, ModelTokenizer, PromptLimits,
};

/// Arguments of `kvroute tokenize`.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Staged model directory (tokenizer.json[.gz], tokenizer_config.json).
    #[arg(long)]
    model_dir: PathBuf,
    /// OpenAI request body (JSON file; `-` reads standard input).
    #[arg(long)]
    request: PathBuf,
    /// `chat` or `completions`; detected from the body (`messages`) when omitted.
    #[arg(long)]
    endpoint: Option<String>,
    /// Hash contract, e.g. `vllm@0.33.0:sha256_cbor:block=16:seed=0`.
    #[arg(long)]
    contract: Option<String>,
    /// The engine's max_model_len (prompts longer than this are refused as vLLM does).
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
    let tok = ModelTokenizer::load(&args.model_dir, &options).map_err(|e| e.to_string())?;
    let value = parse_json(&body).map_err(|e| format!("request is not JSON: {e}"))?;
    let endpoint = match args.endpoint.as_deref() {
        None => ApiKind::detect(&value),
        Some("chat") => ApiKind::Chat,
        Some("completions") => ApiKind::Completions,
        Some(other) => return Err(format!("--endpoint {other}: use chat or completions")),
    };
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
        prompts.push(serde_json::json!({
            "rendered_prompt": p.rendered,
            "num_tokens": p.token_ids.len(),
            "token_ids": p.token_ids,
            "block_keys_u64": keys.iter().map(|k| k.0).collect::<Vec<u64>>(),
        }));
    }
    let doc = serde_json::json!({
        "model": prompt.model,
        "contract": contract.as_ref().map(ToString::to_string),
        "cache_salt": prompt.cache_salt,
        "truncated": prompt.truncated,
        "engine_prompts": prompts,
    });
    if args.json {
        return serde_json::to_string_pretty(&doc).map_err(|e| e.to_string());
    }
    let mut out = format!("model: {}\n", prompt.model);
    if let Some(c) = &contract {
        out.push_str(&format!("contract: {c}\n"));
    }
    for (i, p) in doc["engine_prompts"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        out.push_str(&format!("--- engine prompt {i}\n"));
        if let Some(text) = p["rendered_prompt"].as_str() {
            out.push_str(&format!(
                "rendered ({} chars):\n{text}\n",
                text.chars().count()
            ));
        }
        out.push_str(&format!(
            "token ids ({}): {}\n",
            p["num_tokens"], p["token_ids"]
        ));
        if contract.is_some() {
            out.push_str(&format!("block keys: {}\n", p["block_keys_u64"]));
        }
    }
    Ok(out.trim_end().to_owned())
}
