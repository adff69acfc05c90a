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

/// A uint head as a fixed 9-byte array plus its length, so the token loop can do
/// constant-size stores instead of variable-length copies.
#[inline(always)]
fn uint_head_fixed(n: u64) -> ([u8; 9], usize) {
    let mut b = [0u8; 9];
    let len = if n < 24 {
        b[0] = n as u8;
        1
    } else if n <= 0xff {
        b[0] = 24;
        b[1] = n as u8;
        2
    } else if n <= 0xffff {
        b[0] = 25;
        b[1..3].copy_from_slice(&(n as u16).to_be_bytes());
        3
    } else if n <= 0xffff_ffff {
        b[0] = 26;
        b[1..5].copy_from_slice(&(n as u32).to_be_bytes());
        5
    } else {
        b[0] = 27;
        b[1..9].copy_from_slice(&n.to_be_bytes());
        9
    };
    (b, len)
}

/// Appends the token ints (major type 0) of a block.
#[inline(always)]
fn token_ints<T: Copy + Into<u64>>(out: &mut Vec<u8>, tokens: &[T]) {
    let start = out.len();
    out.resize(start + tokens.len() * 9 + 9, 0);
    let mut pos = start;
    for &t in tokens {
        let (bytes, len) = uint_head_fixed(t.into());
        if let Some(dst) = out.get_mut(pos..pos + 9) {
            dst.copy_from_slice(&bytes);
        }
        pos += len;
    }
    out.truncate(pos);
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
    out.push((MAJOR_ARRAY << 5) | 3);
    // Constant-size copies for the two real digest widths.
    match parent.len() {
        32 => {
            out.extend_from_slice(&[(MAJOR_BYTES << 5) | 24, 32]);
            let mut fixed = [0u8; 32];
            fixed.copy_from_slice(parent);
            out.extend_from_slice(&fixed);
        }
        16 => {
            out.push((MAJOR_BYTES << 5) | 16);
            let mut fixed = [0u8; 16];
            fixed.copy_from_slice(parent);
            out.extend_from_slice(&fixed);
        }
        _ => bytes(out, parent),
    }
    head(out, MAJOR_ARRAY, tokens.len() as u64);
    token_ints(out, tokens);
    let lookahead_tokens = lookahead;
    if let Some(la) = lookahead_tokens {
        head(out, MAJOR_ARRAY, 1 + la.len() as u64);
    }
    let count = extra.clone().count();
    if count == 0 {
        out.push(NULL);
    } else {
        head(out, MAJOR_ARRAY, count as u64);
        for it in extra {
            item(out, &it);
        }
    }
    if let Some(la) = lookahead_tokens {
        for &t in la {
            head(out, MAJOR_UINT, t.into());
        }
    }
}
