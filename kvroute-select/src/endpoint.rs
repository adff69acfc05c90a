//! Rule endpoints: identity, address, role, weight and capacity.

use kvroute_core::EndpointId;

/// What an endpoint does in a prefill/decode (P/D) topology.
///
/// In a converged rule every endpoint is a candidate whatever its role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Role {
    /// Runs prefill only; its KV moves to a decode endpoint afterwards.
    Prefill,
    /// Runs decode only; never chosen as the prefill endpoint of a P/D decision.
    Decode,
    /// Runs both phases (the converged case, or a mixed P/D pool member).
    #[default]
    Both,
}

impl Role {
    /// Whether the endpoint may serve the prefill leg.
    #[must_use]
    pub const fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether the endpoint may serve the decode leg.
    #[must_use]
    pub const fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// One backend of a rule.
///
/// Endpoints are addressed by their position in the rule ([`EndpointId`] `i` is the
/// `i`-th endpoint); `inventory_slot` maps the endpoint to its dense id in the
/// inventory index that scoring reads (decode endpoints usually have none).
///
/// ```
/// use kvroute_select::{Endpoint, Role};
/// let ep = Endpoint::new("10.0.0.1:8000", Role::Prefill).with_inventory_slot(0);
/// assert_eq!(ep.inventory_slot, Some(0));
/// assert_eq!(ep.weight, 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Host-chosen address (`host:port`, URL, ...); opaque to selection.
    pub address: String,
    /// Role in a P/D topology.
    pub role: Role,
    /// Relative weight for the weighted selector (0 = only when every weight is 0).
    pub weight: u32,
    /// Concurrent requests the endpoint is sized for; loads are compared as
    /// `in_flight / capacity`. 0 is treated as 1.
    pub capacity: u32,
    /// Dense id of this endpoint in the inventory index, if it publishes KV events.
    pub inventory_slot: Option<u32>,
}

impl Endpoint {
    /// An endpoint with weight 1, capacity 1 and no inventory slot.
    #[must_use]
    pub fn new(address: impl Into<String>, role: Role) -> Self {
        Self {
            address: address.into(),
            role,
            weight: 1,
            capacity: 1,
            inventory_slot: None,
        }
    }

    /// Sets the inventory slot.
    #[must_use]
    pub fn with_inventory_slot(mut self, slot: u32) -> Self {
        self.inventory_slot = Some(slot);
        self
    }

    /// Sets the weight.
    #[must_use]
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// Sets the capacity.
    #[must_use]
    pub fn with_capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity;
        self
    }

    #[inline]
    pub(crate) fn capacity_or_one(&self) -> u32 {
        self.capacity.max(1)
    }
}

/// Iterates `(EndpointId, &Endpoint)` pairs of a rule's endpoint list.
pub(crate) fn enumerate(endpoints: &[Endpoint]) -> impl Iterator<Item = (EndpointId, &Endpoint)> {
    endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| (EndpointId(u32::try_from(i).unwrap_or(u32::MAX)), e))
}
