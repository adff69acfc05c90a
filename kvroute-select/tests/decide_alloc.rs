//! A reused `Decision` decides without allocating once its buffers have
//! grown — with its explanation off (nothing is recorded, nothing is
//! allocated for it) and on (the explanation's buffers are reused too) —
//! counted by a global allocator that counts this thread's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;

/// Counts allocations made by the current thread (other test threads do not
/// disturb a measurement).
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as for `dealloc`, and `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCS.with(Cell::get)
}

const N: usize = 8;

fn allocations_per_decisions(explain: bool, retry: bool) -> u64 {
    let c = ContractId::new("alloc/bs16");
    let eps = (0..N)
        .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i as u32))
        .collect();
    let rule = Rule::new(
        RuleConfig::kv_exact("alloc", Topology::Converged, eps, 16, c.clone()),
        None,
    )
    .unwrap();
    let keys: Vec<BlockKey> = (0..256).map(|i| BlockKey(1_000 + i)).collect();
    let mut inv = KeySetInventory::new(N);
    for slot in 0..N {
        inv.store(slot, keys[..slot * 20].iter().copied());
    }
    let mut load = LoadTable::new(N);
    for i in 0..N {
        load.set(
            EndpointId(i as u32),
            EndpointLoad {
                in_flight: (i * 3 % 7) as u32,
                queued_prefill_tokens: (i * 500) as u64,
            },
        );
    }
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &c,
        prompt_tokens: 4096,
    });
    let mut d = Decision::new();
    d.set_explain(explain);
    let run = |d: &mut Decision, at: u64| {
        let now = Duration::from_millis(at);
        rule.decide_into(d, &req, &inv, &load, &AlwaysAvailable, now);
        assert!(d.target().is_some());
        if retry {
            let _ = rule.retry(d, Leg::Endpoint, &req, &load, &AlwaysAvailable, now);
        }
        std::hint::black_box(d.account());
    };
    for i in 0..50 {
        run(&mut d, i);
    }
    let before = allocations();
    for i in 50..250 {
        run(&mut d, i);
    }
    let n = allocations() - before;
    if explain {
        assert!(d.explanation().is_some_and(|x| !x.picks.is_empty()));
    } else {
        assert!(d.explanation().is_none());
    }
    n
}

#[test]
fn decisions_do_not_allocate_unless_asked_and_then_reuse_their_buffers() {
    assert_eq!(allocations_per_decisions(false, false), 0, "not explaining");
    assert_eq!(
        allocations_per_decisions(false, true),
        0,
        "not explaining, with a retry"
    );
    assert_eq!(allocations_per_decisions(true, false), 0, "explaining");
    assert_eq!(
        allocations_per_decisions(true, true),
        0,
        "explaining, with a retry"
    );
}

/// The counter counts: asking for an explanation allocates it once.
#[test]
fn the_counter_sees_an_explanation_being_allocated() {
    let before = allocations();
    let mut d = Decision::new();
    d.set_explain(true);
    assert!(allocations() > before);
}
