//! The hot path: the chain of a request without extra keys or lookahead
//! (`extra_keys = None` in every block), the shape of every plain text prompt.
//!
//! Only the first bytes of a block's input depend on the chain:
//! `array(3), bytes(parent)`. The rest, `tuple(tokens), None` (and for
//! SHA-256 the padding, which depends only on the length), is known from the
//! tokens alone. So the blocks are encoded a batch at a time, each behind a
//! gap the size of that prefix, in one loop the CPU can overlap freely; the
//! serial part of the chain is then only "copy the parent into the gap,
//! digest".

use xxhash_rust::xxh3::xxh3_128;

use super::{cbor, hash_block, sha256, ExtraKeyItem, VllmAlgorithm};
use crate::digest::Digest;
use crate::error::HashError;
use crate::types::BlockKey;

/// Ring slots of encoded blocks in [`sha_ring_chain`]; more than
/// [`AHEAD`], so the slot being encoded is never the one being digested.
const RING: usize = 4;

/// How many blocks ahead of the digest [`sha_ring_chain`] encodes.
const AHEAD: usize = 2;

/// Most blocks per batch.
const MAX_BATCH: usize = 16;

/// Scratch bytes a batch may use, bounding it for large block sizes.
const BATCH_BYTES: usize = 16 * 1024;

/// Hashes the full blocks of `tokens` (`block_size` tokens each) chained on
/// `parent`, which is updated after every block. Appends each block's key,
/// and its digest when asked.
///
/// On an error (a pickle over one frame) the blocks before it are appended
/// and `parent` is the last of them.
pub(crate) fn extend_plain(
    algorithm: VllmAlgorithm,
    scratch: &mut Vec<u8>,
    parent: &mut Digest,
    tokens: &[u32],
    block_size: usize,
    out_keys: &mut Vec<BlockKey>,
    mut out_digests: Option<&mut Vec<Digest>>,
) -> Result<(), HashError> {
    if block_size == 0 {
        return Ok(());
    }
    let blocks = tokens.len() / block_size;
    out_keys.reserve(blocks);
    if let Some(ds) = out_digests.as_deref_mut() {
        ds.reserve(blocks);
    }
    match algorithm {
        VllmAlgorithm::Sha256Cbor if parent.len() == 32 => {
            #[cfg(target_arch = "x86_64")]
            {
                let mut p = [0u8; 32];
                p.copy_from_slice(parent.as_bytes());
                let digests = out_digests.as_deref_mut();
                if super::shani::chain(scratch, &mut p, tokens, block_size, out_keys, digests) {
                    *parent = Digest::from_32(p);
                    return Ok(());
                }
            }
            sha_ring_chain(scratch, parent, tokens, block_size, out_keys, out_digests);
        }
        VllmAlgorithm::XxhashCbor if parent.len() == 16 => {
            cbor_chain::<16, false>(scratch, parent, tokens, block_size, out_keys, out_digests);
        }
        _ => {
            for block in tokens.chunks_exact(block_size) {
                let d = hash_block(
                    algorithm,
                    scratch,
                    parent,
                    block,
                    std::iter::empty::<ExtraKeyItem<'_>>(),
                    None,
                )?;
                push(d, out_keys, out_digests.as_deref_mut());
                *parent = d;
            }
        }
    }
    Ok(())
}

#[inline(always)]
fn push(d: Digest, out_keys: &mut Vec<BlockKey>, out_digests: Option<&mut Vec<Digest>>) {
    out_keys.push(d.last8_be());
    if let Some(ds) = out_digests {
        ds.push(d);
    }
}

/// The CBOR chain for a `P`-byte digest: SHA-256 (`SHA`, P = 32) or XXH3-128.
fn cbor_chain<const P: usize, const SHA: bool>(
    scratch: &mut Vec<u8>,
    parent: &mut Digest,
    tokens: &[u32],
    block_size: usize,
    out_keys: &mut Vec<BlockKey>,
    mut out_digests: Option<&mut Vec<Digest>>,
) {
    let (head, head_len) = const { cbor::parent_prefix::<P>() };
    let prefix_len = head_len + P;
    // Worst case of one block's bytes: gap, tail and (SHA-256) the padding.
    let region = prefix_len + cbor::plain_tail_bound(block_size) + if SHA { 72 } else { 0 };
    let batch = (BATCH_BYTES / region).clamp(1, MAX_BATCH);
    let need = batch * region + cbor::HEAD_ROOM;
    if scratch.len() < need {
        scratch.resize(need, 0);
    }
    let mut p = [0u8; P];
    p.copy_from_slice(parent.as_bytes());
    let mut spans = [(0usize, 0usize); MAX_BATCH];
    for chunk in tokens.chunks(batch * block_size) {
        // Encode every block of the batch behind its gap: nothing here waits
        // on a digest.
        let mut n = 0;
        let mut pos = 0;
        for (span, block) in spans.iter_mut().zip(chunk.chunks_exact(block_size)) {
            let tail_end = cbor::put_plain_tail(scratch, pos + prefix_len, block);
            let end = if SHA {
                sha256::pad(scratch, pos, tail_end - pos)
            } else {
                tail_end
            };
            *span = (pos, end);
            pos = end;
            n += 1;
        }
        // The chain: the parent into the gap, then the digest.
        for &(start, end) in spans.iter().take(n) {
            if let Some(gap) = scratch.get_mut(start..start + prefix_len) {
                let (h, rest) = gap.split_at_mut(head_len);
                h.copy_from_slice(head.get(..head_len).unwrap_or(&[]));
                rest.copy_from_slice(&p);
            }
            let input = scratch.get(start..end).unwrap_or(&[]);
            if SHA {
                p.copy_from_slice(&sha256::digest_padded(input));
            } else {
                p.copy_from_slice(&xxh3_128(input).to_be_bytes());
            }
            // vLLM's key: the digest's last 8 bytes, big-endian.
            let mut last8 = [0u8; 8];
            last8.copy_from_slice(&p[P - 8..]);
            out_keys.push(BlockKey(u64::from_be_bytes(last8)));
            if let Some(ds) = out_digests.as_deref_mut() {
                ds.push(digest_of(&p));
            }
        }
    }
    *parent = digest_of(&p);
}

/// The SHA-256 CBOR chain, software-pipelined: block `i + AHEAD` is encoded
/// while block `i`'s compressions run, so the encoding (which needs only the
/// tokens) executes in the shadow of the digest's latency-bound dependency
/// chain instead of after it. It goes in two steps, one after each 64-byte
/// compression is issued: a whole block's encoding (~400 instructions at
/// block 16) does not fit the reorder window beside a compression, and the
/// next compression would wait behind it. The first 64-byte block already
/// holds the parent (bytes 3..35), so no compression can start early.
///
/// XXH3-128 stays on [`cbor_chain`]'s batches: its digest is too short to
/// hide an encoding (18 vs 14 M blocks/s there at block 16).
fn sha_ring_chain(
    scratch: &mut Vec<u8>,
    parent: &mut Digest,
    tokens: &[u32],
    block_size: usize,
    out_keys: &mut Vec<BlockKey>,
    mut out_digests: Option<&mut Vec<Digest>>,
) {
    const P: usize = 32;
    let (head, head_len) = const { cbor::parent_prefix::<P>() };
    let prefix_len = head_len + P;
    // Worst case of one block's bytes: gap, tail and padding, and the spare
    // bytes the branch-free writers store past the end.
    let stride = prefix_len + cbor::plain_tail_bound(block_size) + 72 + cbor::HEAD_ROOM;
    let need = RING * stride;
    if scratch.len() < need {
        scratch.resize(need, 0);
    }
    let mut p = [0u8; P];
    p.copy_from_slice(parent.as_bytes());
    let mut ends = [0usize; RING];
    let blocks = tokens.len() / block_size;
    // Encodes block `i` into `slot` (its ring slot) behind the parent-sized
    // gap, in two steps (the first half of the ids, then the rest): a step
    // is small enough to fit the reorder window beside one compression.
    // `mid` carries the position between the steps; returns where the
    // input ends after the second.
    let encode_step = |slot: &mut [u8], i: usize, phase: usize, mid: usize| -> usize {
        let Some(block) = tokens.get(i * block_size..(i + 1) * block_size) else {
            return 0;
        };
        let half = block.len() / 2;
        if phase == 0 {
            if let Some(h) = slot.get_mut(..head_len) {
                h.copy_from_slice(head.get(..head_len).unwrap_or(&[]));
            }
            let pos = cbor::put_tuple_head(slot, prefix_len, block.len());
            cbor::put_ids(slot, pos, block.get(..half).unwrap_or(&[]))
        } else {
            let pos = cbor::put_ids(slot, mid, block.get(half..).unwrap_or(&[]));
            let tail_end = cbor::put_none(slot, pos);
            sha256::pad(slot, 0, tail_end)
        }
    };
    for (i, (end, slot)) in ends
        .iter_mut()
        .zip(scratch.chunks_exact_mut(stride))
        .enumerate()
        .take(AHEAD.min(blocks))
    {
        let mid = encode_step(slot, i, 0, 0);
        *end = encode_step(slot, i, 1, mid);
    }
    for i in 0..blocks {
        let (cur, next) = slots(scratch, stride, i % RING, (i + AHEAD) % RING);
        if let Some(gap) = cur.get_mut(head_len..prefix_len) {
            gap.copy_from_slice(&p);
        }
        let input = cur.get(..ends[i % RING]).unwrap_or(&[]);
        let ahead = i + AHEAD < blocks;
        let mut phase = 0;
        let mut mid = 0;
        let next_end = &mut ends[(i + AHEAD) % RING];
        let mut step = || {
            if ahead && phase < 2 {
                if phase == 0 {
                    mid = encode_step(next, i + AHEAD, 0, 0);
                } else {
                    *next_end = encode_step(next, i + AHEAD, 1, mid);
                }
                phase += 1;
            }
        };
        p.copy_from_slice(&sha256::digest_padded_with(input, &mut step));
        // The steps a one-block message left.
        step();
        step();
        // vLLM's key: the digest's last 8 bytes, big-endian.
        let mut last8 = [0u8; 8];
        last8.copy_from_slice(&p[P - 8..]);
        out_keys.push(BlockKey(u64::from_be_bytes(last8)));
        if let Some(ds) = out_digests.as_deref_mut() {
            ds.push(digest_of(&p));
        }
    }
    *parent = digest_of(&p);
}

/// Ring slots `a` and `b` (distinct) of `scratch`, `stride` bytes each.
#[inline(always)]
fn slots(scratch: &mut [u8], stride: usize, a: usize, b: usize) -> (&mut [u8], &mut [u8]) {
    let (lo, hi, swap) = if a < b { (a, b, false) } else { (b, a, true) };
    let (left, right) = scratch.split_at_mut(hi * stride);
    let x = left
        .get_mut(lo * stride..(lo + 1) * stride)
        .unwrap_or(&mut []);
    let y = right.get_mut(..stride).unwrap_or(&mut []);
    if swap {
        (y, x)
    } else {
        (x, y)
    }
}

fn digest_of<const P: usize>(p: &[u8; P]) -> Digest {
    Digest::from_slice(p).unwrap_or(Digest::EMPTY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm::none_hash;
    use ciborium::value::{Integer, Value};
    use proptest::prelude::*;
    use sha2::{Digest as _, Sha256};

    /// The straightforward encoding: a ciborium value tree per block, then
    /// sha2 / xxhash-rust over its bytes.
    fn oracle(algorithm: VllmAlgorithm, tokens: &[u32], bs: usize) -> Vec<Vec<u8>> {
        let mut parent = none_hash(algorithm, "0").as_bytes().to_vec();
        let mut digests = Vec::new();
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
            parent = if algorithm == VllmAlgorithm::Sha256Cbor {
                Sha256::digest(&bytes).to_vec()
            } else {
                xxh3_128(&bytes).to_be_bytes().to_vec()
            };
            digests.push(parent.clone());
        }
        digests
    }

    fn token() -> impl Strategy<Value = u32> {
        prop_oneof![
            0u32..24,
            0u32..256,
            0u32..65_536,
            0u32..152_000,
            any::<u32>()
        ]
    }

    proptest! {
        #[test]
        fn chain_matches_ciborium_and_sha2(
            tokens in proptest::collection::vec(token(), 0..700),
            bs in prop_oneof![1usize..40, Just(16usize), Just(64usize), 100usize..300],
            sha in any::<bool>(),
            split in any::<prop::sample::Index>(),
        ) {
            let algorithm = if sha { VllmAlgorithm::Sha256Cbor } else { VllmAlgorithm::XxhashCbor };
            let want = oracle(algorithm, &tokens, bs);
            // Two calls, the second continuing the first's chain and scratch.
            let blocks = tokens.len() / bs;
            let cut = split.index(blocks + 1) * bs;
            let mut parent = none_hash(algorithm, "0");
            let mut scratch = Vec::new();
            let (mut keys, mut digests) = (Vec::new(), Vec::new());
            for part in [&tokens[..cut], &tokens[cut..blocks * bs]] {
                extend_plain(algorithm, &mut scratch, &mut parent, part, bs, &mut keys, Some(&mut digests))
                    .expect("cbor never fails");
            }
            let got: Vec<Vec<u8>> = digests.iter().map(|d| d.as_bytes().to_vec()).collect();
            prop_assert_eq!(&got, &want);
            let want_keys: Vec<BlockKey> = digests.iter().map(Digest::last8_be).collect();
            prop_assert_eq!(keys, want_keys);
            if let Some(last) = want.last() {
                prop_assert_eq!(parent.as_bytes(), last.as_slice());
            }
            // The portable SHA-256 chain, which the dispatch above skips on
            // CPUs with SHA-NI.
            if sha {
                let mut parent = none_hash(algorithm, "0");
                let (mut keys, mut portable) = (Vec::new(), Vec::new());
                sha_ring_chain(&mut scratch, &mut parent, &tokens[..blocks * bs], bs, &mut keys, Some(&mut portable));
                prop_assert_eq!(&portable, &digests);
                let want_keys: Vec<BlockKey> = digests.iter().map(Digest::last8_be).collect();
                prop_assert_eq!(keys, want_keys);
            }
        }
    }
}
