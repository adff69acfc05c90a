//! Fuzz entry points and the reference encoders they compare against.
//!
//! Not a stable API: used by `fuzz/fuzz_targets/*`, the corpus replay test and
//! property tests. Mismatches panic on purpose (that is how a fuzzer reports).

use crate::vllm::{self, ExtraKeyItem, VllmAlgorithm};

/// An owned extra-key item (test input).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnedItem {
    /// `("lora", name, path)`.
    Lora(String, String),
    /// `("mm", identifier, offset)`.
    Mm(String, i64),
    /// `("cache_salt", salt)`.
    CacheSalt(String),
    /// `("prompt_embeds", digest)`.
    PromptEmbeds([u8; 32]),
}

impl OwnedItem {
    fn borrow(&self) -> ExtraKeyItem<'_> {
        match self {
            OwnedItem::Lora(n, p) => ExtraKeyItem::Lora { name: n, path: p },
            OwnedItem::Mm(i, o) => ExtraKeyItem::Mm {
                identifier: i,
                offset: *o,
            },
            OwnedItem::CacheSalt(s) => ExtraKeyItem::CacheSalt(s),
            OwnedItem::PromptEmbeds(d) => ExtraKeyItem::PromptEmbeds(d),
        }
    }
}

/// One block value `(parent, tokens, extra)` to serialise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuzzBlock {
    /// Parent digest bytes.
    pub parent: Vec<u8>,
    /// Token ids.
    pub tokens: Vec<u64>,
    /// Items of `E` (empty = `None`).
    pub items: Vec<OwnedItem>,
    /// Lookahead tokens (`Some` = the `(E, t1..tL)` form).
    pub lookahead: Option<Vec<u64>>,
}

struct Reader<'a> {
    data: &'a [u8],
}

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self
            .data
            .split_first()
            .map_or((0, &[][..]), |(f, r)| (*f, r));
        self.data = rest;
        first
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head.to_vec()
    }

    /// An integer whose width is chosen by the input, so every CBOR/pickle width occurs.
    fn int(&mut self) -> u64 {
        let width = match self.byte() % 5 {
            0 => 1,
            1 => 2,
            2 => 3,
            3 => 4,
            _ => 8,
        };
        let mut buf = [0u8; 8];
        for slot in buf.iter_mut().take(width) {
            *slot = self.byte();
        }
        u64::from_le_bytes(buf)
    }

    fn string(&mut self) -> String {
        let len = usize::from(self.byte() % 40);
        let raw = self.bytes(len);
        String::from_utf8_lossy(&raw).into_owned()
    }
}

impl FuzzBlock {
    /// Derives a block value from arbitrary bytes.
    #[must_use]
    pub fn from_bytes(data: &[u8]) -> Self {
        let mut r = Reader { data };
        let flags = r.byte();
        let parent_len = if flags & 1 == 0 { 32 } else { 16 };
        let mut parent = r.bytes(parent_len);
        parent.resize(parent_len, 0);
        let n_tokens = usize::from(r.byte() % 70);
        let tokens = (0..n_tokens).map(|_| r.int()).collect();
        let n_items = usize::from(r.byte() % 6);
        let items = (0..n_items)
            .map(|_| match r.byte() % 4 {
                0 => OwnedItem::Lora(r.string(), r.string()),
                1 => OwnedItem::Mm(r.string(), r.int() as i64),
                2 => OwnedItem::CacheSalt(r.string()),
                _ => {
                    let mut d = [0u8; 32];
                    for slot in &mut d {
                        *slot = r.byte();
                    }
                    OwnedItem::PromptEmbeds(d)
                }
            })
            .collect();
        let lookahead = (flags & 2 != 0).then(|| {
            let n = usize::from(r.byte() % 4) + 1;
            (0..n).map(|_| r.int()).collect()
        });
        Self {
            parent,
            tokens,
            items,
            lookahead,
        }
    }

    fn encode(&self, algorithm: VllmAlgorithm) -> Vec<u8> {
        let mut out = Vec::new();
        vllm::encode_block(
            algorithm,
            &mut out,
            &self.parent,
            &self.tokens,
            self.items.iter().map(OwnedItem::borrow),
            self.lookahead.as_deref(),
        );
        out
    }

    /// The hand-written CBOR encoder's output.
    #[must_use]
    pub fn encode_cbor(&self) -> Vec<u8> {
        self.encode(VllmAlgorithm::Sha256Cbor)
    }

    /// The hand-written pickle encoder's output.
    #[must_use]
    pub fn encode_pickle(&self) -> Vec<u8> {
        self.encode(VllmAlgorithm::Sha256)
    }

    /// The Python value, as a tree for the reference encoders.
    #[must_use]
    pub fn to_py(&self) -> PyValue {
        let item = |it: &OwnedItem| match it {
            OwnedItem::Lora(n, p) => PyValue::Tuple(vec![
                PyValue::tag("lora"),
                PyValue::user(n),
                PyValue::user(p),
            ]),
            OwnedItem::Mm(i, o) => PyValue::Tuple(vec![
                PyValue::tag("mm"),
                PyValue::user(i),
                PyValue::Int(i128::from(*o)),
            ]),
            OwnedItem::CacheSalt(s) => {
                PyValue::Tuple(vec![PyValue::tag("cache_salt"), PyValue::user(s)])
            }
            OwnedItem::PromptEmbeds(d) => PyValue::Tuple(vec![
                PyValue::tag("prompt_embeds"),
                PyValue::Bytes(d.to_vec()),
            ]),
        };
        let e = if self.items.is_empty() {
            PyValue::None
        } else {
            PyValue::Tuple(self.items.iter().map(item).collect())
        };
        let extra = match &self.lookahead {
            None => e,
            Some(la) => {
                let mut v = vec![e];
                v.extend(la.iter().map(|&t| PyValue::Int(i128::from(t))));
                PyValue::Tuple(v)
            }
        };
        PyValue::Tuple(vec![
            PyValue::Bytes(self.parent.clone()),
            PyValue::Tuple(
                self.tokens
                    .iter()
                    .map(|&t| PyValue::Int(i128::from(t)))
                    .collect(),
            ),
            extra,
        ])
    }
}

/// A Python value of the shapes vLLM hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `int`.
    Int(i128),
    /// `bytes`.
    Bytes(Vec<u8>),
    /// `str`; `shared` marks strings that are one shared object wherever they occur
    /// (interned code literals and CPython's empty / one-Latin-1-char singletons).
    Str {
        /// Text.
        text: String,
        /// One object for every occurrence of this text.
        shared: bool,
    },
    /// `tuple`.
    Tuple(Vec<PyValue>),
}

impl PyValue {
    fn tag(s: &str) -> Self {
        PyValue::Str {
            text: s.to_owned(),
            shared: true,
        }
    }

    fn user(s: &str) -> Self {
        let mut chars = s.chars();
        let shared = match (chars.next(), chars.next()) {
            (None, _) => true,
            (Some(c), None) => u32::from(c) < 256,
            _ => false,
        };
        PyValue::Str {
            text: s.to_owned(),
            shared,
        }
    }
}

/// A plain tree-walking pickler (protocol 5, single frame), written independently
/// of the hand-written encoder, following `pickle.py`'s `save_*` methods.
#[must_use]
pub fn reference_pickle(v: &PyValue) -> Vec<u8> {
    struct P {
        out: Vec<u8>,
        memo_len: u32,
        shared: Vec<(String, u32)>,
    }
    impl P {
        fn memoize(&mut self) {
            self.out.push(0x94);
            self.memo_len += 1;
        }
        fn save(&mut self, v: &PyValue) {
            match v {
                PyValue::None => self.out.push(b'N'),
                PyValue::Int(n) => {
                    let n = *n;
                    if (0..256).contains(&n) {
                        self.out.push(b'K');
                        self.out.push(n as u8);
                    } else if (0..65536).contains(&n) {
                        self.out.push(b'M');
                        self.out.extend_from_slice(&(n as u16).to_le_bytes());
                    } else if (-(1i128 << 31)..(1i128 << 31)).contains(&n) {
                        self.out.push(b'J');
                        self.out.extend_from_slice(&(n as i32).to_le_bytes());
                    } else {
                        // encode_long: shortest little-endian two's complement.
                        let mut bytes = Vec::new();
                        let mut x = n;
                        loop {
                            bytes.push((x & 0xff) as u8);
                            x >>= 8;
                            let last = bytes.last().copied().unwrap_or(0);
                            let done =
                                (x == 0 && last & 0x80 == 0) || (x == -1 && last & 0x80 != 0);
                            if done {
                                break;
                            }
                        }
                        self.out.push(0x8a);
                        self.out.push(bytes.len() as u8);
                        self.out.extend_from_slice(&bytes);
                    }
                }
                PyValue::Bytes(b) => {
                    if b.len() < 256 {
                        self.out.push(b'C');
                        self.out.push(b.len() as u8);
                    } else {
                        self.out.push(b'B');
                        self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    }
                    self.out.extend_from_slice(b);
                    self.memoize();
                }
                PyValue::Str { text, shared } => {
                    if *shared {
                        if let Some((_, idx)) = self.shared.iter().find(|(t, _)| t == text) {
                            let idx = *idx;
                            if idx < 256 {
                                self.out.push(b'h');
                                self.out.push(idx as u8);
                            } else {
                                self.out.push(b'j');
                                self.out.extend_from_slice(&idx.to_le_bytes());
                            }
                            return;
                        }
                        self.shared.push((text.clone(), self.memo_len));
                    }
                    if text.len() < 256 {
                        self.out.push(0x8c);
                        self.out.push(text.len() as u8);
                    } else {
                        self.out.push(b'X');
                        self.out
                            .extend_from_slice(&(text.len() as u32).to_le_bytes());
                    }
                    self.out.extend_from_slice(text.as_bytes());
                    self.memoize();
                }
                PyValue::Tuple(items) => {
                    if items.is_empty() {
                        self.out.push(b')');
                        return;
                    }
                    let small = items.len() <= 3;
                    if !small {
                        self.out.push(b'(');
                    }
                    for it in items {
                        self.save(it);
                    }
                    if small {
                        self.out.push([0x85, 0x86, 0x87][items.len() - 1]);
                    } else {
                        self.out.push(b't');
                    }
                    self.memoize();
                }
            }
        }
    }
    let mut p = P {
        out: Vec::new(),
        memo_len: 0,
        shared: Vec::new(),
    };
    p.save(v);
    p.out.push(b'.');
    let mut framed = vec![0x80, 5, 0x95];
    framed.extend_from_slice(&(p.out.len() as u64).to_le_bytes());
    framed.extend_from_slice(&p.out);
    framed
}

/// The same value encoded by `ciborium` (the CBOR reference).
#[cfg(feature = "fuzzing")]
#[must_use]
pub fn reference_cbor(v: &PyValue) -> Vec<u8> {
    use ciborium::value::{Integer, Value};
    fn conv(v: &PyValue) -> Value {
        match v {
            PyValue::None => Value::Null,
            PyValue::Int(n) => {
                Value::Integer(Integer::try_from(*n).unwrap_or_else(|_| Integer::from(0)))
            }
            PyValue::Bytes(b) => Value::Bytes(b.clone()),
            PyValue::Str { text, .. } => Value::Text(text.clone()),
            PyValue::Tuple(items) => Value::Array(items.iter().map(conv).collect()),
        }
    }
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = ciborium::into_writer(&conv(v), &mut out);
    out
}

/// Fuzz target `cbor_encoder`: hand-written canonical CBOR == ciborium's bytes.
#[cfg(feature = "fuzzing")]
pub fn cbor_encoder(data: &[u8]) {
    let block = FuzzBlock::from_bytes(data);
    let ours = block.encode_cbor();
    let reference = reference_cbor(&block.to_py());
    assert_eq!(ours, reference, "CBOR mismatch for {block:?}");
}

/// Fuzz target `pickle_encoder`: hand-written pickle == the reference pickler.
pub fn pickle_encoder(data: &[u8]) {
    let block = FuzzBlock::from_bytes(data);
    let ours = block.encode_pickle();
    let reference = reference_pickle(&block.to_py());
    assert_eq!(ours, reference, "pickle mismatch for {block:?}");
}
