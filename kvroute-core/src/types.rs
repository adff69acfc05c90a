//! Shared vocabulary types: block keys, endpoints, token ids, storage tiers.

use std::fmt;

/// A token id as the engine sees it.
///
/// Every engine this crate supports uses vocabularies below 2^32; contracts whose
/// serialisation could carry wider integers take `u32` on purpose so the hot path
/// stays narrow.
pub type TokenId = u32;

/// The 64-bit key of one KV-cache block, as it appears in engine events and in
/// inventories.
///
/// For vLLM this is the last 8 bytes (big-endian) of the block digest, for SGLang
/// the first 8 bytes of the page SHA-256 read as a big-endian integer (`i64` on the
/// wire, stored here as the same 64 bits), for TensorRT-LLM the C++ `size_t`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[repr(transparent)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// The key as a signed integer (SGLang's wire form).
    #[must_use]
    pub const fn as_i64(self) -> i64 {
        self.0 as i64
    }

    /// Builds a key from a signed wire integer without changing its bits.
    #[must_use]
    pub const fn from_i64(v: i64) -> Self {
        Self(v as u64)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({:#018x})", self.0)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<u64> for BlockKey {
    fn from(v: u64) -> Self {
        Self(v)
    }
}

/// Dense index of an endpoint within a rule or an inventory index.
///
/// Dense small integers let scoring use flat arrays instead of maps.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
#[repr(transparent)]
pub struct EndpointId(pub u32);

impl EndpointId {
    /// The id as an array index.
    #[must_use]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ep{}", self.0)
    }
}

/// Where a cached block lives on the engine side.
///
/// GPU-resident blocks save the most prefill work; host and disk tiers must be
/// loaded back first, so scorers weigh them lower.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub enum Medium {
    /// Device memory (vLLM `"GPU"`, SGLang `"GPU"`, TRT-LLM cache level 0).
    #[default]
    Gpu,
    /// Host memory (vLLM `"CPU"`, SGLang `"CPU_PINNED"`, TRT-LLM cache level 1).
    Cpu,
    /// Local disk or SSD tier.
    Disk,
    /// A tier outside the engine process (SGLang `"EXTERNAL"`, LMCache, ...).
    External,
}

impl Medium {
    /// Parses an engine's medium string. Unknown strings map to `None` so the
    /// caller can count them instead of guessing.
    #[must_use]
    pub fn from_wire(s: &str) -> Option<Self> {
        match s {
            "GPU" | "gpu" | "cuda" | "CUDA" => Some(Self::Gpu),
            "CPU" | "cpu" | "CPU_PINNED" | "cpu_pinned" | "HOST" | "host" => Some(Self::Cpu),
            // vLLM's offloading to disk publishes "STORAGE".
            "DISK" | "disk" | "SSD" | "ssd" | "STORAGE" | "storage" => Some(Self::Disk),
            "EXTERNAL" | "external" => Some(Self::External),
            _ => None,
        }
    }

    /// All tiers, fastest first.
    pub const ALL: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Disk, Medium::External];

    /// A stable small index (0 = GPU) for per-tier arrays.
    #[must_use]
    pub const fn index(self) -> usize {
        match self {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            Medium::Disk => 2,
            Medium::External => 3,
        }
    }

    /// The lowercase tier name of metrics and the admin API.
    ///
    /// ```
    /// use kvroute_core::Medium;
    /// assert_eq!(Medium::Gpu.as_str(), "gpu");
    /// ```
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Cpu => "cpu",
            Medium::Disk => "disk",
            Medium::External => "external",
        }
    }
}
