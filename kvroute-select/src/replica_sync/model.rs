//! [`RemoteLoad`]'s specification as a naive model: it keeps every origin it
//! ever heard of for good, with the newest totals per endpoint and a flag
//! for whether the table still keeps it, and answers each question by
//! scanning them, where the table keeps a bounded list, tombstones and
//! running sums. The fuzz target and the property tests drive both with the
//! same deltas and compare every answer.
//!
//! The model's memory is unbounded, the table's is not: it forgets the
//! oldest tombstones beyond `max_origins` (and each after a TTL, as the
//! model does). The two agree while at most
//! `max_origins` origin ids other than the table's own are ever used, which
//! the drivers keep to.

use std::collections::BTreeMap;
use std::time::Duration;

// The table's entry type is plain data (sequence number, totals, charged
// counter and its base); the model keeps its own rules for filling it.
use super::{Applied, Entry, LoadDelta, RemoteConfig, RemoteCounters};
use crate::{Deciders, EndpointLoad};

#[derive(Debug, Default)]
struct Origin {
    /// Kept by the table (heard from and not forgotten since).
    kept: bool,
    /// Its newest news said it decides no more, and that news' sequence number.
    retiring: bool,
    retiring_seq: u64,
    retiring_at: Duration,
    last_heard: Duration,
    /// Highest sequence number applied since the table last took it in
    /// (kept after it is forgotten).
    max_seq: u64,
    /// When the table last forgot it.
    forgotten_at: Duration,
    entries: BTreeMap<usize, Entry>,
}

/// The naive model of a [`super::RemoteLoad`] table.
#[derive(Debug)]
pub(crate) struct Model {
    cfg: RemoteConfig,
    own: u64,
    origins: BTreeMap<u64, Origin>,
    /// Per endpoint, the charged shares of origins forgotten so far.
    retired: BTreeMap<usize, u64>,
    counters: RemoteCounters,
}

impl Model {
    pub(crate) fn new(cfg: RemoteConfig, own: u64) -> Self {
        Self {
            cfg,
            own,
            origins: BTreeMap::new(),
            retired: BTreeMap::new(),
            counters: RemoteCounters::default(),
        }
    }

    fn live(&self, o: &Origin, now: Duration) -> bool {
        o.kept && now.saturating_sub(o.last_heard) <= self.cfg.ttl
    }

    fn kept(&self) -> usize {
        self.origins.values().filter(|o| o.kept).count()
    }

    /// A delta received at `now`: applied only if it is news, from another
    /// replica, about a known endpoint, and there is room for its origin.
    pub(crate) fn apply(&mut self, d: &LoadDelta, now: Duration) -> Applied {
        let result = self.apply_inner(d, now);
        self.counters.count(result);
        result
    }

    fn apply_inner(&mut self, d: &LoadDelta, now: Duration) -> Applied {
        if d.origin == self.own {
            return Applied::Own;
        }
        let e = d.endpoint.index();
        if e >= self.cfg.endpoints {
            return Applied::UnknownEndpoint;
        }
        // Sequence numbers start at 1: 0 is never news.
        if d.seq == 0 {
            return Applied::Stale;
        }
        if d.queued_prefill_tokens > super::MAX_DELTA_TOKENS {
            return Applied::Implausible;
        }
        // Silent past the TTL: forgotten before its news is applied.
        if self
            .origins
            .get(&d.origin)
            .is_some_and(|o| o.kept && !self.live(o, now))
        {
            self.expire(now);
        }
        let kept = self.origins.get(&d.origin).is_some_and(|o| o.kept);
        if !kept {
            if self.kept() >= self.cfg.max_origins {
                self.expire(now);
            }
            // A forgotten origin comes back within a TTL of being forgotten
            // only with news newer than anything it sent before.
            let ttl = self.cfg.ttl;
            if self
                .origins
                .get(&d.origin)
                .is_some_and(|o| d.seq <= o.max_seq && now.saturating_sub(o.forgotten_at) <= ttl)
            {
                return Applied::Stale;
            }
            if self.kept() >= self.cfg.max_origins {
                return Applied::OriginsFull;
            }
            let o = self.origins.entry(d.origin).or_default();
            o.kept = true;
            o.retiring = false;
            o.retiring_seq = 0;
            o.retiring_at = now;
            o.last_heard = now;
            o.max_seq = 0;
            o.entries.clear();
        }
        let Some(o) = self.origins.get_mut(&d.origin) else {
            return Applied::UnknownEndpoint;
        };
        let entry = o.entries.entry(e).or_default();
        // A counter step above the bound past what the entry counted is
        // refused before anything changes.
        if entry.seq != 0
            && d.charged_prefill_tokens.saturating_sub(entry.charged) > super::MAX_DELTA_TOKENS
        {
            return Applied::Implausible;
        }
        // An entry no news refreshed for a TTL starts afresh, carrying on
        // from the charged tokens it had counted when the counter has not
        // gone back.
        let mut counted = None;
        if entry.seq != 0 && now.saturating_sub(entry.heard) > self.cfg.ttl {
            let r = self.retired.entry(e).or_default();
            *r = r.saturating_add(entry.charged.saturating_sub(entry.base));
            counted = Some(entry.charged);
            *entry = Entry::default();
        }
        if d.seq <= entry.seq {
            return Applied::Stale;
        }
        let fresh = d
            .charged_prefill_tokens
            .saturating_sub(d.queued_prefill_tokens);
        if entry.seq == 0 {
            entry.base = match counted {
                Some(c) if d.charged_prefill_tokens >= c => c,
                _ => fresh,
            };
        } else if d.charged_prefill_tokens < entry.charged {
            // A counter that went back is not this origin's: its share so
            // far is retired and the entry counts afresh.
            let r = self.retired.entry(e).or_default();
            *r = r.saturating_add(entry.charged.saturating_sub(entry.base));
            entry.base = fresh;
        }
        entry.seq = d.seq;
        entry.load = EndpointLoad {
            in_flight: d.in_flight,
            queued_prefill_tokens: d.queued_prefill_tokens,
        };
        entry.charged = d.charged_prefill_tokens;
        entry.heard = now;
        o.last_heard = o.last_heard.max(now);
        o.max_seq = o.max_seq.max(d.seq);
        Applied::Applied
    }

    /// The endpoint left: every kept origin's entry for it is dropped, its
    /// charged share retired.
    pub(crate) fn clear_endpoint(&mut self, endpoint: usize) {
        if endpoint >= self.cfg.endpoints {
            return;
        }
        for o in self.origins.values_mut().filter(|o| o.kept) {
            if let Some(entry) = o.entries.remove(&endpoint) {
                let r = self.retired.entry(endpoint).or_default();
                *r = r.saturating_add(entry.charged.saturating_sub(entry.base));
            }
        }
    }

    /// Forgets the origins silent for longer than the TTL; how many.
    pub(crate) fn expire(&mut self, now: Duration) -> usize {
        let ttl = self.cfg.ttl;
        let mut gone = 0;
        for o in self.origins.values_mut() {
            if o.kept && now.saturating_sub(o.last_heard) > ttl {
                o.kept = false;
                o.forgotten_at = now;
                gone += 1;
                for (e, entry) in &o.entries {
                    let r = self.retired.entry(*e).or_default();
                    *r = r.saturating_add(entry.charged.saturating_sub(entry.base));
                }
            }
        }
        self.counters.expired += gone as u64;
        gone
    }

    /// The live origins' summed totals on `endpoint`, of entries news set
    /// within the TTL.
    pub(crate) fn remote(&self, endpoint: usize, now: Duration) -> EndpointLoad {
        let mut sum = EndpointLoad::default();
        for o in self.origins.values().filter(|o| self.live(o, now)) {
            if let Some(en) = o
                .entries
                .get(&endpoint)
                .filter(|en| now.saturating_sub(en.heard) <= self.cfg.ttl)
            {
                sum.in_flight = sum.in_flight.saturating_add(en.load.in_flight);
                sum.queued_prefill_tokens = sum
                    .queued_prefill_tokens
                    .saturating_add(en.load.queued_prefill_tokens);
            }
        }
        sum
    }

    /// Charged tokens: forgotten origins' shares plus every kept origin's.
    pub(crate) fn remote_charged(&self, endpoint: usize) -> u64 {
        let retired = self.retired.get(&endpoint).copied().unwrap_or(0);
        self.origins
            .values()
            .filter(|o| o.kept)
            .filter_map(|o| o.entries.get(&endpoint))
            .fold(retired, |acc, e| {
                acc.saturating_add(e.charged.saturating_sub(e.base))
            })
    }

    /// Whether a kept origin still decides, as its news up to `seq` says
    /// (older news than what set it changes nothing, unless that was set
    /// more than a TTL before `now`).
    pub(crate) fn set_retiring(&mut self, origin: u64, retiring: bool, seq: u64, now: Duration) {
        let ttl = self.cfg.ttl;
        if let Some(o) = self.origins.get_mut(&origin).filter(|o| {
            o.kept && (seq >= o.retiring_seq || now.saturating_sub(o.retiring_at) > ttl)
        }) {
            o.retiring = retiring;
            o.retiring_seq = seq;
            o.retiring_at = now;
        }
    }

    /// This replica and the live origins that still decide, ranked by id.
    pub(crate) fn deciders(&self, now: Duration) -> Deciders {
        let live: Vec<u64> = self
            .origins
            .iter()
            .filter(|(_, o)| self.live(o, now) && !o.retiring)
            .map(|(id, _)| *id)
            .collect();
        Deciders {
            count: u32::try_from(live.len() + 1).unwrap_or(u32::MAX),
            rank: u32::try_from(live.iter().filter(|id| **id < self.own).count())
                .unwrap_or(u32::MAX),
            ordered: false,
            home: false,
        }
    }

    pub(crate) fn counters(&self) -> RemoteCounters {
        RemoteCounters {
            origins: self.kept() as u64,
            ..self.counters
        }
    }
}
