//! Exact tokenization of long texts on several threads.
//!
//! A long text is cut at *seams* — positions where the tokenizer provably
//! cannot merge across — the pieces are encoded on a bounded worker pool and
//! the ids concatenated. The result is the ids of one full encode.
//!
//! Why a seam is exact: [`SeamPolicy`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use tokenizers::Tokenizer;

use super::PromptError;

/// Settings of a [`ParallelEncoder`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelConfig {
    /// Worker threads of the pool (≥ 1; 1 keeps every encode on the caller's
    /// thread and starts no thread).
    pub threads: usize,
    /// Texts shorter than this many bytes are encoded in one piece on the
    /// caller's thread (splitting costs more than it saves).
    pub min_bytes: usize,
    /// Pieces per thread a long text is cut into (more pieces even out
    /// pieces that tokenize at different speeds).
    pub pieces_per_thread: usize,
    /// Bytes on each side of a seam re-encoded to check it.
    pub window_bytes: usize,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            threads: 2,
            min_bytes: 16 * 1024,
            pieces_per_thread: 2,
            window_bytes: 128,
        }
    }
}

/// Errors of [`ParallelEncoder::new`].
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// The worker pool could not be built (threads could not be spawned).
    #[error("building the tokenizer worker pool: {0}")]
    Pool(String),
}

/// A bounded pool of tokenizer threads (sized by [`ParallelConfig::threads`])
/// and the splitting rules. Built once by the caller and shared; concurrent
/// encodes queue on the same threads.
///
/// A long text is cut at seams ([`SeamPolicy`]), the pieces are encoded on
/// the pool and the ids concatenated: the ids of one full encode. Attach it
/// to a tokenizer with [`ModelTokenizer::set_parallel`](super::ModelTokenizer::set_parallel)
/// or [`TokenizerPool::set_parallel`](super::TokenizerPool::set_parallel).
///
/// ```
/// use kvroute_engines::prompt::{ParallelConfig, ParallelEncoder};
/// let encoder = ParallelEncoder::new(ParallelConfig { threads: 2, ..ParallelConfig::default() })?;
/// assert_eq!(encoder.threads(), 2);
/// # Ok::<(), kvroute_engines::prompt::ParallelError>(())
/// ```
pub struct ParallelEncoder {
    pool: Option<rayon::ThreadPool>,
    config: ParallelConfig,
}

impl std::fmt::Debug for ParallelEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelEncoder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Longest stretch scanned past a piece's target end for a seam.
const MAX_SCAN: usize = 16 * 1024;

impl ParallelEncoder {
    /// A pool of `config.threads` workers (none when `threads <= 1`).
    pub fn new(config: ParallelConfig) -> Result<Self, ParallelError> {
        let pool = if config.threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(config.threads)
                    .thread_name(|i| format!("kvroute-tokenize-{i}"))
                    .build()
                    .map_err(|e| ParallelError::Pool(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Self { pool, config })
    }

    /// Worker threads (1: no pool).
    #[must_use]
    pub fn threads(&self) -> usize {
        self.config.threads.max(1)
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &ParallelConfig {
        &self.config
    }

    /// The pool when `text` is to be split: long, a seam policy given, and
    /// the caller not one of the pool's own threads (it would wait for
    /// pieces queued behind itself).
    fn pool_for(&self, policy: Option<&SeamPolicy>, text: &str) -> Option<&rayon::ThreadPool> {
        self.pool.as_ref().filter(|pool| {
            policy.is_some()
                && text.len() >= self.config.min_bytes
                && pool.current_thread_index().is_none()
        })
    }

    /// Ids of `text` without special tokens added, identical to
    /// `tokenizer.encode_fast(text, false)`: split at seams and encoded on the
    /// pool when the text is long and `policy` (from
    /// [`SeamPolicy::for_tokenizer`] of this `tokenizer`) is given, in one
    /// piece on the caller's thread otherwise.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        policy: Option<&SeamPolicy>,
        text: &str,
    ) -> Result<Vec<u32>, PromptError> {
        self.encode_with(&|t: &str| encode_one(tokenizer, t), policy, text)
    }

    /// [`Self::encode`] with `enc` as the whole-text encoder of the pieces
    /// and the seam checks: any function giving `encode_fast(text, false)`'s
    /// ids of the tokenizer `policy` was proven for (the fast byte-level
    /// BPE path of [`super::ModelTokenizer`]).
    pub(crate) fn encode_with<G>(
        &self,
        enc: &G,
        policy: Option<&SeamPolicy>,
        text: &str,
    ) -> Result<Vec<u32>, PromptError>
    where
        G: Fn(&str) -> Result<Vec<u32>, PromptError> + Sync,
    {
        if self.pool_for(policy, text).is_none() {
            return enc(text);
        }
        let mut ids = Vec::new();
        self.encode_each_with(enc, policy, text, |part: &[u32]| {
            if ids.is_empty() {
                // About 4 bytes per token in prose: one reservation for most texts.
                ids.reserve(part.len().max(text.len() / 3));
            }
            ids.extend_from_slice(part);
            Ok::<_, PromptError>(())
        })?;
        Ok(ids)
    }

    /// [`Self::encode`] that hands the ids to `sink` piece by piece, in text
    /// order, as soon as a piece and every piece before it are encoded. The
    /// sink runs on the caller's thread while later pieces still encode on
    /// the pool, so work on the first ids (hashing their blocks) overlaps the
    /// tokenization of the rest. The concatenation of what `sink` receives is
    /// `encode`'s result. A sink error stops the delivery, skips pieces not
    /// started yet and is returned.
    ///
    /// Called from a thread of this pool it encodes the text in one piece on
    /// that thread.
    ///
    /// ```
    /// use kvroute_engines::prompt::{ParallelConfig, ParallelEncoder, SeamPolicy};
    /// # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
    /// # let tok = kvroute_engines::prompt::ModelTokenizer::load(&dir, &Default::default()).unwrap();
    /// let tokenizer = tok.tokenizer();
    /// let policy = SeamPolicy::for_tokenizer(tokenizer);
    /// let encoder = ParallelEncoder::new(ParallelConfig { min_bytes: 64, ..ParallelConfig::default() })?;
    /// let text = "the router keeps a prefix of every prompt and sends it on ".repeat(20);
    /// let mut pieces = Vec::new();
    /// encoder.encode_each(tokenizer, policy.as_ref(), &text, |ids| {
    ///     pieces.push(ids.to_vec());
    ///     Ok::<_, kvroute_engines::prompt::PromptError>(())
    /// })?;
    /// assert!(pieces.len() > 1);
    /// assert_eq!(pieces.concat(), tokenizer.encode_fast(text.as_str(), false).unwrap().get_ids());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn encode_each<E, F>(
        &self,
        tokenizer: &Tokenizer,
        policy: Option<&SeamPolicy>,
        text: &str,
        sink: F,
    ) -> Result<(), E>
    where
        E: From<PromptError>,
        F: FnMut(&[u32]) -> Result<(), E>,
    {
        self.encode_each_with(&|t: &str| encode_one(tokenizer, t), policy, text, sink)
    }

    /// [`Self::encode_each`] with `enc` as the encoder ([`Self::encode_with`]).
    pub(crate) fn encode_each_with<E, F, G>(
        &self,
        enc: &G,
        policy: Option<&SeamPolicy>,
        text: &str,
        sink: F,
    ) -> Result<(), E>
    where
        E: From<PromptError>,
        F: FnMut(&[u32]) -> Result<(), E>,
        G: Fn(&str) -> Result<Vec<u32>, PromptError> + Sync,
    {
        let window = self.config.window_bytes;
        self.encode_each_checked(enc, policy, text, sink, |lo, p| {
            window_agrees(enc, text, lo, p, window)
        })
    }

    /// [`Self::encode_each`] with the seam check as a parameter (`check(lo,
    /// p)`: may `text` be cut at `p`, the previous cut being `lo`), so tests
    /// can make seams fail.
    ///
    /// The cuts are chosen first by the byte rule alone ([`SeamPolicy`]) and
    /// every piece starts encoding at once; the task of piece `k` checks the
    /// seam it starts at before encoding, so the checks run on the pool in
    /// parallel instead of one after the other before any piece starts. A
    /// piece is delivered only when the seam it ends at has passed. When a
    /// seam fails (it never has: the rule is proven, the check is a guard),
    /// the rest of the text from the last delivered cut — a cut that passed —
    /// is encoded in one piece on the caller's thread.
    fn encode_each_checked<E, F, C, G>(
        &self,
        enc: &G,
        policy: Option<&SeamPolicy>,
        text: &str,
        mut sink: F,
        check: C,
    ) -> Result<(), E>
    where
        E: From<PromptError>,
        F: FnMut(&[u32]) -> Result<(), E>,
        C: Fn(usize, usize) -> bool + Sync,
        G: Fn(&str) -> Result<Vec<u32>, PromptError> + Sync,
    {
        let Some(pool) = self.pool_for(policy, text) else {
            return sink(&enc(text)?);
        };
        let want = self
            .threads()
            .saturating_mul(self.config.pieces_per_thread.max(1));
        let cuts = candidate_seams(text, want);
        if cuts.is_empty() {
            return sink(&enc(text)?);
        }
        // bounds[k]..bounds[k + 1] is piece k.
        let mut bounds = Vec::with_capacity(cuts.len() + 2);
        bounds.push(0);
        bounds.extend_from_slice(&cuts);
        bounds.push(text.len());
        let n = bounds.len() - 1;
        let bounds = &bounds;
        let stop = AtomicBool::new(false);
        let (tx, rx) = mpsc::channel::<Done>();
        // The scope body runs here, on the caller's thread: it receives the
        // pieces as the workers finish them and feeds the sink in order. The
        // scope returns only when every spawned piece is done or skipped.
        pool.in_place_scope(|scope| {
            for k in 0..n {
                let (tx, stop, check) = (tx.clone(), &stop, &check);
                scope.spawn(move |_| {
                    let (Some(&from), Some(&to)) = (bounds.get(k), bounds.get(k + 1)) else {
                        return;
                    };
                    if k > 0 {
                        let lo = bounds.get(k - 1).copied().unwrap_or(0);
                        let ok = check(lo, from);
                        // A closed receiver means the caller stopped: nothing to do.
                        if tx.send(Done::Seam(k, ok)).is_err() || !ok {
                            return;
                        }
                    }
                    if !stop.load(Ordering::Relaxed) {
                        let piece = text.get(from..to).unwrap_or_default();
                        let _ = tx.send(Done::Piece(k, enc(piece)));
                    }
                });
            }
            drop(tx);
            let stopped = |e: E| {
                stop.store(true, Ordering::Relaxed);
                Err(e)
            };
            let mut ready: Vec<Option<Vec<u32>>> = vec![None; n];
            // seam[k]: the check of the cut piece k starts at (piece 0's is
            // the start of the text).
            let mut seam: Vec<Option<bool>> = vec![None; n];
            if let Some(first) = seam.first_mut() {
                *first = Some(true);
            }
            let mut next = 0;
            loop {
                // Deliver every piece whose ids are here and whose end passed.
                while next < n {
                    let end = if next + 1 < n {
                        seam.get(next + 1).copied().flatten()
                    } else {
                        Some(true)
                    };
                    match end {
                        Some(false) => {
                            stop.store(true, Ordering::Relaxed);
                            let from = bounds.get(next).copied().unwrap_or(0);
                            tracing::debug!(cut = bounds.get(next + 1), "seam check failed");
                            let rest = enc(text.get(from..).unwrap_or_default());
                            return match rest {
                                Ok(ids) => sink(&ids),
                                Err(e) => Err(E::from(e)),
                            };
                        }
                        None => break,
                        Some(true) => {
                            let Some(part) = ready.get_mut(next).and_then(Option::take) else {
                                break;
                            };
                            if let Err(e) = sink(&part) {
                                return stopped(e);
                            }
                            next += 1;
                        }
                    }
                }
                if next >= n {
                    return Ok(());
                }
                match rx.recv() {
                    Ok(Done::Seam(k, ok)) => {
                        if let Some(s) = seam.get_mut(k) {
                            *s = Some(ok);
                        }
                    }
                    Ok(Done::Piece(k, Ok(part))) => {
                        if let Some(slot) = ready.get_mut(k) {
                            *slot = Some(part);
                        }
                    }
                    Ok(Done::Piece(_, Err(e))) => return stopped(E::from(e)),
                    // Every sender is gone with pieces missing: only a
                    // panicking worker does that (rayon re-raises it at the
                    // end of the scope).
                    Err(_) => {
                        return Err(E::from(PromptError::Tokenize(
                            "a tokenizer worker stopped".into(),
                        )))
                    }
                }
            }
        })
    }
}

/// What a piece's task reports to the caller's thread.
enum Done {
    /// The check of the seam piece `.0` starts at.
    Seam(usize, bool),
    /// Piece `.0`'s ids.
    Piece(usize, Result<Vec<u32>, PromptError>),
}

fn encode_one(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PromptError> {
    tokenizer
        .encode_fast(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| PromptError::Tokenize(e.to_string()))
}

/// Proof, for one tokenizer, that its pipeline is one the seam rule below
/// holds for; built once per tokenizer by [`SeamPolicy::for_tokenizer`] and
/// passed to [`ParallelEncoder::encode`].
///
/// # Why a seam is exact
///
/// A seam is a byte position `p` with an ASCII letter at `p - 1`, a space at
/// `p` and an ASCII letter at `p + 1`, in a tokenizer whose pipeline is
/// (checked by [`SeamPolicy::for_tokenizer`]): no normalizer or NFC; a GPT-style
/// pre-tokenizer — `ByteLevel` with its own regex, or a `Split` on a regex
/// whose letter alternative is `…\p{L}+` followed by `ByteLevel` without a
/// regex (Qwen2/Qwen3, Llama 3, GPT-4 style) —; a BPE model; no added token
/// containing a space or stripping whitespace around itself.
///
/// * NFC cannot compose across `p`: the space is a starter that is never the
///   second element of a composition, and the letter before it has nothing
///   after it to compose with.
/// * Added tokens are matched on the raw text first; none contains a space,
///   so no match crosses `p`.
/// * The regex pre-token holding the letter at `p - 1` is a run of letters (a
///   letter alternative or a contraction) and ends there, because the space
///   is not a letter; the next pre-token starts at `p` in the whole text and
///   in the right piece alike. Matching is left to right and the only
///   lookahead (`\s+(?!\S)`) looks one character ahead of a whitespace run,
///   which before `p` lies before `p`. So both pieces pre-tokenize exactly as
///   their part of the whole text, and BPE never merges across pre-tokens.
///
/// Each seam is also checked by encoding a window around it whole and in two
/// halves ([`ParallelConfig::window_bytes`]), on the pool beside the pieces;
/// past a seam that fails, the rest of the text is encoded in one piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeamPolicy {
    _proven: (),
}

impl SeamPolicy {
    /// `Some` when `tokenizer`'s normalizer, pre-tokenizer, model and added
    /// tokens are of the kinds the seam rule is proven for; other tokenizers
    /// are always encoded whole.
    #[must_use]
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Option<Self> {
        supports_seams(tokenizer).then_some(Self { _proven: () })
    }
}

/// True when `tokenizer`'s pipeline is one the seam rule is proven for.
#[must_use]
pub(crate) fn supports_seams(tokenizer: &Tokenizer) -> bool {
    let normalizer_ok = match tokenizer.get_normalizer() {
        None => true,
        Some(n) => serde_json::to_value(n).is_ok_and(|v| is_type(&v, "NFC")),
    };
    let model_ok = matches!(tokenizer.get_model(), tokenizers::ModelWrapper::BPE(_));
    let added_ok = tokenizer
        .get_added_tokens_decoder()
        .values()
        .all(|t| !t.content.contains(' ') && !t.lstrip && !t.rstrip);
    let pre_ok = tokenizer
        .get_pre_tokenizer()
        .and_then(|p| serde_json::to_value(p).ok())
        .is_some_and(|v| pre_tokenizer_ok(Some(&v)));
    // The rule takes added tokens as matched before pre-tokenizing; encoded
    // as text they are not.
    let specials_matched = !tokenizer.get_encode_special_tokens();
    normalizer_ok && model_ok && added_ok && pre_ok && specials_matched
}

fn is_type(v: &serde_json::Value, name: &str) -> bool {
    v.get("type").and_then(|t| t.as_str()) == Some(name)
}

fn byte_level_with_regex(v: &serde_json::Value, use_regex: bool) -> bool {
    is_type(v, "ByteLevel")
        && v.get("use_regex").and_then(|u| u.as_bool()) == Some(use_regex)
        && v.get("add_prefix_space").and_then(|u| u.as_bool()) == Some(false)
}

fn pre_tokenizer_ok(pre: Option<&serde_json::Value>) -> bool {
    let Some(pre) = pre else {
        return false;
    };
    if byte_level_with_regex(pre, true) {
        return true;
    }
    let Some(steps) = pre
        .get("pretokenizers")
        .and_then(|p| p.as_array())
        .filter(|_| is_type(pre, "Sequence"))
    else {
        return false;
    };
    let [split, byte_level] = steps.as_slice() else {
        return false;
    };
    let regex = split
        .get("pattern")
        .and_then(|p| p.get("Regex"))
        .and_then(|r| r.as_str())
        .unwrap_or("");
    is_type(split, "Split")
        && split.get("behavior").and_then(|b| b.as_str()) == Some("Isolated")
        && split.get("invert").and_then(|b| b.as_bool()) == Some(false)
        && regex.contains(r"\p{L}+")
        && !regex.contains(r"\p{L}+\s")
        && byte_level_with_regex(byte_level, false)
}

#[inline]
fn is_seam(bytes: &[u8], p: usize) -> bool {
    let at = |i: usize| bytes.get(i).copied().unwrap_or(0);
    p > 0 && at(p) == b' ' && at(p - 1).is_ascii_alphabetic() && at(p + 1).is_ascii_alphabetic()
}

/// Moves `i` down to the nearest char boundary of `text`.
fn floor_boundary(text: &str, mut i: usize) -> usize {
    while i > 0 && !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_boundary(text: &str, mut i: usize) -> usize {
    while i < text.len() && !text.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// Re-encodes `window` bytes each side of `p` whole and in two halves.
fn window_agrees<G>(enc: &G, text: &str, lo: usize, p: usize, window: usize) -> bool
where
    G: Fn(&str) -> Result<Vec<u32>, PromptError>,
{
    let a = floor_boundary(text, p.saturating_sub(window).max(lo));
    let b = ceil_boundary(text, p.saturating_add(window).min(text.len()));
    let (Some(whole), Some(left), Some(right)) = (text.get(a..b), text.get(a..p), text.get(p..b))
    else {
        return false;
    };
    match (enc(whole), enc(left), enc(right)) {
        (Ok(w), Ok(l), Ok(r)) => {
            w.len() == l.len() + r.len() && w.starts_with(&l) && w.ends_with(&r)
        }
        _ => false,
    }
}

/// Up to `pieces - 1` seam positions (ascending byte offsets) cutting `text`
/// into about `pieces` equal parts, each checked by `window_agrees`. Fewer
/// when the text has no seam near a target (e.g. CJK or code without
/// `letter space letter`). Meaningful only for a tokenizer with a
/// [`SeamPolicy`].
#[must_use]
pub fn seams(tokenizer: &Tokenizer, text: &str, pieces: usize, window: usize) -> Vec<usize> {
    let enc = |t: &str| encode_one(tokenizer, t);
    seams_where(text, pieces, |lo, p| {
        window_agrees(&enc, text, lo, p, window)
    })
}

/// The seams of [`seams`] by the byte rule alone, unchecked.
fn candidate_seams(text: &str, pieces: usize) -> Vec<usize> {
    seams_where(text, pieces, |_, _| true)
}

/// For each of `pieces - 1` equally spaced targets, the first seam at or
/// after it (within [`MAX_SCAN`] bytes, past the previous cut) that `accept(previous
/// cut, seam)` takes.
fn seams_where(text: &str, pieces: usize, accept: impl Fn(usize, usize) -> bool) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    if pieces < 2 {
        return out;
    }
    let step = text.len() / pieces;
    let mut last = 0usize;
    for k in 1..pieces {
        let target = (k * step).max(last + 1);
        let end = target.saturating_add(MAX_SCAN).min(text.len());
        let mut p = target;
        while p < end {
            if is_seam(bytes, p) && accept(last, p) {
                out.push(p);
                last = p;
                break;
            }
            p += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;

    fn qwen3() -> &'static Tokenizer {
        static T: OnceLock<super::super::ModelTokenizer> = OnceLock::new();
        T.get_or_init(|| {
            let dir =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
            super::super::ModelTokenizer::load(&dir, &Default::default()).unwrap()
        })
        .tokenizer()
    }

    fn reference(text: &str) -> Vec<u32> {
        encode_one(qwen3(), text).unwrap()
    }

    /// A seam whose check fails: the pieces before it are delivered, the
    /// rest of the text from the last passed cut comes in one piece, and the
    /// ids are those of one full encode — for each seam failing in turn.
    #[test]
    fn a_failing_seam_check_falls_back_to_one_piece_for_the_rest() {
        let tok = qwen3();
        let policy = SeamPolicy::for_tokenizer(tok);
        let enc = ParallelEncoder::new(ParallelConfig {
            threads: 2,
            min_bytes: 0,
            pieces_per_thread: 3,
            window_bytes: 32,
        })
        .unwrap();
        let text = "The router keeps the prefix of every prompt. ".repeat(300);
        let cuts = candidate_seams(&text, 6);
        assert_eq!(cuts.len(), 5);
        let want = reference(&text);
        for (i, &bad) in cuts.iter().enumerate() {
            let mut parts = Vec::new();
            enc.encode_each_checked(
                &|t: &str| encode_one(tok, t),
                policy.as_ref(),
                &text,
                |ids| {
                    parts.push(ids.to_vec());
                    Ok::<_, PromptError>(())
                },
                |_, p| p != bad,
            )
            .unwrap();
            // Pieces 0..=i end at passed seams; the rest is one piece.
            assert_eq!(parts.len(), i + 1, "seam {i} failing");
            assert_eq!(parts.concat(), want, "seam {i} failing");
        }
        // With every check passing: one part per piece.
        let mut n = 0;
        enc.encode_each(tok, policy.as_ref(), &text, |_| {
            n += 1;
            Ok::<_, PromptError>(())
        })
        .unwrap();
        assert_eq!(n, 6);
    }
}
