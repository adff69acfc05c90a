//! An exact, faster encoder for byte-level BPE tokenizers (Qwen2/Qwen3,
//! Llama 3, DeepSeek, GPT-4-style): the tokenizer's own regexes and BPE
//! model, without `tokenizers`' per-byte offset bookkeeping, and with a
//! bounded cache of each pre-token's ids.
//!
//! # Why the ids are the tokenizer's
//!
//! `Tokenizer::encode_fast(text, false)` runs, for such a pipeline
//! ([`ByteBpe::for_tokenizer`] checks the shape and refuses any other):
//!
//! 1. the added vocabulary: a leftmost-longest Aho-Corasick search over the
//!    raw text for the added tokens (all `normalized: false`, none stripping
//!    whitespace or restricted to single words, special tokens not encoded as
//!    text); each match becomes its token's id, the gaps go on;
//! 2. the normalizer on each gap — none, or NFC, which is the identity on the
//!    texts this encoder is used for (the caller checks the NFC quick check,
//!    as for the NFC-free twin in `tokenizer.rs`);
//! 3. each `Split` pre-tokenizer in turn (`Isolated`, not inverted): every
//!    regex match and every non-empty gap between matches becomes a piece,
//!    empty pieces are dropped;
//! 4. `ByteLevel` without a regex and without a prefix space: each piece's
//!    bytes map to GPT-2's printable byte alphabet, no further split;
//! 5. the model's `tokenize` on each mapped piece; the ids concatenate.
//!    Post-processing adds nothing without special tokens.
//!
//! This module does the same steps with the same building blocks: the same
//! `aho-corasick` match kind over the same token contents, the tokenizer's
//! own regex type (`tokenizers::utils::SysRegex`, Oniguruma) compiled from
//! the same pattern, the same byte alphabet (checked against
//! `ByteLevel::alphabet` at load), and the tokenizer's own model for every
//! pre-token it has not seen. What it leaves out is what only offsets need:
//! the alignment vector of every normalized string, the token strings and the
//! `Encoding`. A pre-token's ids depend on nothing but its bytes (step 5 sees
//! the piece alone), so they are cached by those bytes. Tests compare it with
//! `encode_fast` on every golden prompt and on random texts built from
//! whitespace runs, digits, contractions, CJK, emoji, accents, added tokens
//! and their look-alikes.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use hashbrown::HashMap;
use parking_lot::RwLock;
use tokenizers::utils::SysRegex;
use tokenizers::{Model, ModelWrapper, Tokenizer};

use super::error::PromptError;

/// Cache shards (a power of two): parallel tokenization threads look up
/// pre-tokens at once, and one lock word would bounce between their cores.
const SHARDS: usize = 16;

/// Default byte budget of the pre-token cache (all shards).
pub(crate) const DEFAULT_WORD_CACHE_BYTES: usize = 16 << 20;

/// Pre-tokens longer than this are encoded every time: a long run of one
/// character class (a base64 blob, a whitespace run) is rarely seen twice and
/// would fill the cache.
const MAX_CACHED_WORD: usize = 64;

/// The fast encoder of one tokenizer.
pub(crate) struct ByteBpe {
    /// Added tokens of the raw text, leftmost-longest; `None` if there are
    /// none.
    added: Option<AhoCorasick>,
    /// Id of each `added` pattern.
    added_ids: Vec<u32>,
    /// The `Split` pre-tokenizers, in order.
    splits: Vec<SysRegex>,
    /// GPT-2's byte → printable char map of `ByteLevel`.
    byte_char: [char; 256],
    words: WordCache,
}

impl std::fmt::Debug for ByteBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBpe")
            .field("added_tokens", &self.added_ids.len())
            .field("splits", &self.splits.len())
            .finish_non_exhaustive()
    }
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves,
/// the other 68 bytes to U+0100.. in byte order.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in (0u8..=255).zip(map.iter_mut()) {
        let code = if printable(b) {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    map
}

fn is_type(v: &serde_json::Value, name: &str) -> bool {
    v.get("type").and_then(|t| t.as_str()) == Some(name)
}

/// `ByteLevel` that neither splits nor adds a prefix space.
fn plain_byte_level(v: &serde_json::Value) -> bool {
    is_type(v, "ByteLevel")
        && v.get("use_regex").and_then(serde_json::Value::as_bool) == Some(false)
        && v.get("add_prefix_space")
            .and_then(serde_json::Value::as_bool)
            == Some(false)
}

/// The regex of an `Isolated`, non-inverted `Split` on a regex.
fn isolated_split(v: &serde_json::Value) -> Option<&str> {
    (is_type(v, "Split")
        && v.get("behavior").and_then(|b| b.as_str()) == Some("Isolated")
        && v.get("invert").and_then(serde_json::Value::as_bool) == Some(false))
    .then(|| v.get("pattern")?.get("Regex")?.as_str())
    .flatten()
}

/// The split regexes of a supported pre-tokenizer: `Sequence[Split…,
/// ByteLevel]` or a lone plain `ByteLevel`.
fn split_patterns(pre: &serde_json::Value) -> Option<Vec<String>> {
    if plain_byte_level(pre) {
        return Some(Vec::new());
    }
    if !is_type(pre, "Sequence") {
        return None;
    }
    let steps = pre.get("pretokenizers")?.as_array()?;
    let (last, splits) = steps.split_last()?;
    if !plain_byte_level(last) {
        return None;
    }
    splits
        .iter()
        .map(|s| isolated_split(s).map(str::to_owned))
        .collect()
}

impl ByteBpe {
    /// The fast encoder for `tokenizer`, or `None` when its pipeline is not
    /// one the module docs prove exact (then callers use `encode_fast`).
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer, cache_bytes: usize) -> Option<Self> {
        let normalizer_ok = match tokenizer.get_normalizer() {
            None => true,
            Some(n) => serde_json::to_value(n).is_ok_and(|v| is_type(&v, "NFC")),
        };
        let model_ok = matches!(tokenizer.get_model(), ModelWrapper::BPE(b) if b.dropout.is_none());
        if !normalizer_ok || !model_ok || tokenizer.get_encode_special_tokens() {
            return None;
        }
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
        let splits = split_patterns(&pre)?
            .iter()
            .map(|p| SysRegex::new(p).ok())
            .collect::<Option<Vec<_>>>()?;
        let byte_char = byte_alphabet();
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        if alphabet.len() != 256 || !byte_char.iter().all(|c| alphabet.contains(c)) {
            return None;
        }
        let added = tokenizer.get_added_tokens_decoder();
        if added
            .values()
            .any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word || t.content.is_empty())
        {
            return None;
        }
        let mut contents = Vec::with_capacity(added.len());
        let mut added_ids = Vec::with_capacity(added.len());
        for t in added.values() {
            // The id `tokenizers` gives a match: the added vocabulary's, else
            // the model's.
            added_ids.push(tokenizer.token_to_id(&t.content)?);
            contents.push(t.content.clone());
        }
        let added = if contents.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&contents)
                    .ok()?,
            )
        };
        Some(Self {
            added,
            added_ids,
            splits,
            byte_char,
            words: WordCache::new(cache_bytes),
        })
    }

    /// Appends the ids of `text` (`encode_fast(text, false)` of the tokenizer
    /// this was built for, with NFC the identity on `text`) to `out`.
    pub(crate) fn encode_into(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), PromptError> {
        let Some(added) = &self.added else {
            return self.encode_gap(model, text, out);
        };
        let mut from = 0;
        for m in added.find_iter(text) {
            if from < m.start() {
                self.encode_gap(model, text.get(from..m.start()).unwrap_or_default(), out)?;
            }
            if let Some(id) = self.added_ids.get(m.pattern().as_usize()) {
                out.push(*id);
            }
            from = m.end();
        }
        if from < text.len() {
            self.encode_gap(model, text.get(from..).unwrap_or_default(), out)?;
        }
        Ok(())
    }

    /// Steps 3–5 of the module docs on a text without added tokens.
    fn encode_gap(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), PromptError> {
        self.split_from(0, model, text, out)
    }

    /// Splits `piece` by the regexes from `level` on, each match and gap in
    /// order, and encodes the final pieces.
    fn split_from(
        &self,
        level: usize,
        model: &ModelWrapper,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), PromptError> {
        if piece.is_empty() {
            return Ok(());
        }
        let Some(regex) = self.splits.get(level) else {
            return self.encode_word(model, piece, out);
        };
        let mut prev = 0;
        for (start, end) in regex.find_iter(piece) {
            if prev < start {
                self.split_from(
                    level + 1,
                    model,
                    piece.get(prev..start).unwrap_or_default(),
                    out,
                )?;
            }
            self.split_from(
                level + 1,
                model,
                piece.get(start..end).unwrap_or_default(),
                out,
            )?;
            prev = end;
        }
        if prev < piece.len() {
            self.split_from(level + 1, model, piece.get(prev..).unwrap_or_default(), out)?;
        }
        Ok(())
    }

    /// One pre-token: the cache, else the model on its byte-level form.
    fn encode_word(
        &self,
        model: &ModelWrapper,
        word: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), PromptError> {
        let cacheable = word.len() <= MAX_CACHED_WORD;
        let hash = self.words.hash(word.as_bytes());
        if cacheable {
            if self.words.extend_with(hash, word.as_bytes(), out) {
                return Ok(());
            }
        } else {
            self.words.note_miss(hash);
        }
        let mapped: String = word
            .bytes()
            .map(|b| self.byte_char[usize::from(b)])
            .collect();
        let tokens = model
            .tokenize(&mapped)
            .map_err(|e| PromptError::Tokenize(e.to_string()))?;
        let start = out.len();
        out.extend(tokens.iter().map(|t| t.id));
        if cacheable {
            self.words
                .insert(hash, word.as_bytes(), out.get(start..).unwrap_or_default());
        }
        Ok(())
    }

    /// Pre-token cache counters.
    pub(crate) fn cache_stats(&self) -> PreTokenCacheStats {
        self.words.stats()
    }

    /// Empties the pre-token cache (the counters stay).
    pub(crate) fn clear_cache(&self) {
        for shard in self.words.shards.iter() {
            *shard.maps.write() = Generations::default();
        }
    }
}

/// Counters of the fast byte-level BPE path's pre-token cache
/// ([`ModelTokenizer::pre_token_cache_stats`](super::ModelTokenizer::pre_token_cache_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PreTokenCacheStats {
    /// Pre-tokens answered from the cache.
    pub hits: u64,
    /// Pre-tokens the tokenizer's model encoded (those of at most 64 bytes
    /// are then cached).
    pub misses: u64,
    /// Bytes held (keys, ids and per-entry overhead), within the budget.
    pub bytes: usize,
}

/// One shard's two generations, as the span cache (hits in the previous one
/// are promoted; when the current one passes half the shard's budget the
/// previous one is dropped).
#[derive(Default)]
struct Generations {
    current: HashMap<Box<[u8]>, Box<[u32]>>,
    previous: HashMap<Box<[u8]>, Box<[u32]>>,
    current_bytes: usize,
    previous_bytes: usize,
}

#[derive(Default)]
struct Shard {
    maps: RwLock<Generations>,
    hits: AtomicU64,
    misses: AtomicU64,
}

fn entry_cost(word: &[u8], ids: &[u32]) -> usize {
    word.len() + ids.len() * 4 + 48
}

/// A bounded map from pre-token bytes to ids, sharded by hash.
struct WordCache {
    shards: Box<[Shard]>,
    hasher: hashbrown::DefaultHashBuilder,
    /// Budget of each shard's current generation.
    half_budget: usize,
}

impl WordCache {
    fn new(budget: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            half_budget: budget / SHARDS / 2,
        }
    }

    fn hash(&self, word: &[u8]) -> u64 {
        self.hasher.hash_one(word)
    }

    fn shard(&self, hash: u64) -> Option<&Shard> {
        // The top bits: hashbrown's tables use the low bits and the top 7.
        self.shards.get((hash >> 52) as usize % SHARDS)
    }

    /// Appends `word`'s cached ids to `out`; false on a miss.
    fn extend_with(&self, hash: u64, word: &[u8], out: &mut Vec<u32>) -> bool {
        if self.half_budget == 0 {
            return false;
        }
        let Some(shard) = self.shard(hash) else {
            return false;
        };
        {
            let g = shard.maps.read();
            if let Some(ids) = g.current.get(word) {
                out.extend_from_slice(ids);
                shard.hits.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            if !g.previous.contains_key(word) {
                shard.misses.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        let mut g = shard.maps.write();
        let Some((key, ids)) = g.previous.remove_entry(word) else {
            // Promoted or dropped by another thread in between.
            if let Some(ids) = g.current.get(word) {
                out.extend_from_slice(ids);
                shard.hits.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            shard.misses.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        out.extend_from_slice(&ids);
        let cost = entry_cost(&key, &ids);
        g.previous_bytes = g.previous_bytes.saturating_sub(cost);
        shard.hits.fetch_add(1, Ordering::Relaxed);
        Self::put(&mut g, key, ids, self.half_budget);
        true
    }

    fn note_miss(&self, hash: u64) {
        if let Some(shard) = self.shard(hash) {
            shard.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn insert(&self, hash: u64, word: &[u8], ids: &[u32]) {
        if self.half_budget == 0 {
            return;
        }
        let Some(shard) = self.shard(hash) else {
            return;
        };
        let mut g = shard.maps.write();
        if g.current.contains_key(word) {
            return;
        }
        Self::put(&mut g, word.into(), ids.into(), self.half_budget);
    }

    fn put(g: &mut Generations, key: Box<[u8]>, ids: Box<[u32]>, half_budget: usize) {
        let cost = entry_cost(&key, &ids);
        if g.current_bytes + cost > half_budget {
            g.previous = std::mem::take(&mut g.current);
            g.previous_bytes = g.current_bytes;
            g.current_bytes = 0;
        }
        g.current_bytes += cost;
        g.current.insert(key, ids);
    }

    fn stats(&self) -> PreTokenCacheStats {
        let mut out = PreTokenCacheStats::default();
        for shard in self.shards.iter() {
            let g = shard.maps.read();
            out.hits += shard.hits.load(Ordering::Relaxed);
            out.misses += shard.misses.load(Ordering::Relaxed);
            out.bytes += g.current_bytes + g.previous_bytes;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    fn qwen3_json() -> &'static serde_json::Value {
        static J: OnceLock<serde_json::Value> = OnceLock::new();
        J.get_or_init(|| {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
            let gz = std::fs::read(dir.join("tokenizer.json.gz")).unwrap();
            let mut raw = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz.as_slice()), &mut raw)
                .unwrap();
            serde_json::from_slice(&raw).unwrap()
        })
    }

    fn tokenizer_from(v: &serde_json::Value) -> Tokenizer {
        Tokenizer::from_bytes(serde_json::to_vec(v).unwrap()).unwrap()
    }

    /// Qwen3 without its NFC normalizer: the oracle for any text (with it,
    /// the fast path is only used where NFC is the identity).
    fn twin() -> &'static (Tokenizer, ByteBpe) {
        static T: OnceLock<(Tokenizer, ByteBpe)> = OnceLock::new();
        T.get_or_init(|| {
            let mut v = qwen3_json().clone();
            v["normalizer"] = serde_json::Value::Null;
            let t = tokenizer_from(&v);
            // A small cache, so the proptests run through evictions.
            let fast = ByteBpe::for_tokenizer(&t, 64 << 10).unwrap();
            (t, fast)
        })
    }

    fn fast_ids(t: &Tokenizer, fast: &ByteBpe, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        fast.encode_into(t.get_model(), text, &mut ids).unwrap();
        ids
    }

    fn hf_ids(t: &Tokenizer, text: &str) -> Vec<u32> {
        t.encode_fast(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn the_alphabet_is_byte_levels() {
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        let ours = byte_alphabet();
        let distinct: std::collections::HashSet<char> = ours.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(distinct, alphabet.into_iter().collect());
        // Spot checks of GPT-2's table: space → 'Ġ', newline → 'Ċ'.
        assert_eq!(ours[usize::from(b' ')], 'Ġ');
        assert_eq!(ours[usize::from(b'\n')], 'Ċ');
        assert_eq!(ours[usize::from(b'a')], 'a');
    }

    #[test]
    fn qwen3_is_supported_with_and_without_nfc() {
        assert!(ByteBpe::for_tokenizer(&tokenizer_from(qwen3_json()), 1 << 20).is_some());
        assert_eq!(twin().1.splits.len(), 1);
        assert_eq!(twin().1.added_ids.len(), 26);
    }

    /// Every pipeline change the module docs do not cover is refused.
    #[test]
    fn other_pipelines_are_refused() {
        let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = qwen3_json().clone();
            edit(&mut v);
            ByteBpe::for_tokenizer(&tokenizer_from(&v), 1 << 20).is_none()
        };
        assert!(refused(
            &|v| v["normalizer"] = serde_json::json!({"type": "Lowercase"})
        ));
        assert!(refused(
            &|v| v["normalizer"] = serde_json::json!({"type": "NFKC"})
        ));
        assert!(refused(&|v| v["added_tokens"][0]["lstrip"] = true.into()));
        assert!(refused(&|v| v["added_tokens"][1]["rstrip"] = true.into()));
        assert!(refused(
            &|v| v["added_tokens"][2]["single_word"] = true.into()
        ));
        assert!(refused(
            &|v| v["added_tokens"][3]["normalized"] = true.into()
        ));
        assert!(refused(
            &|v| v["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithPrevious".into()
        ));
        assert!(refused(
            &|v| v["pre_tokenizer"]["pretokenizers"][0]["invert"] = true.into()
        ));
        assert!(refused(
            &|v| v["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true.into()
        ));
        assert!(refused(
            &|v| v["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true.into()
        ));
        assert!(refused(
            &|v| v["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"})
        ));
        assert!(refused(&|v| v["model"]["dropout"] = 0.1.into()));
        // A second Split before ByteLevel (DeepSeek style) is supported.
        let mut v = qwen3_json().clone();
        let split = v["pre_tokenizer"]["pretokenizers"][0].clone();
        let mut digits = split.clone();
        digits["pattern"]["Regex"] = r"\p{N}{1,3}".into();
        v["pre_tokenizer"]["pretokenizers"] = serde_json::json!([
            digits,
            split,
            v["pre_tokenizer"]["pretokenizers"][1].clone()
        ]);
        v["normalizer"] = serde_json::Value::Null;
        let t = tokenizer_from(&v);
        let fast = ByteBpe::for_tokenizer(&t, 1 << 20).unwrap();
        for text in [
            "12345 apples, 987654 pears",
            "a1b22c333d4444",
            " 2024-12-02\n\n",
        ] {
            assert_eq!(fast_ids(&t, &fast, text), hf_ids(&t, text), "{text:?}");
        }
    }

    /// Fragments that stress each step: added tokens and look-alikes,
    /// contractions in both cases, whitespace runs before and after
    /// newlines, digits, punctuation runs, CJK, emoji with joiners,
    /// combining marks, control and non-printable bytes.
    const FRAGMENTS: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<|im_start",
        "|>",
        "<|",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call",
        "<|endoftext|>",
        "'s",
        "'S",
        "'ll",
        "'LL",
        "'re",
        "'d",
        "'",
        "don",
        "hello",
        "Hello",
        "WORLD",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n",
        "\n ",
        "\u{a0}",
        "\u{3000}",
        "123",
        "4",
        "2024",
        "3.14",
        "!",
        "...",
        "?!",
        "--",
        "(",
        ")",
        "{\"a\": 1}",
        "ok.",
        "東京",
        "の",
        "한국어",
        "Привет",
        "مرحبا",
        "😀",
        "👨\u{200d}👩\u{200d}👧",
        "é",
        "e\u{301}",
        "\u{301}",
        "ß",
        "ﬁ",
        "\u{0}",
        "\u{7f}",
        "\u{1b}[0m",
        "\u{fffd}",
        "x",
    ];

    fn fragment_text() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(FRAGMENTS), 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(768))]

        #[test]
        fn equals_the_tokenizer_on_fragment_texts(text in fragment_text()) {
            let (t, fast) = twin();
            prop_assert_eq!(fast_ids(t, fast, &text), hf_ids(t, &text));
        }

        #[test]
        fn equals_the_tokenizer_on_any_text(text in "\\PC{0,64}|[ -~\\t\\n\\r]{0,128}") {
            let (t, fast) = twin();
            prop_assert_eq!(fast_ids(t, fast, &text), hf_ids(t, &text));
        }

        /// Twice: the second pass reads the pre-token cache.
        #[test]
        fn cached_pre_tokens_give_the_same_ids(text in fragment_text()) {
            let (t, fast) = twin();
            let first = fast_ids(t, fast, &text);
            prop_assert_eq!(&fast_ids(t, fast, &text), &first);
            prop_assert_eq!(first, hf_ids(t, &text));
        }
    }

    #[test]
    fn long_pre_tokens_and_the_cache_bound() {
        let (t, _) = twin();
        let fast = ByteBpe::for_tokenizer(t, 4 << 10).unwrap();
        // A pre-token longer than the cache's limit, and many distinct words
        // through a 4 KiB cache.
        let long = format!("{} {}", "z".repeat(300), " ".repeat(200));
        assert_eq!(fast_ids(t, &fast, &long), hf_ids(t, &long));
        // Distinct letter words (digits would split into single-digit pre-tokens).
        let word = |mut i: u32| {
            let mut w = String::from(" q");
            while i > 0 {
                w.push(char::from(b'a' + (i % 26) as u8));
                i /= 26;
            }
            w
        };
        let words: String = (0..2000).map(word).collect();
        assert_eq!(fast_ids(t, &fast, &words), hf_ids(t, &words));
        let stats = fast.cache_stats();
        assert!(stats.bytes <= 4 << 10, "{stats:?}");
        assert_eq!(fast_ids(t, &fast, &words), hf_ids(t, &words));
        let again = fast.cache_stats();
        // 2 000 distinct words do not fit: the second pass misses again.
        assert!(
            again.bytes <= 4 << 10 && again.misses >= 2 * 2000,
            "{again:?}"
        );
        let hello = "hello hello hello hello";
        assert_eq!(fast_ids(t, &fast, hello), hf_ids(t, hello));
        assert!(fast.cache_stats().hits >= again.hits + 2);
    }
}
