//! Turns within a burst ([`kvroute_select::burst_turn`]) as the
//! router takes them: which requests wait, and for how long.

use std::time::Duration;

use kvroute_core::BlockKey;
use kvroute_select::{burst_turn, Deciders, Turn, TurnConfig};

use super::{view, KvRouter};
use crate::prompt::PreparedPrompt;

/// [`KvRouter::home_fraction`]'s buffers, kept per thread.
#[derive(Default)]
struct Scratch {
    overlaps: Vec<kvroute_ingest::Overlap>,
    prefixes: Vec<u32>,
}

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

impl KvRouter {
    /// The turn of a request with these block keys (`None`: a prompt
    /// without keys) that is ready to be decided now
    /// ([`kvroute_select::burst_turn`]): while its rule's decisions come in
    /// bursts, a request without a home waits
    /// [`crate::KvRouterBuilder::burst_order`] so the burst's requests with
    /// one are placed first, and with other replicas live, `rank ·`
    /// [`crate::ReplicaConfig::stagger`] more, so the replicas decide the
    /// burst in turn. A request with a home (most of what the other
    /// endpoints lack is cached on one: it goes there) is never held; with
    /// replicas taking turns it is decided at once as part of the ordered
    /// burst ([`Turn::in_turn`]). [`Turn::NONE`] outside bursts or with both
    /// off.
    /// [`KvRouter::pick`] takes it; a host deciding with
    /// [`KvRouter::pick_prepared`] calls [`KvRouter::take_turn`] first, one
    /// deciding with keys waits [`Turn::hold`] and passes the turn to
    /// [`KvRouter::pick_keys_in_turn`]. Holds are counted in the rule's
    /// counters ([`kvroute_select::CountersSnapshot::held`]).
    #[must_use]
    pub fn turn(&self, keys: Option<&[BlockKey]>) -> Turn {
        let now = self.shared.now();
        let rule = std::sync::Arc::clone(&self.shared.current().rule);
        let replicas = self.shared.replicas.as_ref();
        let cfg = TurnConfig {
            order: self.shared.burst_order,
            stagger: replicas.map_or(Duration::ZERO, |r| r.stagger()),
        };
        let deciders = || replicas.map_or(Deciders::ALONE, |r| r.remote().deciders(now));
        let turn = burst_turn(cfg, rule.burst_stats(), deciders, || {
            self.home_fraction(keys.unwrap_or_default(), now)
        });
        if !turn.hold.is_zero() {
            rule.counters().held(turn.hold);
        }
        turn
    }

    /// How much of the prompt only its home holds: the longest prefix of
    /// `keys` any endpoint holds beyond the prefix most endpoints hold (the
    /// lower median over the endpoints: a shared system prompt), as a
    /// fraction of the blocks past that common prefix (0 for no keys, or
    /// when every endpoint holds the whole prompt). A prompt whose cached
    /// part is held everywhere has no home: where it goes depends on load
    /// alone, as for a fresh prompt, and it takes its turn.
    fn home_fraction(&self, keys: &[BlockKey], now: Duration) -> f64 {
        use kvroute_ingest::InventoryView;
        if keys.is_empty() {
            return 0.0;
        }
        let view = view::RouterView::new(&self.shared, now);
        // The rule's endpoints only: the index also has slots kept free for
        // endpoints added later (an empty URL).
        let generation = self.shared.current();
        // Per-thread scratch: a decision in a burst checks this for every
        // request, and a fleet of a thousand endpoints would otherwise
        // allocate two vectors of that size each time.
        let (best, common) = SCRATCH.with(|cell| {
            // Taken and put back (a `Cell`, so nothing can panic on a
            // nested use; there is none).
            let mut scratch = cell.take();
            let Scratch { overlaps, prefixes } = &mut scratch;
            overlaps.clear();
            overlaps.resize(view.endpoint_count(), kvroute_ingest::Overlap::default());
            view.score_prefix(keys, overlaps);
            prefixes.clear();
            prefixes.extend(
                overlaps
                    .iter()
                    .zip(generation.urls.iter())
                    .filter(|(_, url)| !url.is_empty())
                    .map(|(o, _)| o.prefix),
            );
            let best = prefixes.iter().copied().max().unwrap_or(0);
            let middle = prefixes.len().saturating_sub(1) / 2;
            let common = if prefixes.is_empty() {
                0
            } else {
                *prefixes.select_nth_unstable(middle).1
            };
            cell.set(scratch);
            (best, common)
        });
        let len = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        let beyond = len.saturating_sub(common);
        if beyond == 0 {
            return 0.0;
        }
        f64::from(best.saturating_sub(common)) / f64::from(beyond)
    }

    /// Takes this replica's turn for `prompt` ([`KvRouter::turn`]): waits
    /// its hold on a tokio timer (returns at once when there is none) and
    /// records the turn in the prompt, so that [`KvRouter::pick_prepared`]
    /// and [`KvRouter::pick_explained`] decide it in turn.
    pub async fn take_turn(&self, prompt: &mut PreparedPrompt) {
        let turn = self.turn(prompt.keys().map(|(k, _)| k));
        if !turn.hold.is_zero() {
            tokio::time::sleep(turn.hold).await;
        }
        prompt.set_turn(turn);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvroute_core::{BlockKey, EndpointId};
    use kvroute_ingest::{BlockStored, EventBatch, KvEvent};
    use kvroute_select::Turn;

    use super::super::test_support::{host_router, Loopback};
    use crate::{Clock, HostTransport, KvRouter, ManualClock, ReplicaConfig};

    const STAGGER: Duration = Duration::from_millis(1);

    fn replica(origin: u64, clock: &Arc<ManualClock>) -> KvRouter {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(origin);
        r.stagger = STAGGER;
        host_router(4)
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .replicas(r)
            .build()
            .expect("router")
    }

    fn keys(ids: impl IntoIterator<Item = u64>) -> Vec<BlockKey> {
        ids.into_iter().map(BlockKey).collect()
    }

    fn stored(seq: u64, keys: Vec<BlockKey>, parent: Option<u64>) -> EventBatch {
        EventBatch {
            seq,
            timestamp: 0.0,
            dp_rank: None,
            events: vec![KvEvent::Stored(BlockStored {
                keys,
                parent: parent.map(BlockKey),
                block_size: 4,
                ..BlockStored::default()
            })],
        }
    }

    /// A system prompt every endpoint holds is no home, however much of the
    /// prompt it is: a new conversation over it is placed by load alone and
    /// takes its turn. A conversation whose history one endpoint holds goes
    /// there at once, unless that history is under half of what the others
    /// lack.
    #[test]
    fn a_prompt_takes_its_turn_unless_one_endpoint_holds_most_of_what_the_others_lack() {
        let clock = Arc::new(ManualClock::default());
        let lower = replica(1, &clock);
        let me = replica(2, &clock);
        // Every endpoint holds the six-block system prompt; endpoint 0 also
        // holds one conversation's eight blocks of history after it.
        for e in 0..4 {
            assert!(me.ingest_at(EndpointId(e), &stored(0, keys(1..=6), None)));
        }
        assert!(me.ingest_at(EndpointId(0), &stored(1, keys(201..=208), Some(6))));
        // The lower-ranked replica is live, and this one's decisions come in
        // bursts of three.
        let heartbeat = lower.drain_replica_batch(true).expect("a heartbeat");
        me.apply_replica_batch(&heartbeat);
        let other = keys([1, 2, 900]);
        for at in [0, 50] {
            clock.set(Duration::from_millis(at));
            let picks: Vec<_> = (0..3)
                .map(|_| me.pick_keys(&other, 12).expect("pick"))
                .collect();
            drop(picks);
        }
        clock.set(Duration::from_millis(100));
        // Rank 1 of 2: one stagger for the burst's requests with a home
        // (the ordering's wait, at least a stagger with replicas), one for
        // the rank below.
        let in_turn = Turn {
            hold: 2 * STAGGER,
            in_turn: true,
            home: false,
        };
        // A new question over the system prompt: 6 of its 8 blocks cached
        // everywhere, none only somewhere.
        let fresh = keys((1..=6).chain([101, 102]));
        assert_eq!(me.turn(Some(&fresh)), in_turn);
        // The conversation's next turn: endpoint 0 holds 8 of the 10 blocks
        // past the system prompt. Decided at once, as part of the ordered
        // burst.
        let next = keys((1..=6).chain(201..=210));
        assert_eq!(
            me.turn(Some(&next)),
            Turn {
                hold: Duration::ZERO,
                in_turn: true,
                home: true
            }
        );
        // A branch of it that endpoint 0 holds 3 of 10 blocks of.
        let branch = keys((1..=6).chain(201..=203).chain(301..=307));
        assert_eq!(me.turn(Some(&branch)), in_turn);
        // Alone, nothing waits.
        assert_eq!(lower.turn(Some(&fresh)), Turn::NONE);
    }

    /// A gateway alone orders its bursts: once its decisions come several at
    /// an instant, a prompt without a home waits the burst ordering (not in
    /// a replica's turn) while a conversation's next turn goes at once;
    /// requests one at a time never wait, nor anything with the ordering
    /// off. Holds are counted in the rule's counters.
    #[test]
    fn alone_a_prompt_without_a_home_waits_for_the_bursts_requests_with_one() {
        let order = Duration::from_millis(3);
        let alone = |order: Duration, clock: &Arc<ManualClock>| {
            host_router(4)
                .clock(Arc::clone(clock) as Arc<dyn Clock>)
                .burst_order(order)
                .build()
                .expect("router")
        };
        let clock = Arc::new(ManualClock::default());
        let (router, off) = (alone(order, &clock), alone(Duration::ZERO, &clock));
        for r in [&router, &off] {
            for e in 0..4 {
                assert!(r.ingest_at(EndpointId(e), &stored(0, keys(1..=6), None)));
            }
            assert!(r.ingest_at(EndpointId(0), &stored(1, keys(201..=208), Some(6))));
        }
        let fresh = keys((1..=6).chain([101, 102]));
        let next = keys((1..=6).chain(201..=210));
        // One at a time: nothing waits.
        for at in [0, 50, 100] {
            clock.set(Duration::from_millis(at));
            drop(router.pick_keys(&keys([1, 2, 900]), 12).expect("pick"));
        }
        clock.set(Duration::from_millis(150));
        assert_eq!(router.turn(Some(&fresh)), Turn::NONE);
        // Bursts of three.
        for at in [200, 250] {
            clock.set(Duration::from_millis(at));
            for r in [&router, &off] {
                let picks: Vec<_> = (0..3)
                    .map(|_| r.pick_keys(&keys([1, 2, 900]), 12).expect("pick"))
                    .collect();
                drop(picks);
            }
        }
        clock.set(Duration::from_millis(300));
        let held = router.counters().held;
        assert_eq!(
            router.turn(Some(&fresh)),
            Turn {
                hold: order,
                in_turn: false,
                home: false
            }
        );
        assert_eq!(router.turn(Some(&next)), Turn::NONE);
        assert_eq!(off.turn(Some(&fresh)), Turn::NONE);
        let c = router.counters();
        assert_eq!((c.held, c.held_us), (held + 1, (held + 1) * 3_000));
    }

    /// A router over `n` endpoints, started on the test's runtime, whose
    /// replica messages `sent` records; `sync_interval` apart at most.
    fn recorded(sent: &Arc<Loopback>, n: usize, sync_interval: Duration) -> KvRouter {
        let mut r = ReplicaConfig::new(Arc::clone(sent) as Arc<dyn crate::ReplicaTransport>);
        r.origin = Some(2);
        r.stagger = STAGGER;
        r.sync_interval = sync_interval;
        r.heartbeat = Duration::from_secs(3600);
        host_router(n).replicas(r).spawn().expect("router")
    }

    /// Waits (bounded) until `sent` holds `n` messages.
    async fn sent_reaches(sent: &Loopback, n: usize) -> bool {
        for _ in 0..500 {
            if sent.sent.lock().len() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// The higher ranks decide one stagger after a decision made in its
    /// turn, which may be sooner than the next coalesced message: such a
    /// decision is published at once, while one outside a turn waits for
    /// the sync interval to end (here a minute away).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_decision_in_its_turn_is_published_at_once_within_the_sync_interval() {
        let sent = Arc::new(Loopback::default());
        let router = recorded(&sent, 2, Duration::from_secs(60));
        // A decision after a quiet interval goes out at once; the next one
        // outside a turn waits for the tick.
        let prompt = keys(1..=4);
        let first = router.pick_keys(&prompt, 16).expect("pick");
        assert!(
            sent_reaches(&sent, 1).await,
            "the first decision was not sent"
        );
        let outside = router.pick_keys(&prompt, 16).expect("pick");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            sent.sent.lock().len(),
            1,
            "a decision outside a turn was sent before the tick"
        );
        let turn = Turn {
            hold: Duration::ZERO,
            in_turn: true,
            home: false,
        };
        let inside = router
            .pick_keys_in_turn(&prompt, 16, turn)
            .expect("pick in turn");
        assert!(
            sent_reaches(&sent, 2).await,
            "a decision in its turn waited for the next tick"
        );
        drop((first, outside, inside));
    }

    /// A router going away with requests in flight keeps publishing until
    /// they end, and its last message carries every endpoint's totals: a
    /// drain of changed endpoints alone can miss an end that lands while it
    /// runs, and the others would count that request until the TTL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retired_router_ends_with_every_endpoints_totals() {
        let sent = Arc::new(Loopback::default());
        let router = recorded(&sent, 3, Duration::from_millis(20));
        let pick = router.pick_keys(&keys(1..=4), 16).expect("pick");
        assert!(sent_reaches(&sent, 1).await, "the decision was not sent");
        drop(router);
        drop(pick);
        assert!(sent_reaches(&sent, 2).await, "no message after the end");
        let last = sent.sent.lock().last().cloned().expect("a message");
        let batch: crate::ReplicaBatch = serde_json::from_slice(&last).expect("a batch");
        assert_eq!(batch.endpoints.len(), 3, "{batch:?}");
        assert!(
            batch.endpoints.iter().all(|e| e.in_flight == 0),
            "{batch:?}"
        );
    }

    /// Replicas started together count their turns alike: on an idle fleet
    /// each one's first request (no endpoint holds it, none is loaded) would
    /// go to the first endpoint. Once they see each other, each starts its
    /// rotations from its own rank; a router alone starts at the first.
    #[test]
    fn replicas_start_their_rotations_apart() {
        let clock = Arc::new(ManualClock::default());
        let (a, b) = (replica(1, &clock), replica(2, &clock));
        for (from, to) in [(&a, &b), (&b, &a)] {
            let heartbeat = from.drain_replica_batch(true).expect("a heartbeat");
            to.apply_replica_batch(&heartbeat);
        }
        let prompt = keys([5, 6]);
        let first = |r: &KvRouter| r.pick_keys(&prompt, 8).expect("pick").url().to_owned();
        assert_eq!(
            (first(&a), first(&b)),
            ("http://e0".into(), "http://e2".into())
        );
        let alone = host_router(4).build().expect("router");
        assert_eq!(first(&alone), "http://e0");
        // Requests forwarded without a decision too.
        let forwarded = |r: &KvRouter| r.available_by_load(0)[0].clone();
        assert_eq!(
            (forwarded(&a), forwarded(&b), forwarded(&alone)),
            ("http://e0".into(), "http://e2".into(), "http://e0".into())
        );
    }
}
