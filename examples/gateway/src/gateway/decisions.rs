//! Why a request went where it did: the last `[decisions] ring` decisions'
//! explanations, served by `GET /admin/decisions/{id}` (the id is each
//! response's `x-kvroute-decision-id`), and the compact
//! `x-kvroute-explain` response header a request asks for with
//! `x-kvroute-explain: 1` when `[decisions] explain = true`.
//!
//! An entry keeps the library's [`Explanation`] as the decision's last pick
//! left it (every endpoint's cached prefix and load, each ladder step, the
//! cost scorer's terms, cap and verdict) and, once the engine's receipt
//! settled it, the decision's cached-token account. Memory is bounded by
//! the ring's size times the rules' endpoint counts; the oldest entry goes
//! first.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use axum::http::{HeaderMap, HeaderValue};
use kvroute_select::{
    EndpointExplain, Explanation, Leg, LostCause, MissReason, Role, ScoreSummary, TokenAccount,
};
use parking_lot::Mutex;
use serde_json::{json, Value};

use super::state::RuleRuntime;

/// Response header carrying the decision's id (`GET /admin/decisions/{id}`).
pub const DECISION_ID_HEADER: &str = "x-kvroute-decision-id";
/// Request header asking for the explanation (`1`), and the response
/// header carrying it compactly.
pub const EXPLAIN_HEADER: &str = "x-kvroute-explain";

/// One explained decision.
struct Entry {
    id: u64,
    rule: String,
    /// The rule's runtime, for endpoint URLs (not kept alive by the ring:
    /// a replaced or removed rule's entries show indices only).
    runtime: Weak<RuleRuntime>,
    explanation: Box<Explanation>,
    /// The account as the receipt settled it.
    settled: Option<TokenAccount>,
    /// What the entry holds in memory (counted against the ring's bound).
    bytes: usize,
}

/// Memory an entry holds: its own size, the rule name and the
/// explanation's buffers.
fn entry_bytes(rule: &str, x: &Explanation) -> usize {
    std::mem::size_of::<Entry>()
        + std::mem::size_of::<Explanation>()
        + rule.len()
        + x.endpoints.capacity() * std::mem::size_of::<EndpointExplain>()
        + x.picks.capacity() * std::mem::size_of::<kvroute_select::PickStep>()
}

/// The bounded ring of explained decisions.
#[derive(Default)]
pub struct DecisionRing {
    capacity: usize,
    max_bytes: usize,
    next: AtomicU64,
    /// The entries, oldest first, and the bytes they hold.
    entries: Mutex<(VecDeque<Entry>, usize)>,
}

impl std::fmt::Debug for DecisionRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionRing")
            .field("capacity", &self.capacity)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl DecisionRing {
    /// A ring keeping the last `capacity` decisions (0: none) in at most
    /// `max_bytes` of memory (0: none).
    #[must_use]
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        let capacity = if max_bytes == 0 { 0 } else { capacity };
        Self {
            capacity,
            max_bytes,
            next: AtomicU64::new(1),
            entries: Mutex::new((VecDeque::with_capacity(capacity.min(4096)), 0)),
        }
    }

    /// Decisions kept at most.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether decisions are kept.
    #[must_use]
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Keeps `explanation` under a new id, dropping the oldest entry beyond
    /// the capacity; `None` when the ring keeps nothing.
    pub fn record(&self, rt: &Arc<RuleRuntime>, explanation: Box<Explanation>) -> Option<u64> {
        self.push(rt.spec.doc.name.clone(), Arc::downgrade(rt), explanation)
    }

    fn push(
        &self,
        rule: String,
        runtime: Weak<RuleRuntime>,
        explanation: Box<Explanation>,
    ) -> Option<u64> {
        if self.capacity == 0 {
            return None;
        }
        let bytes = entry_bytes(&rule, &explanation);
        let mut guard = self.entries.lock();
        let (entries, held) = &mut *guard;
        // Ids are taken under the lock so the ring stays sorted by id.
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        while entries.len() >= self.capacity
            || (!entries.is_empty() && held.saturating_add(bytes) > self.max_bytes)
        {
            if let Some(old) = entries.pop_front() {
                *held = held.saturating_sub(old.bytes);
            }
        }
        *held = held.saturating_add(bytes);
        entries.push_back(Entry {
            id,
            rule,
            runtime,
            explanation,
            settled: None,
            bytes,
        });
        Some(id)
    }

    /// Records the settled account of decision `id` (ignored once it left
    /// the ring).
    pub fn settle(&self, id: u64, account: TokenAccount) {
        let mut guard = self.entries.lock();
        let entries = &mut guard.0;
        let Some(first) = entries.front().map(|e| e.id) else {
            return;
        };
        let at = usize::try_from(id.saturating_sub(first)).unwrap_or(usize::MAX);
        if let Some(e) = entries.get_mut(at).filter(|e| e.id == id) {
            e.settled = Some(account);
        }
    }

    /// Decision `id` as `GET /admin/decisions/{id}` shows it; `None` when it
    /// is not (or no longer) in the ring.
    #[must_use]
    pub fn get(&self, id: u64) -> Option<Value> {
        let guard = self.entries.lock();
        let entries = &guard.0;
        let first = entries.front()?.id;
        let at = usize::try_from(id.checked_sub(first)?).ok()?;
        let e = entries.get(at).filter(|e| e.id == id)?;
        let rt = e.runtime.upgrade();
        Some(render(e, rt.as_deref()))
    }

    /// Decisions kept now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.lock().0.len()
    }

    /// Bytes the kept decisions hold.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.entries.lock().1
    }

    /// Whether the ring holds no decision.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether a request asked for its explanation (`x-kvroute-explain: 1`).
#[must_use]
pub fn asked(headers: &HeaderMap) -> bool {
    headers
        .get(EXPLAIN_HEADER)
        .is_some_and(|v| v.as_bytes().trim_ascii() == b"1")
}

/// Files a decision's explanation (when it recorded one): into `ring`
/// (when given), with its id in `x-kvroute-decision-id`, and compactly in
/// `x-kvroute-explain` when `header`. Returns the ring id.
pub fn file(
    ring: Option<&DecisionRing>,
    rt: &Arc<RuleRuntime>,
    x: Option<Box<Explanation>>,
    header: bool,
    headers: &mut HeaderMap,
) -> Option<u64> {
    let x = x?;
    if header {
        if let Ok(v) = HeaderValue::from_str(&compact(&x)) {
            headers.insert(EXPLAIN_HEADER, v);
        }
    }
    let id = ring?.record(rt, x)?;
    headers.insert(DECISION_ID_HEADER, HeaderValue::from(id));
    Some(id)
}

fn role(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}

fn leg(l: Leg) -> &'static str {
    match l {
        Leg::Endpoint => "endpoint",
        Leg::Decode => "decode",
    }
}

fn account_json(a: &TokenAccount) -> Value {
    let lost: serde_json::Map<String, Value> = LostCause::ALL
        .iter()
        .map(|c| (c.as_str().to_owned(), json!(a.lost_to(*c))))
        .collect();
    json!({
        "reachable": a.reachable,
        "predicted": a.predicted,
        "achieved": a.achieved,
        "settled": a.settled,
        "lost": lost,
    })
}

fn render(e: &Entry, rt: Option<&RuleRuntime>) -> Value {
    let x = &e.explanation;
    let url = |i: usize| -> Value {
        rt.and_then(|r| r.endpoint(i))
            .map_or(Value::Null, |s| json!(s.url))
    };
    let endpoint =
        |id: Option<kvroute_core::EndpointId>| id.map_or(Value::Null, |i| url(i.index()));
    let picks: Vec<Value> = x
        .picks
        .iter()
        .map(|p| {
            json!({
                "tier": p.tier.as_str(),
                "miss_reason": p.miss.map(MissReason::as_str),
                "endpoint": endpoint(p.endpoint),
                "endpoint_index": p.endpoint.map(|i| i.index()),
                "decode_endpoint": endpoint(p.decode),
                "failed": p.failed.map(|(id, l)| json!({"endpoint": url(id.index()), "endpoint_index": id.index(), "leg": leg(l)})),
                "predicted_blocks": p.predicted_blocks,
                "diverted": p.diverted,
            })
        })
        .collect();
    let endpoints: Vec<Value> = x
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, r)| endpoint_json(i, r, url(i)))
        .collect();
    let last = x.last_pick();
    json!({
        "id": e.id,
        "rule": e.rule,
        "tier": last.map(|p| p.tier.as_str()),
        "endpoint": endpoint(last.and_then(|p| p.endpoint)),
        "endpoint_index": last.and_then(|p| p.endpoint).map(|i| i.index()),
        "decode_endpoint": endpoint(last.and_then(|p| p.decode)),
        "miss_reason": last.and_then(|p| p.miss).map(MissReason::as_str),
        "prompt_tokens": x.prompt_tokens,
        "block_size": x.block_size,
        "keys": x.keys,
        "key_miss": x.key_miss.map(MissReason::as_str),
        "picks": picks,
        "scorer": x.scorer.as_ref().map(|s| scorer_json(s, &url)),
        "endpoints": endpoints,
        "account": account_json(&x.account),
        "settled_account": e.settled.as_ref().map(account_json),
    })
}

fn endpoint_json(i: usize, r: &EndpointExplain, url: Value) -> Value {
    json!({
        "index": i,
        "endpoint": url,
        "role": role(r.role),
        "capacity": r.capacity,
        "eligible": r.ineligible.is_none(),
        "excluded": r.ineligible.map(kvroute_select::Ineligible::as_str),
        "confirmed_prefix_blocks": r.confirmed_prefix_blocks,
        "confirmed_blocks": r.confirmed_blocks,
        "predicted_prefix_blocks": r.predicted_prefix_blocks,
        "contract_mismatch": r.contract_mismatch,
        "in_flight": r.in_flight,
        "queued_prefill_tokens": r.queued_prefill_tokens,
        "reported": r.reported.map(|p| json!({
            "running": p.running,
            "waiting": p.waiting,
            "kv_usage": p.kv_usage,
        })),
        "terms": r.terms.map(|t| json!({
            "cached_tokens": t.cached_tokens,
            "prefill_tokens": t.prefill_tokens,
            "queued_tokens": t.queued_tokens,
            "unseen_tokens": t.unseen_tokens,
            "spill_tokens": t.spill_tokens,
            "evict_tokens": t.evict_tokens,
            "in_flight_tokens": t.in_flight_tokens,
            "ttft": t.ttft,
            "cost": t.cost,
            "under_cap": t.under_cap,
        })),
    })
}

fn scorer_json(s: &ScoreSummary, url: &dyn Fn(usize) -> Value) -> Value {
    json!({
        "cap": s.cap.map(|c| json!({
            "total_in_flight": c.bound.total_in_flight,
            "total_capacity": c.bound.total_capacity,
            "factor": c.bound.factor,
            "headroom": c.headroom,
            "applied": c.applied,
            "refused": c.refused,
        })),
        "admitted_prefix_blocks": s.admitted_prefix_blocks,
        "cheapest": s.cheapest.map(url),
        "cheapest_index": s.cheapest,
        "longest": s.longest.map(url),
        "longest_index": s.longest,
        "affinity_bound": s.affinity_bound,
        "verdict": s.verdict.map(kvroute_select::Verdict::as_str),
    })
}

/// The explanation in one header value: `;`-separated `key=value` pairs —
/// the ladder step and chosen endpoint index, the scorer's verdict, the
/// account (`reachable`, `predicted`, `lost=cause:n,...`), then one `eN=`
/// per endpoint: `c` confirmed and `p` predicted prefix blocks, `q` queued
/// prefill tokens, `f` in flight, then `cap` when the load cap refused it,
/// `ttft` its predicted time to first token, or `!reason` when it was not
/// a candidate.
#[must_use]
pub fn compact(x: &Explanation) -> String {
    let mut s = String::with_capacity(64 + 32 * x.endpoints.len());
    let last = x.last_pick();
    let _ = write!(s, "tier={}", last.map_or("exhausted", |p| p.tier.as_str()));
    if let Some(e) = last.and_then(|p| p.endpoint) {
        let _ = write!(s, ";endpoint={}", e.index());
    }
    if let Some(m) = last.and_then(|p| p.miss) {
        let _ = write!(s, ";miss={}", m.as_str());
    }
    if let Some(v) = x.scorer.and_then(|s| s.verdict) {
        let _ = write!(s, ";verdict={}", v.as_str());
    }
    let a = &x.account;
    let _ = write!(s, ";reachable={};predicted={}", a.reachable, a.predicted);
    let mut first = true;
    for c in LostCause::ALL {
        let n = a.lost_to(c);
        if n > 0 {
            s.push_str(if first { ";lost=" } else { "," });
            first = false;
            let _ = write!(s, "{}:{n}", c.as_str());
        }
    }
    for (i, r) in x.endpoints.iter().enumerate() {
        let _ = write!(
            s,
            ";e{i}=c{}/p{}/q{}/f{}",
            r.confirmed_prefix_blocks,
            r.predicted_prefix_blocks,
            r.queued_prefill_tokens,
            r.in_flight
        );
        if let Some(why) = r.ineligible {
            let _ = write!(s, "/!{}", why.as_str());
        } else if let Some(t) = r.terms {
            if t.under_cap {
                let _ = write!(s, "/ttft{:.1}", t.ttft);
            } else {
                s.push_str("/cap");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_names_the_step_the_account_and_each_endpoint() {
        let mut x = Explanation {
            endpoints: vec![EndpointExplain::default(); 2],
            ..Explanation::default()
        };
        x.endpoints[0].confirmed_prefix_blocks = 4;
        x.endpoints[0].in_flight = 3;
        x.endpoints[0].terms = Some(kvroute_select::ScoreTerms {
            under_cap: false,
            ..Default::default()
        });
        x.endpoints[1].ineligible = Some(kvroute_select::Ineligible::ConnectFailed);
        x.account.reachable = 16;
        x.account.lost[LostCause::LoadCap.index()] = 16;
        let c = compact(&x);
        assert_eq!(
            c,
            "tier=exhausted;reachable=16;predicted=0;lost=load_cap:16;e0=c4/p0/q0/f3/cap;e1=c0/p0/q0/f0/!connect_failed"
        );
        assert!(HeaderValue::from_str(&c).is_ok());
    }

    #[test]
    fn the_ring_keeps_the_last_n_and_settles_by_id() {
        let ring = DecisionRing::new(2, 1 << 20);
        let push = || ring.push("r".into(), Weak::new(), Box::default());
        let ids: Vec<u64> = (0..3).filter_map(|_| push()).collect();
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(ring.len(), 2);
        assert!(ring.get(1).is_none(), "evicted");
        let account = TokenAccount {
            reachable: 8,
            achieved: 8,
            settled: true,
            ..TokenAccount::default()
        };
        ring.settle(1, account);
        ring.settle(3, account);
        assert_eq!(ring.get(2).unwrap()["settled_account"], Value::Null);
        let three = ring.get(3).unwrap();
        assert_eq!(three["id"], 3);
        assert_eq!(three["rule"], "r");
        assert_eq!(three["settled_account"]["achieved"], 8);
        assert!(ring.get(4).is_none());
        let off = DecisionRing::new(0, 1 << 20);
        assert_eq!(off.push("r".into(), Weak::new(), Box::default()), None);
        assert!(off.is_empty());
        let no_memory = DecisionRing::new(8, 0);
        assert_eq!(
            no_memory.push("r".into(), Weak::new(), Box::default()),
            None
        );
    }

    /// On a large rule the byte bound, not the count, limits the ring: a
    /// 1 024-endpoint explanation is about 200 KB.
    #[test]
    fn the_ring_keeps_within_its_bytes() {
        let large = || {
            Box::new(Explanation {
                endpoints: vec![EndpointExplain::default(); 1024],
                ..Explanation::default()
            })
        };
        let one = entry_bytes("r", &large());
        let ring = DecisionRing::new(1024, 3 * one + one / 2);
        let ids: Vec<u64> = (0..10)
            .filter_map(|_| ring.push("r".into(), Weak::new(), large()))
            .collect();
        assert_eq!(ids.len(), 10, "every decision gets an id");
        assert_eq!(ring.len(), 3);
        assert_eq!(ring.bytes(), 3 * one);
        assert!(ring.get(7).is_none() && ring.get(8).is_some() && ring.get(10).is_some());
        // One explanation larger than the bound is still kept, alone.
        let tiny = DecisionRing::new(1024, 1);
        tiny.push("r".into(), Weak::new(), large());
        tiny.push("r".into(), Weak::new(), large());
        assert_eq!(tiny.len(), 1);
    }
}
