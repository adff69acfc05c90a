//! The cost scorer's cache-room term: while some endpoint's cache has room
//! for what a request would write, a placement that would evict cached
//! blocks elsewhere costs them. New conversations over a shared root then
//! spread over caches with room instead of filling the few that hold the
//! root; a conversation stays with its history; and with no room anywhere
//! (a fleet whose caches are full) or no known capacity, nothing changes.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{InventoryView, Overlap};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;
/// Blocks each engine's cache holds.
const CAPACITY: u64 = 1_000;

fn rule(n: u32, eviction_weight: f64) -> (Rule, ContractId) {
    let c = ContractId::new("room/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i))
        .collect();
    let mut cfg = RuleConfig::kv_exact("room", Topology::Converged, eps, BS, c.clone());
    cfg.scorer = Arc::new(CostScorer(CostConfig {
        eviction_weight,
        ..CostConfig::default()
    }));
    cfg.predicted.capacity = 0;
    (Rule::new(cfg, None).unwrap(), c)
}

/// An inventory that also says how many blocks each engine's cache holds.
struct Held {
    inv: KeySetInventory,
    blocks: Vec<u64>,
}

impl InventoryView for Held {
    fn endpoint_count(&self) -> usize {
        self.inv.endpoint_count()
    }
    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.inv.score(keys, out);
    }
    fn gpu_blocks(&self, endpoint: usize) -> Option<u64> {
        self.blocks.get(endpoint).copied()
    }
}

/// Loads, and engine reports that state each cache's capacity (or none).
struct Reported {
    loads: LoadTable,
    capacity: Option<u64>,
}

impl Load for Reported {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.loads.load(endpoint)
    }
    fn report(&self, _: EndpointId) -> Option<EngineReport> {
        self.capacity.map(|c| EngineReport {
            kv_capacity_blocks: Some(c),
            ..EngineReport::default()
        })
    }
}

fn chain(seed: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64)
        .map(|i| BlockKey(seed * 1_000_000 + i))
        .collect()
}

fn pick(r: &Rule, c: &ContractId, keys: &[BlockKey], view: &Held, load: &Reported) -> u32 {
    let req = Request::new(PromptInput::Keys {
        keys,
        contract: c,
        prompt_tokens: u32::try_from(keys.len()).unwrap() * BS,
    });
    let d = r.decide(&req, view, load, &AlwaysAvailable, Duration::ZERO);
    d.target().expect("a target").endpoint.0
}

/// Two idle endpoints reporting [`CAPACITY`]: endpoint 0 holds `held` and
/// its cache `blocks0` blocks, endpoint 1's cache is empty.
fn two_endpoints(held: &[BlockKey], blocks0: u64) -> (Held, Reported) {
    let mut inv = KeySetInventory::new(2);
    inv.store(0, held.iter().copied());
    let view = Held {
        inv,
        blocks: vec![blocks0, 0],
    };
    let load = Reported {
        loads: LoadTable::new(2),
        capacity: Some(CAPACITY),
    };
    (view, load)
}

/// Endpoint 0 holds a shared root (4 blocks) and its cache is full;
/// endpoint 1's is empty. A new 40-block conversation would evict 36
/// cached blocks on endpoint 0 and nothing on endpoint 1: it goes to 1,
/// re-prefilling the root there. Without the term it stays with the root.
#[test]
fn a_new_conversation_goes_where_the_cache_has_room() {
    let root = chain(1, 4);
    let mut keys = root.clone();
    keys.extend(chain(2, 36));
    let (view, load) = two_endpoints(&root, CAPACITY);
    let (with, c) = rule(2, 1.0);
    assert_eq!(pick(&with, &c, &keys, &view, &load), 1);
    let (without, c) = rule(2, 0.0);
    assert_eq!(pick(&without, &c, &keys, &view, &load), 0);
}

/// A conversation whose history (36 of 40 blocks) is on a full cache stays
/// there: its new turn evicts 4 blocks, far less than re-prefilling the
/// history where there is room.
#[test]
fn a_conversation_stays_with_its_history_on_a_full_cache() {
    let keys = chain(3, 40);
    let (view, load) = two_endpoints(&keys[..36], CAPACITY);
    let (r, c) = rule(2, 1.0);
    assert_eq!(pick(&r, &c, &keys, &view, &load), 0);
}

/// The explanation shows the term: what endpoint 0 would evict.
#[test]
fn the_explanation_shows_the_evicted_tokens() {
    let root = chain(4, 4);
    let mut keys = root.clone();
    keys.extend(chain(5, 36));
    let (view, load) = two_endpoints(&root, CAPACITY - 6);
    let (r, c) = rule(2, 1.0);
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &c,
        prompt_tokens: 40 * BS,
    });
    let mut d = Decision::new();
    d.set_explain(true);
    r.decide_into(&mut d, &req, &view, &load, &AlwaysAvailable, Duration::ZERO);
    let x = d.explanation().expect("an explanation");
    let terms = |e: usize| x.endpoints[e].terms.expect("terms");
    // 36 blocks written into 6 free: 30 blocks evicted.
    assert_eq!(terms(0).evict_tokens, f64::from(30 * BS));
    assert_eq!(terms(1).evict_tokens, 0.0);
}

proptest! {
    /// With every cache full (no candidate has room for what it would
    /// write) or no capacity reported, every decision is the one the rule
    /// makes without the term.
    #[test]
    fn without_room_anywhere_nothing_changes(
        prefixes in proptest::collection::vec(0usize..30, 3),
        loads in proptest::collection::vec((0u32..6, 0u64..4_000), 3),
        reported in any::<bool>(),
        len in 1usize..40,
    ) {
        let keys = chain(6, len);
        let mut inv = KeySetInventory::new(3);
        for (e, p) in prefixes.iter().enumerate() {
            inv.store(e, keys[..(*p).min(len - 1)].iter().copied());
        }
        let view = Held { inv, blocks: vec![CAPACITY; 3] };
        let mut table = LoadTable::new(3);
        for (e, (in_flight, queued)) in loads.iter().enumerate() {
            table.set(EndpointId(e as u32), EndpointLoad {
                in_flight: *in_flight,
                queued_prefill_tokens: *queued,
            });
        }
        let load = Reported { loads: table, capacity: reported.then_some(CAPACITY) };
        let (with, c) = rule(3, 1.0);
        let (without, _) = rule(3, 0.0);
        prop_assert_eq!(
            pick(&with, &c, &keys, &view, &load),
            pick(&without, &c, &keys, &view, &load)
        );
    }
}
