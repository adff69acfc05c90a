//! Decisions' buffers, kept for the next request: a decision holds several
//! per-endpoint arrays (overlaps, loads, reports, exclusions), and on a large
//! pool allocating and initialising them anew for every request costs more
//! than the choice itself. A request's decision comes back when its answer
//! has been settled or its pick is dropped.

use kvroute_select::Decision;
use parking_lot::Mutex;

/// Decisions kept at most: enough for the requests a gateway starts while
/// others end, small enough that an idle router holds little (each is about
/// 150 bytes per endpoint).
const KEPT: usize = 16;

/// Returned decisions, waiting for the next request.
#[derive(Default)]
pub(crate) struct Recycled {
    kept: Mutex<Vec<Decision>>,
}

impl Recycled {
    /// A decision to decide into: a returned one (its buffers already
    /// sized) or a new one.
    pub(crate) fn take(&self) -> Decision {
        self.kept.lock().pop().unwrap_or_default()
    }

    /// Keeps `d`'s buffers for a later request, unless enough are kept
    /// already or it has none (a decision taken out of its pick).
    pub(crate) fn put(&self, mut d: Decision) {
        if !has_buffers(&d) {
            return;
        }
        // An explanation was handed out with the request, or is not wanted
        // by the next one: it is not kept.
        d.set_explain(false);
        let mut kept = self.kept.lock();
        if kept.len() < KEPT {
            kept.push(d);
        }
    }
}

/// Whether `d` was decided into (its per-endpoint buffers are sized).
fn has_buffers(d: &Decision) -> bool {
    !d.overlaps().is_empty()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn keeps_sized_decisions_up_to_its_bound() {
        let r = Recycled::default();
        assert!(
            !has_buffers(&r.take()),
            "an empty pool makes a new decision"
        );
        // A decision without buffers is not worth keeping.
        r.put(Decision::new());
        assert_eq!(r.kept.lock().len(), 0);
        for _ in 0..KEPT + 3 {
            r.put(sized());
        }
        assert_eq!(r.kept.lock().len(), KEPT);
        assert!(has_buffers(&r.take()));
        assert_eq!(r.kept.lock().len(), KEPT - 1);
    }

    /// A decision a rule decided into.
    fn sized() -> Decision {
        use kvroute_select::{
            AlwaysAvailable, ContractId, Endpoint, KeySetInventory, LoadTable, PromptInput,
            Request, Role, Rule, RuleConfig, Topology,
        };
        let eps = (0..4)
            .map(|i| Endpoint::new(format!("e{i}:1"), Role::Both).with_inventory_slot(i))
            .collect();
        let contract = ContractId::new("c");
        let cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, 16, contract.clone());
        let rule = Rule::new(cfg, None).unwrap();
        let mut d = Decision::new();
        d.set_explain(true);
        let keys = [kvroute_core::BlockKey(1)];
        let req = Request::new(PromptInput::Keys {
            keys: &keys,
            contract: &contract,
            prompt_tokens: 16,
        });
        let (inv, load) = (KeySetInventory::new(4), LoadTable::new(4));
        rule.decide_into(&mut d, &req, &inv, &load, &AlwaysAvailable, Duration::ZERO);
        d
    }
}
