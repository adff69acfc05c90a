//! Candidate sampling on large pools ([`Thresholds::sample_size`]): which
//! endpoints a decision scores, against a reference model, and that a
//! sampled decision is the full decision over the endpoints it scored.

mod common;
use common::Avail;

use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;

/// A load table seen by one of several deciders.
struct Ranked<'a>(&'a LoadTable, u32);

impl Load for Ranked<'_> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.0.load(endpoint)
    }

    fn deciders(&self) -> Deciders {
        Deciders {
            count: 4,
            rank: self.1,
            ..Deciders::ALONE
        }
    }
}

fn keys(blocks: u32) -> Vec<BlockKey> {
    salted_keys(0, blocks)
}

fn salted_keys(salt: u64, blocks: u32) -> Vec<BlockKey> {
    (0..u64::from(blocks))
        .map(|i| BlockKey(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1) ^ salt << 48))
        .collect()
}

fn rule(n: usize, sample_size: u32) -> Rule {
    let c = ContractId::new("test/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("e{i}:1"), Role::Both).with_inventory_slot(i as u32))
        .collect();
    let mut cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, BS, c);
    cfg.thresholds.sample_size = sample_size;
    Rule::new(cfg, None).unwrap()
}

/// A pool whose endpoint `i` holds the first `held[i]` blocks of `prompt`
/// and carries `in_flight[i]` requests.
fn pool(prompt: &[BlockKey], held: &[u32], in_flight: &[u32]) -> (KeySetInventory, LoadTable) {
    let mut inv = KeySetInventory::new(held.len());
    let mut load = LoadTable::new(held.len());
    for (i, (&h, &f)) in held.iter().zip(in_flight).enumerate() {
        inv.store(i, prompt[..h as usize].iter().copied());
        load.set(
            EndpointId(i as u32),
            EndpointLoad {
                in_flight: f,
                queued_prefill_tokens: 0,
            },
        );
    }
    (inv, load)
}

/// The request of `prompt`'s keys under contract `c`.
fn keyed<'a>(prompt: &'a [BlockKey], c: &'a ContractId) -> Request<'a> {
    Request::new(PromptInput::Keys {
        keys: prompt,
        contract: c,
        prompt_tokens: prompt.len() as u32 * BS,
    })
}

/// The same pool in the ingest index, whose walk marks the banks it scored
/// alike (which the sample's pass judges once).
fn indexed(prompt: &[BlockKey], held: &[u32]) -> kvroute_ingest::SharedIndex {
    use kvroute_ingest::{IndexConfig, SharedIndex};
    let index = SharedIndex::new(held.len(), IndexConfig::default());
    for (i, &h) in held.iter().enumerate() {
        index
            .store_chain(
                EndpointId(i as u32),
                kvroute_core::Medium::Gpu,
                None,
                &prompt[..h as usize],
            )
            .unwrap();
    }
    index
}

/// The decision and the endpoints it left out of its sample.
fn decide<L: Load, H: Health, V: kvroute_ingest::InventoryView>(
    rule: &Rule,
    prompt: &[BlockKey],
    inv: &V,
    load: &L,
    health: &H,
) -> (Option<usize>, Vec<bool>) {
    let c = ContractId::new("test/bs16");
    let req = keyed(prompt, &c);
    let mut d = Decision::new();
    d.set_explain(true);
    rule.decide_into(&mut d, &req, inv, load, health, Duration::ZERO);
    let x = d.take_explanation().unwrap();
    let left_out = x
        .endpoints
        .iter()
        .map(|r| r.ineligible == Some(Ineligible::NotSampled))
        .collect();
    (d.target().map(|t| t.endpoint.index()), left_out)
}

/// A fleet of 1 024 sharing a 4-block root, one endpoint holding the whole
/// prompt: the decision scores that endpoint and a sample of 64 others,
/// and goes there.
#[test]
fn a_large_pool_scores_every_longer_holder_and_a_sample() {
    let prompt = keys(16);
    let n = 1024;
    let mut held = vec![4u32; n];
    held[700] = 16;
    let (inv, load) = pool(&prompt, &held, &vec![1; n]);
    let r = rule(n, 64);
    let (target, left_out) = decide(&r, &prompt, &inv, &load, &AlwaysAvailable);
    assert_eq!(target, Some(700));
    assert!(!left_out[700], "the longest holder is scored");
    let scored = left_out.iter().filter(|l| !**l).count();
    assert!((2..=65).contains(&scored), "scored {scored}");
    // At or below four times the sample size every endpoint is scored.
    let (small_inv, small_load) = pool(&prompt, &held[..256], &vec![1; 256]);
    let (_, left_out) = decide(
        &rule(256, 64),
        &prompt,
        &small_inv,
        &small_load,
        &AlwaysAvailable,
    );
    assert!(left_out.iter().all(|l| !*l));
    // And with sampling off.
    let (_, left_out) = decide(&rule(n, 0), &prompt, &inv, &load, &AlwaysAvailable);
    assert!(left_out.iter().all(|l| !*l));
}

/// Most of a pool holds a 10-block root on disk; one endpoint holds 8 of
/// its blocks on the GPU, another all 10 in host memory: both may save more
/// prefill than the disk copies (a shorter prefix in a faster tier), so
/// both are scored, and the GPU one wins at equal load.
#[test]
fn a_shorter_prefix_in_a_faster_tier_is_scored() {
    use kvroute_core::Medium;
    use kvroute_ingest::{IndexConfig, SharedIndex};
    let prompt = keys(12);
    let n = 300;
    let index = SharedIndex::new(n, IndexConfig::default());
    let mut load = LoadTable::new(n);
    for i in 0..n {
        let e = EndpointId(i as u32);
        match i {
            123 => index.store(e, Medium::Gpu, &prompt[..8]).unwrap(),
            200 => index.store(e, Medium::Cpu, &prompt[..10]).unwrap(),
            _ => index.store(e, Medium::Disk, &prompt[..10]).unwrap(),
        };
        load.set(
            e,
            EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: 0,
            },
        );
    }
    let c = ContractId::new("test/bs16");
    let req = keyed(&prompt, &c);
    let r = rule(n, 4);
    let mut d = Decision::new();
    r.decide_into(
        &mut d,
        &req,
        &index,
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    let sampled = d.sampled();
    assert!(
        !sampled.is_empty() && sampled.len() < n,
        "sampled: {}",
        sampled.len()
    );
    assert!(sampled.contains(&123) && sampled.contains(&200));
    assert_eq!(d.target().map(|t| t.endpoint.index()), Some(123));
}

/// Deciders draw samples of their own: replicas started together (their
/// rules' counters alike) deciding one burst on one view look at different
/// endpoints.
#[test]
fn deciders_draw_different_samples() {
    let prompt = keys(8);
    let n = 1024;
    let (inv, load) = pool(&prompt, &vec![2; n], &vec![1; n]);
    let samples: Vec<Vec<bool>> = (0..4)
        .map(|rank| {
            let r = rule(n, 32);
            decide(&r, &prompt, &inv, &Ranked(&load, rank), &AlwaysAvailable).1
        })
        .collect();
    for a in 0..4 {
        for b in a + 1..4 {
            assert_ne!(samples[a], samples[b], "ranks {a} and {b}");
        }
    }
}

/// A prompt every endpoint holds one block of, below the rule's two-block
/// threshold: the sampled decision misses and falls back to the rule's
/// selector, which chooses over the whole pool (the one idle endpoint of
/// 1 024, which a sample of 64 would usually miss); so does a prompt cached
/// nowhere.
#[test]
fn a_fallback_chooses_over_the_whole_pool() {
    let n = 1024;
    let mut in_flight = vec![3u32; n];
    in_flight[777] = 0;
    let c = ContractId::new("test/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("e{i}:1"), Role::Both).with_inventory_slot(i as u32))
        .collect();
    let mut cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, BS, c.clone());
    cfg.thresholds.min_overlap_blocks = 2;
    let r = Rule::new(cfg, None).unwrap();
    for salt in 1..9 {
        // Fresh prompts: a repeated one would be credited to 777 by the
        // predicted entry the first decision left, and decided by KV-exact.
        let prompt = salted_keys(salt, 8);
        let (inv, load) = pool(&prompt, &vec![1; n], &in_flight);
        let req = keyed(&prompt, &c);
        let mut d = Decision::new();
        d.set_explain(true);
        r.decide_into(&mut d, &req, &inv, &load, &AlwaysAvailable, Duration::ZERO);
        assert_eq!(d.miss(), Some(MissReason::BelowThreshold));
        assert_eq!(d.target().map(|t| t.endpoint.index()), Some(777));
        assert!(d.sampled().is_empty(), "the fallback scored every endpoint");
        let x = d.take_explanation().unwrap();
        assert!(x.endpoints.iter().all(|r| r.ineligible.is_none()));
        // Cached nowhere.
        let (inv, load) = pool(&prompt, &vec![0; n], &in_flight);
        let (target, left_out) = decide(
            &r,
            &salted_keys(salt + 100, 8),
            &inv,
            &load,
            &AlwaysAvailable,
        );
        assert_eq!(target, Some(777));
        assert!(left_out.iter().all(|l| !*l));
    }
}

/// A sample whose every endpoint is down: the decision is made over the
/// whole pool, by KV-exact, not handed to the fallback.
#[test]
fn a_sample_with_nothing_available_decides_over_the_whole_pool() {
    let prompt = keys(8);
    let n = 200;
    let (inv, load) = pool(&prompt, &vec![2; n], &vec![1; n]);
    // Draw the sample once, then take exactly its endpoints down.
    let r = rule(n, 2);
    let (_, left_out) = decide(&r, &prompt, &inv, &load, &AlwaysAvailable);
    let up: Vec<bool> = left_out.clone();
    let r = rule(n, 2);
    let c = ContractId::new("test/bs16");
    let req = keyed(&prompt, &c);
    let mut d = Decision::new();
    r.decide_into(
        &mut d,
        &req,
        &inv,
        &load,
        &Avail(up.clone()),
        Duration::ZERO,
    );
    assert_eq!(d.source(), Source::KvExact);
    let t = d.target().unwrap().endpoint.index();
    assert!(up[t]);
    assert!(d.sampled().is_empty());
}

#[derive(Clone, Debug)]
struct Fleet {
    prompt_blocks: u32,
    /// Banks of 64 endpoints are often all alike (a shared root held by a
    /// whole bank, or nothing): the index marks those.
    held: Vec<u32>,
    in_flight: Vec<u32>,
    up: Vec<bool>,
    sample_size: u32,
}

fn fleet() -> impl Strategy<Value = Fleet> {
    (17usize..200, 1u32..5, 2u32..12, 0u32..12).prop_flat_map(|(n, k, blocks, common)| {
        let common = common.min(blocks);
        (
            Just(blocks),
            prop::collection::vec(prop_oneof![3 => Just(common), 1 => 0..=blocks], n),
            prop::collection::vec(
                prop_oneof![2 => Just(None), 1 => Just(Some(common)), 1 => (0..=blocks).prop_map(Some)],
                n.div_ceil(64),
            ),
            prop::collection::vec(0u32..6, n),
            prop::collection::vec(prop::bool::weighted(0.9), n),
            Just(k),
        )
            .prop_map(
                move |(prompt_blocks, mut held, alike, in_flight, up, sample_size)| {
                    for (bank, alike) in held.chunks_mut(64).zip(alike) {
                        if let Some(h) = alike {
                            bank.fill(h);
                        }
                    }
                    Fleet {
                        prompt_blocks,
                        held,
                        in_flight,
                        up,
                        sample_size,
                    }
                },
            )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every endpoint holding more of the prompt than a majority of the
    /// pool shares is scored; and the sampled decision is the decision a
    /// rule scoring every endpoint makes when the ones left out are
    /// unavailable.
    #[test]
    fn a_sample_keeps_every_longer_holder_and_decides_as_the_full_rule(f in fleet()) {
        let prompt = keys(f.prompt_blocks);
        let n = f.held.len();
        let (inv, load) = pool(&prompt, &f.held, &f.in_flight);
        let sampled = rule(n, f.sample_size);
        let (target, left_out) = decide(&sampled, &prompt, &inv, &load, &Avail(f.up.clone()));
        // Reference: the prefix held by more than half of the pool, if any.
        let majority = (0..=f.prompt_blocks)
            .find(|p| f.held.iter().filter(|h| *h == p).count() * 2 > n);
        if let Some(m) = majority {
            for (i, h) in f.held.iter().enumerate() {
                if *h > m {
                    prop_assert!(!left_out[i], "endpoint {i} holds {h} > {m} and was left out");
                }
            }
        }
        if n <= 4 * f.sample_size as usize {
            prop_assert!(left_out.iter().all(|l| !*l));
        }
        let up: Vec<bool> = f.up.iter().zip(&left_out).map(|(u, l)| *u && !*l).collect();
        let (full_target, _) = decide(&rule(n, 0), &prompt, &inv, &load, &Avail(up));
        // A fallback chooses over the whole pool in both.
        let fell_back = left_out.iter().all(|l| !*l);
        if !fell_back {
            prop_assert_eq!(target, full_target);
        }
        // Over the ingest index (banks scored alike judged once) the same
        // endpoints are left out, and the same endpoint is chosen.
        let index = indexed(&prompt, &f.held);
        let (index_target, index_left_out) =
            decide(&rule(n, f.sample_size), &prompt, &index, &load, &Avail(f.up.clone()));
        prop_assert_eq!(&index_left_out, &left_out);
        prop_assert_eq!(index_target, target);
        // And over an index with slots kept free beyond the rule's
        // endpoints (for endpoints added later).
        let mut roomy = f.held.clone();
        roomy.resize(n + 37, 0);
        let index = indexed(&prompt, &roomy);
        let (roomy_target, roomy_left_out) =
            decide(&rule(n, f.sample_size), &prompt, &index, &load, &Avail(f.up.clone()));
        prop_assert_eq!(roomy_left_out, left_out);
        prop_assert_eq!(roomy_target, target);
    }
}

/// A sampled first pick that widens (nothing of the sample can take the
/// request) reads the inventories of the endpoints it adds: the endpoint it
/// picks there gets its prediction recorded like any other, so the burst's
/// next request is credited there.
#[test]
fn a_widened_first_pick_records_its_prediction() {
    use kvroute_core::Medium;
    use kvroute_ingest::{IndexConfig, SharedIndex};
    let prompt = keys(12);
    let n = 300;
    let index = SharedIndex::new(n, IndexConfig::default());
    // Every endpoint holds a 4-block root; endpoint 7 the whole prompt but
    // it is down, so the sample (7 and 4 others) may hold nothing up.
    for i in 0..n {
        let held = if i == 7 { 12 } else { 4 };
        index
            .store_chain(EndpointId(i as u32), Medium::Gpu, None, &prompt[..held])
            .unwrap();
    }
    let load = LoadTable::new(n);
    let c = ContractId::new("test/bs16");
    let req = keyed(&prompt, &c);
    let r = rule(n, 4);
    // Only endpoints outside any sample of 4 draws are up: 7 is down, and
    // so is every endpoint below 290 (a sample that drew one of 290–299
    // would not widen; the seed makes this one draw below 290).
    let up: Vec<bool> = (0..n).map(|i| i >= 290).collect();
    let mut d = Decision::new();
    r.decide_into(
        &mut d,
        &req,
        &index,
        &load,
        &Avail(up.clone()),
        Duration::ZERO,
    );
    let t = d.target().expect("a target over the whole pool").endpoint;
    assert!(t.index() >= 290, "target {t}");
    assert!(d.sampled().is_empty(), "the decision widened");
    let next = r.decide(&req, &index, &load, &Avail(up), Duration::ZERO);
    assert_eq!(
        next.speculative_prefix()[t.index()],
        12,
        "the widened pick's prediction"
    );
}
