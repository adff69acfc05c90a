//! vLLM's prefix-cache block hash (golden/vllm/README.md is the specification).
//!
//! ```text
//! NONE_HASH = hash_fn(seed_str)
//! digest[i] = hash_fn((parent, tuple(tokens_i), extra_keys_i))   parent = NONE_HASH | digest[i-1]
//! key[i]    = u64::from_be_bytes(last 8 bytes of digest[i])
//! ```

pub(crate) mod cbor;
pub(crate) mod pickle;
mod plain;
mod sha256;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod shani;

pub(crate) use plain::extend_plain;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::error::{ContractError, HashError};
use crate::extras::RequestExtras;

/// `--prefix-caching-hash-algo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VllmAlgorithm {
    /// `sha256`: SHA-256 of `pickle.dumps(obj, protocol=5)` (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 of canonical CBOR.
    Sha256Cbor,
    /// `xxhash`: XXH3-128 of the pickle (vLLM ≥ 0.13).
    Xxhash,
    /// `xxhash_cbor`: XXH3-128 of canonical CBOR (vLLM ≥ 0.13).
    XxhashCbor,
}

impl VllmAlgorithm {
    /// All algorithms.
    pub const ALL: [VllmAlgorithm; 4] = [
        VllmAlgorithm::Sha256,
        VllmAlgorithm::Sha256Cbor,
        VllmAlgorithm::Xxhash,
        VllmAlgorithm::XxhashCbor,
    ];

    /// The engine's name for it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            VllmAlgorithm::Sha256 => "sha256",
            VllmAlgorithm::Sha256Cbor => "sha256_cbor",
            VllmAlgorithm::Xxhash => "xxhash",
            VllmAlgorithm::XxhashCbor => "xxhash_cbor",
        }
    }

    /// True for the canonical-CBOR serialisation, false for pickle.
    #[must_use]
    pub const fn uses_cbor(self) -> bool {
        matches!(self, VllmAlgorithm::Sha256Cbor | VllmAlgorithm::XxhashCbor)
    }

    /// True for the XXH3-128 digests (random NONE_HASH when PYTHONHASHSEED is unset).
    #[must_use]
    pub const fn is_xxhash(self) -> bool {
        matches!(self, VllmAlgorithm::Xxhash | VllmAlgorithm::XxhashCbor)
    }

    /// Digest length in bytes.
    #[must_use]
    pub const fn digest_len(self) -> usize {
        if self.is_xxhash() {
            16
        } else {
            32
        }
    }

    /// `hash_fn(input)` over already-serialised bytes.
    #[must_use]
    #[inline]
    pub fn digest(self, input: &[u8]) -> Digest {
        if self.is_xxhash() {
            Digest::from_16(xxhash_rust::xxh3::xxh3_128(input).to_be_bytes())
        } else {
            Digest::from_32(Sha256::digest(input).into())
        }
    }
}

const ALGORITHM_NAMES: &str = "\"sha256\", \"sha256_cbor\", \"xxhash\", \"xxhash_cbor\"";

impl FromStr for VllmAlgorithm {
    type Err = ContractError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| ContractError::UnknownAlgorithm {
                engine: "vllm",
                name: s.to_owned(),
                expected: ALGORITHM_NAMES,
            })
    }
}

impl fmt::Display for VllmAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for VllmAlgorithm {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for VllmAlgorithm {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// One element of a block's extra-key tuple `E` (vLLM ≥ 0.31 tagged form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraKeyItem<'a> {
    /// `("lora", name, path)`.
    Lora {
        /// `lora_name`.
        name: &'a str,
        /// `lora_path`.
        path: &'a str,
    },
    /// `("mm", identifier, offset - block_start)`.
    Mm {
        /// Item identifier.
        identifier: &'a str,
        /// Item offset relative to the block start (negative if it began earlier).
        offset: i64,
    },
    /// `("cache_salt", salt)` (block 0 only).
    CacheSalt(&'a str),
    /// `("prompt_embeds", sha256 digest bytes)`.
    PromptEmbeds(&'a [u8; 32]),
}

/// One entry of `BlockStored.extra_keys`: the tuple `E` with tags stripped and the LoRA path dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventExtraKey {
    /// LoRA name.
    Lora(String),
    /// `(identifier, offset)`.
    Mm(String, i64),
    /// Cache salt.
    CacheSalt(String),
    /// Prompt-embeds digest.
    PromptEmbeds([u8; 32]),
}

impl EventExtraKey {
    /// What the engine publishes for one extra-key item.
    #[must_use]
    pub fn from_item(item: &ExtraKeyItem<'_>) -> Self {
        match *item {
            ExtraKeyItem::Lora { name, .. } => Self::Lora(name.to_owned()),
            ExtraKeyItem::Mm { identifier, offset } => Self::Mm(identifier.to_owned(), offset),
            ExtraKeyItem::CacheSalt(s) => Self::CacheSalt(s.to_owned()),
            ExtraKeyItem::PromptEmbeds(d) => Self::PromptEmbeds(*d),
        }
    }
}

/// Serialises `value` the way `algorithm` does (CBOR or pickle) into `out`.
pub(crate) fn encode_block<'a, T, I>(
    algorithm: VllmAlgorithm,
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: &[T],
    extra: I,
    lookahead: Option<&[T]>,
) where
    T: Copy + Into<u64>,
    I: Iterator<Item = ExtraKeyItem<'a>> + Clone,
{
    if algorithm.uses_cbor() {
        cbor::encode_block(out, parent, tokens, extra, lookahead);
    } else {
        pickle::encode_block(out, parent, tokens, extra, lookahead);
    }
}

/// `NONE_HASH = hash_fn(seed_str)`: the chain root for `seed_str`.
///
/// This is the raw rule and accepts any string (including values CPython would
/// refuse); [`crate::HashContract`] validation decides which seeds are real.
///
/// ```
/// use kvroute_core::vllm::{none_hash, VllmAlgorithm};
/// assert_eq!(
///     none_hash(VllmAlgorithm::XxhashCbor, "0").to_hex(),
///     "1ebe36576dcb573f26b99533a20aaeca"
/// );
/// ```
#[must_use]
pub fn none_hash(algorithm: VllmAlgorithm, seed_str: &str) -> Digest {
    let mut buf = Vec::with_capacity(seed_str.len() + 16);
    if algorithm.uses_cbor() {
        cbor::encode_str(&mut buf, seed_str);
    } else {
        pickle::encode_str(&mut buf, seed_str);
    }
    algorithm.digest(&buf)
}

/// Serialises one block and digests it, using `scratch` as working space.
///
/// `tokens` may be any unsigned integers (vLLM hashes Python ints); the hot path
/// uses `u32`. Keep `scratch` between blocks: after the first block it is not
/// allocated or zero-filled again. Its contents afterwards are unspecified; use
/// [`serialize_block`] for the bytes `hash_fn` sees.
pub fn hash_block<'a, T, I>(
    algorithm: VllmAlgorithm,
    scratch: &mut Vec<u8>,
    parent: &Digest,
    tokens: &[T],
    extra: I,
    lookahead: Option<&[T]>,
) -> Result<Digest, HashError>
where
    T: Copy + Into<u64>,
    I: Iterator<Item = ExtraKeyItem<'a>> + Clone,
{
    if algorithm.uses_cbor() {
        let len = cbor::write_block(scratch, 0, parent.as_bytes(), tokens, extra, lookahead);
        if algorithm == VllmAlgorithm::Sha256Cbor {
            return Ok(Digest::from_32(sha256::digest_in_place(scratch, len)));
        }
        return Ok(algorithm.digest(scratch.get(..len).unwrap_or(&[])));
    }
    scratch.clear();
    pickle::encode_block(scratch, parent.as_bytes(), tokens, extra, lookahead);
    if scratch.len() >= pickle::MAX_SINGLE_FRAME {
        return Err(HashError::PickleTooLarge { len: scratch.len() });
    }
    Ok(algorithm.digest(scratch))
}

/// Appends the bytes [`hash_block`] digests for one block: the canonical CBOR
/// or the pickle of `(parent, tuple(tokens), extra_keys)`.
///
/// ```
/// use kvroute_core::vllm::{none_hash, serialize_block, ExtraKeyItem, VllmAlgorithm};
/// let root = none_hash(VllmAlgorithm::Sha256Cbor, "0");
/// let mut bytes = Vec::new();
/// serialize_block(
///     VllmAlgorithm::Sha256Cbor,
///     &mut bytes,
///     &root,
///     &[1u32, 2, 300],
///     std::iter::empty::<ExtraKeyItem<'_>>(),
///     None,
/// );
/// // array(3), bytes(32) head, the root, array(3), 1, 2, uint16 300, null
/// assert_eq!(bytes.len(), 1 + 2 + 32 + 1 + 1 + 1 + 3 + 1);
/// assert_eq!(&bytes[..3], &[0x83, 0x58, 0x20]);
/// assert_eq!(&bytes[35..], &[0x83, 0x01, 0x02, 0x19, 0x01, 0x2c, 0xf6]);
/// ```
pub fn serialize_block<'a, T, I>(
    algorithm: VllmAlgorithm,
    out: &mut Vec<u8>,
    parent: &Digest,
    tokens: &[T],
    extra: I,
    lookahead: Option<&[T]>,
) where
    T: Copy + Into<u64>,
    I: Iterator<Item = ExtraKeyItem<'a>> + Clone,
{
    encode_block(algorithm, out, parent.as_bytes(), tokens, extra, lookahead);
}

/// The extra-key items of the block covering `[start, window_end)` (the block
/// plus its lookahead tokens), in vLLM's order: LoRA, multimodal items
/// overlapping the window, cache salt (block 0, non-empty), prompt-embeds digest.
///
/// Multimodal items are matched by overlap with the window, as the README states.
pub fn block_extra_items(
    extras: &RequestExtras,
    start: u64,
    window_end: u64,
) -> Result<impl Iterator<Item = ExtraKeyItem<'_>> + Clone + '_, HashError> {
    let prompt_embeds = if extras.prompt_embeds.is_empty() {
        None
    } else {
        let found = extras
            .prompt_embeds
            .iter()
            .find(|d| d.start == start && d.end == window_end)
            .ok_or(HashError::MissingPromptEmbedsDigest {
                start,
                end: window_end,
            })?;
        Some(ExtraKeyItem::PromptEmbeds(&found.digest))
    };
    let lora = extras.lora.as_ref().map(|l| ExtraKeyItem::Lora {
        name: &l.name,
        path: &l.path,
    });
    let mm = extras
        .mm_features
        .iter()
        .filter(move |f| f.offset < window_end && f.offset.saturating_add(f.length) > start)
        .map(move |f| ExtraKeyItem::Mm {
            identifier: &f.identifier,
            offset: (f.offset as i128 - start as i128).clamp(i64::MIN as i128, i64::MAX as i128)
                as i64,
        });
    let salt = extras
        .cache_salt
        .as_deref()
        .filter(|s| start == 0 && !s.is_empty())
        .map(ExtraKeyItem::CacheSalt);
    Ok(lora.into_iter().chain(mm).chain(salt).chain(prompt_embeds))
}

/// What `BlockStored.extra_keys` carries for one block: `None` when the block has no extra keys.
pub fn event_extra_keys<'a>(
    items: impl Iterator<Item = ExtraKeyItem<'a>>,
) -> Option<Vec<EventExtraKey>> {
    let keys: Vec<EventExtraKey> = items.map(|i| EventExtraKey::from_item(&i)).collect();
    (!keys.is_empty()).then_some(keys)
}

/// Hybrid models: the digest a group with block size `group_block_size` publishes
/// for its block `group_index`, given the chain at the hash block size: the chain
/// digest at that group block's last hash-block boundary.
///
/// Returns `None` if `group_block_size` is not a multiple of `hash_block_size`
/// or the chain is too short.
#[must_use]
pub fn group_view_digest(
    chain: &[Digest],
    hash_block_size: usize,
    group_block_size: usize,
    group_index: usize,
) -> Option<Digest> {
    if hash_block_size == 0 || !group_block_size.is_multiple_of(hash_block_size) {
        return None;
    }
    let ratio = group_block_size / hash_block_size;
    let idx = group_index
        .checked_add(1)?
        .checked_mul(ratio)?
        .checked_sub(1)?;
    chain.get(idx).copied()
}
