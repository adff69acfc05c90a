//! Conversions between selection's vocabulary and the neighbouring crates'
//! (`kvroute-core`'s [`HashContract`], `kvroute-ingest`'s key mode), so a host
//! derives each value from one source instead of restating it.

use kvroute_core::HashContract;

use crate::keys::{ContractId, KeyMode};

impl From<HashContract> for ContractId {
    /// The contract's canonical compact form (as `From<&HashContract>`).
    ///
    /// ```
    /// use kvroute_core::HashContract;
    /// use kvroute_select::ContractId;
    /// let c: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    /// assert_eq!(ContractId::from(c).as_str(), "vllm@0.33.0:sha256_cbor:block=16:seed=0");
    /// ```
    fn from(c: HashContract) -> Self {
        ContractId::from(&c)
    }
}

impl From<&kvroute_ingest::KeyMode> for KeyMode {
    /// What the prompt side must do for inventories keyed this way: an
    /// inventory of engine keys needs engine-identical prompt keys, a re-keyed
    /// one the same re-keying.
    ///
    /// ```
    /// use kvroute_select::KeyMode;
    /// assert_eq!(KeyMode::from(&kvroute_ingest::KeyMode::Engine), KeyMode::EngineKeys);
    /// ```
    fn from(m: &kvroute_ingest::KeyMode) -> Self {
        match m {
            kvroute_ingest::KeyMode::Engine => KeyMode::EngineKeys,
            kvroute_ingest::KeyMode::Rekey(_) => KeyMode::Rekeyed,
        }
    }
}

impl KeyMode {
    /// The key mode a contract implies: re-key contracts (`rekey:...`) are
    /// [`KeyMode::Rekeyed`], every engine contract [`KeyMode::EngineKeys`].
    ///
    /// ```
    /// use kvroute_core::HashContract;
    /// use kvroute_select::KeyMode;
    /// let c: HashContract = "rekey:xxh3_64_chain:block=16:seed=1".parse().unwrap();
    /// assert_eq!(KeyMode::of_contract(&c), KeyMode::Rekeyed);
    /// ```
    #[must_use]
    pub fn of_contract(contract: &HashContract) -> Self {
        match contract {
            HashContract::Rekey(_) => KeyMode::Rekeyed,
            _ => KeyMode::EngineKeys,
        }
    }
}
