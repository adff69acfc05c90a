//! Decision sharing between gateway replicas (sans-IO).
//!
//! Behind a front end that spreads requests over several gateway replicas,
//! each replica's [`LoadTracker`] sees only the requests *it* routed. Engine
//! reports ([`crate::ReportedLoad`]) add everyone's requests, but only once per
//! poll and only as request counts — not the prefill work each decision
//! predicted. So replicas tell each other what they charged:
//!
//! * a tracker built with [`LoadTracker::with_sync`] keeps an **outbox**: every
//!   charge, first byte / prefill-leg answer, release and retarget marks its
//!   endpoint; [`LoadTracker::drain_deltas`] turns each marked endpoint into
//!   one [`LoadDelta`] — the change since the last drain *and* the origin's
//!   resulting totals there, with a per-origin sequence number; with
//!   [`LoadTracker::wake_on_change`] the tracker calls the host once a drain
//!   has something to send, so the host's sync task sleeps between changes
//!   instead of polling;
//! * every peer applies the deltas into a [`RemoteLoad`] table (per origin, per
//!   endpoint), which [`RemoteLoad::view`] adds to the local load.
//!
//! Why the delta carries totals: applying a message *sets* the origin's entry
//! for that endpoint when its sequence number is newer than the one applied,
//! so duplicates and reordering are harmless, and a lost message is repaired
//! by the next one for the same endpoint (or the next
//! [`LoadTracker::resync`], which the host also uses as a heartbeat). The
//! outbox coalesces changes per endpoint, so it is bounded by the number of
//! endpoints and never drops a change: changes merged into a pending delta are
//! counted ([`OutboxCounters::coalesced`]).
//!
//! An origin silent for longer than [`RemoteConfig::ttl`] (given `now`) stops
//! counting and is forgotten by [`RemoteLoad::expire`], so a crashed replica's
//! load does not stick. So does one origin's entry for one endpoint that no
//! news refreshed for a TTL while the origin speaks of others: heartbeats
//! announce every endpoint the origin has, so such an entry names an
//! endpoint it no longer has (removed, or its slot reused), or was set by a
//! message whose sequence number its real deltas never pass (a corrupt or
//! forged one); the next delta for it starts a fresh entry. An origin id
//! should name one process lifetime: a restarted replica takes a fresh id
//! (its sequence numbers start again), the old one expires. One that keeps
//! its id is heard again once its old entries have gone quiet for a TTL and
//! the forgotten origin's last sequence number has been kept for another
//! (its late messages must not bring its old load back).
//!
//! ## Composing with engine reports without double counting
//!
//! An engine report counts every replica's requests at the time of the poll.
//! Hand [`crate::ReportedLoad`] the *local + remote* view both when recording
//! a report ([`crate::ReportedLoad::update`]'s `local_at_report`) and when
//! reading ([`crate::ReportedLoad::view`]): the combined load is then
//! `engine + (local + remote)_now − (local + remote)_at_report`, never below
//! `(local + remote)_now`. Requests the engine already counted are counted
//! once; requests decided by any replica since the poll are added once.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use kvroute_core::EndpointId;
//! use kvroute_select::{Load, LoadTracker, RemoteConfig, RemoteLoad, Target};
//!
//! // Replica 1 routes a request; replica 2 hears about it.
//! let one = Arc::new(LoadTracker::with_sync(2, 1));
//! let two = Arc::new(LoadTracker::with_sync(2, 2));
//! let remote_at_two = RemoteLoad::new(RemoteConfig { endpoints: 2, ..RemoteConfig::default() }, 2);
//! let guard = one.charge(Target { endpoint: EndpointId(0), decode: None }, 500);
//! let mut out = Vec::new();
//! one.drain_deltas(&mut out);
//! let now = Duration::from_secs(1);
//! for d in &out {
//!     remote_at_two.apply(d, now);
//! }
//! let view = remote_at_two.view(&*two, now);
//! assert_eq!(view.load(EndpointId(0)).in_flight, 1);
//! assert_eq!(view.load(EndpointId(0)).queued_prefill_tokens, 500);
//! // The request ends on replica 1: replica 2's view follows.
//! drop(guard);
//! out.clear();
//! one.drain_deltas(&mut out);
//! for d in &out {
//!     remote_at_two.apply(d, now);
//! }
//! assert_eq!(remote_at_two.view(&*two, now).load(EndpointId(0)).in_flight, 0);
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kvroute_core::EndpointId;

use crate::load::{Deciders, EndpointLoad, Load};
use crate::tracker::LoadTracker;
use crate::turn::Turn;

/// One replica's change of load on one endpoint, for the other replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoadDelta {
    /// The replica (one process lifetime) that made the decisions.
    pub origin: u64,
    /// Per-origin sequence number, increasing over all of its deltas.
    pub seq: u64,
    /// The endpoint, as the rule's [`EndpointId`] (replicas share the
    /// configuration, so ids agree). Serialized as its number.
    #[serde(with = "endpoint_number")]
    pub endpoint: EndpointId,
    /// Requests in flight added (+) or finished (−) since the origin's
    /// previous delta for this endpoint.
    pub requests: i64,
    /// Predicted queued prefill tokens added (+) or done (−) since then.
    pub prefill_tokens: i64,
    /// The origin's requests in flight on the endpoint after the change.
    pub in_flight: u32,
    /// The origin's predicted queued prefill tokens there after the change.
    pub queued_prefill_tokens: u64,
    /// Predicted prefill tokens the origin ever charged there since the
    /// endpoint took its slot (monotonic; [`LoadTracker::charged_tokens`]
    /// less its value when [`LoadTracker::retire`] gave the slot to this
    /// endpoint: peers count it per endpoint). With it a peer's drain model tells
    /// the origin's new work from its finished work, which the net
    /// `queued_prefill_tokens` cannot. 0 from peers that do not send it:
    /// their work then counts as untimed.
    #[serde(default)]
    pub charged_prefill_tokens: u64,
}

mod endpoint_number {
    use kvroute_core::EndpointId;
    use serde::{Deserialize, Deserializer, Serializer};

    #[allow(clippy::trivially_copy_pass_by_ref)]
    pub(super) fn serialize<S: Serializer>(e: &EndpointId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(e.0)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<EndpointId, D::Error> {
        u32::deserialize(d).map(EndpointId)
    }
}

/// The outbox state of a [`LoadTracker`] built with [`LoadTracker::with_sync`].
pub(crate) struct Outbox {
    origin: u64,
    next_seq: AtomicU64,
    resync: AtomicBool,
    pub(crate) coalesced: AtomicU64,
    emitted: AtomicU64,
    /// Some endpoint changed since the last drain began.
    pending: AtomicBool,
    /// Called when `pending` turns on ([`LoadTracker::wake_on_change`]).
    wake: Option<Wake>,
}

/// The host's wake-up callback. The tracker only calls it, after the
/// slot's totals and the outbox's `pending` flag are written, reads nothing
/// through it, and catches a panic in it ([`Outbox::touched`]): a charge or
/// release that woke the host always completes (a charge unwinding before
/// it returned its leg would leave a request counted for good). So the
/// callback's unwind safety is not the tracker's, and a `LoadTracker` stays
/// usable by code that catches panics.
struct Wake(Box<dyn Fn() + Send + Sync>);

impl std::panic::UnwindSafe for Wake {}
impl std::panic::RefUnwindSafe for Wake {}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("origin", &self.origin)
            .field("next_seq", &self.next_seq)
            .field("resync", &self.resync)
            .field("coalesced", &self.coalesced)
            .field("emitted", &self.emitted)
            .field("pending", &self.pending)
            .field("wake", &self.wake.is_some())
            .finish()
    }
}

impl Outbox {
    /// A slot was touched; `first`: it had nothing waiting since the last
    /// drain. Wakes the host once per drain, however many endpoints change.
    pub(crate) fn touched(&self, first: bool) {
        if !first {
            self.coalesced.fetch_add(1, Ordering::Relaxed);
        } else if !self.pending.swap(true, Ordering::AcqRel) {
            if let Some(Wake(wake)) = &self.wake {
                // The host's code: a panic in it must not cut the charge or
                // release short. The change stays pending for the next drain.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(wake)).is_err() {
                    tracing::error!("replica sync wake-up callback panicked; the change waits for the next drain");
                }
            }
        }
    }
}

/// Counters of a tracker's outbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutboxCounters {
    /// Deltas drained.
    pub emitted: u64,
    /// Changes merged into a delta still pending (nothing is dropped: the
    /// pending delta carries the totals).
    pub coalesced: u64,
}

impl LoadTracker {
    /// A tracker for `endpoints` endpoints whose changes are also kept for
    /// the other replicas, announced as coming from `origin` (pick a fresh id
    /// per process start, e.g. random).
    #[must_use]
    pub fn with_sync(endpoints: usize, origin: u64) -> Self {
        let mut t = Self::new(endpoints);
        t.sync = Some(Outbox {
            origin,
            next_seq: AtomicU64::new(1),
            resync: AtomicBool::new(false),
            coalesced: AtomicU64::new(0),
            emitted: AtomicU64::new(0),
            pending: AtomicBool::new(false),
            wake: None,
        });
        t
    }

    /// Calls `wake` when an endpoint's load changes while nothing waited to
    /// be drained: at most once between two [`LoadTracker::drain_deltas`],
    /// so a host's sync task can sleep until there is something to send
    /// instead of polling. `wake` runs on the thread that charged or
    /// released the load and must not block (e.g. notify a task). Nothing
    /// without [`LoadTracker::with_sync`].
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use kvroute_core::EndpointId;
    /// use kvroute_select::{LoadTracker, Target};
    ///
    /// let woken = Arc::new(AtomicUsize::new(0));
    /// let w = Arc::clone(&woken);
    /// let tracker = Arc::new(LoadTracker::with_sync(2, 7).wake_on_change(move || {
    ///     w.fetch_add(1, Ordering::Relaxed);
    /// }));
    /// let a = tracker.charge(Target { endpoint: EndpointId(0), decode: None }, 100);
    /// let b = tracker.charge(Target { endpoint: EndpointId(1), decode: None }, 100);
    /// assert_eq!(woken.load(Ordering::Relaxed), 1); // one wake for both
    /// tracker.drain_deltas(&mut Vec::new());
    /// drop((a, b));
    /// assert_eq!(woken.load(Ordering::Relaxed), 2);
    /// ```
    #[must_use]
    pub fn wake_on_change(mut self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        if let Some(outbox) = &mut self.sync {
            outbox.wake = Some(Wake(Box::new(wake)));
        }
        self
    }

    /// The origin id this tracker announces, if it syncs.
    #[must_use]
    pub fn origin(&self) -> Option<u64> {
        self.sync.as_ref().map(|o| o.origin)
    }

    /// Appends one [`LoadDelta`] per endpoint whose load changed since the
    /// last drain (every endpoint after [`LoadTracker::resync`]) to `out`;
    /// returns how many. Nothing without [`LoadTracker::with_sync`].
    ///
    /// Drain from one task at a time (the host's sync loop): concurrent
    /// drains may announce the same change twice, which peers ignore by
    /// sequence, but their `requests`/`prefill_tokens` changes may overlap.
    pub fn drain_deltas(&self, out: &mut Vec<LoadDelta>) -> usize {
        let Some(outbox) = &self.sync else {
            return 0;
        };
        // Before the slots are read: a change to a slot already read sets
        // it again and wakes the host for the next drain.
        outbox.pending.store(false, Ordering::Release);
        let all = outbox.resync.swap(false, Ordering::AcqRel);
        let mut n = 0;
        for (i, s) in self.slots.iter().enumerate() {
            let dirty = s.dirty.swap(false, Ordering::AcqRel);
            let in_flight = s.in_flight();
            let tokens = s.prefill_tokens();
            let sent_in_flight = s.sent_in_flight.load(Ordering::Relaxed);
            let sent_tokens = s.sent_tokens.load(Ordering::Relaxed);
            let charged = s.charged_tokens.load(Ordering::Acquire);
            let sent_charged = s.sent_charged.load(Ordering::Relaxed);
            // Since the slot's present endpoint took it.
            let announced = charged.saturating_sub(s.charged_base.load(Ordering::Acquire));
            // A charge and a first byte of equal size between two drains
            // leave the totals as they were, but peers' drain models must
            // still learn that work arrived and was done.
            let changed =
                in_flight != sent_in_flight || tokens != sent_tokens || charged != sent_charged;
            if !(all || (dirty && changed)) {
                continue;
            }
            s.sent_in_flight.store(in_flight, Ordering::Relaxed);
            s.sent_tokens.store(tokens, Ordering::Relaxed);
            s.sent_charged.store(charged, Ordering::Relaxed);
            out.push(LoadDelta {
                origin: outbox.origin,
                seq: outbox.next_seq.fetch_add(1, Ordering::Relaxed),
                endpoint: EndpointId(u32::try_from(i).unwrap_or(u32::MAX)),
                requests: i64::from(in_flight) - i64::from(sent_in_flight),
                prefill_tokens: i64::try_from(tokens)
                    .unwrap_or(i64::MAX)
                    .saturating_sub(i64::try_from(sent_tokens).unwrap_or(i64::MAX)),
                in_flight,
                queued_prefill_tokens: tokens,
                charged_prefill_tokens: announced,
            });
            n += 1;
        }
        outbox.emitted.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Whether `endpoint`'s totals differ from what the last
    /// [`LoadTracker::drain_deltas`] announced of it (false without sync).
    #[must_use]
    pub fn unannounced(&self, endpoint: EndpointId) -> bool {
        let Some(s) = self.sync.as_ref().and(self.slots.get(endpoint.index())) else {
            return false;
        };
        s.in_flight() != s.sent_in_flight.load(Ordering::Relaxed)
            || s.prefill_tokens() != s.sent_tokens.load(Ordering::Relaxed)
            || s.charged_tokens.load(Ordering::Acquire) != s.sent_charged.load(Ordering::Relaxed)
    }

    /// Makes the next [`LoadTracker::drain_deltas`] announce every endpoint:
    /// the heartbeat that keeps this origin alive at its peers (call it more
    /// often than their [`RemoteConfig::ttl`]) and repairs any lost message.
    pub fn resync(&self) {
        if let Some(o) = &self.sync {
            o.resync.store(true, Ordering::Release);
        }
    }

    /// The outbox's counters (zero without sync).
    #[must_use]
    pub fn outbox_counters(&self) -> OutboxCounters {
        self.sync
            .as_ref()
            .map_or_else(OutboxCounters::default, |o| OutboxCounters {
                emitted: o.emitted.load(Ordering::Relaxed),
                coalesced: o.coalesced.load(Ordering::Relaxed),
            })
    }
}

/// Bounds of a [`RemoteLoad`] table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// Endpoints of the rule (deltas for other ids are refused).
    pub endpoints: usize,
    /// Origins (other replicas) kept at most; a new origin beyond this is
    /// refused (counted) until a silent one expires.
    pub max_origins: usize,
    /// An origin silent for longer than this stops counting.
    pub ttl: Duration,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            endpoints: 0,
            max_origins: 64,
            ttl: Duration::from_secs(5),
        }
    }
}

/// The most prefill tokens one delta may announce as queued, and the most
/// its charged counter may advance past what the table counted of the
/// origin's entry: 2^40 (about 10^12) tokens, beyond any engine's queue and
/// any sync interval's work. A delta above it is refused as
/// [`Applied::Implausible`] (a corrupt or forged message): the charged
/// counter only grows, so one such value would otherwise pin every peer's
/// [`RemoteLoad::remote_charged`] for the endpoint for good.
pub const MAX_DELTA_TOKENS: u64 = 1 << 40;

/// What [`RemoteLoad::apply`] did with a delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The origin's entry for the endpoint now holds the delta's totals.
    Applied,
    /// A duplicate, an older delta than one already applied, or a sequence
    /// number 0 (they start at 1): ignored.
    Stale,
    /// The delta came from this replica itself: ignored.
    Own,
    /// The endpoint is not in the table: ignored.
    UnknownEndpoint,
    /// A new origin while [`RemoteConfig::max_origins`] live origins are kept.
    OriginsFull,
    /// Queued prefill or a charged-counter step above [`MAX_DELTA_TOKENS`]:
    /// ignored.
    Implausible,
}

/// Counters of a [`RemoteLoad`] table; every refused delta is counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteCounters {
    /// Deltas applied.
    pub applied: u64,
    /// Duplicates and reordered older deltas ignored.
    pub stale: u64,
    /// Own deltas ignored.
    pub own: u64,
    /// Deltas for unknown endpoints.
    pub unknown_endpoint: u64,
    /// Deltas refused because the origin table was full.
    pub origins_full: u64,
    /// Deltas refused as implausible ([`MAX_DELTA_TOKENS`]).
    pub implausible: u64,
    /// Origins forgotten after [`RemoteConfig::ttl`] of silence.
    pub expired: u64,
    /// Origins currently kept.
    pub origins: u64,
}

impl RemoteCounters {
    /// Counts what one delta did.
    fn count(&mut self, result: Applied) {
        match result {
            Applied::Applied => self.applied += 1,
            Applied::Stale => self.stale += 1,
            Applied::Own => self.own += 1,
            Applied::UnknownEndpoint => self.unknown_endpoint += 1,
            Applied::OriginsFull => self.origins_full += 1,
            Applied::Implausible => self.implausible += 1,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    /// 0: nothing applied yet (sequence numbers start at 1).
    seq: u64,
    load: EndpointLoad,
    /// The origin's announced charged-token counter, and its value when this
    /// table first heard of the endpoint less what was queued then: the
    /// entry's share of [`RemoteLoad::remote_charged`] is `charged − base`,
    /// so an origin first heard of mid-run adds exactly its queue, not its
    /// whole history.
    charged: u64,
    base: u64,
    /// When news last set it.
    heard: Duration,
}

impl Entry {
    fn charged_share(&self) -> u64 {
        self.charged.saturating_sub(self.base)
    }
}

#[derive(Debug)]
struct Origin {
    id: u64,
    /// Its newest news said it decides no more ([`RemoteLoad::set_retiring`]).
    retiring: bool,
    /// The sequence number of the news that set `retiring`, and when.
    retiring_seq: u64,
    retiring_at: Duration,
    last_heard: Duration,
    /// Highest sequence number applied from this origin.
    max_seq: u64,
    entries: Box<[Entry]>,
}

#[derive(Debug, Default)]
struct Inner {
    origins: Vec<Origin>,
    /// Expired origins' (id, highest sequence applied, when forgotten), the
    /// last `max_origins` of them, each for one TTL: a late message of an
    /// expired origin must not bring its old load back.
    tombstones: std::collections::VecDeque<(u64, u64, Duration)>,
    /// Per endpoint (sized when the table is built), the charged-token
    /// shares of origins and entries forgotten since: keeps
    /// [`RemoteLoad::remote_charged`] monotonic.
    retired: Vec<u64>,
    counters: RemoteCounters,
}

/// The other replicas' load, per origin and endpoint, as their
/// [`LoadDelta`]s announced it. `&self` from many tasks (one lock, held for
/// a table lookup); sans-IO: `now` is an argument.
#[derive(Debug)]
pub struct RemoteLoad {
    cfg: RemoteConfig,
    own: u64,
    inner: parking_lot::RwLock<Inner>,
}

impl RemoteLoad {
    /// An empty table; deltas from `own` (this replica's origin id) are ignored.
    #[must_use]
    pub fn new(cfg: RemoteConfig, own: u64) -> Self {
        Self {
            cfg,
            own,
            inner: parking_lot::RwLock::new(Inner {
                retired: vec![0; cfg.endpoints],
                ..Inner::default()
            }),
        }
    }

    /// The table's bounds.
    #[must_use]
    pub fn config(&self) -> RemoteConfig {
        self.cfg
    }

    fn live(&self, o: &Origin, now: Duration) -> bool {
        now.saturating_sub(o.last_heard) <= self.cfg.ttl
    }

    /// An entry news refreshed within the TTL at `now` (heartbeats refresh
    /// every endpoint the origin has).
    fn fresh(&self, e: &Entry, now: Duration) -> bool {
        now.saturating_sub(e.heard) <= self.cfg.ttl
    }

    /// Applies one delta received at `now`.
    pub fn apply(&self, d: &LoadDelta, now: Duration) -> Applied {
        let mut inner = self.inner.write();
        let result = self.apply_locked(&mut inner, d, now);
        inner.counters.count(result);
        result
    }

    fn apply_locked(&self, inner: &mut Inner, d: &LoadDelta, now: Duration) -> Applied {
        if d.origin == self.own {
            return Applied::Own;
        }
        let e = d.endpoint.index();
        if e >= self.cfg.endpoints {
            return Applied::UnknownEndpoint;
        }
        // Sequence numbers start at 1: a 0 is never news, and must not make
        // a new origin live (it would count among the deciders and change
        // every replica's rank until its TTL).
        if d.seq == 0 {
            return Applied::Stale;
        }
        // Before the origin is taken in: a forged message must not make a
        // new origin count among the deciders.
        if d.queued_prefill_tokens > MAX_DELTA_TOKENS {
            return Applied::Implausible;
        }
        // An origin silent past the TTL is gone even if no expiry ran since
        // (hosts that never tick): forgotten first, so that news from it
        // starts afresh instead of reviving its old entries everywhere.
        if inner
            .origins
            .iter()
            .any(|o| o.id == d.origin && !self.live(o, now))
        {
            self.expire_locked(inner, now);
        }
        let pos = match inner.origins.iter().position(|o| o.id == d.origin) {
            Some(p) => p,
            None => {
                if inner.origins.len() >= self.cfg.max_origins {
                    self.expire_locked(inner, now);
                }
                let ttl = self.cfg.ttl;
                if let Some(t) = inner
                    .tombstones
                    .iter()
                    .position(|t| t.0 == d.origin && now.saturating_sub(t.2) <= ttl)
                {
                    if inner.tombstones.get(t).is_some_and(|t| d.seq <= t.1) {
                        return Applied::Stale;
                    }
                    if inner.origins.len() < self.cfg.max_origins {
                        inner.tombstones.remove(t);
                    }
                }
                if inner.origins.len() >= self.cfg.max_origins {
                    return Applied::OriginsFull;
                }
                inner.origins.push(Origin {
                    id: d.origin,
                    retiring: false,
                    retiring_seq: 0,
                    retiring_at: now,
                    last_heard: now,
                    max_seq: 0,
                    entries: vec![Entry::default(); self.cfg.endpoints].into_boxed_slice(),
                });
                inner.origins.len() - 1
            }
        };
        let Some(o) = inner.origins.get_mut(pos) else {
            return Applied::UnknownEndpoint;
        };
        let Some(entry) = o.entries.get_mut(e) else {
            return Applied::UnknownEndpoint;
        };
        // Before anything changes: the counter may advance at most
        // MAX_DELTA_TOKENS past what the entry counted (quiet or not).
        if entry.seq != 0
            && d.charged_prefill_tokens.saturating_sub(entry.charged) > MAX_DELTA_TOKENS
        {
            return Applied::Implausible;
        }
        // What an entry gone quiet had counted of the origin's charged
        // counter: a fresh entry that carries on from it counts only the
        // work charged since (not its queue again as new work).
        let mut counted = None;
        if entry.seq != 0 && now.saturating_sub(entry.heard) > self.cfg.ttl {
            // Quiet for a TTL while its origin spoke: whatever set it is
            // not this origin's view of the endpoint any more. Its charged
            // share is kept in the monotonic counter.
            if let Some(r) = inner.retired.get_mut(e) {
                *r = r.saturating_add(entry.charged_share());
            }
            counted = Some(entry.charged);
            *entry = Entry::default();
        }
        if d.seq <= entry.seq {
            return Applied::Stale;
        }
        let fresh = d
            .charged_prefill_tokens
            .saturating_sub(d.queued_prefill_tokens);
        let base = match (entry.seq, counted) {
            (0, Some(c)) if d.charged_prefill_tokens >= c => c,
            (0, _) => fresh,
            // The counter only grows per origin and older messages are
            // stale above, so one that went back was never this origin's
            // (a corrupt or forged value, or a restart under the same id):
            // the share so far is kept, the entry counts afresh.
            _ if d.charged_prefill_tokens < entry.charged => {
                if let Some(r) = inner.retired.get_mut(e) {
                    *r = r.saturating_add(entry.charged_share());
                }
                fresh
            }
            _ => entry.base,
        };
        *entry = Entry {
            seq: d.seq,
            load: EndpointLoad {
                in_flight: d.in_flight,
                queued_prefill_tokens: d.queued_prefill_tokens,
            },
            charged: d.charged_prefill_tokens,
            base,
            heard: now,
        };
        // Only news keeps an origin alive: a late duplicate of an old
        // message must not revive a crashed replica.
        o.last_heard = o.last_heard.max(now);
        o.max_seq = o.max_seq.max(d.seq);
        Applied::Applied
    }

    fn expire_locked(&self, inner: &mut Inner, now: Duration) -> usize {
        let before = inner.origins.len();
        let mut gone_ids = Vec::new();
        let Inner {
            origins, retired, ..
        } = inner;
        origins.retain(|o| {
            let keep = self.live(o, now);
            if !keep {
                gone_ids.push((o.id, o.max_seq));
                for (r, e) in retired.iter_mut().zip(o.entries.iter()) {
                    *r = r.saturating_add(e.charged_share());
                }
            }
            keep
        });
        for t in gone_ids {
            // One per origin (an older one of the same origin has aged).
            inner.tombstones.retain(|old| old.0 != t.0);
            if inner.tombstones.len() >= self.cfg.max_origins.max(1) {
                inner.tombstones.pop_front();
            }
            inner.tombstones.push_back((t.0, t.1, now));
        }
        let gone = before - inner.origins.len();
        inner.counters.expired += gone as u64;
        gone
    }

    /// `endpoint` left the rule (its slot may be reused by another): every
    /// origin's entry for it is forgotten, its charged share kept in the
    /// monotonic counter ([`RemoteLoad::remote_charged`]). The next delta
    /// naming the slot starts a fresh entry, as for an endpoint first heard
    /// of.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        let mut inner = self.inner.write();
        let e = endpoint.index();
        let Inner {
            origins, retired, ..
        } = &mut *inner;
        let Some(r) = retired.get_mut(e) else {
            return;
        };
        for o in origins.iter_mut() {
            if let Some(entry) = o.entries.get_mut(e) {
                *r = r.saturating_add(entry.charged_share());
                *entry = Entry::default();
            }
        }
    }

    /// Forgets origins silent for longer than the TTL at `now`; returns how
    /// many. (They stop counting at once anyway; this frees their memory.)
    pub fn expire(&self, now: Duration) -> usize {
        let mut inner = self.inner.write();
        self.expire_locked(&mut inner, now)
    }

    /// The other replicas' summed load on `endpoint` at `now`.
    #[must_use]
    pub fn remote(&self, endpoint: EndpointId, now: Duration) -> EndpointLoad {
        let inner = self.inner.read();
        let mut sum = EndpointLoad::default();
        for o in inner.origins.iter().filter(|o| self.live(o, now)) {
            if let Some(en) = o
                .entries
                .get(endpoint.index())
                .filter(|en| self.fresh(en, now))
            {
                sum.in_flight = sum.in_flight.saturating_add(en.load.in_flight);
                sum.queued_prefill_tokens = sum
                    .queued_prefill_tokens
                    .saturating_add(en.load.queued_prefill_tokens);
            }
        }
        sum
    }

    /// Predicted prefill tokens the other replicas charged to `endpoint`
    /// since this table first heard of each of them (plus what was queued
    /// then), a monotonic counter: silent and forgotten origins keep their
    /// share, so a peer's drain model never sees it go backwards.
    #[must_use]
    pub fn remote_charged(&self, endpoint: EndpointId) -> u64 {
        let inner = self.inner.read();
        let retired = inner.retired.get(endpoint.index()).copied().unwrap_or(0);
        inner
            .origins
            .iter()
            .filter_map(|o| o.entries.get(endpoint.index()))
            .fold(retired, |acc, e| acc.saturating_add(e.charged_share()))
    }

    /// Whether `origin` still decides, as a message whose deltas were just
    /// applied says, `seq` the highest sequence number applied from it (call
    /// it only for a message with news): a router replaced (its rule
    /// reloaded) or going away announces the ends of the requests it routed
    /// as retiring. Its load keeps counting until they end (or it goes
    /// silent for the TTL), but it is not one of the [`RemoteLoad::deciders`]
    /// while its newest news says so; an older message applied late (news
    /// for another endpoint) changes nothing, unless what set the flag is
    /// older than the TTL at `now` (a forged sequence number of 2^64 − 1
    /// must not freeze it while the origin lives). Nothing happens for an
    /// origin the table does not keep.
    pub fn set_retiring(&self, origin: u64, retiring: bool, seq: u64, now: Duration) {
        let ttl = self.cfg.ttl;
        let mut inner = self.inner.write();
        if let Some(o) = inner.origins.iter_mut().find(|o| {
            o.id == origin && (seq >= o.retiring_seq || now.saturating_sub(o.retiring_at) > ttl)
        }) {
            o.retiring = retiring;
            o.retiring_seq = seq;
            o.retiring_at = now;
        }
    }

    /// This replica and the origins heard from within the TTL at `now` that
    /// still decide, and this replica's rank among them by origin id: every
    /// replica that hears the same origins ranks itself differently, without
    /// talking about it.
    #[must_use]
    pub fn deciders(&self, now: Duration) -> Deciders {
        let inner = self.inner.read();
        let (mut live, mut below) = (0u32, 0u32);
        for o in inner
            .origins
            .iter()
            .filter(|o| self.live(o, now) && !o.retiring)
        {
            live = live.saturating_add(1);
            below = below.saturating_add(u32::from(o.id < self.own));
        }
        Deciders {
            count: live.saturating_add(1),
            rank: below,
            ordered: false,
            home: false,
        }
    }

    /// The table's counters.
    #[must_use]
    pub fn counters(&self) -> RemoteCounters {
        let inner = self.inner.read();
        RemoteCounters {
            origins: inner.origins.len() as u64,
            ..inner.counters
        }
    }

    /// `local` plus the other replicas' load, as of `now`.
    #[must_use]
    pub fn view<'a, L: Load + ?Sized>(&'a self, local: &'a L, now: Duration) -> WithRemote<'a, L> {
        WithRemote {
            remote: self,
            local,
            now,
            turn: Turn::NONE,
        }
    }
}

/// A [`Load`] that is a host's own load plus its peers'; see [`RemoteLoad`].
#[derive(Debug)]
pub struct WithRemote<'a, L: ?Sized> {
    remote: &'a RemoteLoad,
    local: &'a L,
    now: Duration,
    turn: Turn,
}

impl<L: ?Sized> WithRemote<'_, L> {
    /// The view for a decision made in `turn` ([`crate::burst_turn`]): in its
    /// turn, [`Load::deciders`] reports the deciders as ordered.
    #[must_use]
    pub fn in_turn(mut self, turn: Turn) -> Self {
        self.turn = turn;
        self
    }
}

impl<L: Load + ?Sized> Load for WithRemote<'_, L> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        let l = self.local.load(endpoint);
        let r = self.remote.remote(endpoint, self.now);
        EndpointLoad {
            in_flight: l.in_flight.saturating_add(r.in_flight),
            queued_prefill_tokens: l
                .queued_prefill_tokens
                .saturating_add(r.queued_prefill_tokens),
        }
    }

    /// The local counter plus [`RemoteLoad::remote_charged`]; `None` when the
    /// local view does not count.
    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        self.local
            .charged_prefill_tokens(endpoint)
            .map(|l| l.saturating_add(self.remote.remote_charged(endpoint)))
    }

    fn prefill_progress(&self, endpoint: EndpointId) -> Option<crate::PrefillProgress> {
        self.local.prefill_progress(endpoint)
    }

    /// The local view's deciders plus every live origin, ranked by origin id
    /// ([`RemoteLoad::deciders`]).
    fn deciders(&self) -> Deciders {
        let local = self.local.deciders();
        let remote = self.remote.deciders(self.now);
        Deciders {
            count: local.count.saturating_add(remote.count - 1),
            rank: local.rank.saturating_add(remote.rank),
            ordered: false,
            home: false,
        }
        .in_turn(self.turn)
    }
}

#[cfg(feature = "fuzzing")]
pub(crate) mod model;

#[cfg(test)]
mod tests;
