//! Live load, supplied by the host (as tower's `Load`, but per endpoint).

use kvroute_core::EndpointId;

/// The work an endpoint currently carries, as the host observes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointLoad {
    /// Requests sent and not yet completed.
    pub in_flight: u32,
    /// Prompt tokens admitted but not yet prefilled (engine queue), if known.
    pub queued_prefill_tokens: u64,
}

/// Per-endpoint load of a rule's endpoints, indexed by the rule's [`EndpointId`]s.
///
/// ```
/// use kvroute_select::{EndpointLoad, Load, LoadTable};
/// use kvroute_core::EndpointId;
/// let mut t = LoadTable::new(2);
/// t.set(EndpointId(1), EndpointLoad { in_flight: 3, queued_prefill_tokens: 0 });
/// assert_eq!(t.load(EndpointId(1)).in_flight, 3);
/// assert_eq!(t.load(EndpointId(9)), EndpointLoad::default());
/// ```
pub trait Load {
    /// The load of endpoint `endpoint`; unknown endpoints report zero load.
    fn load(&self, endpoint: EndpointId) -> EndpointLoad;
}

/// A plain table of loads — what a host that counts its own in-flight requests
/// can hand to selection directly.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadTable {
    loads: Vec<EndpointLoad>,
}

impl LoadTable {
    /// `endpoints` zero loads.
    #[must_use]
    pub fn new(endpoints: usize) -> Self {
        Self {
            loads: vec![EndpointLoad::default(); endpoints],
        }
    }

    /// Sets the load of one endpoint (ignored for ids beyond the table).
    pub fn set(&mut self, endpoint: EndpointId, load: EndpointLoad) {
        if let Some(slot) = self.loads.get_mut(endpoint.index()) {
            *slot = load;
        }
    }

    /// Mutable access for incremental bookkeeping.
    pub fn get_mut(&mut self, endpoint: EndpointId) -> Option<&mut EndpointLoad> {
        self.loads.get_mut(endpoint.index())
    }
}

impl Load for LoadTable {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.loads
            .get(endpoint.index())
            .copied()
            .unwrap_or_default()
    }
}

impl<L: Load + ?Sized> Load for &L {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        (**self).load(endpoint)
    }
}
