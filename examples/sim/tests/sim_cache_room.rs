//! A lightly loaded fleet with idle caches: fresh conversations over one
//! shared root must spread over the caches with room, not fill the few that
//! hold the root and evict conversations they would have served from cache.
//! The default cost scorer's cache-room term (the engines report their KV
//! capacity) keeps the hit ratio at the pooled bound; with the term off the
//! same run loses hits. Simulated time, real rule / tracker / ingest /
//! worker model.

mod support;

use kvroute_sim as sim;

use sim::fleet::FleetConfig;
use sim::policy::{Policy, Tuning};
use sim::report::PolicyReport;
use sim::workload::{generate, GenConfig, Kind};
use sim::RunPlan;

fn run(eviction_weight: f64) -> PolicyReport {
    let mut tuning = Tuning::default();
    tuning.cost.eviction_weight = eviction_weight;
    let fleet = FleetConfig {
        tuning,
        ..support::fleet(32, 16, 262_144)
    };
    let w = generate(&GenConfig {
        kind: Kind::ChatBursts,
        requests: 1200,
        seed: 1,
        rate: Kind::ChatBursts.default_rate(),
    });
    let plan = RunPlan {
        fleet,
        policies: vec![Policy::KvExact],
        time_scale: 1.0,
        arrival_spread_us: 0,
    };
    let mut r = sim::simulate_all(w, "chat-bursts", &plan).unwrap();
    r.policies.remove(0)
}

#[test]
fn fresh_conversations_spread_over_caches_with_room() {
    let default = run(tuning_default_weight());
    let off = run(0.0);
    eprintln!(
        "default: hit {:.4} ({:.3} of pooled) mean {:.1} | off: hit {:.4} ({:.3} of pooled) mean {:.1}",
        default.prefix_hit_ratio,
        default.hit_over_pooled,
        default.ttft_ms.mean,
        off.prefix_hit_ratio,
        off.hit_over_pooled,
        off.ttft_ms.mean,
    );
    assert_eq!(default.served, 1200);
    assert!(
        default.hit_over_pooled >= 0.97,
        "hit ratio {:.3} of the pooled bound",
        default.hit_over_pooled
    );
    // Measured: 0.998 and 0.948 of the pooled bound.
    assert!(
        default.hit_over_pooled >= off.hit_over_pooled + 0.03,
        "of the pooled bound: with the term {:.3}, without {:.3}",
        default.hit_over_pooled,
        off.hit_over_pooled
    );
    assert!(default.ttft_ms.mean <= off.ttft_ms.mean);
}

fn tuning_default_weight() -> f64 {
    let w = Tuning::default().cost.eviction_weight;
    assert!(w > 0.0, "the term is on by default");
    w
}
