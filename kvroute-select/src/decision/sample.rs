//! Candidate sampling on large pools: which endpoints a KV-exact decision
//! scores when the pool is larger than [`crate::Thresholds::sample_size`]
//! allows scoring in full.
//!
//! On a large fleet most endpoints hold the same part of a prompt (a shared
//! system prompt, or nothing); they differ only in load. A decision then
//! scores every endpoint that may save more prefill than that common part
//! (a longer prefix, or more of it in some faster tier) — the cache side
//! stays exact — and `sample_size` of the others drawn
//! at random: the best of `d` random choices balances load almost as well as
//! the best of all (Mitzenmacher, "The power of two choices in randomized
//! load balancing", IEEE TPDS 2001), and on load information that is
//! already stale it herds less than the global least-loaded (Mitzenmacher,
//! "How useful is old information?", IEEE TPDS 2000). Deciders draw
//! different samples (their rank is in the seed), so replicas deciding one
//! burst look at different endpoints.
//!
//! Everything here is one pass over the overlaps, and on a pool that
//! stands alike it costs per run of 64 endpoints the view scored alike
//! ([`kvroute_ingest::InventoryView::score_prefix_uniform`]) rather than per
//! endpoint; what it saves is the per-endpoint load, report, health and cost
//! work of every endpoint it leaves out.

use kvroute_ingest::Overlap;

use super::Decision;

/// Endpoints the pool's common standing does not dominate must be scored:
/// more than this share of the pool (`1 / SAMPLE_GIVE_UP`) and the decision
/// scores the whole pool instead.
const SAMPLE_GIVE_UP: usize = 2;

/// Endpoints probed for the standing most of the pool shares.
const PROBES: usize = 9;

/// Draws tried per sampled endpoint before giving up on filling the sample
/// (draws hitting an endpoint already in it are retried).
const DRAWS_PER_SAMPLE: usize = 4;

/// An endpoint's standing on the cache side: its credited prefix's blocks
/// per tier (GPU, CPU, disk, external), those only predicted entries credit
/// counted as GPU blocks, as the scorers count them. An endpoint whose
/// blocks are at most another's in every tier saves no more prefill there,
/// whatever the tiers' weights: it is *dominated*.
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
struct Standing([u32; 4]);

impl Standing {
    #[inline]
    fn of(o: &Overlap, predicted: u32) -> Self {
        let [gpu, cpu, disk, ext] = o.prefix_by_medium;
        let prefix = o.prefix.max(predicted);
        let tiered = gpu
            .saturating_add(cpu)
            .saturating_add(disk)
            .saturating_add(ext);
        Self([
            gpu.saturating_add(prefix.saturating_sub(tiered)),
            cpu,
            disk,
            ext,
        ])
    }

    /// At most `other`'s blocks in every tier.
    #[inline]
    fn within(self, other: Self) -> bool {
        let (a, b) = (self.0, other.0);
        (a[0] <= b[0]) & (a[1] <= b[1]) & (a[2] <= b[2]) & (a[3] <= b[3])
    }
}

/// Chooses the endpoints a decision over `n` endpoints scores, into
/// `d.sampled` (ascending), or leaves it empty to score all of them: no
/// standing is shared by more than half of the pool, it does not dominate
/// more than half, or no endpoint holds any of the prompt (KV-exact then
/// misses, and the fallback chooses over the whole pool anyway). `seed`
/// differs per decision and per decider.
pub(super) fn choose(d: &mut Decision, n: usize, sample_size: usize, seed: u64) {
    d.sampled.clear();
    let predicted = |i: usize| d.speculative.get(i).copied().unwrap_or(0);
    // The standing more than half of the pool shares, if one does: the most
    // frequent among endpoints spread over the pool (a majority is
    // practically always among them), confirmed by the count below (else
    // every endpoint is scored).
    let probes: [Standing; PROBES] = std::array::from_fn(|k| {
        let i = (2 * k + 1) * n / (2 * PROBES);
        d.overlaps
            .get(i)
            .map_or_else(Standing::default, |o| Standing::of(o, predicted(i)))
    });
    let common = probes
        .iter()
        .max_by_key(|s| probes.iter().filter(|t| t == s).count())
        .copied()
        .unwrap_or_default();
    // Every endpoint the common standing does not dominate is scored (a
    // longer prefix, or more blocks in some tier). Without a standing most
    // of the pool shares, every endpoint is.
    let words = n.div_ceil(64);
    d.sample_marks.clear();
    d.sample_marks.resize(words, 0);
    let (mut kept, mut same) = (0usize, 0usize);
    let limit = n / SAMPLE_GIVE_UP;
    let overlaps = d.overlaps.get(..n).unwrap_or_default();
    let spec = d.speculative.get(..n).filter(|s| !s.is_empty());
    // The view's runs are the words here.
    const _: () = assert!(kvroute_ingest::UNIFORM_RUN == 64);
    for (w, (chunk, mark)) in overlaps.chunks(64).zip(&mut d.sample_marks).enumerate() {
        let uniform = d.uniform.get(w).copied().unwrap_or(false);
        let (keep, alike) = match spec {
            Some(spec) => word::<true>(
                chunk,
                uniform,
                spec.get(w * 64..).unwrap_or_default(),
                common,
            ),
            None => word::<false>(chunk, uniform, &[], common),
        };
        same += alike;
        kept += keep.count_ones() as usize;
        if kept > limit {
            d.sample_marks.clear();
            return;
        }
        *mark = keep;
    }
    if same * 2 <= n || (kept == 0 && common == Standing::default()) {
        d.sample_marks.clear();
        return;
    }
    // `sample_size` others, drawn at random without repetition.
    let mut state = seed;
    let mut drawn = 0usize;
    for _ in 0..sample_size.saturating_mul(DRAWS_PER_SAMPLE) {
        if drawn == sample_size {
            break;
        }
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let r = kvroute_core::mix::fmix64(state);
        // A multiply-shift maps the draw onto 0..n without a division.
        let i = ((u128::from(r) * n as u128) >> 64) as usize;
        if let Some(w) = d.sample_marks.get_mut(i / 64) {
            let bit = 1u64 << (i % 64);
            if *w & bit == 0 {
                *w |= bit;
                drawn += 1;
            }
        }
    }
    for (wi, w) in d.sample_marks.iter().enumerate() {
        let mut rest = *w;
        while rest != 0 {
            let bit = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            if let Ok(i) = u32::try_from(wi * 64 + bit) {
                d.sampled.push(i);
            }
        }
    }
}

/// One word of the pool (up to 64 endpoints, whose predicted prefixes
/// start `predicted` when `PREDICTED`): the endpoints `common` does not
/// dominate, as bits, and how many stand alike. This is the only pass over
/// the whole pool, and a large pool is mostly one standing: a word the view
/// scored all alike (`uniform`) is judged once, and an endpoint whose
/// figures equal its predecessor's reuses its verdict.
#[inline]
fn word<const PREDICTED: bool>(
    chunk: &[Overlap],
    uniform: bool,
    predicted: &[u32],
    common: Standing,
) -> (u64, usize) {
    let (mut kept, mut alike) = (0u64, 0usize);
    if let (true, Some(first)) = (uniform, chunk.first()) {
        let p = if PREDICTED {
            predicted.first().copied().unwrap_or(0)
        } else {
            0
        };
        if !PREDICTED || uniform_u32(chunk.len(), predicted, p) {
            let s = Standing::of(first, p);
            let all = u64::MAX >> (64 - chunk.len().min(64));
            let keep = if s.within(common) { 0 } else { all };
            return (keep, if s == common { chunk.len() } else { 0 });
        }
    }
    // The previous endpoint's inputs (prefix, tiers, predicted prefix, two
    // to a word) and verdict, starting from those of an endpoint holding
    // nothing.
    let empty = Standing::default();
    let mut last = ([0u64; 3], empty == common, !empty.within(common));
    let pair = |a: u32, b: u32| u64::from(a) | u64::from(b) << 32;
    for (j, o) in chunk.iter().enumerate().take(64) {
        let p = if PREDICTED {
            predicted.get(j).copied().unwrap_or(0)
        } else {
            0
        };
        let [g, c, d, e] = o.prefix_by_medium;
        let inputs = [pair(o.prefix, g), pair(c, d), pair(e, p)];
        // One branch, well predicted on a pool of mostly one standing.
        let differs = (inputs[0] ^ last.0[0]) | (inputs[1] ^ last.0[1]) | (inputs[2] ^ last.0[2]);
        if differs != 0 {
            let s = Standing::of(o, p);
            last = (inputs, s == common, !s.within(common));
        }
        alike += usize::from(last.1);
        kept |= u64::from(last.2) << j;
    }
    (kept, alike)
}

/// Whether the first `len` predicted prefixes all equal `p` (missing ones
/// read as 0).
#[inline]
fn uniform_u32(len: usize, predicted: &[u32], p: u32) -> bool {
    let head = predicted.get(..len).unwrap_or(predicted);
    let diff = head.iter().fold(0u32, |acc, x| acc | (x ^ p));
    diff == 0 && (head.len() == len || p == 0)
}

/// The seed of one decision's sample: the rule's seed, the decider's rank
/// and the rule's sample counter, mixed.
pub(super) fn seed(rule_seed: u64, rank: u32, turn: u64) -> u64 {
    kvroute_core::mix::fmix64(rule_seed ^ (u64::from(rank) << 40) ^ turn.rotate_left(17))
}
