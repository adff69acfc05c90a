//! Hash-contract descriptors: what the operator names for each rule.
//!
//! A contract pins everything that changes an engine's block keys: engine,
//! version, algorithm, root seed, block size and extra-key settings. There is no
//! default contract; [`HashContract::hasher`] validates it and refuses
//! combinations whose keys cannot be reproduced, saying what to set on the engine.

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ContractError;
use crate::names::UnknownName;
use crate::version::EngineVersion;
use crate::vllm::VllmAlgorithm;

/// A block-key contract, deserialisable from a rule's configuration.
///
/// ```
/// use kvroute_core::HashContract;
/// // TOML / JSON form (here JSON):
/// let c: HashContract = serde_json::from_str(
///     r#"{"engine":"vllm","version":"0.33.0","algorithm":"sha256_cbor",
///         "block_size":16,"pythonhashseed":"0"}"#,
/// ).unwrap();
/// // Compact form, same contract:
/// let d: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
/// assert_eq!(c, d);
/// assert_eq!(d.to_string(), "vllm@0.33.0:sha256_cbor:block=16:seed=0");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "engine", rename_all = "lowercase")]
pub enum HashContract {
    /// vLLM prefix-cache block hashes.
    Vllm(VllmContract),
    /// SGLang radix-cache page hashes.
    Sglang(SglangContract),
    /// TensorRT-LLM block keys.
    Trtllm(TrtllmContract),
    /// kvroute's engine-independent re-key (keys recomputed from event tokens).
    Rekey(RekeyContract),
}

/// vLLM: `--prefix-caching-hash-algo`, `PYTHONHASHSEED`, `--block-size`, EAGLE lookahead.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VllmContract {
    /// Engine version (decides the NONE_HASH rule and the extra-key layout).
    pub version: EngineVersion,
    /// `--prefix-caching-hash-algo`.
    pub algorithm: VllmAlgorithm,
    /// The engine's `PYTHONHASHSEED` environment variable; omitted = unset.
    #[serde(default, skip_serializing_if = "PythonHashSeed::is_unset")]
    pub pythonhashseed: PythonHashSeed,
    /// The hash block size (`--block-size`; for hybrid models the smallest group block size).
    #[serde(deserialize_with = "block_size", serialize_with = "ser_block_size")]
    pub block_size: NonZeroU32,
    /// EAGLE `num_hash_lookahead_tokens` (0 without speculative decoding).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lookahead_tokens: u32,
}

/// SGLang: version (page chain or legacy), `--page-size`, `kv_events_config.format`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SglangContract {
    /// Engine version (≥ 0.5.6 page chain, 0.4.8 ..= 0.5.5 legacy).
    pub version: EngineVersion,
    /// `sha256_page_chain` (≥ 0.5.6) or `legacy_pyhash` (0.4.8 ..= 0.5.5).
    pub algorithm: SglangAlgorithm,
    /// `--page-size`.
    #[serde(
        alias = "page_size",
        deserialize_with = "block_size",
        serialize_with = "ser_block_size"
    )]
    pub block_size: NonZeroU32,
    /// The KV-events `format` (`default` or `dynamo`, ≥ 0.5.22).
    #[serde(default, skip_serializing_if = "SglangEventsFormat::is_default")]
    pub kv_events_format: SglangEventsFormat,
}

/// TensorRT-LLM: `tokens_per_block` and the hash algorithm.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrtllmContract {
    /// Engine version, informational (the V1 rule has not changed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<EngineVersion>,
    /// `v1_block_key`.
    pub algorithm: TrtllmAlgorithm,
    /// `tokens_per_block`.
    #[serde(
        alias = "tokens_per_block",
        deserialize_with = "block_size",
        serialize_with = "ser_block_size"
    )]
    pub block_size: NonZeroU32,
}

/// Re-keying: both router and ingest recompute keys from tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RekeyContract {
    /// `xxh3_64_chain`.
    pub algorithm: RekeyAlgorithm,
    /// XXH3 seed; 1337 matches Dynamo's published vectors.
    pub seed: u64,
    /// Tokens per re-keyed block (normally the engine's block size).
    #[serde(deserialize_with = "block_size", serialize_with = "ser_block_size")]
    pub block_size: NonZeroU32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn block_size<'de, D: Deserializer<'de>>(d: D) -> Result<NonZeroU32, D::Error> {
    let n = u32::deserialize(d)?;
    NonZeroU32::new(n).ok_or_else(|| serde::de::Error::custom(ContractError::ZeroBlockSize))
}

fn ser_block_size<S: Serializer>(v: &NonZeroU32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u32(v.get())
}

/// vLLM's `PYTHONHASHSEED` as the engine process sees it.
///
/// vLLM hashes the variable's text verbatim into NONE_HASH when it is set — even
/// `""` and `"random"` give fixed, reproducible roots. When it is unset the root is
/// `"vllm-none-hash"` (sha256/sha256_cbor, vLLM ≥ 0.29) or random (xxhash
/// algorithms, and every algorithm before 0.29).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum PythonHashSeed {
    /// Not in the engine's environment.
    #[default]
    Unset,
    /// Set to this exact text.
    Value(String),
}

impl PythonHashSeed {
    /// True when unset.
    #[must_use]
    pub fn is_unset(&self) -> bool {
        matches!(self, PythonHashSeed::Unset)
    }

    /// Whether CPython starts with this value: unset, `""` (treated as unset by
    /// CPython, but vLLM still reads `""`), `"random"`, or what `strtoul` reads
    /// as an integer in [0, 4294967295] with nothing after it.
    #[must_use]
    pub fn accepted_by_cpython(&self) -> bool {
        let PythonHashSeed::Value(v) = self else {
            return true;
        };
        if v.is_empty() || v == "random" {
            return true;
        }
        let body = v.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
        let digits = body.strip_prefix('+').unwrap_or(body);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let significant = digits.trim_start_matches('0');
        significant.len() <= 10
            && (significant.is_empty()
                || significant
                    .parse::<u64>()
                    .is_ok_and(|n| n <= u64::from(u32::MAX)))
    }
}

impl Serialize for PythonHashSeed {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PythonHashSeed::Unset => s.serialize_none(),
            PythonHashSeed::Value(v) => s.serialize_str(v),
        }
    }
}

impl<'de> Deserialize<'de> for PythonHashSeed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<String>::deserialize(d)? {
            None => PythonHashSeed::Unset,
            Some(v) => PythonHashSeed::Value(v),
        })
    }
}

macro_rules! named_enum {
    ($(#[$m:meta])* $name:ident, $engine:literal, $expected:literal, { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            $($(#[$vm])* $variant),+
        }

        impl $name {
            /// The configuration name.
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl FromStr for $name {
            type Err = ContractError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(ContractError::UnknownAlgorithm {
                        engine: $engine,
                        name: s.to_owned(),
                        expected: $expected,
                    }),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

named_enum!(
    /// SGLang's hashing scheme.
    SglangAlgorithm, "sglang", "\"sha256_page_chain\" (>= 0.5.6), \"legacy_pyhash\" (0.4.8 ..= 0.5.5)", {
        /// SHA-256 page chain (≥ 0.5.6).
        #[default]
        Sha256PageChain = "sha256_page_chain",
        /// CPython `hash(tuple(page))` (0.4.8 ..= 0.5.5).
        LegacyPyhash = "legacy_pyhash",
    }
);

named_enum!(
    /// SGLang `kv_events_config` `format`.
    SglangEventsFormat, "sglang", "\"default\", \"dynamo\"", {
        /// Plain keys (salted requests only seed the chain).
        #[default]
        Default = "default",
        /// Dynamo format: salted requests are also namespaced.
        Dynamo = "dynamo",
    }
);

impl SglangEventsFormat {
    fn is_default(&self) -> bool {
        *self == SglangEventsFormat::Default
    }
}

named_enum!(
    /// TensorRT-LLM's hashing scheme.
    TrtllmAlgorithm, "trtllm", "\"v1_block_key\"", {
        /// `BlockKeyHasher::hash` (V1).
        #[default]
        V1BlockKey = "v1_block_key",
    }
);

named_enum!(
    /// kvroute re-key scheme.
    RekeyAlgorithm, "rekey", "\"xxh3_64_chain\"", {
        /// Chained XXH3-64 over u32 little-endian tokens (Dynamo-compatible).
        #[default]
        Xxh3Chain = "xxh3_64_chain",
    }
);

impl HashContract {
    /// The block (page) size.
    #[must_use]
    pub fn block_size(&self) -> NonZeroU32 {
        match self {
            HashContract::Vllm(c) => c.block_size,
            HashContract::Sglang(c) => c.block_size,
            HashContract::Trtllm(c) => c.block_size,
            HashContract::Rekey(c) => c.block_size,
        }
    }

    /// `vllm`, `sglang`, `trtllm` or `rekey`.
    #[must_use]
    pub fn engine_name(&self) -> &'static str {
        match self {
            HashContract::Vllm(_) => "vllm",
            HashContract::Sglang(_) => "sglang",
            HashContract::Trtllm(_) => "trtllm",
            HashContract::Rekey(_) => "rekey",
        }
    }

    /// Validates the contract and prepares a hasher (computes the chain root).
    pub fn hasher(&self) -> Result<crate::BlockHasher, ContractError> {
        crate::BlockHasher::new(self)
    }

    /// Whether every key depends on all the blocks before it (a chain), so
    /// that equal keys mean equal prefixes: true for every contract except
    /// SGLang 0.4.8 ..= 0.5.5's `legacy_pyhash`, which hashes each page
    /// alone. The inventory's prefix shortcut (chain runs) relies on it.
    ///
    /// ```
    /// use kvroute_core::HashContract;
    /// let v: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    /// assert!(v.keys_chained());
    /// let legacy: HashContract = "sglang@0.5.5:legacy_pyhash:block=16".parse().unwrap();
    /// assert!(!legacy.keys_chained());
    /// ```
    #[must_use]
    pub fn keys_chained(&self) -> bool {
        !matches!(
            self,
            HashContract::Sglang(SglangContract {
                algorithm: SglangAlgorithm::LegacyPyhash,
                ..
            })
        )
    }

    /// How inventories and prompts are keyed under this contract: re-key
    /// contracts ([`HashContract::Rekey`]) re-key, every engine contract uses
    /// the engine's own keys. The ingest side and the prompt side both take
    /// their mode from here, so they cannot disagree.
    ///
    /// ```
    /// use kvroute_core::{HashContract, KeyMode};
    /// let c: HashContract = "rekey:xxh3_64_chain:block=16:seed=1".parse().unwrap();
    /// assert_eq!(c.key_mode(), KeyMode::Rekey);
    /// let v: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    /// assert_eq!(v.key_mode(), KeyMode::Engine);
    /// ```
    #[must_use]
    pub fn key_mode(&self) -> KeyMode {
        match self {
            HashContract::Rekey(_) => KeyMode::Rekey,
            HashContract::Vllm(_) | HashContract::Sglang(_) | HashContract::Trtllm(_) => {
                KeyMode::Engine
            }
        }
    }
}

/// Where an inventory's keys come from, which fixes how prompt keys are made.
/// The one key-mode vocabulary of every kvroute crate (ingest, selection, the
/// facade); derive it from the contract with [`HashContract::key_mode`].
///
/// ```
/// use kvroute_core::KeyMode;
/// assert_eq!("rekey".parse::<KeyMode>(), Ok(KeyMode::Rekey));
/// assert_eq!(KeyMode::Engine.to_string(), "engine");
/// assert_eq!(KeyMode::default(), KeyMode::Engine);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyMode {
    /// The engines' own event keys; prompt keys must be bit-identical to them.
    #[default]
    Engine,
    /// kvroute re-keys stored blocks from the token ids the events carry (for
    /// contracts that cannot be reproduced); prompt keys use the same re-keying.
    Rekey,
}

impl KeyMode {
    /// `engine` or `rekey` (the configuration, admin and metrics spelling).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            KeyMode::Engine => "engine",
            KeyMode::Rekey => "rekey",
        }
    }
}

impl fmt::Display for KeyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KeyMode {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "engine" => Ok(KeyMode::Engine),
            "rekey" => Ok(KeyMode::Rekey),
            other => Err(UnknownName {
                what: "key mode",
                name: other.to_owned(),
                expected: "engine or rekey",
            }),
        }
    }
}

impl fmt::Display for HashContract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashContract::Vllm(c) => {
                write!(
                    f,
                    "vllm@{}:{}:block={}",
                    c.version, c.algorithm, c.block_size
                )?;
                if let PythonHashSeed::Value(v) = &c.pythonhashseed {
                    write!(f, ":seed={v}")?;
                }
                if c.lookahead_tokens > 0 {
                    write!(f, ":lookahead={}", c.lookahead_tokens)?;
                }
                Ok(())
            }
            HashContract::Sglang(c) => {
                write!(
                    f,
                    "sglang@{}:{}:block={}",
                    c.version, c.algorithm, c.block_size
                )?;
                if !c.kv_events_format.is_default() {
                    write!(f, ":format={}", c.kv_events_format)?;
                }
                Ok(())
            }
            HashContract::Trtllm(c) => {
                f.write_str("trtllm")?;
                if let Some(v) = c.version {
                    write!(f, "@{v}")?;
                }
                write!(f, ":{}:block={}", c.algorithm, c.block_size)
            }
            HashContract::Rekey(c) => {
                write!(
                    f,
                    "rekey:{}:block={}:seed={}",
                    c.algorithm, c.block_size, c.seed
                )
            }
        }
    }
}

impl FromStr for HashContract {
    type Err = ContractError;

    /// Parses `ENGINE[@VERSION]:ALGORITHM:key=value...` with keys `block` (alias
    /// `page`), `seed` (vLLM PYTHONHASHSEED text, absent = unset; re-key XXH3 seed),
    /// `format` (SGLang) and `lookahead` (vLLM).
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| ContractError::BadSpec {
            spec: spec.to_owned(),
            reason: reason.to_owned(),
        };
        let mut parts = spec.split(':');
        let head = parts.next().unwrap_or_default();
        let (engine, version) = match head.split_once('@') {
            Some((e, v)) => (
                e,
                Some(
                    v.parse::<EngineVersion>()
                        .map_err(|e| bad(&e.to_string()))?,
                ),
            ),
            None => (head, None),
        };
        let algorithm = parts.next().ok_or_else(|| bad("missing algorithm"))?;
        let mut block = None;
        let mut seed: Option<&str> = None;
        let mut format = None;
        let mut lookahead = 0u32;
        for kv in parts {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(&format!("{kv:?} is not key=value")))?;
            match k {
                "block" | "page" => {
                    let n: u32 = v
                        .parse()
                        .map_err(|_| bad(&format!("block={v:?} is not an integer")))?;
                    block = Some(NonZeroU32::new(n).ok_or(ContractError::ZeroBlockSize)?);
                }
                "seed" => seed = Some(v),
                "format" => format = Some(v.parse::<SglangEventsFormat>()?),
                "lookahead" => {
                    lookahead = v
                        .parse()
                        .map_err(|_| bad(&format!("lookahead={v:?} is not an integer")))?;
                }
                _ => return Err(bad(&format!("unknown key {k:?}"))),
            }
        }
        let block_size = block.ok_or_else(|| bad("missing block=N"))?;
        let need_version = || version.ok_or_else(|| bad("this engine needs @VERSION"));
        let reject = |key: &str, set: bool| {
            if set {
                Err(bad(&format!("{key}= does not apply to {engine}")))
            } else {
                Ok(())
            }
        };
        match engine {
            "vllm" => {
                reject("format", format.is_some())?;
                Ok(HashContract::Vllm(VllmContract {
                    version: need_version()?,
                    algorithm: algorithm.parse()?,
                    pythonhashseed: seed.map_or(PythonHashSeed::Unset, |s| {
                        PythonHashSeed::Value(s.to_owned())
                    }),
                    block_size,
                    lookahead_tokens: lookahead,
                }))
            }
            "sglang" => {
                reject("seed", seed.is_some())?;
                reject("lookahead", lookahead != 0)?;
                Ok(HashContract::Sglang(SglangContract {
                    version: need_version()?,
                    algorithm: algorithm.parse()?,
                    block_size,
                    kv_events_format: format.unwrap_or_default(),
                }))
            }
            "trtllm" => {
                reject("seed", seed.is_some())?;
                reject("format", format.is_some())?;
                reject("lookahead", lookahead != 0)?;
                Ok(HashContract::Trtllm(TrtllmContract {
                    version,
                    algorithm: algorithm.parse()?,
                    block_size,
                }))
            }
            "rekey" => {
                reject("format", format.is_some())?;
                reject("lookahead", lookahead != 0)?;
                let seed = seed
                    .ok_or_else(|| bad("rekey needs seed=N (1337 = Dynamo's)"))?
                    .parse()
                    .map_err(|_| bad("rekey seed must be an unsigned integer"))?;
                Ok(HashContract::Rekey(RekeyContract {
                    algorithm: algorithm.parse()?,
                    seed,
                    block_size,
                }))
            }
            other => Err(bad(&format!(
                "unknown engine {other:?} (vllm, sglang, trtllm, rekey)"
            ))),
        }
    }
}
