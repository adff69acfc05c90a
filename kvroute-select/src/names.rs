//! The configuration names of selection's enums — [`Choice`], [`Topology`],
//! [`ScorerKind`], [`SelectorKind`], [`Role`] — as `FromStr` / `Display` /
//! serde, so configuration files, CLIs and the simulator parse one spelling
//! instead of each matching strings of its own.
//!
//! Names are `snake_case`, as in the gateway's TOML; [`Display`] prints the
//! name [`FromStr`] accepts, so every value round-trips. An unknown name is a
//! [`UnknownName`] that lists the accepted ones.
//!
//! [`Source::as_str`] is the label of a decision's tier (not a configuration
//! name: nothing parses it).
//!
//! ```
//! use kvroute_select::{Choice, ScorerKind, SelectorKind, Topology};
//! assert_eq!("prefill_decode".parse::<Topology>(), Ok(Topology::PrefillDecode));
//! assert_eq!(SelectorKind::PowerOfTwoChoices.to_string(), "p2c");
//! let err = "fastest".parse::<Choice>().unwrap_err();
//! assert_eq!(err.to_string(),
//!     "unknown choice \"fastest\"; expected kv_exact, round_robin or content_affinity");
//! // A scorer name picks the built-in scorer with its default parameters.
//! let scorer = "longest_prefix".parse::<ScorerKind>().unwrap().build();
//! assert_eq!(ScorerKind::of(&*scorer), Some(ScorerKind::LongestPrefix));
//! ```
//!
//! [`Display`]: std::fmt::Display
//! [`FromStr`]: std::str::FromStr

use std::fmt;
use std::str::FromStr;

pub use kvroute_core::UnknownName;

use crate::decision::Source;
use crate::endpoint::Role;
use crate::rule::{Choice, Topology};
use crate::scoring::{
    CostScorer, LoadAwareScorer, LongestPrefixScorer, OverlapCountScorer, Scorer, ScorerRef,
};
use crate::selector::SelectorKind;

/// Which KV-exact scorer, without its parameters (a [`Scorer`] carries them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ScorerKind {
    /// [`CostScorer`].
    #[default]
    Cost,
    /// [`OverlapCountScorer`].
    OverlapCount,
    /// [`LongestPrefixScorer`].
    LongestPrefix,
    /// [`LoadAwareScorer`].
    LoadAware,
}

impl ScorerKind {
    /// The built-in kind of `scorer`, by its name; `None` for a host's own.
    #[must_use]
    pub fn of(scorer: &dyn Scorer) -> Option<Self> {
        scorer.name().parse().ok()
    }

    /// The built-in scorer of this kind with default parameters.
    #[must_use]
    pub fn build(self) -> ScorerRef {
        match self {
            ScorerKind::Cost => std::sync::Arc::new(CostScorer::default()),
            ScorerKind::OverlapCount => std::sync::Arc::new(OverlapCountScorer),
            ScorerKind::LongestPrefix => std::sync::Arc::new(LongestPrefixScorer),
            ScorerKind::LoadAware => std::sync::Arc::new(LoadAwareScorer::default()),
        }
    }
}

/// `FromStr`, `Display`, `as_str` and string serde for a fieldless enum, from
/// one table so the spellings cannot drift apart.
macro_rules! names {
    ($ty:ty, $what:literal, $expected:literal, { $($variant:path => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// The configuration name.
            #[must_use]
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($variant => $name),+
                }
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($name => Ok($variant),)+
                    _ => Err(UnknownName {
                        what: $what,
                        name: s.to_owned(),
                        expected: $expected,
                    }),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let name = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                name.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

names!(Choice, "choice", "kv_exact, round_robin or content_affinity", {
    Choice::KvExact => "kv_exact",
    Choice::RoundRobin => "round_robin",
    Choice::ContentAffinity => "content_affinity",
});

names!(Topology, "topology", "converged or prefill_decode", {
    Topology::Converged => "converged",
    Topology::PrefillDecode => "prefill_decode",
});

names!(ScorerKind, "scorer", "cost, overlap_count, longest_prefix or load_aware", {
    ScorerKind::Cost => "cost",
    ScorerKind::OverlapCount => "overlap_count",
    ScorerKind::LongestPrefix => "longest_prefix",
    ScorerKind::LoadAware => "load_aware",
});

names!(SelectorKind, "selector",
    "round_robin, least_load, least_prefill, p2c, chwbl, random or weighted", {
    SelectorKind::RoundRobin => "round_robin",
    SelectorKind::LeastLoad => "least_load",
    SelectorKind::LeastPrefill => "least_prefill",
    SelectorKind::PowerOfTwoChoices => "p2c",
    SelectorKind::Chwbl => "chwbl",
    SelectorKind::Random => "random",
    SelectorKind::Weighted => "weighted",
});

names!(Role, "role", "both, prefill or decode", {
    Role::Both => "both",
    Role::Prefill => "prefill",
    Role::Decode => "decode",
});

impl Source {
    /// The tier label of metrics (`kvroute_decisions_total{tier="..."}`), the
    /// decision log and the admin API. Every fallback is `fallback`, whatever
    /// its selector.
    ///
    /// ```
    /// use kvroute_select::{SelectorKind, Source};
    /// assert_eq!(Source::KvExact.as_str(), "kv_exact");
    /// assert_eq!(Source::Fallback(SelectorKind::Chwbl).as_str(), "fallback");
    /// ```
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Source::Exhausted => "exhausted",
            Source::Fallback(_) => "fallback",
            Source::KvExact => "kv_exact",
            Source::SessionAffinity => "session_affinity",
            Source::TrieAffinity => "trie_affinity",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant: `Display` → `FromStr` is the identity, serde agrees with
    /// both, and names are unique within an enum. The variant lists are
    /// exhaustive matches, so a new variant without a name fails to compile.
    #[test]
    fn every_name_round_trips_through_display_fromstr_and_serde() {
        fn check<T>(all: &[T])
        where
            T: Copy + PartialEq + fmt::Debug + fmt::Display + FromStr<Err = UnknownName>,
            T: serde::Serialize + serde::de::DeserializeOwned,
        {
            let mut names = Vec::new();
            for &v in all {
                let name = v.to_string();
                assert_eq!(name.parse::<T>(), Ok(v), "{name}");
                let json = serde_json::to_string(&v).unwrap();
                assert_eq!(json, format!("{name:?}"));
                assert_eq!(serde_json::from_str::<T>(&json).unwrap(), v);
                assert!(!names.contains(&name), "duplicate name {name}");
                names.push(name);
            }
            let err = "no_such_name".parse::<T>().unwrap_err();
            for n in &names {
                assert!(err.expected.contains(n.as_str()), "{n} missing from {err}");
            }
            assert!(serde_json::from_str::<T>("\"no_such_name\"").is_err());
        }
        let choices = [Choice::KvExact, Choice::RoundRobin, Choice::ContentAffinity];
        for c in choices {
            match c {
                Choice::KvExact | Choice::RoundRobin | Choice::ContentAffinity => {}
            }
        }
        check(&choices);
        let topologies = [Topology::Converged, Topology::PrefillDecode];
        for t in topologies {
            match t {
                Topology::Converged | Topology::PrefillDecode => {}
            }
        }
        check(&topologies);
        let scorers = [
            ScorerKind::Cost,
            ScorerKind::OverlapCount,
            ScorerKind::LongestPrefix,
            ScorerKind::LoadAware,
        ];
        check(&scorers);
        for k in scorers {
            let built = k.build();
            assert_eq!(ScorerKind::of(&*built), Some(k));
            assert_eq!(built.name(), k.as_str());
        }
        let selectors = [
            SelectorKind::RoundRobin,
            SelectorKind::LeastLoad,
            SelectorKind::LeastPrefill,
            SelectorKind::PowerOfTwoChoices,
            SelectorKind::Chwbl,
            SelectorKind::Random,
            SelectorKind::Weighted,
        ];
        for s in selectors {
            match s {
                SelectorKind::RoundRobin
                | SelectorKind::LeastLoad
                | SelectorKind::LeastPrefill
                | SelectorKind::PowerOfTwoChoices
                | SelectorKind::Chwbl
                | SelectorKind::Random
                | SelectorKind::Weighted => {}
            }
        }
        check(&selectors);
        check(&[Role::Both, Role::Prefill, Role::Decode]);
    }

    /// The default scorer is the cost scorer, named `cost`, as the gateway's
    /// default configuration says.
    #[test]
    fn defaults_have_the_default_names() {
        let rule = crate::RuleConfig::kv_exact(
            "r",
            Topology::Converged,
            Vec::new(),
            16,
            crate::ContractId::new("c"),
        );
        assert_eq!(ScorerKind::of(&*rule.scorer), Some(ScorerKind::default()));
        assert_eq!(ScorerKind::default().as_str(), "cost");
        assert_eq!(Choice::default().as_str(), "kv_exact");
        assert_eq!(Topology::default().as_str(), "converged");
    }
}
