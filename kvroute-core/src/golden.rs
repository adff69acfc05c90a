//! Golden hash-vector checkers (`kvroute parity`).
//!
//! Each checker takes a parsed JSON file and recomputes every field it can —
//! serialised hash inputs, digests, event keys, parent keys, extra keys, group
//! views, roots — reporting one [`GoldenFailure`] per failing case. The report
//! types are generic so other crates' fixture checkers can reuse them.
//!
//! ```
//! use kvroute_core::golden::{check_value, HashVectorFormat, detect};
//! let file = serde_json::json!({
//!     "xxh3_seed": 1337,
//!     "vectors": [{"kv_block_size": 4, "tokens": [1, 2, 3],
//!                  "local_block_hash_u64": [], "seq_hash_u64": []}]
//! });
//! assert_eq!(detect(&file), Some(HashVectorFormat::RekeyXxh3));
//! let report = check_value("inline.json", &file).unwrap();
//! assert_eq!(report.summary(), "1 passed, 0 failed");
//! ```

use std::fmt;

use serde_json::Value;

use crate::contract::{
    HashContract, PythonHashSeed, RekeyAlgorithm, RekeyContract, SglangAlgorithm, SglangContract,
    SglangEventsFormat, TrtllmAlgorithm, TrtllmContract, VllmContract,
};
use crate::digest::Digest;
use crate::extras::{LoraAdapter, MmFeature, PromptEmbedsDigest, RequestExtras};
use crate::types::{BlockKey, TokenId};
use crate::version::EngineVersion;
use crate::vllm::{self, ExtraKeyItem, VllmAlgorithm};
use crate::{rekey, sglang, trtllm, ContractError};

/// One failing case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenFailure {
    /// File label (usually its path).
    pub file: String,
    /// Case id or `section[index]`.
    pub case: String,
    /// Every mismatch found in the case, `; `-separated.
    pub message: String,
}

impl fmt::Display for GoldenFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FAIL {} {}: {}", self.file, self.case, self.message)
    }
}

/// Outcome of checking golden cases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GoldenReport {
    /// Cases that matched in every checked field.
    pub passed: usize,
    /// Cases with at least one mismatch.
    pub failures: Vec<GoldenFailure>,
}

impl GoldenReport {
    /// An empty report.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a case: passed if `problems` is empty, else one failure listing them.
    pub fn record(&mut self, file: &str, case: &str, problems: &[String]) {
        if problems.is_empty() {
            self.passed += 1;
        } else {
            self.fail(file, case, problems.join("; "));
        }
    }

    /// Records a failing case.
    pub fn fail(&mut self, file: &str, case: &str, message: impl Into<String>) {
        self.failures.push(GoldenFailure {
            file: file.to_owned(),
            case: case.to_owned(),
            message: message.into(),
        });
    }

    /// Adds another report's counts and failures.
    pub fn merge(&mut self, other: GoldenReport) {
        self.passed += other.passed;
        self.failures.extend(other.failures);
    }

    /// Number of failing cases.
    #[must_use]
    pub fn failed(&self) -> usize {
        self.failures.len()
    }

    /// True if nothing failed.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.failures.is_empty()
    }

    /// `N passed, M failed`.
    #[must_use]
    pub fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed())
    }
}

/// The hash-vector formats this module checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashVectorFormat {
    /// `"schema": "vllm-block-hash-vectors/1"`.
    VllmBlockHashV1,
    /// SGLang ≥ 0.5.6 page chain (`unsalted` / `namespaced`).
    SglangPageChain,
    /// SGLang 0.4.8 ..= 0.5.5 Python tuple hash.
    SglangLegacyPyhash,
    /// Chained XXH3-64 re-key (Dynamo's `LocalBlockHash` layout).
    RekeyXxh3,
    /// TensorRT-LLM `v1_block_key`.
    TrtllmV1BlockKey,
}

/// Which hash-vector format `v` is, if any.
#[must_use]
pub fn detect(v: &Value) -> Option<HashVectorFormat> {
    let s = |k: &str| v.get(k).and_then(Value::as_str);
    if s("schema") == Some("vllm-block-hash-vectors/1") {
        return Some(HashVectorFormat::VllmBlockHashV1);
    }
    if s("engine") == Some("sglang") && v.get("unsalted").is_some() {
        return Some(HashVectorFormat::SglangPageChain);
    }
    if s("engine") == Some("sglang")
        && v.get("empty_tuple_hash").is_some()
        && v.get("vectors").is_some_and(Value::is_array)
    {
        return Some(HashVectorFormat::SglangLegacyPyhash);
    }
    if v.get("xxh3_seed").is_some() && v.get("vectors").is_some_and(Value::is_array) {
        return Some(HashVectorFormat::RekeyXxh3);
    }
    if s("engine") == Some("tensorrt-llm")
        && s("hash_algo") == Some("v1_block_key")
        && v.get("vectors").is_some_and(Value::is_array)
    {
        return Some(HashVectorFormat::TrtllmV1BlockKey);
    }
    None
}

/// Detects the format and checks it; `None` if `v` is not a hash-vector file.
#[must_use]
pub fn check_value(file: &str, v: &Value) -> Option<GoldenReport> {
    detect(v).map(|format| check(format, file, v))
}

/// Checks every case of a file of the given format.
#[must_use]
pub fn check(format: HashVectorFormat, file: &str, v: &Value) -> GoldenReport {
    let mut report = GoldenReport::new();
    let result = match format {
        HashVectorFormat::VllmBlockHashV1 => check_vllm(file, v, &mut report),
        HashVectorFormat::SglangPageChain => check_sglang(file, v, &mut report),
        HashVectorFormat::SglangLegacyPyhash => check_sglang_legacy(file, v, &mut report),
        HashVectorFormat::RekeyXxh3 => check_rekey(file, v, &mut report),
        HashVectorFormat::TrtllmV1BlockKey => check_trtllm(file, v, &mut report),
    };
    if let Err(message) = result {
        report.fail(file, "(file)", message);
    }
    report
}

// ---------------------------------------------------------------------------
// JSON helpers: malformed input becomes a failure message, never a panic.

type Res<T> = Result<T, String>;

fn field<'a>(v: &'a Value, k: &str) -> Res<&'a Value> {
    v.get(k).ok_or_else(|| format!("missing field `{k}`"))
}

fn u64_of(v: &Value, k: &str) -> Res<u64> {
    field(v, k)?
        .as_u64()
        .ok_or_else(|| format!("`{k}` is not an unsigned integer"))
}

fn str_of<'a>(v: &'a Value, k: &str) -> Res<&'a str> {
    field(v, k)?
        .as_str()
        .ok_or_else(|| format!("`{k}` is not a string"))
}

fn opt_str(v: &Value, k: &str) -> Res<Option<String>> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{k}` is not a string or null")),
    }
}

fn arr<'a>(v: &'a Value, k: &str) -> Res<&'a Vec<Value>> {
    field(v, k)?
        .as_array()
        .ok_or_else(|| format!("`{k}` is not an array"))
}

fn u64s(v: &Value, k: &str) -> Res<Vec<u64>> {
    arr(v, k)?
        .iter()
        .map(|x| {
            x.as_u64()
                .ok_or_else(|| format!("`{k}` has a non-u64 entry"))
        })
        .collect()
}

fn i64s(v: &Value, k: &str) -> Res<Vec<i64>> {
    arr(v, k)?
        .iter()
        .map(|x| {
            x.as_i64()
                .ok_or_else(|| format!("`{k}` has a non-i64 entry"))
        })
        .collect()
}

fn strs<'a>(v: &'a Value, k: &str) -> Res<Vec<&'a str>> {
    arr(v, k)?
        .iter()
        .map(|x| {
            x.as_str()
                .ok_or_else(|| format!("`{k}` has a non-string entry"))
        })
        .collect()
}

fn u32_tokens(tokens: &[u64]) -> Res<Vec<TokenId>> {
    tokens
        .iter()
        .map(|&t| u32::try_from(t).map_err(|_| format!("token {t} does not fit u32")))
        .collect()
}

fn hex_bytes(text: &str) -> Res<Vec<u8>> {
    let mut out = vec![0u8; text.len() / 2];
    match crate::digest::decode_hex_into(text, &mut out) {
        Some(n) if n == out.len() => Ok(out),
        _ => Err(format!("bad hex {text:?}")),
    }
}

fn to_hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Collects mismatches of one case.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn eq<T: PartialEq + fmt::Debug>(&mut self, what: impl fmt::Display, got: T, want: T) {
        if got != want {
            self.0
                .push(format!("{what}: computed {got:?}, golden {want:?}"));
        }
    }

    fn push(&mut self, msg: impl Into<String>) {
        self.0.push(msg.into());
    }

    fn absorb<T>(&mut self, r: Res<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.0.push(e);
                None
            }
        }
    }
}

fn keys_u64(keys: &[BlockKey]) -> Vec<u64> {
    keys.iter().map(|k| k.0).collect()
}

fn keys_i64(keys: &[BlockKey]) -> Vec<i64> {
    keys.iter().map(|k| k.as_i64()).collect()
}

// ---------------------------------------------------------------------------
// vLLM

fn item_json(item: &ExtraKeyItem<'_>) -> Value {
    match *item {
        ExtraKeyItem::Lora { name, path } => serde_json::json!(["lora", name, path]),
        ExtraKeyItem::Mm { identifier, offset } => serde_json::json!(["mm", identifier, offset]),
        ExtraKeyItem::CacheSalt(s) => serde_json::json!(["cache_salt", s]),
        ExtraKeyItem::PromptEmbeds(d) => {
            serde_json::json!(["prompt_embeds", {"bytes_hex": to_hex(d)}])
        }
    }
}

fn event_key_json(key: &vllm::EventExtraKey) -> Value {
    match key {
        vllm::EventExtraKey::Lora(name) => Value::from(name.as_str()),
        vllm::EventExtraKey::Mm(id, off) => serde_json::json!([id, off]),
        vllm::EventExtraKey::CacheSalt(s) => Value::from(s.as_str()),
        vllm::EventExtraKey::PromptEmbeds(d) => serde_json::json!({"bytes_hex": to_hex(d)}),
    }
}

fn vllm_extras(case: &Value) -> Res<RequestExtras> {
    let mut extras = RequestExtras::default();
    if let Some(lora) = case.get("lora").filter(|l| !l.is_null()) {
        extras.lora = Some(LoraAdapter {
            name: str_of(lora, "name")?.to_owned(),
            path: str_of(lora, "path")?.to_owned(),
        });
    }
    extras.cache_salt = opt_str(case, "cache_salt")?;
    if let Some(mm) = case.get("mm_features") {
        for f in mm.as_array().ok_or("`mm_features` is not an array")? {
            extras.mm_features.push(MmFeature {
                identifier: str_of(f, "identifier")?.to_owned(),
                offset: u64_of(f, "offset")?,
                length: u64_of(f, "length")?,
            });
        }
    }
    if let Some(pe) = case
        .get("prompt_embeds_block_digests")
        .filter(|p| !p.is_null())
    {
        for d in pe
            .as_array()
            .ok_or("`prompt_embeds_block_digests` is not an array")?
        {
            let bytes = hex_bytes(str_of(d, "digest_hex")?)?;
            let digest: [u8; 32] = bytes
                .try_into()
                .map_err(|_| "prompt-embeds digest is not 32 bytes".to_owned())?;
            extras.prompt_embeds.push(PromptEmbedsDigest {
                start: u64_of(d, "start")?,
                end: u64_of(d, "end")?,
                digest,
            });
        }
    }
    Ok(extras)
}

fn check_vllm(file: &str, v: &Value, report: &mut GoldenReport) -> Res<()> {
    let version: EngineVersion = str_of(v, "vllm_version")?
        .parse()
        .map_err(|e: crate::VersionParseError| e.to_string())?;
    for (i, case) in arr(v, "cases")?.iter().enumerate() {
        let id = case
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| format!("cases[{i}]"), str::to_owned);
        let mut p = Problems::default();
        let r = check_vllm_case(version, case, &mut p);
        p.absorb(r);
        report.record(file, &id, &p.0);
    }
    Ok(())
}

fn check_vllm_case(version: EngineVersion, case: &Value, p: &mut Problems) -> Res<()> {
    let algorithm: VllmAlgorithm = str_of(case, "hash_algo")?
        .parse()
        .map_err(|e: ContractError| e.to_string())?;
    let want_serialization = if algorithm.uses_cbor() {
        "cbor_canonical"
    } else {
        "pickle_protocol_5"
    };
    p.eq(
        "serialization",
        str_of(case, "serialization")?,
        want_serialization,
    );
    let block_size = usize::try_from(u64_of(case, "block_size")?).map_err(|e| e.to_string())?;
    if block_size == 0 {
        return Err("block_size 0".into());
    }
    let lookahead =
        usize::try_from(u64_of(case, "num_hash_lookahead_tokens")?).map_err(|e| e.to_string())?;
    let seed = match field(case, "pythonhashseed")? {
        Value::Null => PythonHashSeed::Unset,
        Value::String(s) => PythonHashSeed::Value(s.clone()),
        _ => return Err("`pythonhashseed` is not a string or null".into()),
    };
    let none_hash_seed = str_of(case, "none_hash_seed")?;
    // The seed rule: the env text verbatim, else the fixed string (sha256*, >= 0.29).
    if let PythonHashSeed::Value(s) = &seed {
        p.eq("none_hash_seed", none_hash_seed, s.as_str());
    } else if !algorithm.is_xxhash() {
        p.eq("none_hash_seed", none_hash_seed, "vllm-none-hash");
    } else {
        p.push("an unset PYTHONHASHSEED with xxhash has a random root; no vector can exist");
    }
    let root = vllm::none_hash(algorithm, none_hash_seed);
    p.eq(
        "none_hash_hex",
        root.to_hex(),
        str_of(case, "none_hash_hex")?.to_owned(),
    );

    let tokens = u64s(case, "token_ids")?;
    let extras = vllm_extras(case)?;
    let blocks = arr(case, "blocks")?;
    let n_blocks = tokens.len().saturating_sub(lookahead) / block_size;
    p.eq("number of blocks", n_blocks, blocks.len());

    let mut scratch = Vec::new();
    let mut parent = root;
    let mut parent_key: Option<BlockKey> = None;
    let mut chain: Vec<Digest> = Vec::new();
    for (i, block) in blocks.iter().enumerate().take(n_blocks) {
        let start = i * block_size;
        let end = start + block_size;
        let what = |f: &str| format!("blocks[{i}].{f}");
        p.eq(what("index"), u64_of(block, "index")?, i as u64);
        p.eq(
            what("token_start"),
            u64_of(block, "token_start")?,
            start as u64,
        );
        p.eq(what("token_end"), u64_of(block, "token_end")?, end as u64);
        p.eq(
            what("parent_hash_hex"),
            parent.to_hex(),
            str_of(block, "parent_hash_hex")?.to_owned(),
        );
        let block_tokens = tokens.get(start..end).ok_or("block out of range")?;
        let la_tokens = tokens
            .get(end..end + lookahead)
            .ok_or("lookahead out of range")?;
        let items = vllm::block_extra_items(&extras, start as u64, (end + lookahead) as u64)
            .map_err(|e| e.to_string())?;

        // The exact Python value of the third tuple element.
        let e_json = {
            let list: Vec<Value> = items.clone().map(|it| item_json(&it)).collect();
            if list.is_empty() {
                Value::Null
            } else {
                Value::Array(list)
            }
        };
        let extra_json = if lookahead > 0 {
            let mut outer = vec![e_json];
            outer.extend(la_tokens.iter().map(|&t| Value::from(t)));
            Value::Array(outer)
        } else {
            e_json
        };
        p.eq(what("extra_keys"), &extra_json, field(block, "extra_keys")?);
        if lookahead > 0 {
            p.eq(
                what("lookahead_token_ids"),
                la_tokens.to_vec(),
                u64s(block, "lookahead_token_ids")?,
            );
        }

        scratch.clear();
        vllm::encode_block(
            algorithm,
            &mut scratch,
            parent.as_bytes(),
            block_tokens,
            items.clone(),
            (lookahead > 0).then_some(la_tokens),
        );
        p.eq(
            what("hash_input_hex"),
            to_hex(&scratch),
            str_of(block, "hash_input_hex")?.to_owned(),
        );
        let digest = vllm::hash_block(
            algorithm,
            &mut scratch,
            &parent,
            block_tokens,
            items.clone(),
            (lookahead > 0).then_some(la_tokens),
        )
        .map_err(|e| e.to_string())?;
        p.eq(
            what("digest_hex"),
            digest.to_hex(),
            str_of(block, "digest_hex")?.to_owned(),
        );
        let key = digest.last8_be();
        p.eq(
            what("event_key_u64"),
            key.0,
            u64_of(block, "event_key_u64")?,
        );
        p.eq(
            what("parent_event_key_u64"),
            parent_key.map(|k| k.0),
            field(block, "parent_event_key_u64")?.as_u64(),
        );
        let event_extra = match vllm::event_extra_keys(items) {
            None => Value::Null,
            Some(keys) => Value::Array(keys.iter().map(event_key_json).collect()),
        };
        p.eq(
            what("event_extra_keys"),
            &event_extra,
            field(block, "event_extra_keys")?,
        );
        parent = digest;
        parent_key = Some(key);
        chain.push(digest);
    }

    if let Some(views) = case.get("group_views").filter(|g| !g.is_null()) {
        for (g, view) in views
            .as_array()
            .ok_or("`group_views` is not an array")?
            .iter()
            .enumerate()
        {
            let group_bs =
                usize::try_from(u64_of(view, "block_size")?).map_err(|e| e.to_string())?;
            let digests = strs(view, "digests_hex")?;
            let keys = u64s(view, "event_keys_u64")?;
            let ratio = group_bs.checked_div(block_size).unwrap_or(0);
            let expected_len = chain.len().checked_div(ratio).unwrap_or(0);
            p.eq(
                format!("group_views[{g}] length"),
                digests.len(),
                expected_len,
            );
            p.eq(
                format!("group_views[{g}] key count"),
                keys.len(),
                expected_len,
            );
            for (j, (want_d, want_k)) in digests.iter().zip(&keys).enumerate() {
                match vllm::group_view_digest(&chain, block_size, group_bs, j) {
                    None => p.push(format!("group_views[{g}][{j}]: no such group block")),
                    Some(d) => {
                        p.eq(
                            format!("group_views[{g}].digests_hex[{j}]"),
                            d.to_hex(),
                            (*want_d).to_owned(),
                        );
                        p.eq(
                            format!("group_views[{g}].event_keys_u64[{j}]"),
                            d.last8_be().0,
                            *want_k,
                        );
                    }
                }
            }
        }
    }

    // The production path (contract validation + BlockHasher) must agree whenever
    // the contract is one a real engine can run with.
    let contract = HashContract::Vllm(VllmContract {
        version,
        algorithm,
        pythonhashseed: seed,
        block_size: std::num::NonZeroU32::new(block_size as u32).ok_or("block size")?,
        lookahead_tokens: lookahead as u32,
    });
    match contract.hasher() {
        Ok(hasher) => {
            if let Ok(tokens32) = u32_tokens(&tokens) {
                p.eq(
                    "BlockHasher root",
                    hasher.root(&extras).map_err(|e| e.to_string())?,
                    root,
                );
                let mut keys = Vec::new();
                hasher
                    .hash_prompt(&tokens32, &extras, &mut keys)
                    .map_err(|e| e.to_string())?;
                p.eq(
                    "BlockHasher keys",
                    keys,
                    chain.iter().map(Digest::last8_be).collect(),
                );
            }
        }
        // Values CPython refuses only exercise the seed-string path (see README).
        Err(ContractError::SeedRejectedByCpython { .. }) => {}
        Err(e) => p.push(format!("contract {contract} refused: {e}")),
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// SGLang

fn sglang_contract(
    version: EngineVersion,
    page_size: u64,
    format: SglangEventsFormat,
    legacy: bool,
) -> Res<HashContract> {
    Ok(HashContract::Sglang(SglangContract {
        version,
        algorithm: if legacy {
            SglangAlgorithm::LegacyPyhash
        } else {
            SglangAlgorithm::Sha256PageChain
        },
        block_size: std::num::NonZeroU32::new(u32::try_from(page_size).map_err(|e| e.to_string())?)
            .ok_or("page_size 0")?,
        kv_events_format: format,
    }))
}

fn run_hasher(
    contract: &HashContract,
    tokens: &[TokenId],
    extras: &RequestExtras,
) -> Res<(Vec<BlockKey>, Vec<Digest>)> {
    let hasher = contract.hasher().map_err(|e| e.to_string())?;
    let mut prompt = hasher.prompt(extras).map_err(|e| e.to_string())?;
    let mut keys = Vec::new();
    let mut digests = Vec::new();
    prompt
        .extend_with_digests(tokens, &mut keys, &mut digests)
        .map_err(|e| e.to_string())?;
    Ok((keys, digests))
}

fn check_sglang(file: &str, v: &Value, report: &mut GoldenReport) -> Res<()> {
    let version: EngineVersion = str_of(v, "engine_version")?
        .parse()
        .map_err(|e: crate::VersionParseError| e.to_string())?;
    for (i, case) in arr(v, "unsalted")?.iter().enumerate() {
        let mut p = Problems::default();
        let r: Res<()> = (|| {
            let tokens = u32_tokens(&u64s(case, "tokens")?)?;
            let contract = sglang_contract(
                version,
                u64_of(case, "page_size")?,
                SglangEventsFormat::Default,
                false,
            )?;
            let (keys, digests) = run_hasher(&contract, &tokens, &RequestExtras::NONE)?;
            p.eq(
                "page_sha256_hex",
                digests.iter().map(Digest::to_hex).collect::<Vec<_>>(),
                strs(case, "page_sha256_hex")?
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
            );
            p.eq(
                "block_hash_u64",
                keys_u64(&keys),
                u64s(case, "block_hash_u64")?,
            );
            p.eq(
                "block_hash_i64",
                keys_i64(&keys),
                i64s(case, "block_hash_i64")?,
            );
            p.eq(
                "parent_of_first",
                &Value::Null,
                field(case, "parent_of_first")?,
            );
            Ok(())
        })();
        p.absorb(r);
        report.record(file, &format!("unsalted[{i}]"), &p.0);
    }
    for (i, case) in arr(v, "namespaced")?.iter().enumerate() {
        let mut p = Problems::default();
        let r: Res<()> = (|| {
            let tokens = u32_tokens(&u64s(case, "tokens")?)?;
            let format: SglangEventsFormat = str_of(case, "format")?
                .parse()
                .map_err(|e: ContractError| e.to_string())?;
            let salt = opt_str(case, "cache_salt")?;
            let extra_key = opt_str(case, "extra_key")?;
            // The seeds as SGLang applies them to the request's values (an
            // empty salt or extra key is none).
            let (root, namespace) = sglang::request_namespace(
                format == SglangEventsFormat::Dynamo,
                extra_key.as_deref(),
                salt.as_deref(),
            );
            p.eq(
                "salt_seed_hex",
                root.map(|d| d.to_hex()),
                opt_str(case, "salt_seed_hex")?,
            );
            p.eq(
                "namespace_seed_hex",
                namespace.map(|n| to_hex(&n)),
                opt_str(case, "namespace_seed_hex")?,
            );
            let contract = sglang_contract(version, u64_of(case, "page_size")?, format, false)?;
            let extras = RequestExtras {
                cache_salt: salt,
                sglang_extra_key: extra_key,
                ..RequestExtras::default()
            };
            let (keys, _) = run_hasher(&contract, &tokens, &extras)?;
            p.eq(
                "block_hash_u64",
                keys_u64(&keys),
                u64s(case, "block_hash_u64")?,
            );
            p.eq(
                "block_hash_i64",
                keys_i64(&keys),
                i64s(case, "block_hash_i64")?,
            );
            Ok(())
        })();
        p.absorb(r);
        report.record(file, &format!("namespaced[{i}]"), &p.0);
    }
    Ok(())
}

fn check_sglang_legacy(file: &str, v: &Value, report: &mut GoldenReport) -> Res<()> {
    // "0.4.7 .. 0.5.5.post3": check with the newest version of the range.
    let range = str_of(v, "engine_versions")?;
    let newest = range.rsplit("..").next().unwrap_or(range).trim();
    let version: EngineVersion = newest
        .parse()
        .map_err(|e: crate::VersionParseError| e.to_string())?;
    let mut p = Problems::default();
    p.eq(
        "empty_tuple_hash",
        sglang::py_tuple_hash(std::iter::empty()) as i64,
        field(v, "empty_tuple_hash")?
            .as_i64()
            .ok_or("`empty_tuple_hash` is not an integer")?,
    );
    report.record(file, "empty_tuple_hash", &p.0);
    for (i, case) in arr(v, "vectors")?.iter().enumerate() {
        let mut p = Problems::default();
        let r: Res<()> = (|| {
            let tokens = u32_tokens(&u64s(case, "tokens")?)?;
            let contract = sglang_contract(
                version,
                u64_of(case, "page_size")?,
                SglangEventsFormat::Default,
                true,
            )?;
            let (keys, _) = run_hasher(&contract, &tokens, &RequestExtras::NONE)?;
            p.eq(
                "page_hash_u64",
                keys_u64(&keys),
                u64s(case, "page_hash_u64")?,
            );
            p.eq(
                "page_hash_i64",
                keys_i64(&keys),
                i64s(case, "page_hash_i64")?,
            );
            Ok(())
        })();
        p.absorb(r);
        report.record(file, &format!("vectors[{i}]"), &p.0);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Re-key and TensorRT-LLM

fn check_rekey(file: &str, v: &Value, report: &mut GoldenReport) -> Res<()> {
    let seed = u64_of(v, "xxh3_seed")?;
    for (i, case) in arr(v, "vectors")?.iter().enumerate() {
        let mut p = Problems::default();
        let r: Res<()> = (|| {
            let tokens = u32_tokens(&u64s(case, "tokens")?)?;
            let bs = u64_of(case, "kv_block_size")?;
            let contract = HashContract::Rekey(RekeyContract {
                algorithm: RekeyAlgorithm::Xxh3Chain,
                seed,
                block_size: std::num::NonZeroU32::new(
                    u32::try_from(bs).map_err(|e| e.to_string())?,
                )
                .ok_or("kv_block_size 0")?,
            });
            let locals: Vec<u64> = tokens
                .chunks_exact(bs as usize)
                .map(|b| rekey::local_block_hash(b, seed))
                .collect();
            p.eq(
                "local_block_hash_u64",
                locals,
                u64s(case, "local_block_hash_u64")?,
            );
            let (keys, _) = run_hasher(&contract, &tokens, &RequestExtras::NONE)?;
            p.eq("seq_hash_u64", keys_u64(&keys), u64s(case, "seq_hash_u64")?);
            Ok(())
        })();
        p.absorb(r);
        report.record(file, &format!("vectors[{i}]"), &p.0);
    }
    Ok(())
}

fn check_trtllm(file: &str, v: &Value, report: &mut GoldenReport) -> Res<()> {
    for (i, case) in arr(v, "vectors")?.iter().enumerate() {
        let mut p = Problems::default();
        let r: Res<()> = (|| {
            let tokens = u32_tokens(&u64s(case, "tokens")?)?;
            let bs = u64_of(case, "tokens_per_block")?;
            let contract = HashContract::Trtllm(TrtllmContract {
                version: None,
                algorithm: TrtllmAlgorithm::V1BlockKey,
                block_size: std::num::NonZeroU32::new(
                    u32::try_from(bs).map_err(|e| e.to_string())?,
                )
                .ok_or("tokens_per_block 0")?,
            });
            let extras = RequestExtras {
                trtllm_lora_task_id: case.get("lora_task_id").and_then(Value::as_u64),
                trtllm_cache_salt_id: case.get("cache_salt_id").and_then(Value::as_u64),
                trtllm_token_extra_ids: match case.get("extra_ids") {
                    None => None,
                    Some(_) => Some(u64s(case, "extra_ids")?),
                },
                ..RequestExtras::default()
            };
            let (keys, _) = run_hasher(&contract, &tokens, &extras)?;
            p.eq(
                "full_block_hashes_u64",
                keys_u64(&keys),
                u64s(case, "full_block_hashes_u64")?,
            );
            p.eq("as_i64", keys_i64(&keys), i64s(case, "as_i64")?);
            // TensorRT-LLM also stores the partial last block, keyed by its own length.
            let mut with_partial = keys.clone();
            let full = keys.len() * bs as usize;
            if let Some(tail) = tokens.get(full..).filter(|t| !t.is_empty()) {
                let parent = keys.last().copied().unwrap_or(BlockKey(0));
                let extra_ids = extras
                    .trtllm_token_extra_ids
                    .as_deref()
                    .and_then(|ids| ids.get(full..));
                with_partial.push(trtllm::block_key(
                    parent,
                    tail,
                    trtllm::TrtllmBlockExtras {
                        token_extra_ids: extra_ids,
                        lora_task_id: extras.trtllm_lora_task_id,
                        cache_salt_id: extras.trtllm_cache_salt_id,
                    },
                ));
            }
            p.eq(
                "with_partial_last_block_u64",
                keys_u64(&with_partial),
                u64s(case, "with_partial_last_block_u64")?,
            );
            Ok(())
        })();
        p.absorb(r);
        report.record(file, &format!("vectors[{i}]"), &p.0);
    }
    Ok(())
}
