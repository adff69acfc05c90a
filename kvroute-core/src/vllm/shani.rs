//! The sha256_cbor chain of a plain prompt with the x86 SHA extensions,
//! written out so that two things sha2's `compress256` cannot do happen:
//!
//! - **The next block is encoded between the rounds.** A compression is a
//!   latency-bound chain of 32 `sha256rnds2` (4 cycles each on Zen 3) with
//!   idle integer ports beside it. Block `i + 1`'s CBOR (which needs only the
//!   tokens) is written a quarter at a time after every 16 rounds of block
//!   `i`, so the encoding sits next to the rounds in program order and runs
//!   in their shadow; after an opaque call it would queue behind them in the
//!   reorder buffer. (One id after every 4 rounds ran as fast on a quiet
//!   core but fell to half speed under load; a quarter block per 16 rounds
//!   held up.)
//! - **The digest never goes through memory.** The first 64 bytes of a
//!   block's input are `83 58 20`, the parent's 32 bytes and the first 29
//!   bytes of the tokens: its message words are the parent's state words
//!   shifted by one byte, built in registers from the finished state instead
//!   of a store, a misaligned reload and a byte swap.
//!
//! Dispatch checks the CPU once ([`available`]); elsewhere, or without the
//! extensions, [`super::plain`]'s portable chain runs. The proptest below
//! holds this against ciborium + sha2.
//!
//! The only `unsafe` is the call of the `#[target_feature]` function after
//! the features were detected; the intrinsics themselves are safe inside it
//! and the buffers are slices, so every access is bounds-checked.

use std::arch::x86_64::{
    __m128i, _mm_add_epi32, _mm_alignr_epi8, _mm_blend_epi16, _mm_extract_epi64, _mm_or_si128,
    _mm_set_epi32, _mm_set_epi64x, _mm_sha256msg1_epu32, _mm_sha256msg2_epu32,
    _mm_sha256rnds2_epu32, _mm_shuffle_epi32, _mm_shuffle_epi8, _mm_slli_epi32, _mm_srli_epi32,
    _mm_srli_si128,
};
use std::sync::OnceLock;

use super::cbor;
use super::sha256::IV;
use crate::digest::Digest;
use crate::types::BlockKey;

/// True if this CPU has SHA-NI and the SSE levels the round code uses.
/// Detected on the first call and cached.
pub(super) fn available() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::arch::is_x86_feature_detected!("sha")
            && std::arch::is_x86_feature_detected!("sse2")
            && std::arch::is_x86_feature_detected!("ssse3")
            && std::arch::is_x86_feature_detected!("sse4.1")
    })
}

/// Hashes the full blocks of `tokens` chained on `parent` (a SHA-256
/// digest, updated to the last block's), appending each key and, when
/// asked, each digest. Returns `false`, touching nothing, if the CPU lacks
/// the extensions ([`available`]).
pub(super) fn chain(
    scratch: &mut Vec<u8>,
    parent: &mut [u8; 32],
    tokens: &[u32],
    block_size: usize,
    out_keys: &mut Vec<BlockKey>,
    out_digests: Option<&mut Vec<Digest>>,
) -> bool {
    if !available() || block_size == 0 {
        return available();
    }
    let stride = slot_len(block_size);
    if scratch.len() < 2 * stride + 64 {
        scratch.resize(2 * stride + 64, 0);
    }
    let skew = (64 - scratch.as_ptr() as usize % 64) % 64;
    // Slots on cache-line boundaries, so a 16-byte message load never
    // straddles two lines.
    let Some(scratch) = scratch.get_mut(skew..skew + 2 * stride) else {
        return false;
    };
    // SAFETY: `available()` has just confirmed that the CPU supports every
    // feature `chain_sha_ni` is compiled for (sha, sse2, ssse3, sse4.1).
    unsafe {
        chain_sha_ni(
            scratch,
            stride,
            parent,
            tokens,
            block_size,
            out_keys,
            out_digests,
        );
    }
    true
}

/// Bytes of one ring slot: a block's input from message byte 32 on (the last
/// three parent bytes, left zero, then the tokens' CBOR and the padding),
/// plus the spare bytes the fixed-width stores write past the end.
const fn slot_len(block_size: usize) -> usize {
    // 3 parent bytes, tuple head (9-byte store), ids (8-byte stores, 5 used),
    // null, the padding (at most 72) and its 64-byte zero run, rounded to
    // whole 64-byte blocks.
    (3 + cbor::HEAD_ROOM + 5 * block_size + 8 + 1 + 8 + 72 + 64).div_ceil(64) * 64
}

/// `padded_len` of [`super::sha256`]: the message, its 0x80 marker and the
/// 64-bit bit length, in whole 64-byte blocks.
const fn padded_len(len: usize) -> usize {
    (len + 9).div_ceil(64) * 64
}

/// FIPS 180-4 section 4.2.2, four round constants per group of rounds.
const K: [[u32; 4]; 16] = [
    [0x428a_2f98, 0x7137_4491, 0xb5c0_fbcf, 0xe9b5_dba5],
    [0x3956_c25b, 0x59f1_11f1, 0x923f_82a4, 0xab1c_5ed5],
    [0xd807_aa98, 0x1283_5b01, 0x2431_85be, 0x550c_7dc3],
    [0x72be_5d74, 0x80de_b1fe, 0x9bdc_06a7, 0xc19b_f174],
    [0xe49b_69c1, 0xefbe_4786, 0x0fc1_9dc6, 0x240c_a1cc],
    [0x2de9_2c6f, 0x4a74_84aa, 0x5cb0_a9dc, 0x76f9_88da],
    [0x983e_5152, 0xa831_c66d, 0xb003_27c8, 0xbf59_7fc7],
    [0xc6e0_0bf3, 0xd5a7_9147, 0x06ca_6351, 0x1429_2967],
    [0x27b7_0a85, 0x2e1b_2138, 0x4d2c_6dfc, 0x5338_0d13],
    [0x650a_7354, 0x766a_0abb, 0x81c2_c92e, 0x9272_2c85],
    [0xa2bf_e8a1, 0xa81a_664b, 0xc24b_8b70, 0xc76c_51a3],
    [0xd192_e819, 0xd699_0624, 0xf40e_3585, 0x106a_a070],
    [0x19a4_c116, 0x1e37_6c08, 0x2748_774c, 0x34b0_bcb5],
    [0x391c_0cb3, 0x4ed8_aa4a, 0x5b9c_ca4f, 0x682e_6ff3],
    [0x748f_82ee, 0x78a5_636f, 0x84c8_7814, 0x8cc7_0208],
    [0x90be_fffa, 0xa450_6ceb, 0xbef9_a3f7, 0xc671_78f2],
];

/// Four rounds: `cdgh`/`abef` are the state in the instructions' layout
/// (lanes high to low A B E F and C D G H), `w` the next four message words.
macro_rules! rounds4 {
    ($abef:ident, $cdgh:ident, $w:expr, $k:expr) => {{
        let k = $k;
        let wk = _mm_add_epi32(
            $w,
            _mm_set_epi32(k[3] as i32, k[2] as i32, k[1] as i32, k[0] as i32),
        );
        $cdgh = _mm_sha256rnds2_epu32($cdgh, $abef, wk);
        $abef = _mm_sha256rnds2_epu32($abef, $cdgh, _mm_shuffle_epi32(wk, 0x0e));
    }};
}

/// The next four message words from the previous sixteen (`w0` oldest).
macro_rules! schedule {
    ($w0:expr, $w1:expr, $w2:expr, $w3:expr) => {
        _mm_sha256msg2_epu32(
            _mm_add_epi32(_mm_sha256msg1_epu32($w0, $w1), _mm_alignr_epi8($w3, $w2, 4)),
            $w3,
        )
    };
}

/// One compression of the message words `w0..w3` (W0..W15) into the state,
/// running `$between` after every fourth group of four rounds.
macro_rules! compress {
    ($abef:ident, $cdgh:ident, $w0:expr, $w1:expr, $w2:expr, $w3:expr, $between:expr) => {{
        let (save_abef, save_cdgh) = ($abef, $cdgh);
        let (mut w0, mut w1, mut w2, mut w3) = ($w0, $w1, $w2, $w3);
        rounds4!($abef, $cdgh, w0, K[0]);
        rounds4!($abef, $cdgh, w1, K[1]);
        rounds4!($abef, $cdgh, w2, K[2]);
        rounds4!($abef, $cdgh, w3, K[3]);
        $between;
        // Groups 4..16, the words rotating through w0..w3.
        w0 = schedule!(w0, w1, w2, w3);
        rounds4!($abef, $cdgh, w0, K[4]);
        w1 = schedule!(w1, w2, w3, w0);
        rounds4!($abef, $cdgh, w1, K[5]);
        w2 = schedule!(w2, w3, w0, w1);
        rounds4!($abef, $cdgh, w2, K[6]);
        w3 = schedule!(w3, w0, w1, w2);
        rounds4!($abef, $cdgh, w3, K[7]);
        $between;
        w0 = schedule!(w0, w1, w2, w3);
        rounds4!($abef, $cdgh, w0, K[8]);
        w1 = schedule!(w1, w2, w3, w0);
        rounds4!($abef, $cdgh, w1, K[9]);
        w2 = schedule!(w2, w3, w0, w1);
        rounds4!($abef, $cdgh, w2, K[10]);
        w3 = schedule!(w3, w0, w1, w2);
        rounds4!($abef, $cdgh, w3, K[11]);
        $between;
        w0 = schedule!(w0, w1, w2, w3);
        rounds4!($abef, $cdgh, w0, K[12]);
        w1 = schedule!(w1, w2, w3, w0);
        rounds4!($abef, $cdgh, w1, K[13]);
        w2 = schedule!(w2, w3, w0, w1);
        rounds4!($abef, $cdgh, w2, K[14]);
        w3 = schedule!(w3, w0, w1, w2);
        rounds4!($abef, $cdgh, w3, K[15]);
        $between;
        $abef = _mm_add_epi32($abef, save_abef);
        $cdgh = _mm_add_epi32($cdgh, save_cdgh);
    }};
}

/// Calls of `$between` per compression in [`compress`].
const STEPS_PER_COMPRESSION: usize = 4;

/// The CBOR of one block's tokens written into its slot a few ids at a
/// time, between the rounds of the block before it.
struct Encoder<'t> {
    ids: &'t [u32],
    /// Ids written so far.
    done: usize,
    /// Where the next byte goes in the slot.
    pos: usize,
    /// Ids per step: the block's ids spread over the round groups of the
    /// block being compressed (one, unless most ids are one-byte heads).
    per_step: usize,
}

impl<'t> Encoder<'t> {
    /// Starts block `ids` in `slot`, to be spread over `steps` calls of
    /// [`Encoder::step`].
    #[inline(always)]
    fn start(slot: &mut [u8], ids: &'t [u32], steps: usize) -> Self {
        // Message bytes 32..35 (the parent's last three): zero here, so the
        // first word loaded from the slot is the first CBOR byte alone and
        // the parent's bits are or-ed in from the state.
        if let Some(z) = slot.get_mut(..3) {
            z.copy_from_slice(&[0; 3]);
        }
        let pos = cbor::put_tuple_head(slot, 3, ids.len());
        Self {
            ids,
            done: 0,
            pos,
            per_step: ids.len().div_ceil(steps.max(1)),
        }
    }

    /// Writes the next ids due.
    #[inline(always)]
    fn step(&mut self, slot: &mut [u8]) {
        for _ in 0..self.per_step {
            if let Some(&t) = self.ids.get(self.done) {
                self.pos = put_id(slot, self.pos, t);
                self.done += 1;
            }
        }
    }

    /// Writes the remaining ids, `None` and the SHA-256 padding; returns how
    /// many 64-byte blocks the message has.
    #[inline(always)]
    fn finish(mut self, slot: &mut [u8]) -> usize {
        while let Some(&t) = self.ids.get(self.done) {
            self.pos = put_id(slot, self.pos, t);
            self.done += 1;
        }
        let tail_end = self.pos + 1;
        let msg_len = 32 + tail_end;
        let total = padded_len(msg_len);
        let end = total - 32;
        // None, the marker, then 64 zeros: more than the padding needs.
        if let Some(d) = slot.get_mut(self.pos..self.pos + 2) {
            d.copy_from_slice(&[0xf6, 0x80]);
        }
        if let Some(z) = slot.get_mut(tail_end + 1..tail_end + 65) {
            z.copy_from_slice(&[0; 64]);
        }
        if let Some(l) = slot.get_mut(end - 8..end) {
            l.copy_from_slice(&(msg_len as u64 * 8).to_be_bytes());
        }
        total / 64
    }
}

/// Per head class (value < 24, < 2^8, < 2^16, < 2^32): the initial byte in
/// the top byte of the head's 8-byte store, the shift that left-aligns the
/// value after it (for a value under 24 the value is the initial byte), and
/// the head's length.
const ID_INITIAL: [u64; 4] = [0, 0x18 << 56, 0x19 << 56, 0x1a << 56];
const ID_SHIFT: [u8; 4] = [56, 48, 40, 24];
const ID_LEN: [u8; 4] = [1, 2, 3, 5];

/// A token id as a shortest-form CBOR unsigned integer at `slot[pos..]`,
/// without branches on its value (ids over a vocabulary mix 3- and 5-byte
/// heads at random): one 8-byte store, advancing by the head's length.
#[inline(always)]
fn put_id(slot: &mut [u8], pos: usize, t: u32) -> usize {
    let class = usize::from(t >= 24) + usize::from(t > 0xff) + usize::from(t > 0xffff);
    let class = class & 3;
    let word = ID_INITIAL[class] | (u64::from(t) << ID_SHIFT[class]);
    if let Some(d) = slot.get_mut(pos..pos + 8) {
        d.copy_from_slice(&word.to_be_bytes());
    }
    pos + usize::from(ID_LEN[class])
}

/// `bytes[..16]` as four big-endian message words.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn load_be(bytes: &[u8]) -> __m128i {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    if let (Some(l), Some(h)) = (bytes.get(..8), bytes.get(8..16)) {
        lo.copy_from_slice(l);
        hi.copy_from_slice(h);
    }
    let v = _mm_set_epi64x(i64::from_le_bytes(hi), i64::from_le_bytes(lo));
    // Byte-swap each 32-bit lane.
    _mm_shuffle_epi8(
        v,
        _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203),
    )
}

/// `bytes[at..at + 64]` as message words W0..W15.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn load_block(bytes: &[u8], at: usize) -> [__m128i; 4] {
    let b = bytes.get(at..at + 64).unwrap_or(&[]);
    [
        load_be(b),
        load_be(b.get(16..).unwrap_or(&[])),
        load_be(b.get(32..).unwrap_or(&[])),
        load_be(b.get(48..).unwrap_or(&[])),
    ]
}

/// The digest's words, lanes low to high: `[A, B, C, D]` and `[E, F, G, H]`.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn linear(abef: __m128i, cdgh: __m128i) -> (__m128i, __m128i) {
    let feba = _mm_shuffle_epi32(abef, 0x1b);
    let dchg = _mm_shuffle_epi32(cdgh, 0xb1);
    (
        _mm_blend_epi16(feba, dchg, 0xf0),
        _mm_alignr_epi8(dchg, feba, 8),
    )
}

/// The digest as bytes, from its linear words.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn digest_bytes(d0: __m128i, d1: __m128i) -> [u8; 32] {
    let mut out = [0u8; 32];
    let words = [
        _mm_extract_epi64(d0, 0),
        _mm_extract_epi64(d0, 1),
        _mm_extract_epi64(d1, 0),
        _mm_extract_epi64(d1, 1),
    ];
    for (o, pair) in out.chunks_exact_mut(8).zip(words) {
        // Each i64 holds two words, the lower-numbered in the low half.
        let pair = pair as u64;
        o[..4].copy_from_slice(&(pair as u32).to_be_bytes());
        o[4..].copy_from_slice(&((pair >> 32) as u32).to_be_bytes());
    }
    out
}

/// Linear digest words from digest bytes.
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn words_of(p: &[u8; 32]) -> (__m128i, __m128i) {
    (load_be(&p[..16]), load_be(&p[16..]))
}

/// The chain itself; see the module documentation. `scratch` holds two
/// slots of `stride` bytes: the block being compressed and the next one.
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn chain_sha_ni(
    scratch: &mut [u8],
    stride: usize,
    parent: &mut [u8; 32],
    tokens: &[u32],
    block_size: usize,
    out_keys: &mut Vec<BlockKey>,
    mut out_digests: Option<&mut Vec<Digest>>,
) {
    let blocks = tokens.len() / block_size;
    if blocks == 0 {
        return;
    }
    let iv_abef = _mm_set_epi32(IV[0] as i32, IV[1] as i32, IV[4] as i32, IV[5] as i32);
    let iv_cdgh = _mm_set_epi32(IV[2] as i32, IV[3] as i32, IV[6] as i32, IV[7] as i32);
    // array(3) and bytes(32): with the parent's first byte, message word 0.
    let prefix = _mm_set_epi32(0x0083_5820, 0, 0, 0);
    let (mut d0, mut d1) = words_of(parent);
    let (slot_a, slot_b) = scratch.split_at_mut(stride);
    let mut cur: &mut [u8] = slot_a;
    let mut next: &mut [u8] = slot_b;
    let enc = Encoder::start(cur, tokens.get(..block_size).unwrap_or(&[]), 1);
    let mut cur_blocks = enc.finish(cur);
    for i in 0..blocks {
        let following = tokens
            .get((i + 1) * block_size..(i + 2) * block_size)
            .unwrap_or(&[]);
        let mut enc = Encoder::start(next, following, STEPS_PER_COMPRESSION * cur_blocks);
        // W0..W7 are the prefix and the parent shifted right by one byte,
        // W8 the parent's last byte before the slot's first.
        let w0 = _mm_or_si128(
            _mm_srli_epi32(d0, 24),
            _mm_slli_epi32(_mm_alignr_epi8(d0, prefix, 12), 8),
        );
        let w1 = _mm_or_si128(
            _mm_srli_epi32(d1, 24),
            _mm_slli_epi32(_mm_alignr_epi8(d1, d0, 12), 8),
        );
        let w2 = _mm_or_si128(
            load_be(cur.get(..16).unwrap_or(&[])),
            _mm_srli_si128(_mm_slli_epi32(d1, 8), 12),
        );
        let w3 = load_be(cur.get(16..32).unwrap_or(&[]));
        let (mut abef, mut cdgh) = (iv_abef, iv_cdgh);
        compress!(abef, cdgh, w0, w1, w2, w3, enc.step(next));
        for b in 1..cur_blocks {
            let [m0, m1, m2, m3] = load_block(cur, 64 * b - 32);
            compress!(abef, cdgh, m0, m1, m2, m3, enc.step(next));
        }
        cur_blocks = enc.finish(next);
        (d0, d1) = linear(abef, cdgh);
        // vLLM's key: the digest's last 8 bytes (G, H) big-endian.
        let gh = _mm_extract_epi64(d1, 1) as u64;
        out_keys.push(BlockKey(gh.rotate_left(32)));
        if let Some(ds) = out_digests.as_deref_mut() {
            ds.push(Digest::from_32(digest_bytes(d0, d1)));
        }
        std::mem::swap(&mut cur, &mut next);
    }
    *parent = digest_bytes(d0, d1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ciborium::value::{Integer, Value};
    use proptest::prelude::*;
    use sha2::{Digest as _, Sha256};

    /// This module is only worth its `unsafe` where it runs: a machine
    /// without SHA-NI cannot test it and says so, unless told to skip.
    fn require_sha_ni() -> bool {
        if available() {
            return true;
        }
        assert!(
            std::env::var_os("KVROUTE_SKIP_SHA_NI_TESTS").is_some(),
            "this CPU lacks SHA-NI, so the SHA-NI chain cannot be tested here; \
             set KVROUTE_SKIP_SHA_NI_TESTS=1 to skip these tests knowingly"
        );
        false
    }

    /// ciborium's encoding of each block and sha2's digest of it.
    fn oracle(parent: &[u8; 32], tokens: &[u32], bs: usize) -> Vec<[u8; 32]> {
        let mut parent = parent.to_vec();
        let mut out = Vec::new();
        for block in tokens.chunks_exact(bs) {
            let value = Value::Array(vec![
                Value::Bytes(parent.clone()),
                Value::Array(
                    block
                        .iter()
                        .map(|&t| Value::Integer(Integer::from(t)))
                        .collect(),
                ),
                Value::Null,
            ]);
            let mut bytes = Vec::new();
            ciborium::into_writer(&value, &mut bytes).expect("in-memory write");
            let d: [u8; 32] = Sha256::digest(&bytes).into();
            parent = d.to_vec();
            out.push(d);
        }
        out
    }

    fn token() -> impl Strategy<Value = u32> {
        prop_oneof![
            0u32..24,
            24u32..256,
            256u32..65_536,
            65_536u32..152_000,
            any::<u32>()
        ]
    }

    proptest! {
        /// Random parents, ids over the whole u32 range (all head lengths),
        /// block sizes giving one to many 64-byte blocks per message, and a
        /// scratch reused across two calls with junk left in it.
        #[test]
        fn matches_ciborium_and_sha2(
            parent in any::<[u8; 32]>(),
            tokens in proptest::collection::vec(token(), 0..600),
            bs in prop_oneof![1usize..40, Just(16usize), Just(64usize), 100usize..260],
            split in any::<prop::sample::Index>(),
            junk in any::<u8>(),
        ) {
            if !require_sha_ni() {
                return Ok(());
            }
            let want = oracle(&parent, &tokens, bs);
            let blocks = tokens.len() / bs;
            let cut = split.index(blocks + 1) * bs;
            let mut p = parent;
            let mut scratch = vec![junk; 7];
            let (mut keys, mut digests) = (Vec::new(), Vec::new());
            for part in [&tokens[..cut], &tokens[cut..blocks * bs]] {
                prop_assert!(chain(&mut scratch, &mut p, part, bs, &mut keys, Some(&mut digests)));
            }
            let got: Vec<[u8; 32]> = digests
                .iter()
                .map(|d| d.as_bytes().try_into().expect("32-byte digest"))
                .collect();
            prop_assert_eq!(&got, &want);
            let want_keys: Vec<BlockKey> = want
                .iter()
                .map(|d| BlockKey(u64::from_be_bytes(d[24..].try_into().expect("8 bytes"))))
                .collect();
            prop_assert_eq!(keys, want_keys);
            prop_assert_eq!(p, *want.last().unwrap_or(&parent));
        }
    }

    /// Every message length from one to three 64-byte blocks, across both
    /// padding cases (length field in the last block or a block of its own).
    #[test]
    fn every_padding_boundary() {
        if !require_sha_ni() {
            return;
        }
        let parent = [0xa5u8; 32];
        for bs in 1..=40usize {
            for big in [0u32, 30, 300, 70_000] {
                let tokens: Vec<u32> = (0..3 * bs as u32).map(|i| i % 7 + big).collect();
                let mut p = parent;
                let (mut keys, mut digests) = (Vec::new(), Vec::new());
                assert!(chain(
                    &mut Vec::new(),
                    &mut p,
                    &tokens,
                    bs,
                    &mut keys,
                    Some(&mut digests)
                ));
                let got: Vec<[u8; 32]> = digests
                    .iter()
                    .map(|d| d.as_bytes().try_into().expect("32-byte digest"))
                    .collect();
                assert_eq!(
                    got,
                    oracle(&parent, &tokens, bs),
                    "block size {bs}, ids from {big}"
                );
            }
        }
    }
}
