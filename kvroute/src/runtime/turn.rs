//! Turns within a burst ([`kvroute_select::RemoteLoad::turn`]) as the
//! router takes them: which requests wait, and for how long.

use std::time::Duration;

use kvroute_core::BlockKey;
use kvroute_select::Turn;

use super::{view, KvRouter};
use crate::prompt::PreparedPrompt;

impl KvRouter {
    /// This replica's turn for a request with these block keys (`None`: a
    /// prompt without keys) that is ready to be decided now
    /// ([`kvroute_select::RemoteLoad::turn`]): while its requests come in
    /// bursts and other replicas are live, hold it `rank ·`
    /// [`ReplicaConfig::stagger`] and decide it in turn; [`Turn::NONE`]
    /// without replicas, alone, while requests come one at a time, or when
    /// most of the prompt is cached somewhere (it goes where its cache is).
    /// [`KvRouter::pick`] takes it; a host deciding with
    /// [`KvRouter::pick_prepared`] calls [`KvRouter::take_turn`] first, one
    /// deciding with keys waits [`Turn::hold`] and passes the turn to
    /// [`KvRouter::pick_keys_in_turn`]. Holds are counted in
    /// [`ReplicaCounters`].
    #[must_use]
    pub fn turn(&self, keys: Option<&[BlockKey]>) -> Turn {
        let Some(r) = &self.shared.replicas else {
            return Turn::NONE;
        };
        let now = self.shared.now();
        let burst = self.shared.current().rule.burst_stats();
        let turn = r.remote().turn(now, burst, || {
            self.cached_fraction(keys.unwrap_or_default(), now)
        });
        if !turn.hold.is_zero() {
            r.held(turn.hold);
        }
        turn
    }

    /// The longest prefix of `keys` any endpoint holds, as a fraction of
    /// them (0 for no keys), walked only as far as
    /// [`kvroute_select::TURN_MAX_CACHED`] of them: a longer prefix changes
    /// nothing the turn depends on, and the decision walks the whole prompt
    /// again anyway.
    ///
    /// A prefix every endpoint holds (a shared system prompt) counts too: a
    /// new conversation over a long one is then decided at once, each
    /// replica preferring its own zone of the engines (the cost scorer's
    /// other deciders), which in the simulator spreads bursts of short
    /// prompts over a shared root better than turns do.
    fn cached_fraction(&self, keys: &[BlockKey], now: Duration) -> f64 {
        use kvroute_ingest::InventoryView;
        if keys.is_empty() {
            return 0.0;
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let deciding = (keys.len() as f64 * kvroute_select::TURN_MAX_CACHED).ceil() as usize;
        let head = keys.get(..deciding.max(1)).unwrap_or(keys);
        let view = view::RouterView::new(&self.shared, now);
        let mut out = vec![kvroute_ingest::Overlap::default(); view.endpoint_count()];
        view.score_prefix(head, &mut out);
        let best = out.iter().map(|o| o.prefix).max().unwrap_or(0);
        #[allow(clippy::cast_precision_loss)]
        let fraction = f64::from(best) / keys.len() as f64;
        fraction
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
    use kvroute_ingest::{BlockStored, EventBatch, KvEvent, SeqWindowConfig};
    use kvroute_select::Turn;

    use crate::engine::{Engine, Follow};
    use crate::{Backend, Clock, HostTransport, KvRouter, ManualClock, ReplicaConfig};

    /// Endpoints whose events the test applies itself.
    #[derive(Debug)]
    struct HostEngine;

    impl Engine for HostEngine {
        fn name(&self) -> &str {
            "test"
        }

        fn events_carry_tokens(&self) -> bool {
            false
        }

        fn window(&self, _follow: &Follow) -> SeqWindowConfig {
            SeqWindowConfig::default()
        }
    }

    const STAGGER: Duration = Duration::from_millis(1);

    fn replica(origin: u64, clock: &Arc<ManualClock>) -> KvRouter {
        let engine: Arc<dyn Engine> = Arc::new(HostEngine);
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(origin);
        r.stagger = STAGGER;
        let mut b = KvRouter::builder_for_keys("test/bs4", 4)
            .no_engine_load()
            .no_health_probes()
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .replicas(r);
        for e in 0..4 {
            b = b.endpoint(Backend::new(Arc::clone(&engine), format!("http://e{e}")).host_events());
        }
        b.build().expect("router")
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

    /// A prompt mostly cached somewhere is decided at once; one cached
    /// less than half anywhere waits its turn; alone, nothing waits.
    #[test]
    fn a_prompt_takes_its_turn_unless_half_of_it_is_cached_somewhere() {
        let clock = Arc::new(ManualClock::default());
        let lower = replica(1, &clock);
        let me = replica(2, &clock);
        // Every endpoint holds a two-block system prompt; endpoint 0 also
        // holds one conversation's six blocks of history after it.
        for e in 0..4 {
            assert!(me.ingest_at(EndpointId(e), &stored(0, keys(1..=2), None)));
        }
        assert!(me.ingest_at(EndpointId(0), &stored(1, keys(201..=206), Some(2))));
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
        let in_turn = Turn {
            hold: STAGGER,
            in_turn: true,
        };
        // A new question over the system prompt: 2 of its 8 blocks cached.
        let fresh = keys((1..=2).chain(101..=106));
        assert_eq!(me.turn(Some(&fresh)), in_turn);
        // The conversation's next turn: 8 of its 10 blocks cached on
        // endpoint 0.
        let next = keys((1..=2).chain(201..=208));
        assert_eq!(me.turn(Some(&next)), Turn::NONE);
        // A branch of it: 4 of 10 blocks cached.
        let branch = keys((1..=2).chain(201..=202).chain(301..=306));
        assert_eq!(me.turn(Some(&branch)), in_turn);
        // A short question over the system prompt: 2 of 3 blocks cached
        // everywhere, decided at once.
        let short = keys([1, 2, 400]);
        assert_eq!(me.turn(Some(&short)), Turn::NONE);
        // Alone, nothing waits.
        assert_eq!(lower.turn(Some(&fresh)), Turn::NONE);
    }

    /// Records what the publishing task sends.
    #[derive(Debug, Default)]
    struct Recording(parking_lot::Mutex<Vec<bytes::Bytes>>);

    impl crate::ReplicaTransport for Recording {
        fn publish(&self, _pool: &str, payload: bytes::Bytes) {
            self.0.lock().push(payload);
        }

        fn subscribe(
            &self,
            _pool: &str,
            _sink: crate::ReplicaSink,
        ) -> Result<crate::ReplicaSubscription, crate::ReplicaError> {
            Ok(crate::ReplicaSubscription::new(()))
        }
    }

    /// Waits (bounded) until `sent` holds `n` messages.
    async fn sent_reaches(sent: &Recording, n: usize) -> bool {
        for _ in 0..500 {
            if sent.0.lock().len() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// The higher ranks decide one stagger after a decision made in its
    /// turn, which may be sooner than the next coalesced message: such a
    /// decision is published at once, while one outside a turn waits for
    /// the next tick (here a minute away).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_decision_in_its_turn_is_published_at_once_within_the_sync_interval() {
        let sent = Arc::new(Recording::default());
        let engine: Arc<dyn Engine> = Arc::new(HostEngine);
        let mut r = ReplicaConfig::new(Arc::clone(&sent) as Arc<dyn crate::ReplicaTransport>);
        r.origin = Some(2);
        r.stagger = STAGGER;
        r.sync_interval = Duration::from_secs(60);
        r.heartbeat = Duration::from_secs(3600);
        let mut b = KvRouter::builder_for_keys("test/bs4", 4)
            .no_engine_load()
            .no_health_probes()
            .replicas(r);
        for e in 0..2 {
            b = b.endpoint(Backend::new(Arc::clone(&engine), format!("http://e{e}")).host_events());
        }
        let router = b.spawn().expect("router");
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
            sent.0.lock().len(),
            1,
            "a decision outside a turn was sent before the tick"
        );
        let turn = Turn {
            hold: Duration::ZERO,
            in_turn: true,
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
}
