//! A decision made into a reused [`Decision`] (its buffers sized by earlier
//! decisions, as hosts and the runtime reuse them) equals one made into a
//! fresh `Decision`: nothing of an earlier decision shows through — not its
//! overlaps, its sample, its endpoints' contract status or clears, its
//! explanation rows, nor what a retry or a receipt reads.

use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryHealth, InventoryView, Overlap, SharedIndex};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;

/// The ingest index with a contract status and clear count per endpoint.
struct Reporting {
    index: SharedIndex,
    health: Vec<InventoryHealth>,
}

impl InventoryView for Reporting {
    fn endpoint_count(&self) -> usize {
        self.index.endpoint_count()
    }
    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.index.score(keys, out);
    }
    fn score_prefix(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.index.score_prefix(keys, out);
    }
    fn score_prefix_uniform(&self, keys: &[BlockKey], out: &mut [Overlap], uniform: &mut [bool]) {
        self.index.score_prefix_uniform(keys, out, uniform);
    }
    fn health(&self, endpoint: usize) -> InventoryHealth {
        self.health.get(endpoint).copied().unwrap_or_default()
    }
    fn gpu_blocks(&self, endpoint: usize) -> Option<u64> {
        InventoryView::gpu_blocks(&self.index, endpoint)
    }
}

/// One request of the sequence: its prompt, and the pool it meets.
#[derive(Clone, Debug)]
struct Step {
    prompt_blocks: u32,
    /// Every endpoint holds this much of the prompt (a shared root), but
    /// those `holders` picks out hold `longer`; none when `root` is 0 and
    /// nothing is cached.
    root: u32,
    longer: u32,
    holders: u64,
    /// Endpoints reporting a mismatched contract, and clears.
    mismatched: u64,
    clears: u64,
    /// The host fails to connect to the first target.
    retry: bool,
    /// The prompt's keys come under another hash contract (nothing is
    /// scored).
    foreign: bool,
}

fn step() -> impl Strategy<Value = Step> {
    (
        2u32..10,
        prop_oneof![1 => Just(0u32), 2 => 1u32..4],
        0u32..10,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.15),
    )
        .prop_map(
            |(prompt_blocks, root, longer, holders, mismatched, clears, retry, foreign)| Step {
                prompt_blocks,
                root: root.min(prompt_blocks),
                longer: longer.min(prompt_blocks),
                holders,
                mismatched,
                clears,
                retry,
                foreign,
            },
        )
}

fn view(n: usize, s: &Step, prompt: &[BlockKey]) -> Reporting {
    let index = SharedIndex::new(n, IndexConfig::default());
    let mut health = Vec::with_capacity(n);
    for i in 0..n {
        let bit = |m: u64| m.rotate_left(i as u32 * 7) & 1 == 1;
        let held = if bit(s.holders) && i % 5 == 0 {
            s.longer
        } else {
            s.root
        };
        index
            .store_chain(
                EndpointId(i as u32),
                Medium::Gpu,
                None,
                &prompt[..held as usize],
            )
            .unwrap();
        health.push(InventoryHealth {
            contract_mismatch: bit(s.mismatched) && i % 3 == 0,
            clears: u64::from(bit(s.clears)),
            ..Default::default()
        });
    }
    Reporting { index, health }
}

fn rule(n: usize) -> Rule {
    let c = ContractId::new("test/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("e{i}:1"), Role::Both).with_inventory_slot(i as u32))
        .collect();
    let mut cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, BS, c);
    cfg.thresholds.sample_size = 4;
    Rule::new(cfg, None).unwrap()
}

/// Everything a host reads of a decision.
#[derive(Debug, PartialEq)]
struct Seen {
    target: Option<Target>,
    source: Source,
    miss: Option<MissReason>,
    sampled: Vec<u32>,
    overlaps: Vec<Overlap>,
    speculative: Vec<u32>,
    explanation: Option<Box<Explanation>>,
    settlement: Settlement,
}

/// Decides `s` by `rule` into `d`, retries once if asked, and settles a
/// receipt of the prompt's first block.
fn run(rule: &Rule, d: &mut Decision, n: usize, s: &Step, at: Duration) -> Seen {
    let prompt: Vec<BlockKey> = (0..u64::from(s.prompt_blocks))
        .map(|k| BlockKey(k * 0x9e37_79b9 + 1))
        .collect();
    let view = view(n, s, &prompt);
    let load = LoadTable::new(n);
    let c = ContractId::new(if s.foreign { "other/bs16" } else { "test/bs16" });
    let req = Request::new(PromptInput::Keys {
        keys: &prompt,
        contract: &c,
        prompt_tokens: s.prompt_blocks * BS,
    });
    d.set_explain(true);
    rule.decide_into(d, &req, &view, &load, &AlwaysAvailable, at);
    if s.retry && d.target().is_some() {
        rule.retry(d, Leg::Endpoint, &req, &load, &AlwaysAvailable, at);
    }
    Seen {
        target: d.target(),
        source: d.source(),
        miss: d.miss(),
        sampled: d.sampled().to_vec(),
        overlaps: d.overlaps().to_vec(),
        speculative: d.speculative_prefix().to_vec(),
        settlement: rule.settle(d, BS, Some(s.prompt_blocks * BS)),
        explanation: d.take_explanation(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The same requests to two like rules, one deciding into one reused
    /// decision and the other into a fresh decision each time: a small pool
    /// (every endpoint scored) and a large one (sampled when most of it
    /// stands alike), prompts cached everywhere, somewhere or nowhere.
    #[test]
    fn a_reused_decision_decides_as_a_fresh_one(
        n in prop_oneof![Just(40usize), Just(300)],
        steps in prop::collection::vec(step(), 2..10),
    ) {
        let (reusing, fresh) = (rule(n), rule(n));
        let mut reused = Decision::new();
        for (k, s) in steps.iter().enumerate() {
            let at = Duration::from_millis(k as u64);
            let a = run(&reusing, &mut reused, n, s, at);
            let b = run(&fresh, &mut Decision::new(), n, s, at);
            prop_assert_eq!(a, b, "step {}", k);
        }
    }
}
