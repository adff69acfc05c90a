//! SGLang block keys (golden/sglang/README.md is the specification).
//!
//! * ≥ 0.5.6: SHA-256 page chain, `d_i = SHA256(d_{i-1} || u32le(page_i))`,
//!   key = first 8 bytes big-endian (published as `i64`).
//! * ≥ 0.5.18: a `cache_salt` seeds the chain with `SHA256("sglang-cache-salt-v1\0" || salt)`.
//! * ≥ 0.5.22: `kv_events_format = "dynamo"` or a registered LoRA maps every key
//!   through a namespace seed.
//! * 0.4.8 ..= 0.5.5: CPython `hash(tuple(page))`, see [`legacy_page_hash`].
//!
//! An empty `cache_salt` or `extra_key` is no value at all: SGLang normalises
//! both to `None` before they reach the radix tree
//! (`GenerateReqInput._normalize_single_inputs`, `Req.__init__`,
//! `RadixKey.__init__`), so such a request keeps the plain keys
//! ([`request_namespace`]).

use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::types::{BlockKey, TokenId};

const SALT_DOMAIN: &[u8] = b"sglang-cache-salt-v1\0";
const NAMESPACE_DOMAIN: &[u8] = b"sglang-kv-event-namespace-v1";

/// `d_i = SHA256(parent || u32le(page))`; an empty parent is the unsalted first page.
#[must_use]
#[inline]
pub fn page_digest(parent: &Digest, page: &[TokenId]) -> Digest {
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    // Stage the little-endian tokens through a stack buffer to feed SHA-256 in large chunks.
    let mut buf = [0u8; 256];
    for chunk in page.chunks(buf.len() / 4) {
        let mut n = 0;
        for (slot, t) in buf.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&t.to_le_bytes());
            n += 4;
        }
        h.update(buf.get(..n).unwrap_or(&[]));
    }
    Digest::from_32(h.finalize().into())
}

/// `SHA256("sglang-cache-salt-v1\0" || salt)`: the parent of the first page of a salted request.
#[must_use]
pub fn salt_seed(cache_salt: &str) -> Digest {
    let mut h = Sha256::new();
    h.update(SALT_DOMAIN);
    h.update(cache_salt.as_bytes());
    Digest::from_32(h.finalize().into())
}

fn part(h: &mut Sha256, value: Option<&str>) {
    match value {
        None => h.update([0u8]),
        Some(s) => {
            h.update([1u8]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
    }
}

/// `SHA256("sglang-kv-event-namespace-v1" || part(extra_key) || part(cache_salt))`.
#[must_use]
pub fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(NAMESPACE_DOMAIN);
    part(&mut h, extra_key);
    part(&mut h, cache_salt);
    h.finalize().into()
}

/// A request's `cache_salt` / `extra_key` as SGLang keeps it: `value or None`.
#[must_use]
#[inline]
pub fn present(value: Option<&str>) -> Option<&str> {
    value.filter(|v| !v.is_empty())
}

/// The chain seed and namespace seed SGLang (≥ 0.5.22) applies to a request's
/// pages: `(salt_seed(salt), namespace_seed)` after [`present`] on both
/// inputs. The dynamo format namespaces salted and LoRA requests; the
/// default format only a registered LoRA's `extra_key`
/// (`KVCacheEventRecorder._namespace_seed`). Plain requests keep plain keys.
#[must_use]
pub fn request_namespace(
    dynamo: bool,
    extra_key: Option<&str>,
    cache_salt: Option<&str>,
) -> (Option<Digest>, Option<[u8; 32]>) {
    let (extra_key, cache_salt) = (present(extra_key), present(cache_salt));
    let root = cache_salt.map(salt_seed);
    let namespaced = extra_key.is_some() || (dynamo && cache_salt.is_some());
    (
        root,
        namespaced.then(|| namespace_seed(extra_key, cache_salt)),
    )
}

/// `int64_be(SHA256(seed || i64_be(key))[0..8])`.
#[must_use]
#[inline]
pub fn namespaced_key(seed: &[u8; 32], key: BlockKey) -> BlockKey {
    let mut h = Sha256::new();
    h.update(seed);
    h.update(key.0.to_be_bytes());
    Digest::from_32(h.finalize().into()).first8_be()
}

// CPython's tuple hash constants (Objects/tupleobject.c, 64-bit build, xxHash-derived).
const XXPRIME_1: u64 = 11_400_714_785_074_694_791;
const XXPRIME_2: u64 = 14_029_467_366_897_019_727;
const XXPRIME_5: u64 = 2_870_177_450_012_600_261;
const PYHASH_MODULUS: u64 = (1 << 61) - 1;

/// CPython's `hash(int)` for a non-negative int: `n mod (2^61 - 1)`.
#[must_use]
#[inline]
pub const fn py_int_hash(n: u64) -> u64 {
    n % PYHASH_MODULUS
}

/// CPython ≥ 3.8 (64-bit) `hash(tuple_of_nonnegative_ints)`, as the raw 64 bits.
#[must_use]
pub fn py_tuple_hash(items: impl ExactSizeIterator<Item = u64>) -> u64 {
    let len = items.len() as u64;
    let mut acc = XXPRIME_5;
    for item in items {
        acc = acc.wrapping_add(py_int_hash(item).wrapping_mul(XXPRIME_2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(XXPRIME_1);
    }
    acc = acc.wrapping_add(len ^ (XXPRIME_5 ^ 3_527_539));
    if acc == u64::MAX {
        return 1_546_275_796;
    }
    acc
}

/// SGLang 0.4.8 ..= 0.5.5 page key: `hash(tuple(page))`. Not chained: the same page
/// text gets the same key at any position.
#[must_use]
pub fn legacy_page_hash(page: &[TokenId]) -> BlockKey {
    BlockKey(py_tuple_hash(page.iter().map(|&t| u64::from(t))))
}
