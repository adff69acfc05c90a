//! The load tracker against a naive model: every guard remembers which
//! endpoints it charged, in which of their slots' epochs, and how many
//! prefill tokens; an endpoint's load is the sum over the live guards
//! charged in its current epoch. Real [`LoadTracker`] guards charge,
//! answer, retarget and release; slots are retired (a new endpoint takes
//! them) in between. After every step the tracker's load, started and
//! charged counters equal the model's.

use std::sync::Arc;

use kvroute_core::EndpointId;
use kvroute_select::{EndpointLoad, Load, LoadGuard, LoadTracker, Target};
use proptest::prelude::*;

const SLOTS: u32 = 3;

#[derive(Clone, Copy, Debug)]
enum Op {
    Charge {
        endpoint: u32,
        decode: Option<u32>,
        tokens: u32,
    },
    FirstByte(usize),
    PrefillLegDone(usize),
    Retarget {
        guard: usize,
        endpoint: u32,
        tokens: u32,
    },
    RetargetDecode {
        guard: usize,
        decode: u32,
    },
    ReleaseDecode(usize),
    Drop(usize),
    Retire(u32),
}

fn op() -> impl Strategy<Value = Op> {
    // One id beyond the tracker: unknown endpoints are ignored.
    let e = 0..=SLOTS;
    prop_oneof![
        3 => (e.clone(), proptest::option::of(e.clone()), 0u32..5000)
            .prop_map(|(endpoint, decode, tokens)| Op::Charge { endpoint, decode, tokens }),
        1 => any::<usize>().prop_map(Op::FirstByte),
        1 => any::<usize>().prop_map(Op::PrefillLegDone),
        1 => (any::<usize>(), e.clone(), 0u32..5000)
            .prop_map(|(guard, endpoint, tokens)| Op::Retarget { guard, endpoint, tokens }),
        1 => (any::<usize>(), e.clone()).prop_map(|(guard, decode)| Op::RetargetDecode { guard, decode }),
        1 => any::<usize>().prop_map(Op::ReleaseDecode),
        2 => any::<usize>().prop_map(Op::Drop),
        1 => e.prop_map(Op::Retire),
    ]
}

/// A guard as the model sees it: its legs as (endpoint, epoch).
#[derive(Clone, Copy, Debug, Default)]
struct ModelGuard {
    main: Option<(u32, u32)>,
    decode: Option<(u32, u32)>,
    tokens: u64,
}

#[derive(Default)]
struct Model {
    epochs: [u32; SLOTS as usize],
    started: [u64; SLOTS as usize],
    charged: [u64; SLOTS as usize],
    guards: Vec<ModelGuard>,
}

impl Model {
    /// A leg charged on `e`; on an unknown endpoint it has an epoch no
    /// slot ever reaches (the guard still holds it, and counts nowhere).
    fn leg(&mut self, e: u32, tokens: u64) -> (u32, u32) {
        let Some(slot) = usize::try_from(e).ok().filter(|s| *s < SLOTS as usize) else {
            return (e, u32::MAX);
        };
        self.started[slot] += 1;
        self.charged[slot] += tokens;
        (e, self.epochs[slot])
    }

    fn charge(&mut self, endpoint: u32, decode: Option<u32>, tokens: u32) -> ModelGuard {
        let tokens = u64::from(tokens);
        let main = Some(self.leg(endpoint, tokens));
        let decode = decode.filter(|d| *d != endpoint).map(|d| self.leg(d, 0));
        ModelGuard {
            main,
            decode,
            tokens,
        }
    }

    fn load(&self, e: u32) -> EndpointLoad {
        let mut l = EndpointLoad::default();
        let current = |leg: Option<(u32, u32)>| {
            leg.is_some_and(|(le, epoch)| le == e && self.epochs.get(e as usize) == Some(&epoch))
        };
        for g in &self.guards {
            if current(g.main) {
                l.in_flight += 1;
                l.queued_prefill_tokens += g.tokens;
            }
            if current(g.decode) {
                l.in_flight += 1;
            }
        }
        l
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_tracker_follows_its_model(ops in proptest::collection::vec(op(), 1..120)) {
        let tracker = Arc::new(LoadTracker::new(SLOTS as usize));
        let mut model = Model::default();
        let mut guards: Vec<LoadGuard> = Vec::new();
        let pick = |len: usize, i: usize| (len > 0).then(|| i % len);
        for op in ops {
            match op {
                Op::Charge { endpoint, decode, tokens } => {
                    let target = Target { endpoint: EndpointId(endpoint), decode: decode.map(EndpointId) };
                    guards.push(tracker.charge(target, tokens));
                    let g = model.charge(endpoint, decode, tokens);
                    model.guards.push(g);
                }
                Op::FirstByte(i) => if let Some(i) = pick(guards.len(), i) {
                    guards[i].first_byte();
                    model.guards[i].tokens = 0;
                },
                Op::PrefillLegDone(i) => if let Some(i) = pick(guards.len(), i) {
                    guards[i].prefill_leg_done();
                    let g = &mut model.guards[i];
                    if g.decode.is_some() {
                        g.main = None;
                    }
                    g.tokens = 0;
                },
                Op::Retarget { guard, endpoint, tokens } => if let Some(i) = pick(guards.len(), guard) {
                    let target = Target { endpoint: EndpointId(endpoint), decode: None };
                    guards[i].retarget(target, tokens);
                    model.guards[i] = model.charge(endpoint, None, tokens);
                },
                Op::RetargetDecode { guard, decode } => if let Some(i) = pick(guards.len(), guard) {
                    guards[i].retarget_decode(EndpointId(decode));
                    let main = model.guards[i].main.map(|(e, _)| e);
                    model.guards[i].decode = if main == Some(decode) { None } else { Some(model.leg(decode, 0)) };
                },
                Op::ReleaseDecode(i) => if let Some(i) = pick(guards.len(), i) {
                    guards[i].release_decode();
                    model.guards[i].decode = None;
                },
                Op::Drop(i) => if let Some(i) = pick(guards.len(), i) {
                    drop(guards.swap_remove(i));
                    model.guards.swap_remove(i);
                },
                Op::Retire(e) => {
                    tracker.retire(EndpointId(e));
                    if let Some(epoch) = model.epochs.get_mut(e as usize) {
                        *epoch += 1;
                    }
                }
            }
            for e in 0..=SLOTS {
                let id = EndpointId(e);
                prop_assert_eq!(tracker.load(id), model.load(e), "load of {} after {:?}", e, op);
                let slot = e as usize;
                prop_assert_eq!(tracker.started(id), model.started.get(slot).copied().unwrap_or(0));
                prop_assert_eq!(tracker.charged_tokens(id), model.charged.get(slot).copied().unwrap_or(0));
            }
            for (g, m) in guards.iter().zip(&model.guards) {
                prop_assert_eq!(g.endpoint(), m.main.map(|(e, _)| EndpointId(e)));
                prop_assert_eq!(g.prefill_tokens(), m.tokens);
            }
        }
        drop(guards);
        for e in 0..SLOTS {
            prop_assert_eq!(tracker.load(EndpointId(e)), EndpointLoad::default());
        }
    }
}
