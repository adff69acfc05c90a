//! A bounded cache of token ids for segments of rendered prompts.
//!
//! # Why cached ids equal a full tokenization
//!
//! BPE over a concatenation is not the concatenation of BPE results in general.
//! But the `tokenizers` pipeline does not see the text as one piece: step one
//! (`AddedVocabulary::extract_and_normalize`) finds every added-token match in
//! the raw text and splits there; the normaliser, the pre-tokenizer and the model
//! then run on each remaining piece on its own, and the ids of the pieces are
//! concatenated. So if we cut the text exactly at the start of an added-token
//! match (the *delimiter*, `<|im_start|>` for ChatML templates), each side is
//! split into the same pieces it would be split into inside the whole text, and
//! `encode(a + b) == encode(a) ++ encode(b)`. That holds when:
//!
//! 1. the delimiter is matched on raw text (`normalized: false`) and absorbs no
//!    neighbouring whitespace (`lstrip`, `rstrip`, `single_word` all false), so
//!    the match starts exactly at the cut;
//! 2. no other added token can match across the cut: none contains the delimiter
//!    and none ends with a proper prefix of it (matching is leftmost-first, so a
//!    token starting inside the delimiter can never win against it);
//! 3. nothing in the pipeline depends on a piece's position in the whole text
//!    (a `Metaspace` pre-tokenizer with `prepend_scheme: "first"` does), and no
//!    post-processor adds tokens (segments are encoded without special tokens);
//! 4. no truncation or padding is configured in the tokenizer (cleared at load),
//!    and special tokens are matched, not encoded as text
//!    (`split_special_tokens`).
//!
//! The NFC normaliser needs no extra argument: it runs per piece in the full
//! tokenization too, and the cut coincides with a piece boundary. (The delimiter
//! is ASCII and starts with `<`, which has no combining class, so no composition
//! could cross it anyway.) [`SegmentPolicy::from_tokenizer`] checks 1-4 and
//! disables caching otherwise; tests compare cached and full ids on all golden
//! cases and on random conversations.
//!
//! # Bound
//!
//! Two generations of maps: lookups check the current then the previous one
//! (promoting hits); when the current generation passes half the byte budget,
//! the previous one is dropped and the current becomes previous. Memory stays
//! below the budget plus one entry, every operation is O(1) amortised, and
//! anything used within the last half-budget of insertions survives.

use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64;

/// Where rendered text may be cut without changing its tokenization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentPolicy {
    delimiter: String,
}

impl SegmentPolicy {
    /// Checks the tokenizer against the conditions in the module docs for each
    /// candidate delimiter (in order) and returns a policy for the first that
    /// passes, or `None` (then caching is off).
    #[must_use]
    pub(crate) fn from_tokenizer(tokenizer: &Tokenizer, candidates: &[&str]) -> Option<Self> {
        // With special tokens encoded as text, a delimiter is no longer a
        // token of its own that the text around it cannot merge into.
        if tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
            || tokenizer.get_encode_special_tokens()
        {
            return None;
        }
        if let Some(pre) = tokenizer.get_pre_tokenizer() {
            let json = serde_json::to_string(pre).ok()?;
            if json.contains("\"prepend_scheme\":\"first\"") {
                return None;
            }
        }
        let added = tokenizer.get_added_tokens_decoder();
        candidates.iter().find_map(|&cand| {
            let delim = added.values().find(|t| t.content == cand)?;
            if delim.normalized || delim.lstrip || delim.rstrip || delim.single_word {
                return None;
            }
            let crosses = added.values().any(|t| {
                t.content != cand
                    && (t.content.contains(cand)
                        || (1..cand.len()).any(|k| {
                            cand.get(..k)
                                .is_some_and(|prefix| t.content.ends_with(prefix))
                        }))
            });
            (!crosses).then(|| Self {
                delimiter: cand.to_owned(),
            })
        })
    }

    /// Splits `text` right before every delimiter occurrence. The pieces
    /// concatenate to `text`; none is empty.
    pub(crate) fn segments<'a>(&'a self, text: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let mut starts: Vec<usize> = text
            .match_indices(self.delimiter.as_str())
            .map(|(i, _)| i)
            .collect();
        if starts.first() != Some(&0) {
            starts.insert(0, 0);
        }
        let n = starts.len();
        (0..n).filter_map(move |i| {
            let s = *starts.get(i)?;
            let e = starts.get(i + 1).copied().unwrap_or(text.len());
            text.get(s..e).filter(|seg| !seg.is_empty())
        })
    }
}

struct Entry {
    text: Box<str>,
    ids: Arc<[u32]>,
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.len() + self.ids.len() * 4 + 64
    }
}

#[derive(Default)]
struct Generations {
    current: HashMap<u64, Entry>,
    current_bytes: usize,
    previous: HashMap<u64, Entry>,
}

/// Counters of a model's span cache: token ids of rendered-prompt segments
/// (cut before a chat delimiter such as `<|im_start|>` where the tokenizer
/// provably tokenizes each side alone as in the whole text), bounded by
/// [`ModelOptions::span_cache_bytes`](super::ModelOptions::span_cache_bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpanCacheStats {
    /// Segments found.
    pub hits: u64,
    /// Segments tokenized.
    pub misses: u64,
    /// Bytes currently held (both generations).
    pub bytes: usize,
}

/// Bounded, thread-safe map from segment text to its token ids.
pub(crate) struct SpanCache {
    inner: Mutex<(Generations, SpanCacheStats)>,
    budget_bytes: usize,
}

impl std::fmt::Debug for SpanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanCache")
            .field("budget_bytes", &self.budget_bytes)
            .field("stats", &self.stats())
            .finish()
    }
}

impl SpanCache {
    /// A cache holding at most about `budget_bytes` of text and ids.
    #[must_use]
    pub(crate) fn new(budget_bytes: usize) -> Self {
        Self {
            inner: Mutex::new((Generations::default(), SpanCacheStats::default())),
            budget_bytes,
        }
    }

    /// Current counters.
    #[must_use]
    pub(crate) fn stats(&self) -> SpanCacheStats {
        let g = self.inner.lock();
        let mut s = g.1;
        s.bytes = g.0.current_bytes + g.0.previous.values().map(Entry::cost).sum::<usize>();
        s
    }

    /// Drops everything.
    pub(crate) fn clear(&self) {
        let mut g = self.inner.lock();
        g.0 = Generations::default();
    }

    /// The ids of `text`, from the cache or from `tokenize` (then cached).
    pub(crate) fn get_or_insert<E>(
        &self,
        text: &str,
        tokenize: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        let key = xxh3_64(text.as_bytes());
        {
            let mut guard = self.inner.lock();
            let (g, stats) = &mut *guard;
            if let Some(e) = g.current.get(&key) {
                if &*e.text == text {
                    stats.hits += 1;
                    return Ok(Arc::clone(&e.ids));
                }
            } else if let Some(e) = g.previous.remove(&key) {
                if &*e.text == text {
                    stats.hits += 1;
                    let ids = Arc::clone(&e.ids);
                    Self::insert_entry(g, key, e, self.budget_bytes);
                    return Ok(ids);
                }
            }
            stats.misses += 1;
        }
        let ids: Arc<[u32]> = tokenize(text)?.into();
        let entry = Entry {
            text: text.into(),
            ids: Arc::clone(&ids),
        };
        if entry.cost() <= self.budget_bytes / 2 {
            let mut guard = self.inner.lock();
            Self::insert_entry(&mut guard.0, key, entry, self.budget_bytes);
        }
        Ok(ids)
    }

    fn insert_entry(g: &mut Generations, key: u64, entry: Entry, budget: usize) {
        let cost = entry.cost();
        if let Some(old) = g.current.insert(key, entry) {
            g.current_bytes -= old.cost();
        }
        g.current_bytes += cost;
        if g.current_bytes > budget / 2 {
            g.previous = std::mem::take(&mut g.current);
            g.current_bytes = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_text() {
        let p = SegmentPolicy {
            delimiter: "<|im_start|>".into(),
        };
        let text = "a<|im_start|>b<|im_start|><|im_start|>c";
        let segs: Vec<&str> = p.segments(text).collect();
        assert_eq!(
            segs,
            vec!["a", "<|im_start|>b", "<|im_start|>", "<|im_start|>c"]
        );
        assert_eq!(segs.concat(), text);
        let segs: Vec<&str> = p.segments("<|im_start|>x").collect();
        assert_eq!(segs, vec!["<|im_start|>x"]);
        assert_eq!(p.segments("").count(), 0);
    }

    #[test]
    fn cache_is_bounded_and_hits() {
        let cache = SpanCache::new(4096);
        let mut calls = 0;
        for round in 0..3 {
            for i in 0..200 {
                let text = format!("segment number {i}");
                let ids = cache
                    .get_or_insert::<()>(&text, |t| {
                        calls += 1;
                        Ok(t.bytes().map(u32::from).collect())
                    })
                    .unwrap();
                assert_eq!(ids.len(), text.len());
            }
            assert!(cache.stats().bytes <= 4096 + 200, "round {round}");
        }
        let hit = cache.get_or_insert::<()>("segment number 199", |_| panic!("should hit"));
        assert!(hit.is_ok());
        assert!(calls >= 200);
    }
}
