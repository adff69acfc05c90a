//! SHA-256 of a message already sitting in a reusable buffer: the padding is
//! written in place after it and the 64-byte blocks go straight to sha2's
//! compression function (SHA-NI where the CPU has it).
//!
//! sha2's buffered `Digest` API would copy the message's tail into its own
//! block buffer, pad it there and keep a byte counter; for a ~100-byte block
//! input that bookkeeping costs about as much as the CBOR encoding.

use sha2::compress256;
use sha2::digest::generic_array::GenericArray;

/// The initial hash value H(0) of FIPS 180-4, section 5.3.3 (also the
/// SHA-NI chain's, `shani.rs`).
pub(super) const IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// The padded length of a `len`-byte message: the 0x80 marker and the 64-bit
/// bit length appended, rounded up to whole 64-byte blocks.
#[inline]
pub(crate) const fn padded_len(len: usize) -> usize {
    (len + 9).div_ceil(64) * 64
}

/// SHA-256 of `buf[..len]`. Overwrites up to 72 bytes after the message with
/// the padding, growing `buf` (zero-filled) only if it is shorter than that.
#[inline]
pub(crate) fn digest_in_place(buf: &mut Vec<u8>, len: usize) -> [u8; 32] {
    let total = padded_len(len);
    let room = total.max(len + PAD_ROOM);
    if buf.len() < room {
        buf.resize(room, 0);
    }
    pad(buf, 0, len);
    digest_padded(buf.get(..total).unwrap_or(&[]))
}

/// Writes the padding of the `len`-byte message at `buf[start..]` after it;
/// returns where the padded message ends (`start + padded_len(len)`).
///
/// `buf` must hold [`PAD_ROOM`] bytes after the message and reach the padded
/// end: the zeros are stored as one fixed 64-byte run (no `memset` call for a
/// few dozen bytes), which may run past the padded end.
#[inline]
pub(crate) fn pad(buf: &mut [u8], start: usize, len: usize) -> usize {
    let msg_end = start + len;
    let end = start + padded_len(len);
    if let Some(room) = buf.get_mut(msg_end..msg_end + PAD_ROOM) {
        let (marker, zeros) = room.split_at_mut(1);
        marker.copy_from_slice(&[0x80]);
        zeros.copy_from_slice(&[0u8; PAD_ROOM - 1]);
    }
    if let Some(length) = buf.get_mut(end - 8..end) {
        length.copy_from_slice(&(len as u64).wrapping_mul(8).to_be_bytes());
    }
    end
}

/// Bytes [`pad`] stores after a message: the marker and 64 zeros, which
/// covers the zeros of every padding (at most 63) and reaches the length.
pub(crate) const PAD_ROOM: usize = 65;

/// SHA-256 of an already padded message (a whole number of 64-byte blocks).
#[inline]
pub(crate) fn digest_padded(padded: &[u8]) -> [u8; 32] {
    digest_padded_with(padded, || {})
}

/// [`digest_padded`], calling `between` after each 64-byte block's
/// compression has been issued: work independent of the digest placed there
/// overlaps the compressions' dependency chain.
#[inline]
pub(crate) fn digest_padded_with(padded: &[u8], mut between: impl FnMut()) -> [u8; 32] {
    let mut state = IV;
    for block in padded.chunks_exact(64) {
        compress256(
            &mut state,
            std::slice::from_ref(GenericArray::from_slice(block)),
        );
        between();
    }
    let mut out = [0u8; 32];
    for (o, w) in out.chunks_exact_mut(4).zip(state) {
        o.copy_from_slice(&w.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sha2::{Digest as _, Sha256};

    proptest! {
        /// Against sha2's own buffered API, over every padding case (the
        /// length field in the same block or the next) and leftover bytes
        /// in the buffer past the message.
        #[test]
        fn matches_sha2(
            msg in proptest::collection::vec(any::<u8>(), 0..300),
            junk in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut buf = msg.clone();
            buf.extend_from_slice(&junk);
            let got = digest_in_place(&mut buf, msg.len());
            let want: [u8; 32] = Sha256::digest(&msg).into();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn every_length_around_the_padding_boundaries() {
        let msg: Vec<u8> = (0..200u8).collect();
        let mut buf = Vec::new();
        for len in 0..msg.len() {
            buf.clear();
            buf.extend_from_slice(&msg);
            let want: [u8; 32] = Sha256::digest(&msg[..len]).into();
            assert_eq!(digest_in_place(&mut buf, len), want, "length {len}");
        }
    }

    #[test]
    fn known_answer_abc() {
        let mut buf = b"abc".to_vec();
        assert_eq!(
            hex::encode(digest_in_place(&mut buf, 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
