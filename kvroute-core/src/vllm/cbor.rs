//! Hand-written canonical CBOR for the one shape vLLM hashes:
//! `(parent: bytes, tokens: tuple[int], extra_keys: None | tuple)`.
//!
//! Canonical here means what `cbor2.dumps(obj, canonical=True)` emits for these
//! types: shortest-form heads and definite lengths. Tuples are arrays, `str` is
//! major type 3, `bytes` major type 2, negative ints major type 1.

use super::ExtraKeyItem;

const MAJOR_UINT: u8 = 0;
const MAJOR_NINT: u8 = 1;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const NULL: u8 = 0xf6;

/// Appends a shortest-form head.
#[inline(always)]
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    if n < 24 {
        out.push(m | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[m | 24, n as u8]);
    } else if n <= 0xffff {
        let b = (n as u16).to_be_bytes();
        out.extend_from_slice(&[m | 25, b[0], b[1]]);
    } else if n <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// Room [`put_head`] needs after its position: it always stores 9 bytes.
pub(super) const HEAD_ROOM: usize = 9;

/// Writes a shortest-form head at `buf[pos..]` and returns the position after it.
///
/// Without branches on the value: token ids spread over a vocabulary mix 3- and
/// 5-byte heads at random, which a branchy encoder mispredicts. It stores a
/// fixed 9 bytes (the caller keeps [`HEAD_ROOM`] bytes free) and advances by the
/// real length; the bytes beyond it are overwritten by what follows.
#[inline(always)]
pub(super) fn put_head(buf: &mut [u8], pos: usize, major: u8, n: u64) -> usize {
    let small = n < 24;
    // 0, 1, 2, 3 for 1, 2, 4, 8 payload bytes, announced by 24 + class.
    let class = u32::from(n > 0xff) + u32::from(n > 0xffff) + u32::from(n > 0xffff_ffff);
    let payload_bits = 8u32 << class;
    let initial = (major << 5) | if small { n as u8 } else { 24 + class as u8 };
    // The payload left-aligned after the initial byte: all of it for up to 4
    // bytes, the first 7 of 8 (the 8th goes to the ninth byte).
    let value = if small {
        0
    } else {
        (n << (64 - payload_bits)) >> 8
    };
    let word = (u64::from(initial) << 56) | value;
    let len = if small {
        1
    } else {
        1 + (payload_bits / 8) as usize
    };
    if let Some(dst) = buf.get_mut(pos..pos + HEAD_ROOM) {
        let (first8, ninth) = dst.split_at_mut(8);
        first8.copy_from_slice(&word.to_be_bytes());
        ninth.copy_from_slice(&[n as u8]);
    }
    pos + len
}

/// Worst-case bytes [`put_plain_tail`] stores for `n` tokens.
pub(super) const fn plain_tail_bound(n: usize) -> usize {
    HEAD_ROOM * (n + 1) + 1 + HEAD_ROOM
}

/// Writes the part of a block without extra keys that follows the parent,
/// `tuple(tokens)` then `None`, at `buf[pos..]`; returns where it ends. The
/// caller keeps [`plain_tail_bound`] bytes free.
#[inline]
pub(super) fn put_plain_tail(buf: &mut [u8], pos: usize, tokens: &[u32]) -> usize {
    let pos = put_tuple_head(buf, pos, tokens.len());
    let pos = put_ids(buf, pos, tokens);
    put_none(buf, pos)
}

/// The head of a `tuple` of `n` items at `buf[pos..]` ([`HEAD_ROOM`] free).
#[inline(always)]
pub(super) fn put_tuple_head(buf: &mut [u8], pos: usize, n: usize) -> usize {
    put_head(buf, pos, MAJOR_ARRAY, n as u64)
}

/// The ids as CBOR unsigned integers at `buf[pos..]` ([`HEAD_ROOM`] bytes
/// free per id and after them).
#[inline(always)]
pub(super) fn put_ids(buf: &mut [u8], mut pos: usize, ids: &[u32]) -> usize {
    for &t in ids {
        pos = put_head(buf, pos, MAJOR_UINT, u64::from(t));
    }
    pos
}

/// `None` at `buf[pos]`.
#[inline(always)]
pub(super) fn put_none(buf: &mut [u8], pos: usize) -> usize {
    if let Some(b) = buf.get_mut(pos) {
        *b = NULL;
    }
    pos + 1
}

/// `array(3)` and the byte-string head of a `P`-byte parent: what precedes
/// the parent in every block.
pub(super) const fn parent_prefix<const P: usize>() -> ([u8; 3], usize) {
    let m = (MAJOR_BYTES << 5) as usize;
    if P < 24 {
        ([(MAJOR_ARRAY << 5) | 3, (m | P) as u8, 0], 2)
    } else {
        // Digests are at most 32 bytes: a one-byte length.
        ([(MAJOR_ARRAY << 5) | 3, (m | 24) as u8, P as u8], 3)
    }
}

#[inline(always)]
fn int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        head(out, MAJOR_UINT, v as u64);
    } else {
        // -1 - v never overflows for v < 0.
        head(out, MAJOR_NINT, (-1 - v) as u64);
    }
}

fn text(out: &mut Vec<u8>, s: &str) {
    head(out, MAJOR_TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    head(out, MAJOR_BYTES, b.len() as u64);
    out.extend_from_slice(b);
}

/// `cbor2.dumps(s)`: the NONE_HASH input.
pub(crate) fn encode_str(out: &mut Vec<u8>, s: &str) {
    text(out, s);
}

fn item(out: &mut Vec<u8>, it: &ExtraKeyItem<'_>) {
    match *it {
        ExtraKeyItem::Lora { name, path } => {
            head(out, MAJOR_ARRAY, 3);
            text(out, "lora");
            text(out, name);
            text(out, path);
        }
        ExtraKeyItem::Mm { identifier, offset } => {
            head(out, MAJOR_ARRAY, 3);
            text(out, "mm");
            text(out, identifier);
            int(out, offset);
        }
        ExtraKeyItem::CacheSalt(salt) => {
            head(out, MAJOR_ARRAY, 2);
            text(out, "cache_salt");
            text(out, salt);
        }
        ExtraKeyItem::PromptEmbeds(digest) => {
            head(out, MAJOR_ARRAY, 2);
            text(out, "prompt_embeds");
            bytes(out, digest);
        }
    }
}

/// Appends `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)`.
///
/// `extra` yields the items of `E`; no items means `E` is `None`. With lookahead
/// tokens the third element is `(E, t1, ..., tL)`.
pub(crate) fn encode_block<'a, T, I>(
    out: &mut Vec<u8>,
    parent: &[u8],
    tokens: &[T],
    extra: I,
    lookahead: Option<&[T]>,
) where
    T: Copy + Into<u64>,
    I: Iterator<Item = ExtraKeyItem<'a>> + Clone,
{
    let start = out.len();
    let end = write_block(out, start, parent, tokens, extra, lookahead);
    out.truncate(end);
}

/// Worst-case bytes of the parent, the token array and the lookahead tokens,
/// plus the slack the 9-byte stores of [`put_head`] need.
fn bound<T>(parent: &[u8], tokens: &[T], lookahead: Option<&[T]>) -> usize {
    let la = lookahead.map_or(0, <[T]>::len);
    // array(3) + bytes head + parent + array head + tokens + array head + null + lookahead + slack
    1 + HEAD_ROOM
        + parent.len()
        + HEAD_ROOM * (tokens.len() + 1)
        + HEAD_ROOM
        + 1
        + HEAD_ROOM * la
        + HEAD_ROOM
}

/// Writes the block's CBOR at `buf[start..]` and returns where it ends.
///
/// `buf` only grows (to the worst-case size) and is never zero-filled again:
/// a caller reusing it as scratch keeps its length, and the bytes past the
/// returned end are left over from the stores and mean nothing. With extra
/// keys `buf` is truncated to the end instead (the items are appended).
pub(crate) fn write_block<'a, T, I>(
    buf: &mut Vec<u8>,
    start: usize,
    parent: &[u8],
    tokens: &[T],
    extra: I,
    lookahead: Option<&[T]>,
) -> usize
where
    T: Copy + Into<u64>,
    I: Iterator<Item = ExtraKeyItem<'a>> + Clone,
{
    let need = start + bound(parent, tokens, lookahead);
    if buf.len() < need {
        buf.resize(need, 0);
    }
    let mut pos = start;
    if let Some(b) = buf.get_mut(pos) {
        *b = (MAJOR_ARRAY << 5) | 3;
    }
    pos += 1;
    pos = put_head(buf, pos, MAJOR_BYTES, parent.len() as u64);
    if let Some(dst) = buf.get_mut(pos..pos + parent.len()) {
        dst.copy_from_slice(parent);
    }
    pos += parent.len();
    pos = put_head(buf, pos, MAJOR_ARRAY, tokens.len() as u64);
    for &t in tokens {
        pos = put_head(buf, pos, MAJOR_UINT, t.into());
    }
    if let Some(la) = lookahead {
        pos = put_head(buf, pos, MAJOR_ARRAY, 1 + la.len() as u64);
    }
    let count = extra.clone().count();
    if count == 0 {
        if let Some(b) = buf.get_mut(pos) {
            *b = NULL;
        }
        pos += 1;
        if let Some(la) = lookahead {
            for &t in la {
                pos = put_head(buf, pos, MAJOR_UINT, t.into());
            }
        }
        return pos;
    }
    // Extra keys are rare and variable-sized: append them the plain way.
    buf.truncate(pos);
    head(buf, MAJOR_ARRAY, count as u64);
    for it in extra {
        item(buf, &it);
    }
    if let Some(la) = lookahead {
        for &t in la {
            head(buf, MAJOR_UINT, t.into());
        }
    }
    buf.len()
}
