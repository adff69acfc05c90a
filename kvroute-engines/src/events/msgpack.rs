//! A small zero-copy msgpack reader over `&[u8]`.
//!
//! The event decoders read only the handful of msgpack types msgspec emits, straight
//! from the payload slice: no intermediate value tree, no allocation except what the
//! output events need. Every read checks the remaining length first, so a hostile
//! payload produces a [`DecodeError`] and never a panic or an over-allocation.

use super::DecodeError;

/// Deepest nesting the generic walkers ([`Reader::skip_value`] is iterative and needs
/// no limit; extra-key and JSON conversion recurse) will follow.
pub(crate) const MAX_DEPTH: usize = 32;

/// A msgpack integer as it was on the wire (sign matters only for range checks; hash
/// keys keep the raw 64 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Int {
    /// A positive-fixint or `uint 8/16/32/64`, or a signed encoding holding a value ≥ 0.
    Unsigned(u64),
    /// A negative value.
    Negative(i64),
}

impl Int {
    /// The 64 bits of the integer (two's complement for negatives), which is how
    /// block keys are stored.
    pub(crate) fn bits(self) -> u64 {
        match self {
            Int::Unsigned(v) => v,
            Int::Negative(v) => v as u64,
        }
    }
}

/// A cursor over one msgpack document.
#[derive(Clone, Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading at the beginning of `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Current byte offset (for error reports and rewinding).
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Moves the cursor back to an offset previously returned by [`Reader::pos`].
    pub(crate) fn rewind(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// True once every byte was consumed.
    pub(crate) fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    fn truncated(&self) -> DecodeError {
        DecodeError::Truncated { offset: self.pos }
    }

    fn mismatch(&self, at: usize, expected: &'static str, found: u8) -> DecodeError {
        DecodeError::UnexpectedType {
            offset: at,
            expected,
            found,
        }
    }

    /// The next marker byte without consuming it.
    pub(crate) fn peek(&self) -> Result<u8, DecodeError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.truncated())
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.truncated())?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.truncated())?;
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn be_u8(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from(self.byte()?))
    }

    fn be_u16(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from(u16::from_be_bytes(self.be()?)))
    }

    fn be_u32(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from(u32::from_be_bytes(self.be()?)))
    }

    fn be_u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.be()?))
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub(crate) fn eat_nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Reads an array header and returns its element count.
    pub(crate) fn array_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => self.be_u16()?,
            0xdd => self.be_u32()?,
            _ => return Err(self.mismatch(at, "array", m)),
        };
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Reads a map header and returns its entry count.
    pub(crate) fn map_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0x80..=0x8f => u64::from(m & 0x0f),
            0xde => self.be_u16()?,
            0xdf => self.be_u32()?,
            _ => return Err(self.mismatch(at, "map", m)),
        };
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Reads any integer encoding.
    pub(crate) fn int(&mut self) -> Result<Int, DecodeError> {
        let at = self.pos;
        let m = self.byte()?;
        let signed = |v: i64| {
            if v >= 0 {
                Int::Unsigned(v as u64)
            } else {
                Int::Negative(v)
            }
        };
        Ok(match m {
            0x00..=0x7f => Int::Unsigned(u64::from(m)),
            0xe0..=0xff => Int::Negative(i64::from(m as i8)),
            0xcc => Int::Unsigned(self.be_u8()?),
            0xcd => Int::Unsigned(self.be_u16()?),
            0xce => Int::Unsigned(self.be_u32()?),
            0xcf => Int::Unsigned(self.be_u64()?),
            0xd0 => signed(i64::from(self.byte()? as i8)),
            0xd1 => signed(i64::from(i16::from_be_bytes(self.be()?))),
            0xd2 => signed(i64::from(i32::from_be_bytes(self.be()?))),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            _ => return Err(self.mismatch(at, "integer", m)),
        })
    }

    /// Reads a non-negative integer that must fit in `u32` (token ids, sizes, ranks).
    ///
    /// The common encodings are matched first because this runs once per token.
    #[inline]
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let at = self.pos;
        match self.buf.get(self.pos) {
            Some(&m @ 0x00..=0x7f) => {
                self.pos += 1;
                return Ok(u32::from(m));
            }
            Some(0xcd) => {
                if let Some(s) = self.buf.get(self.pos + 1..self.pos + 3) {
                    self.pos += 3;
                    return Ok(u32::from(u16::from_be_bytes([s[0], s[1]])));
                }
            }
            Some(0xce) => {
                if let Some(s) = self.buf.get(self.pos + 1..self.pos + 5) {
                    self.pos += 5;
                    return Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]));
                }
            }
            _ => {}
        }
        match self.int()? {
            Int::Unsigned(v) => {
                u32::try_from(v).map_err(|_| DecodeError::IntOutOfRange { offset: at, what })
            }
            Int::Negative(_) => Err(DecodeError::IntOutOfRange { offset: at, what }),
        }
    }

    /// Reads a float (float32/64) or an integer, as `f64`.
    pub(crate) fn f64(&mut self) -> Result<f64, DecodeError> {
        let at = self.pos;
        match self.peek()? {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be()?)))
            }
            m => match self.int() {
                Ok(Int::Unsigned(v)) => Ok(v as f64),
                Ok(Int::Negative(v)) => Ok(v as f64),
                Err(_) => Err(self.mismatch(at, "float", m)),
            },
        }
    }

    /// Reads a string (must be UTF-8).
    pub(crate) fn str(&mut self) -> Result<&'a str, DecodeError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be_u8()?,
            0xda => self.be_u16()?,
            0xdb => self.be_u32()?,
            _ => return Err(self.mismatch(at, "string", m)),
        };
        let bytes = self.take(usize::try_from(n).unwrap_or(usize::MAX))?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { offset: at })
    }

    /// Reads a byte string (`bin 8/16/32`).
    pub(crate) fn bin(&mut self) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let m = self.byte()?;
        let n = match m {
            0xc4 => self.be_u8()?,
            0xc5 => self.be_u16()?,
            0xc6 => self.be_u32()?,
            _ => return Err(self.mismatch(at, "bin", m)),
        };
        self.take(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Skips one complete value of any type.
    ///
    /// Iterative (a count of values still owed), so nesting depth cannot overflow the
    /// stack; every loop turn consumes at least one byte, so the work is bounded by
    /// the payload length whatever the headers claim.
    pub(crate) fn skip_value(&mut self) -> Result<(), DecodeError> {
        let mut owed: u64 = 1;
        while owed > 0 {
            owed -= 1;
            let m = self.byte()?;
            let (skip, more): (u64, u64) = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
                0x80..=0x8f => (0, 2 * u64::from(m & 0x0f)),
                0x90..=0x9f => (0, u64::from(m & 0x0f)),
                0xa0..=0xbf => (u64::from(m & 0x1f), 0),
                0xc4 | 0xd9 => (self.be_u8()?, 0),
                0xc5 | 0xda => (self.be_u16()?, 0),
                0xc6 | 0xdb => (self.be_u32()?, 0),
                0xc7 => (self.be_u8()? + 1, 0),
                0xc8 => (self.be_u16()? + 1, 0),
                0xc9 => (self.be_u32()? + 1, 0),
                0xca => (4, 0),
                0xcb => (8, 0),
                0xcc | 0xd0 => (1, 0),
                0xcd | 0xd1 => (2, 0),
                0xce | 0xd2 => (4, 0),
                0xcf | 0xd3 => (8, 0),
                0xd4 => (2, 0),
                0xd5 => (3, 0),
                0xd6 => (5, 0),
                0xd7 => (9, 0),
                0xd8 => (17, 0),
                0xdc => (0, self.be_u16()?),
                0xdd => (0, self.be_u32()?),
                0xde => (0, 2 * self.be_u16()?),
                0xdf => (0, 2 * self.be_u32()?),
                0xc1 => {
                    return Err(DecodeError::UnexpectedType {
                        offset: self.pos - 1,
                        expected: "any value",
                        found: m,
                    })
                }
            };
            self.take(usize::try_from(skip).unwrap_or(usize::MAX))?;
            owed = owed.saturating_add(more);
            // Every value still owed needs at least one byte.
            if owed > self.remaining() as u64 {
                return Err(self.truncated());
            }
        }
        Ok(())
    }
}

/// Converts one msgpack document to JSON the way the fixture generators did
/// (`bytes` → `{"bytes_hex": ...}`), for golden comparisons and diagnostics.
///
/// Not used on the hot path. Extension types become `{"ext": type, "hex": ...}`.
#[cfg(feature = "parity")]
pub(crate) fn to_json(r: &mut Reader<'_>, depth: usize) -> Result<serde_json::Value, DecodeError> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return Err(DecodeError::TooDeep { offset: r.pos() });
    }
    let at = r.pos();
    let m = r.peek()?;
    Ok(match m {
        0xc0 => {
            r.skip_value()?;
            Value::Null
        }
        0xc2 | 0xc3 => {
            r.skip_value()?;
            Value::Bool(m == 0xc3)
        }
        0xca | 0xcb => {
            let f = r.f64()?;
            serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
        }
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xcf | 0xd0..=0xd3 => match r.int()? {
            super::msgpack::Int::Unsigned(v) => Value::from(v),
            super::msgpack::Int::Negative(v) => Value::from(v),
        },
        0xa0..=0xbf | 0xd9..=0xdb => Value::String(r.str()?.to_owned()),
        0xc4..=0xc6 => {
            let b = r.bin()?;
            let mut o = serde_json::Map::new();
            o.insert("bytes_hex".into(), Value::String(hex_lower(b)));
            Value::Object(o)
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            let n = r.array_len()?;
            let mut v = Vec::with_capacity(n.min(r.remaining() / 8));
            for _ in 0..n {
                v.push(to_json(r, depth + 1)?);
            }
            Value::Array(v)
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let n = r.map_len()?;
            let mut o = serde_json::Map::new();
            for _ in 0..n {
                let k = match to_json(r, depth + 1)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                let v = to_json(r, depth + 1)?;
                o.insert(k, v);
            }
            Value::Object(o)
        }
        _ => {
            r.skip_value()?;
            let raw = r.buf.get(at..r.pos()).unwrap_or_default();
            let mut o = serde_json::Map::new();
            o.insert("ext_raw_hex".into(), Value::String(hex_lower(raw)));
            Value::Object(o)
        }
    })
}

/// Lowercase hex of a byte string.
#[cfg(feature = "parity")]
pub(crate) fn hex_lower(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 0x0f)]));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_value_rejects_headers_longer_than_the_payload() {
        // array32 claiming 2^32-1 elements followed by nothing.
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(r.skip_value(), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn ints_keep_their_bits() {
        let mut r = Reader::new(&[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
        assert_eq!(r.int().unwrap(), Int::Negative(-2));
        assert_eq!(Int::Negative(-2).bits(), u64::MAX - 1);
        let mut r = Reader::new(&[0xd0, 0x05]);
        assert_eq!(r.int().unwrap(), Int::Unsigned(5));
    }

    #[test]
    fn u32_fast_path_handles_truncated_wide_ints() {
        let mut r = Reader::new(&[0xce, 0x00, 0x01]);
        assert!(matches!(r.u32("token"), Err(DecodeError::Truncated { .. })));
        let mut r = Reader::new(&[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert!(matches!(
            r.u32("token"),
            Err(DecodeError::IntOutOfRange { .. })
        ));
    }
}
