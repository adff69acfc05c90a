//! Typed errors. Every message says what to set on the engine or in the rule.

use crate::version::EngineVersion;

/// A hash contract that cannot be built, or that would not reproduce the engine's keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    /// The algorithm name is not one this engine has.
    #[error("unknown {engine} hash algorithm {name:?}; expected one of {expected}")]
    UnknownAlgorithm {
        /// Engine the name was given for.
        engine: &'static str,
        /// The name as written.
        name: String,
        /// Accepted names.
        expected: &'static str,
    },
    /// Block (page) size 0.
    #[error("block size must be at least 1: set it to the engine's block size (vLLM `--block-size`, default 16; SGLang `--page-size`; TensorRT-LLM `tokens_per_block`)")]
    ZeroBlockSize,
    /// The engine draws its chain root at random, so no outside party can reproduce its keys.
    #[error("vLLM {version} with `{algorithm}` and PYTHONHASHSEED unset draws NONE_HASH from os.urandom in every process, so its block keys cannot be reproduced: set PYTHONHASHSEED=0 on the engine and `seed=0` in the contract, e.g. `vllm@{version}:{algorithm}:block=16:seed=0`{hint}")]
    RandomRoot {
        /// Engine version named in the contract.
        version: EngineVersion,
        /// Algorithm named in the contract.
        algorithm: &'static str,
        /// Extra advice for this case.
        hint: &'static str,
    },
    /// A PYTHONHASHSEED value CPython refuses at start-up: no engine can run with it.
    #[error("PYTHONHASHSEED={value:?} is rejected by CPython at start-up (it must be \"random\" or an integer in [0, 4294967295]), so no vLLM process can run with it: write in the contract exactly the value the engine runs with (`seed=0`), or omit `seed=` if it is unset")]
    SeedRejectedByCpython {
        /// The value as written.
        value: String,
    },
    /// The version is outside every range this crate has a contract for.
    #[error("{engine} {version} is not supported: {reason}")]
    UnsupportedVersion {
        /// Engine name.
        engine: &'static str,
        /// Version named in the contract.
        version: EngineVersion,
        /// Why, and what to do instead.
        reason: &'static str,
    },
    /// The algorithm does not exist in (or is not the one used by) this engine version.
    #[error("{engine} {version} does not hash with `{algorithm}`: {reason}")]
    AlgorithmVersionMismatch {
        /// Engine name.
        engine: &'static str,
        /// Version named in the contract.
        version: EngineVersion,
        /// Algorithm named in the contract.
        algorithm: &'static str,
        /// Which algorithm/version to use instead.
        reason: &'static str,
    },
    /// A setting the engine does not have in this version or with this algorithm.
    #[error("{setting} is not available here: {reason}")]
    SettingNotSupported {
        /// The setting as named in the rule.
        setting: &'static str,
        /// Why, and what to change.
        reason: &'static str,
    },
    /// A compact contract spec (`vllm@0.33.0:sha256_cbor:block=16:seed=0`) that does not parse.
    #[error("bad hash contract spec {spec:?}: {reason} (form: ENGINE[@VERSION]:ALGORITHM:block=N[:seed=S][:format=F][:lookahead=L])")]
    BadSpec {
        /// The spec as written.
        spec: String,
        /// What is wrong.
        reason: String,
    },
}

/// A request (or event) that cannot be hashed under an otherwise valid contract.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HashError {
    /// A request extra this contract has no place for; ignoring it would give keys the engine never publishes.
    #[error("request extra `{field}` is not part of the {contract} key contract: {hint}")]
    ExtraNotSupported {
        /// `RequestExtras` field name.
        field: &'static str,
        /// Engine/version of the contract.
        contract: String,
        /// What to do instead.
        hint: &'static str,
    },
    /// A token id outside what the engine's key contract can carry.
    #[error("token id {token} at position {position} is out of range for {rule}")]
    TokenOutOfRange {
        /// The token id.
        token: u64,
        /// Its position in the prompt.
        position: usize,
        /// The rule that bounds it.
        rule: &'static str,
    },
    /// A prompt-embeds request without the digest of one of its hashed windows.
    #[error("prompt-embeds request has no digest for tokens [{start}, {end}): supply sha256 of prompt_embeds[{start}:{end}] for every hashed block")]
    MissingPromptEmbedsDigest {
        /// Window start.
        start: u64,
        /// Window end.
        end: u64,
    },
    /// TensorRT-LLM extra ids that do not cover every token.
    #[error("trtllm_token_extra_ids has {got} entries but tokens up to position {needed} are hashed: supply one extra id per prompt token")]
    ExtraIdsTooShort {
        /// Entries supplied.
        got: usize,
        /// Entries needed.
        needed: usize,
    },
    /// A block whose pickle would need several frames (only reachable with huge blocks or strings).
    #[error("a pickled block of {len} bytes would span several pickle frames, which this encoder does not reproduce: use `sha256_cbor`/`xxhash_cbor` on the engine (`--prefix-caching-hash-algo`) or a smaller block size")]
    PickleTooLarge {
        /// Encoded length.
        len: usize,
    },
    /// A parent digest of the wrong length for this contract.
    #[error("parent digest has {got} bytes, this contract chains on {expected}-byte digests")]
    ParentLength {
        /// Bytes supplied.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
}
