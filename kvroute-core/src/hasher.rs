//! Validated contracts turned into hashers: one-shot, incremental and
//! "continue this chain" (attestation) entry points.

use crate::contract::{HashContract, PythonHashSeed, SglangAlgorithm, SglangEventsFormat};
use crate::digest::Digest;
use crate::error::{ContractError, HashError};
use crate::extras::RequestExtras;
use crate::types::{BlockKey, TokenId};
use crate::version::EngineVersion;
use crate::vllm::{self, VllmAlgorithm};
use crate::{rekey, sglang, trtllm};

const VLLM_FIRST_BYTES_DIGESTS: EngineVersion = EngineVersion::new(0, 10, 2);
const VLLM_FIRST_XXHASH: EngineVersion = EngineVersion::new(0, 13, 0);
const VLLM_FIXED_UNSET_SEED: EngineVersion = EngineVersion::new(0, 29, 0);
const VLLM_TAGGED_EXTRAS: EngineVersion = EngineVersion::new(0, 31, 0);
const VLLM_UNSET_SEED_TEXT: &str = "vllm-none-hash";

const SGLANG_FIRST_PAGED_LEGACY: EngineVersion = EngineVersion::new(0, 4, 8);
const SGLANG_FIRST_CHAIN: EngineVersion = EngineVersion::new(0, 5, 6);
const SGLANG_FIRST_SALT_SEED: EngineVersion = EngineVersion::new(0, 5, 18);
const SGLANG_FIRST_NAMESPACE: EngineVersion = EngineVersion::new(0, 5, 22);

/// TensorRT-LLM token ids are `int32`.
const TRTLLM_MAX_TOKEN: u32 = i32::MAX as u32;

#[derive(Clone, Debug)]
enum Kind {
    Vllm {
        algorithm: VllmAlgorithm,
        none_hash: Digest,
        lookahead: usize,
        tagged_extras: bool,
    },
    SglangChain {
        version: EngineVersion,
        dynamo: bool,
    },
    SglangLegacy,
    Trtllm,
    Rekey {
        seed: u64,
    },
}

/// A validated [`HashContract`], ready to hash. Cheap to clone.
///
/// ```
/// use kvroute_core::{HashContract, RequestExtras};
/// let hasher = "vllm@0.33.0:sha256_cbor:block=4:seed=0"
///     .parse::<HashContract>()?
///     .hasher()?;
/// let tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9];
/// let mut keys = Vec::new();
/// hasher.hash_prompt(&tokens, &RequestExtras::NONE, &mut keys)?;
/// assert_eq!(keys.len(), 2); // the partial tail is never hashed
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct BlockHasher {
    contract: HashContract,
    block_size: usize,
    kind: Kind,
}

/// Per-request values derived once from [`RequestExtras`].
#[derive(Clone, Copy, Debug)]
struct Prepared {
    root: Digest,
    namespace: Option<[u8; 32]>,
    /// No extra keys at all: lets the vLLM path skip the extra-key iterator.
    plain: bool,
}

impl BlockHasher {
    /// Validates `contract` (see [`ContractError`] for what is refused).
    pub fn new(contract: &HashContract) -> Result<Self, ContractError> {
        let block_size = contract.block_size().get() as usize;
        let kind = match contract {
            HashContract::Vllm(c) => {
                if c.version < VLLM_FIRST_BYTES_DIGESTS {
                    return Err(ContractError::UnsupportedVersion {
                        engine: "vllm",
                        version: c.version,
                        reason: "vLLM <= 0.10.1 chained Python hash()/truncated 64-bit ints, which cannot be reproduced from outside the process; upgrade to >= 0.10.2 or re-key (`contract = \"rekey:xxh3_64_chain:block=16:seed=1337\"`)",
                    });
                }
                if c.algorithm.is_xxhash() && c.version < VLLM_FIRST_XXHASH {
                    return Err(ContractError::AlgorithmVersionMismatch {
                        engine: "vllm",
                        version: c.version,
                        algorithm: c.algorithm.name(),
                        reason: "xxhash and xxhash_cbor exist since vLLM 0.13.0; name the algorithm the engine runs with (`--prefix-caching-hash-algo`)",
                    });
                }
                let seed_text = match &c.pythonhashseed {
                    PythonHashSeed::Value(v) => {
                        if !c.pythonhashseed.accepted_by_cpython() {
                            return Err(ContractError::SeedRejectedByCpython { value: v.clone() });
                        }
                        v.as_str()
                    }
                    PythonHashSeed::Unset if c.version < VLLM_FIXED_UNSET_SEED => {
                        return Err(ContractError::RandomRoot {
                            version: c.version,
                            algorithm: c.algorithm.name(),
                            hint: " (vLLM older than 0.29 does this for every algorithm)",
                        });
                    }
                    PythonHashSeed::Unset if c.algorithm.is_xxhash() => {
                        return Err(ContractError::RandomRoot {
                            version: c.version,
                            algorithm: c.algorithm.name(),
                            hint:
                                " (xxhash algorithms never use the fixed \"vllm-none-hash\" seed)",
                        });
                    }
                    PythonHashSeed::Unset => VLLM_UNSET_SEED_TEXT,
                };
                Kind::Vllm {
                    algorithm: c.algorithm,
                    none_hash: vllm::none_hash(c.algorithm, seed_text),
                    lookahead: c.lookahead_tokens as usize,
                    tagged_extras: c.version >= VLLM_TAGGED_EXTRAS,
                }
            }
            HashContract::Sglang(c) => {
                if c.version < SGLANG_FIRST_PAGED_LEGACY {
                    return Err(ContractError::UnsupportedVersion {
                        engine: "sglang",
                        version: c.version,
                        reason: "SGLang <= 0.4.7 hashed whole radix nodes, not pages, so a router cannot reproduce its keys; upgrade to >= 0.5.6 or re-key (`contract = \"rekey:xxh3_64_chain:block=16:seed=1337\"`)",
                    });
                }
                let legacy = c.version < SGLANG_FIRST_CHAIN;
                match (legacy, c.algorithm) {
                    (true, SglangAlgorithm::LegacyPyhash) | (false, SglangAlgorithm::Sha256PageChain) => {}
                    (true, _) => {
                        return Err(ContractError::AlgorithmVersionMismatch {
                            engine: "sglang",
                            version: c.version,
                            algorithm: c.algorithm.name(),
                            reason: "SGLang 0.4.8 ..= 0.5.5 publishes hash(tuple(page)); name `legacy_pyhash` in the contract, e.g. `sglang@0.5.5:legacy_pyhash:block=16`",
                        })
                    }
                    (false, _) => {
                        return Err(ContractError::AlgorithmVersionMismatch {
                            engine: "sglang",
                            version: c.version,
                            algorithm: c.algorithm.name(),
                            reason: "SGLang >= 0.5.6 publishes the SHA-256 page chain; name `sha256_page_chain` in the contract, e.g. `sglang@0.5.23:sha256_page_chain:block=16`",
                        })
                    }
                }
                let dynamo = c.kv_events_format == SglangEventsFormat::Dynamo;
                if dynamo && c.version < SGLANG_FIRST_NAMESPACE {
                    return Err(ContractError::SettingNotSupported {
                        setting: "the contract's `format=dynamo`",
                        reason: "SGLang has the dynamo events format since 0.5.22; omit it (or `format=default`) or upgrade the engine",
                    });
                }
                if legacy {
                    Kind::SglangLegacy
                } else {
                    Kind::SglangChain {
                        version: c.version,
                        dynamo,
                    }
                }
            }
            HashContract::Trtllm(_) => Kind::Trtllm,
            HashContract::Rekey(c) => Kind::Rekey { seed: c.seed },
        };
        Ok(Self {
            contract: contract.clone(),
            block_size,
            kind,
        })
    }

    /// The contract this hasher implements.
    #[must_use]
    pub fn contract(&self) -> &HashContract {
        &self.contract
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Tokens that must follow a block before it is hashed (vLLM EAGLE lookahead).
    #[must_use]
    pub fn lookahead(&self) -> usize {
        match self.kind {
            Kind::Vllm { lookahead, .. } => lookahead,
            _ => 0,
        }
    }

    /// Number of blocks a prompt of `n_tokens` tokens has keys for.
    #[must_use]
    pub fn hashable_blocks(&self, n_tokens: usize) -> usize {
        n_tokens.saturating_sub(self.lookahead()) / self.block_size
    }

    /// True when a block's full digest can be rebuilt from its 64-bit key, so a
    /// chain can be continued from an event's `parent_block_hash` alone (see
    /// [`Self::parent_from_key`]).
    #[must_use]
    pub fn chains_on_key(&self) -> bool {
        matches!(
            self.kind,
            Kind::Trtllm | Kind::Rekey { .. } | Kind::SglangLegacy
        )
    }

    /// The parent digest for continuing a chain after the block whose key is `key`.
    ///
    /// `None` for vLLM and SGLang ≥ 0.5.6: they chain on the full digest and
    /// events carry only 64 bits of it, so the caller must remember the digest
    /// (from [`PromptHasher::extend_with_digests`] or [`Self::hash_chain`]).
    #[must_use]
    pub fn parent_from_key(&self, key: BlockKey) -> Option<Digest> {
        self.chains_on_key().then(|| Digest::from_u64(key.0))
    }

    /// The digest block 0 chains on, for this request's extras.
    pub fn root(&self, extras: &RequestExtras) -> Result<Digest, HashError> {
        Ok(self.prepare(extras)?.root)
    }

    fn contract_label(&self) -> String {
        self.contract.to_string()
    }

    fn refuse(&self, field: &'static str, hint: &'static str) -> HashError {
        HashError::ExtraNotSupported {
            field,
            contract: self.contract_label(),
            hint,
        }
    }

    /// Checks that every extra set is one this contract hashes, and derives the
    /// request's root and namespace seed.
    fn prepare(&self, extras: &RequestExtras) -> Result<Prepared, HashError> {
        let allowed: &[&str] = match self.kind {
            Kind::Vllm { tagged_extras, .. } => {
                if tagged_extras {
                    &["lora", "mm_features", "cache_salt", "prompt_embeds"]
                } else {
                    &[]
                }
            }
            Kind::SglangChain { .. } => &["cache_salt", "sglang_extra_key"],
            Kind::SglangLegacy => &[],
            Kind::Trtllm => &[
                "trtllm_lora_task_id",
                "trtllm_cache_salt_id",
                "trtllm_token_extra_ids",
            ],
            Kind::Rekey { .. } => &[],
        };
        if let Some(field) = extras.set_fields().find(|f| !allowed.contains(f)) {
            let hint = match self.kind {
                Kind::Vllm {
                    tagged_extras: false,
                    ..
                } => "only vLLM >= 0.31's extra-key layout is implemented; route such requests by re-keying (`contract = \"rekey:xxh3_64_chain:block=16:seed=1337\"`)",
                Kind::SglangLegacy => "legacy SGLang keys carry no extras; re-key instead (`contract = \"rekey:xxh3_64_chain:block=16:seed=1337\"`)",
                Kind::Rekey { .. } => "re-keying hashes tokens only; keep such requests on a separate rule",
                _ => "this engine does not mix it into block keys; remove it or use the field for this engine",
            };
            return Err(self.refuse(field, hint));
        }
        match &self.kind {
            Kind::Vllm { none_hash, .. } => Ok(Prepared {
                root: *none_hash,
                namespace: None,
                plain: extras.set_fields().next().is_none(),
            }),
            Kind::SglangChain { version, dynamo } => {
                // SGLang takes an empty salt or extra key as none (sglang::present).
                let salt = sglang::present(extras.cache_salt.as_deref());
                let extra_key = sglang::present(extras.sglang_extra_key.as_deref());
                if salt.is_some() && *version < SGLANG_FIRST_SALT_SEED {
                    return Err(self.refuse(
                        "cache_salt",
                        "SGLang seeds pages with cache_salt since 0.5.18; older versions ignore it, so drop it from the request extras",
                    ));
                }
                if extra_key.is_some() && *version < SGLANG_FIRST_NAMESPACE {
                    return Err(self.refuse(
                        "sglang_extra_key",
                        "LoRA key namespacing is only known for SGLang >= 0.5.22; re-key LoRA traffic (`contract = \"rekey:xxh3_64_chain:block=16:seed=1337\"`)",
                    ));
                }
                let (root, namespace) = sglang::request_namespace(*dynamo, extra_key, salt);
                Ok(Prepared {
                    root: root.unwrap_or(Digest::EMPTY),
                    namespace,
                    plain: false,
                })
            }
            Kind::SglangLegacy | Kind::Rekey { .. } => Ok(Prepared {
                root: Digest::EMPTY,
                namespace: None,
                plain: false,
            }),
            Kind::Trtllm => Ok(Prepared {
                root: Digest::from_u64(0),
                namespace: None,
                plain: false,
            }),
        }
    }

    fn check_parent(&self, parent: &Digest) -> Result<(), HashError> {
        let ok = match self.kind {
            Kind::Vllm { algorithm, .. } => parent.len() == algorithm.digest_len(),
            Kind::SglangChain { .. } => parent.is_empty() || parent.len() == 32,
            Kind::Trtllm => parent.len() == 8,
            Kind::Rekey { .. } => parent.is_empty() || parent.len() == 8,
            Kind::SglangLegacy => true,
        };
        if ok {
            Ok(())
        } else {
            Err(HashError::ParentLength {
                got: parent.len(),
                expected: match self.kind {
                    Kind::Vllm { algorithm, .. } => algorithm.digest_len(),
                    Kind::SglangChain { .. } => 32,
                    _ => 8,
                },
            })
        }
    }

    /// Hashes one block. `block_start` is the block's first token position in the
    /// request (extras are positional); `lookahead` holds the tokens after it when
    /// the contract uses lookahead.
    #[allow(clippy::too_many_arguments)]
    fn hash_one(
        &self,
        prep: &Prepared,
        scratch: &mut Vec<u8>,
        extras: &RequestExtras,
        parent: &Digest,
        block_start: usize,
        block_tokens: &[TokenId],
        lookahead: &[TokenId],
    ) -> Result<(Digest, BlockKey), HashError> {
        match &self.kind {
            Kind::Vllm {
                algorithm,
                lookahead: l,
                ..
            } => {
                let la = (*l > 0).then_some(lookahead);
                let d = if prep.plain {
                    // Hot path: a plain text request has `extra_keys = None` everywhere.
                    vllm::hash_block(
                        *algorithm,
                        scratch,
                        parent,
                        block_tokens,
                        std::iter::empty(),
                        la,
                    )?
                } else {
                    let start = block_start as u64;
                    let window_end = start + (block_tokens.len() + l) as u64;
                    let items = vllm::block_extra_items(extras, start, window_end)?;
                    vllm::hash_block(*algorithm, scratch, parent, block_tokens, items, la)?
                };
                Ok((d, d.last8_be()))
            }
            Kind::SglangChain { .. } => {
                let d = sglang::page_digest(parent, block_tokens);
                let raw = d.first8_be();
                let key = match &prep.namespace {
                    Some(seed) => sglang::namespaced_key(seed, raw),
                    None => raw,
                };
                Ok((d, key))
            }
            Kind::SglangLegacy => {
                let key = sglang::legacy_page_hash(block_tokens);
                Ok((Digest::from_u64(key.0), key))
            }
            Kind::Trtllm => {
                if let Some((i, &t)) = block_tokens
                    .iter()
                    .enumerate()
                    .find(|(_, &t)| t > TRTLLM_MAX_TOKEN)
                {
                    return Err(HashError::TokenOutOfRange {
                        token: u64::from(t),
                        position: block_start + i,
                        rule: "TensorRT-LLM, whose token ids are int32 (< 2^31)",
                    });
                }
                let token_extra_ids = match &extras.trtllm_token_extra_ids {
                    None => None,
                    Some(ids) => {
                        let end = block_start + block_tokens.len();
                        Some(
                            ids.get(block_start..end)
                                .ok_or(HashError::ExtraIdsTooShort {
                                    got: ids.len(),
                                    needed: end,
                                })?,
                        )
                    }
                };
                let parent_key = Digest::first8_be(parent);
                let key = trtllm::block_key(
                    parent_key,
                    block_tokens,
                    trtllm::TrtllmBlockExtras {
                        token_extra_ids,
                        lora_task_id: extras.trtllm_lora_task_id,
                        cache_salt_id: extras.trtllm_cache_salt_id,
                    },
                );
                Ok((Digest::from_u64(key.0), key))
            }
            Kind::Rekey { seed } => {
                let local = rekey::local_block_hash(block_tokens, *seed);
                let parent_key = (!parent.is_empty()).then(|| parent.first8_be());
                let key = rekey::sequence_key(parent_key, local, *seed);
                Ok((Digest::from_u64(key.0), key))
            }
        }
    }

    /// Starts an incremental hasher for one request.
    pub fn prompt<'a>(&'a self, extras: &'a RequestExtras) -> Result<PromptHasher<'a>, HashError> {
        let prep = self.prepare(extras)?;
        Ok(PromptHasher {
            hasher: self,
            extras,
            prep,
            parent: prep.root,
            blocks_done: 0,
            scratch: Vec::with_capacity(self.scratch_capacity()),
        })
    }

    fn scratch_capacity(&self) -> usize {
        (self.block_size + self.lookahead()) * 10 + 256
    }

    /// One-shot: appends the keys of every hashable block of `tokens` to `out`.
    /// Returns how many were appended.
    pub fn hash_prompt(
        &self,
        tokens: &[TokenId],
        extras: &RequestExtras,
        out: &mut Vec<BlockKey>,
    ) -> Result<usize, HashError> {
        self.prompt(extras)?.extend(tokens, out)
    }

    /// Continues a chain from a known parent: hashes the full blocks of `tokens`
    /// (which start at block `first_block_index` of the request) after `parent`.
    ///
    /// This is what event attestation needs: recompute a stored event's keys from
    /// its token ids. `parent` is [`Self::root`] when `first_block_index == 0`,
    /// otherwise the parent block's full digest — for vLLM and SGLang ≥ 0.5.6 the
    /// caller must have kept it (events carry only 64 bits), for the others
    /// [`Self::parent_from_key`] rebuilds it from the event's parent key.
    ///
    /// Appends keys to `out_keys` (and digests to `out_digests` if given); returns
    /// the last digest (the parent for whatever follows), or `parent` if no block
    /// was complete.
    pub fn hash_chain(
        &self,
        extras: &RequestExtras,
        parent: &Digest,
        first_block_index: usize,
        tokens: &[TokenId],
        out_keys: &mut Vec<BlockKey>,
        mut out_digests: Option<&mut Vec<Digest>>,
    ) -> Result<Digest, HashError> {
        let prep = self.prepare(extras)?;
        self.check_parent(parent)?;
        let mut scratch = Vec::with_capacity(self.scratch_capacity());
        let mut parent = *parent;
        let b = self.block_size;
        let l = self.lookahead();
        for i in 0..self.hashable_blocks(tokens.len()) {
            let start = i * b;
            let block = tokens.get(start..start + b).unwrap_or(&[]);
            let la = tokens.get(start + b..start + b + l).unwrap_or(&[]);
            let abs_start = (first_block_index + i) * b;
            let (d, key) =
                self.hash_one(&prep, &mut scratch, extras, &parent, abs_start, block, la)?;
            out_keys.push(key);
            if let Some(ds) = out_digests.as_deref_mut() {
                ds.push(d);
            }
            parent = d;
        }
        Ok(parent)
    }
}

/// Incremental hashing of one request: holds the chain's last digest and the
/// number of blocks done, so appending tokens hashes only the new full blocks.
///
/// Allocates its scratch buffer once; hashing a block does not allocate (keys go
/// into the caller's vector, which only grows if it lacks capacity).
///
/// ```
/// use kvroute_core::{HashContract, RequestExtras};
/// let hasher = "sglang@0.5.23:sha256_page_chain:page=4".parse::<HashContract>()?.hasher()?;
/// let extras = RequestExtras::NONE;
/// let mut prompt = hasher.prompt(&extras)?;
/// let mut keys = Vec::new();
/// let tokens: Vec<u32> = (0..10).collect();
/// prompt.extend(&tokens[..6], &mut keys)?;   // block 0
/// prompt.extend(&tokens, &mut keys)?;        // block 1 only; block 0 is not rehashed
/// assert_eq!(prompt.blocks_done(), 2);
/// let mut one_shot = Vec::new();
/// hasher.hash_prompt(&tokens, &extras, &mut one_shot)?;
/// assert_eq!(keys, one_shot);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct PromptHasher<'a> {
    hasher: &'a BlockHasher,
    extras: &'a RequestExtras,
    prep: Prepared,
    parent: Digest,
    blocks_done: usize,
    scratch: Vec<u8>,
}

impl PromptHasher<'_> {
    /// Hashes the blocks of `tokens_so_far` not hashed yet, appending their keys.
    ///
    /// `tokens_so_far` is the whole request so far; its first `blocks_done() *
    /// block_size` tokens must be the ones already hashed (not re-checked).
    /// Returns how many keys were appended.
    pub fn extend(
        &mut self,
        tokens_so_far: &[TokenId],
        out_keys: &mut Vec<BlockKey>,
    ) -> Result<usize, HashError> {
        self.extend_inner(tokens_so_far, out_keys, None)
    }

    /// Like [`Self::extend`], also appending each new block's full digest
    /// (hybrid group views, attestation of later events).
    pub fn extend_with_digests(
        &mut self,
        tokens_so_far: &[TokenId],
        out_keys: &mut Vec<BlockKey>,
        out_digests: &mut Vec<Digest>,
    ) -> Result<usize, HashError> {
        self.extend_inner(tokens_so_far, out_keys, Some(out_digests))
    }

    fn extend_inner(
        &mut self,
        tokens: &[TokenId],
        out_keys: &mut Vec<BlockKey>,
        mut out_digests: Option<&mut Vec<Digest>>,
    ) -> Result<usize, HashError> {
        let h = self.hasher;
        let b = h.block_size;
        let l = h.lookahead();
        let target = h.hashable_blocks(tokens.len());
        let before = self.blocks_done;
        if let Kind::Vllm {
            algorithm,
            lookahead: 0,
            ..
        } = h.kind
        {
            if self.prep.plain {
                // Plain text request: `extra_keys = None` for every block.
                let new = tokens.get(before * b..target * b).unwrap_or(&[]);
                let first = out_keys.len();
                let r = vllm::extend_plain(
                    algorithm,
                    &mut self.scratch,
                    &mut self.parent,
                    new,
                    b,
                    out_keys,
                    out_digests,
                );
                self.blocks_done = before + (out_keys.len() - first);
                r?;
                return Ok(self.blocks_done - before);
            }
        }
        if let Kind::Rekey { seed } = h.kind {
            // One loop over the new blocks, keys only (the digest is the key).
            let new = tokens.get(before * b..target * b).unwrap_or(&[]);
            let parent = (!self.parent.is_empty()).then(|| self.parent.first8_be());
            let first = out_keys.len();
            if let Some(last) = rekey::extend_chain(parent, new, b, seed, out_keys) {
                self.parent = Digest::from_u64(last.0);
            }
            if let Some(ds) = out_digests {
                let added = out_keys.get(first..).unwrap_or(&[]);
                ds.extend(added.iter().map(|k| Digest::from_u64(k.0)));
            }
            self.blocks_done = target.max(before);
            return Ok(self.blocks_done - before);
        }
        while self.blocks_done < target {
            let start = self.blocks_done * b;
            let block = tokens.get(start..start + b).unwrap_or(&[]);
            let la = tokens.get(start + b..start + b + l).unwrap_or(&[]);
            let (d, key) = h.hash_one(
                &self.prep,
                &mut self.scratch,
                self.extras,
                &self.parent,
                start,
                block,
                la,
            )?;
            out_keys.push(key);
            if let Some(ds) = out_digests.as_deref_mut() {
                ds.push(d);
            }
            self.parent = d;
            self.blocks_done += 1;
        }
        Ok(self.blocks_done - before)
    }

    /// Blocks hashed so far.
    #[must_use]
    pub fn blocks_done(&self) -> usize {
        self.blocks_done
    }

    /// The digest the next block chains on (the root before any block).
    #[must_use]
    pub fn parent(&self) -> &Digest {
        &self.parent
    }

    /// Forgets all blocks (same request extras), keeping the scratch buffer.
    pub fn reset(&mut self) {
        self.parent = self.prep.root;
        self.blocks_done = 0;
    }
}
