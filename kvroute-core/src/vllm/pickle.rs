//! Hand-written pickle (protocol 5, CPython's C pickler) for the one shape vLLM
//! hashes with `--prefix-caching-hash-algo sha256|xxhash`.
//!
//! Layout: `PROTO 5`, one `FRAME` holding everything up to and including `STOP`.
//! Every `bytes`, `str` and non-empty tuple is followed by `MEMOIZE`. The memo is
//! keyed by object identity, so only objects that are the *same Python object*
//! inside one block are back-referenced with `BINGET`: in vLLM that is the tag
//! constants (`"lora"`, `"mm"`, `"cache_salt"`, `"prompt_embeds"`), which are
//! code literals and therefore one interned object each. User strings (LoRA name,
//! path, mm identifiers, salt) are distinct objects, as they are when vLLM builds
//! them from a request — except CPython's string singletons: the empty string and
//! one-character strings below U+0100 are shared objects, so a repeat of one of
//! those inside a block is a back-reference too.

use super::ExtraKeyItem;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const BINBYTES: u8 = b'B';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const EMPTY_TUPLE: u8 = b')';
const NONE: u8 = b'N';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const STOP: u8 = b'.';

/// CPython commits a frame once it reaches 64 KiB; a block whose pickle stays
/// below this needs exactly one frame, which is all this encoder writes.
pub(crate) const MAX_SINGLE_FRAME: usize = 64 * 1024;

/// Identity memo of one pickle stream, reduced to what vLLM's shape can share.
struct Memo {
    next: u32,
    tags: [Option<u32>; 4],
    /// (code point or `u32::MAX` for "", memo index) of singleton strings seen;
    /// empty (no allocation) unless a block carries such strings.
    singletons: Vec<(u32, u32)>,
}

/// The CPython singleton a string is, if any: `u32::MAX` for "", else the code point.
fn singleton_of(s: &str) -> Option<u32> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (None, _) => Some(u32::MAX),
        (Some(c), None) if u32::from(c) < 256 => Some(u32::from(c)),
        _ => None,
    }
}

impl Memo {
    fn new() -> Self {
        Self {
            next: 0,
            tags: [None; 4],
            singletons: Vec::new(),
        }
    }

    /// Writes a user string (memoized), or a back-reference for a repeated singleton.
    fn user_text(&mut self, out: &mut Vec<u8>, s: &str) {
        let Some(code) = singleton_of(s) else {
            text(out, s);
            self.memoize(out);
            return;
        };
        if let Some(&(_, idx)) = self.singletons.iter().find(|(c, _)| *c == code) {
            get(out, idx);
            return;
        }
        self.singletons.push((code, self.next));
        text(out, s);
        self.memoize(out);
    }

    fn memoize(&mut self, out: &mut Vec<u8>) {
        out.push(MEMOIZE);
        self.next += 1;
    }

    /// Writes an interned tag string, or a back-reference if already written.
    fn tag(&mut self, out: &mut Vec<u8>, slot: usize, s: &str) {
        match self.tags.get(slot).copied().flatten() {
            Some(idx) => get(out, idx),
            None => {
                let idx = self.next;
                text(out, s);
                self.memoize(out);
                if let Some(t) = self.tags.get_mut(slot) {
                    *t = Some(idx);
                }
            }
        }
    }
}

fn get(out: &mut Vec<u8>, idx: u32) {
    if idx < 256 {
        out.extend_from_slice(&[BINGET, idx as u8]);
    } else {
        out.push(LONG_BINGET);
        out.extend_from_slice(&idx.to_le_bytes());
    }
}

fn text(out: &mut Vec<u8>, s: &str) {
    if s.len() < 256 {
        out.extend_from_slice(&[SHORT_BINUNICODE, s.len() as u8]);
    } else {
        out.push(BINUNICODE);
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    if b.len() < 256 {
        out.extend_from_slice(&[SHORT_BINBYTES, b.len() as u8]);
    } else {
        out.push(BINBYTES);
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(b);
}

/// `save_long`: the narrowest of BININT1/BININT2/BININT, else LONG1 with the
/// minimal little-endian two's complement.
#[inline(always)]
pub(crate) fn int(out: &mut Vec<u8>, v: i128) {
    if (0..=0xff).contains(&v) {
        out.extend_from_slice(&[BININT1, v as u8]);
    } else if (0..=0xffff).contains(&v) {
        let b = (v as u16).to_le_bytes();
        out.extend_from_slice(&[BININT2, b[0], b[1]]);
    } else if (i128::from(i32::MIN)..=i128::from(i32::MAX)).contains(&v) {
        out.push(BININT);
        out.extend_from_slice(&(v as i32).to_le_bytes());
    } else {
        // bit_length(|v|) / 8 + 1 bytes, trimmed by one for negatives whose
        // top byte is pure sign extension (Python's encode_long).
        let magnitude_bits = 128 - v.unsigned_abs().leading_zeros();
        let mut n = (magnitude_bits / 8 + 1) as usize;
        let le = v.to_le_bytes();
        if v < 0 && n > 1 {
            let top = le.get(n - 1).copied().unwrap_or(0);
            let below = le.get(n - 2).copied().unwrap_or(0);
            if top == 0xff && below & 0x80 != 0 {
                n -= 1;
            }
        }
        out.extend_from_slice(&[LONG1, n as u8]);
        out.extend_from_slice(le.get(..n).unwrap_or(&le));
    }
}

/// One token int as a fixed 9-byte array plus its length (tokens are never negative).
#[inline(always)]
fn token_fixed(v: u64) -> ([u8; 9], usize) {
    let mut b = [0u8; 9];
    let len = if v <= 0xff {
        b[0] = BININT1;
        b[1] = v as u8;
        2
    } else if v <= 0xffff {
        b[0] = BININT2;
        b[1..3].copy_from_slice(&(v as u16).to_le_bytes());
        3
    } else if v <= i32::MAX as u64 {
        b[0] = BININT;
        b[1..5].copy_from_slice(&(v as u32).to_le_bytes());
        5
    } else {
        return ([0; 9], 0);
    };
    (b, len)
}

/// Appends the token ints of a block (BININT* fast path, LONG1 via [`int`]).
#[inline(always)]
fn token_ints<T: Copy + Into<u64>>(out: &mut Vec<u8>, tokens: &[T]) {
    let start = out.len();
    out.resize(start + tokens.len() * 5 + 9, 0);
    let mut pos = start;
    for (i, &t) in tokens.iter().enumerate() {
        let (bytes, len) = token_fixed(t.into());
        if len == 0 {
            // Rare wide ints: finish the rest with the general encoder.
            out.truncate(pos);
            for &rest in tokens.get(i..).unwrap_or(&[]) {
                int(out, i128::from(rest.into()));
            }
            return;
        }
        if let Some(dst) = out.get_mut(pos..pos + 9) {
            dst.copy_from_slice(&bytes);
        }
        pos += len;
    }
    out.truncate(pos);
}

/// Closes a tuple of `len` items whose MARK (for len > 3) is already written.
fn close_tuple(out: &mut Vec<u8>, memo: &mut Memo, len: usize) {
    match len {
        // EMPTY_TUPLE is a singleton: CPython does not memoize it.
        0 => return out.push(EMPTY_TUPLE),
        1..=3 => out.push(TUPLE1 + (len as u8 - 1)),
        _ => out.push(TUPLE),
    }
    memo.memoize(out);
}

fn open_tuple(out: &mut Vec<u8>, len: usize) {
    if len > 3 {
        out.push(MARK);
    }
}

fn frame_start(out: &mut Vec<u8>) -> usize {
    out.extend_from_slice(&[PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0]);
    out.len()
}

fn frame_end(out: &mut Vec<u8>, body_start: usize) {
    out.push(STOP);
    let len = (out.len() - body_start) as u64;
    if let Some(slot) = out.get_mut(body_start - 8..body_start) {
        slot.copy_from_slice(&len.to_le_bytes());
    }
}

/// `pickle.dumps(s, protocol=5)`: the NONE_HASH input.
pub(crate) fn encode_str(out: &mut Vec<u8>, s: &str) {
    let start = frame_start(out);
    text(out, s);
    out.push(MEMOIZE);
    frame_end(out, start);
}

fn item(out: &mut Vec<u8>, memo: &mut Memo, it: &ExtraKeyItem<'_>) {
    match *it {
        ExtraKeyItem::Lora { name, path } => {
            memo.tag(out, 0, "lora");
            memo.user_text(out, name);
            memo.user_text(out, path);
            close_tuple(out, memo, 3);
        }
        ExtraKeyItem::Mm { identifier, offset } => {
            memo.tag(out, 1, "mm");
            memo.user_text(out, identifier);
            int(out, i128::from(offset));
            close_tuple(out, memo, 3);
        }
        ExtraKeyItem::CacheSalt(salt) => {
            memo.tag(out, 2, "cache_salt");
            memo.user_text(out, salt);
            close_tuple(out, memo, 2);
        }
        ExtraKeyItem::PromptEmbeds(digest) => {
            memo.tag(out, 3, "prompt_embeds");
            bytes(out, digest);
            memo.memoize(out);
            close_tuple(out, memo, 2);
        }
    }
}

/// Appends `pickle.dumps((parent, tuple(tokens), extra), protocol=5)`.
///
/// Same arguments as [`super::cbor::encode_block`].
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
    let mut memo = Memo::new();
    let start = frame_start(out);
    bytes(out, parent);
    memo.memoize(out);
    open_tuple(out, tokens.len());
    token_ints(out, tokens);
    close_tuple(out, &mut memo, tokens.len());

    let lookahead_tokens = lookahead;
    if let Some(la) = lookahead_tokens {
        open_tuple(out, 1 + la.len());
    }
    let count = extra.clone().count();
    if count == 0 {
        out.push(NONE);
    } else {
        open_tuple(out, count);
        for it in extra {
            item(out, &mut memo, &it);
        }
        close_tuple(out, &mut memo, count);
    }
    if let Some(la) = lookahead_tokens {
        for &t in la {
            int(out, i128::from(t.into()));
        }
        close_tuple(out, &mut memo, 1 + la.len());
    }
    close_tuple(out, &mut memo, 3);
    frame_end(out, start);
}
