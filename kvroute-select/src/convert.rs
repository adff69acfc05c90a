//! Conversions between selection's vocabulary and the neighbouring crates'
//! (`kvroute-core`'s [`HashContract`]), so a host derives each value from one
//! source instead of restating it. The key mode needs none: it is
//! `kvroute-core`'s [`kvroute_core::KeyMode`], from [`HashContract::key_mode`].

use kvroute_core::HashContract;

use crate::keys::ContractId;

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
