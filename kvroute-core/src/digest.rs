//! Full chain digests: what the engines chain on, of which events carry only 64 bits.

use std::fmt;

use crate::types::BlockKey;

/// The full hash of one block (or a chain root), up to 32 bytes, stored inline.
///
/// * vLLM `sha256*`: 32 bytes; `xxhash*`: 16 bytes (XXH3-128, big-endian).
/// * SGLang ≥ 0.5.6: the 32-byte page SHA-256.
/// * TensorRT-LLM, re-key, SGLang legacy: the 8-byte key itself (big-endian).
/// * Empty (`len() == 0`): "no parent" (SGLang's first page, re-key's first block).
///
/// Keeping the full digest matters because vLLM and SGLang chain on it while their
/// events publish only a 64-bit key derived from it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Digest {
    bytes: [u8; 32],
    len: u8,
}

impl Digest {
    /// The empty digest ("no parent").
    pub const EMPTY: Digest = Digest {
        bytes: [0; 32],
        len: 0,
    };

    /// Copies up to 32 bytes; `None` if `bytes` is longer.
    #[must_use]
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        let mut out = Self::EMPTY;
        out.bytes.get_mut(..bytes.len())?.copy_from_slice(bytes);
        out.len = u8::try_from(bytes.len()).ok()?;
        Some(out)
    }

    /// A 32-byte digest.
    #[must_use]
    pub const fn from_32(bytes: [u8; 32]) -> Self {
        Self { bytes, len: 32 }
    }

    /// A 16-byte digest.
    #[must_use]
    pub fn from_16(bytes: [u8; 16]) -> Self {
        let mut out = Self::EMPTY;
        out.bytes[..16].copy_from_slice(&bytes);
        out.len = 16;
        out
    }

    /// An 8-byte digest holding a 64-bit key, big-endian.
    #[must_use]
    pub fn from_u64(key: u64) -> Self {
        let mut out = Self::EMPTY;
        out.bytes[..8].copy_from_slice(&key.to_be_bytes());
        out.len = 8;
        out
    }

    /// The digest bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// Number of bytes (0 for the empty digest).
    #[must_use]
    pub const fn len(&self) -> usize {
        self.len as usize
    }

    /// True for the "no parent" digest.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// vLLM's event key: the last 8 bytes read big-endian (0 if shorter than 8 bytes).
    #[must_use]
    pub fn last8_be(&self) -> BlockKey {
        let b = self.as_bytes();
        let mut key = [0u8; 8];
        if let Some(tail) = b.len().checked_sub(8).and_then(|start| b.get(start..)) {
            key.copy_from_slice(tail);
        }
        BlockKey(u64::from_be_bytes(key))
    }

    /// SGLang's event key: the first 8 bytes read big-endian (0 if shorter).
    #[must_use]
    pub fn first8_be(&self) -> BlockKey {
        let mut key = [0u8; 8];
        if let Some(head) = self.as_bytes().get(..8) {
            key.copy_from_slice(head);
        }
        BlockKey(u64::from_be_bytes(key))
    }

    /// Lowercase hex of the bytes.
    #[must_use]
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(self.len() * 2);
        for b in self.as_bytes() {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// Parses lowercase or uppercase hex of at most 32 bytes.
    #[must_use]
    pub fn from_hex(text: &str) -> Option<Self> {
        let mut buf = [0u8; 32];
        let n = decode_hex_into(text, &mut buf)?;
        Self::from_slice(buf.get(..n)?)
    }
}

/// Decodes hex into `out`, returning the byte count; `None` on bad hex or overflow.
pub(crate) fn decode_hex_into(text: &str, out: &mut [u8]) -> Option<usize> {
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) || bytes.len() / 2 > out.len() {
        return None;
    }
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    for (slot, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        let hi = nibble(*pair.first()?)?;
        let lo = nibble(*pair.get(1)?)?;
        *slot = (hi << 4) | lo;
    }
    Some(bytes.len() / 2)
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}
