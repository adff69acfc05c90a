//! What the simulator's tests share: a fleet of the mock engine's workers
//! with the simulator's defaults, which each test overrides where it needs
//! to (`FleetConfig { replicas: 4, ..fleet(8, 64, 262_144) }`).

use kvroute_engine_model::{CostModel, WorkerConfig};
use kvroute_sim::fleet::FleetConfig;
use kvroute_sim::policy::Tuning;

/// `workers` workers of `capacity_tokens` of KV each in blocks of `block`
/// tokens; one gateway polling the engines every 100 ms, KV events 20.06 ms
/// late, seed 1; the peers' policies scrape every 50 ms.
pub fn fleet(workers: usize, block: u32, capacity_tokens: u32) -> FleetConfig {
    FleetConfig {
        workers,
        worker: WorkerConfig {
            block_size: block,
            capacity_blocks: capacity_tokens / block,
            max_running: 64,
            cost: CostModel::default(),
            ..WorkerConfig::default()
        },
        event_delay_us: 20_060,
        event_loss: 0.0,
        seq_window: 64,
        seed: 1,
        concurrency: None,
        tuning: Tuning::default(),
        replicas: 1,
        load_poll_us: 100_000,
        replica_sync_us: 0,
        replica_stagger_us: 0,
        burst_order_us: 1000,
        peer_poll_us: 50_000,
    }
}
