//! The cost scorer reads the prefill still ahead of a request, not what the
//! tracker holds: a rule driving two serial engines learns their prefill rate
//! from the tracker alone and then sends a request to the endpoint that is a
//! few milliseconds from idle rather than the one whose charged tokens are
//! fewer but just started.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;

const BS: u32 = 16;
/// The engines prefill this many tokens per millisecond, one prompt at a time.
const TOKENS_PER_MS: u64 = 10;

struct Host {
    rule: Rule,
    contract: ContractId,
    tracker: Arc<LoadTracker>,
    inventory: KeySetInventory,
    /// Per endpoint: when its prefill pipeline is free.
    busy_until_ms: [u64; 2],
    /// Requests waiting for their first token: (first token ms, guard).
    open: Vec<(u64, LoadGuard)>,
    seed: u64,
}

impl Host {
    fn new(drain_queue: bool) -> Self {
        let contract = ContractId::new("drain/bs16");
        let eps = (0..2)
            .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i))
            .collect();
        let mut cfg = RuleConfig::kv_exact("drain", Topology::Converged, eps, BS, contract.clone());
        cfg.scorer = Arc::new(CostScorer(CostConfig {
            drain_queue,
            ..CostConfig::default()
        }));
        Self {
            rule: Rule::new(cfg, None).unwrap(),
            contract,
            tracker: Arc::new(LoadTracker::new(2)),
            inventory: KeySetInventory::new(2),
            busy_until_ms: [0; 2],
            open: Vec::new(),
            seed: 0,
        }
    }

    /// First tokens due by `t`, in time order.
    fn advance(&mut self, t: u64) {
        self.open.sort_by_key(|(f, _)| *f);
        for (_, g) in self.open.iter_mut().filter(|(f, _)| *f <= t) {
            g.first_byte();
        }
        self.open.retain(|(f, _)| *f > t);
    }

    /// Routes a fresh prompt of `tokens` at `t` and runs it on the engine the
    /// rule chose; returns that endpoint.
    fn send(&mut self, t: u64, tokens: u32) -> usize {
        self.advance(t);
        self.seed += 1;
        let keys: Vec<BlockKey> = (0..u64::from(tokens / BS))
            .map(|i| BlockKey(self.seed * 1_000_000 + i))
            .collect();
        let req = Request::new(PromptInput::Keys {
            keys: &keys,
            contract: &self.contract,
            prompt_tokens: tokens,
        });
        let d = self.rule.decide(
            &req,
            &self.inventory,
            &*self.tracker,
            &AlwaysAvailable,
            Duration::from_millis(t),
        );
        let target = d.target().unwrap();
        let e = target.endpoint.index();
        let uncached = d.predicted_prefill_tokens(BS);
        let guard = self.tracker.charge(target, uncached);
        let start = self.busy_until_ms[e].max(t);
        self.busy_until_ms[e] = start + u64::from(uncached) / TOKENS_PER_MS;
        self.open.push((self.busy_until_ms[e], guard));
        e
    }

    /// Drives both engines for ten seconds (a prompt of 400..1 000 tokens
    /// every 50 ms), then lets everything finish.
    fn warm_up(&mut self) -> u64 {
        let mut t = 0;
        for k in 0..200u32 {
            self.send(t, 400 + (k * 37) % 601);
            t += 50;
        }
        t + 2_000
    }
}

/// Endpoint A takes a 4 000-token prompt at `t` (400 ms of prefill), endpoint
/// B a 1 000-token one at `t + 380` (100 ms). At `t + 390` A is 10 ms from
/// idle, B 90 ms, while the tracker holds 4 000 tokens for A and 1 000 for
/// B. Returns (A, B, where the 2 000-token prompt sent at `t + 390` went).
fn scenario(host: &mut Host) -> (usize, usize, usize) {
    let t = host.warm_up();
    host.advance(t);
    assert_eq!(host.tracker.load(EndpointId(0)).queued_prefill_tokens, 0);
    assert_eq!(host.tracker.load(EndpointId(1)).queued_prefill_tokens, 0);
    let a = host.send(t, 4000);
    let b = host.send(t + 380, 1000);
    assert_ne!(a, b, "the second prompt goes to the idle endpoint");
    let w = host.send(t + 390, 2000);
    (a, b, w)
}

#[test]
fn a_request_goes_where_the_prefill_ahead_is_shortest() {
    let mut host = Host::new(true);
    let (a, _, w) = scenario(&mut host);
    assert_eq!(w, a, "A is 10 ms from idle, B 90 ms");
}

#[test]
fn without_the_drain_model_the_tracker_figure_misleads() {
    let mut host = Host::new(false);
    let (_, b, w) = scenario(&mut host);
    assert_eq!(
        w, b,
        "4 000 charged tokens on A look busier than 1 000 on B"
    );
}
