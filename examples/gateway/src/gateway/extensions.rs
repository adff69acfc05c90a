//! Engines and scorers a program hosting the gateway adds by name: the
//! built-in engines (`vllm`, `sglang`, `trtllm`, `llama.cpp`) and scorers
//! (`cost`, `longest_prefix`, `overlap_count`, `load_aware`) are always
//! there; [`register_engine`] and [`register_scorer`] add a host's own, which
//! rules then name (`engine = "..."`, `scorer = "..."`) in the configuration
//! file and the admin API exactly as the built-in ones.
//!
//! ```no_run
//! use std::sync::Arc;
//! # fn run(my_engine: Arc<dyn kvroute::Engine>, my_scorer: fn() -> kvroute_select::ScorerRef) {
//! kvroute_gateway::gateway::extensions::register_engine(my_engine).unwrap();
//! kvroute_gateway::gateway::extensions::register_scorer("mine", Arc::new(my_scorer)).unwrap();
//! // ... then start the gateway with a configuration naming them.
//! # }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use kvroute::engine::{self, Engine, Registry};
use kvroute_select::{ScorerKind, ScorerRef};
use parking_lot::RwLock;

/// Builds a fresh scorer for one rule (a scorer may keep per-rule state).
pub type ScorerFactory = Arc<dyn Fn() -> ScorerRef + Send + Sync>;

struct Extensions {
    engines: Registry,
    scorers: BTreeMap<String, ScorerFactory>,
}

fn extensions() -> &'static RwLock<Extensions> {
    static EXT: OnceLock<RwLock<Extensions>> = OnceLock::new();
    EXT.get_or_init(|| {
        RwLock::new(Extensions {
            engines: Registry::builtin(),
            scorers: BTreeMap::new(),
        })
    })
}

/// Adds an engine rules can name.
///
/// # Errors
/// The name (or an alias) is taken.
pub fn register_engine(engine: Arc<dyn Engine>) -> Result<(), String> {
    extensions()
        .write()
        .engines
        .register(engine)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Adds a scorer rules can name; `factory` builds one per rule.
///
/// # Errors
/// The name is a built-in scorer's or already registered.
pub fn register_scorer(name: &str, factory: ScorerFactory) -> Result<(), String> {
    if name.parse::<ScorerKind>().is_ok() {
        return Err(format!("scorer {name:?} is a built-in scorer"));
    }
    let mut ext = extensions().write();
    if ext.scorers.contains_key(name) {
        return Err(format!("scorer {name:?} is already registered"));
    }
    ext.scorers.insert(name.to_owned(), factory);
    Ok(())
}

/// The engine named `name`.
///
/// # Errors
/// The unknown name, with the names known.
pub fn engine(name: &str) -> Result<Arc<dyn Engine>, String> {
    extensions()
        .read()
        .engines
        .get(name)
        .map_err(|e| e.to_string())
}

/// A host scorer named `name`, freshly built; `None` if none is registered.
#[must_use]
pub fn scorer(name: &str) -> Option<ScorerRef> {
    let factory = extensions().read().scorers.get(name).cloned()?;
    Some(factory())
}

/// Every scorer name a rule may use, for error messages.
#[must_use]
pub fn scorer_names() -> Vec<String> {
    let mut names: Vec<String> = [
        ScorerKind::Cost,
        ScorerKind::OverlapCount,
        ScorerKind::LongestPrefix,
        ScorerKind::LoadAware,
    ]
    .iter()
    .map(|k| k.as_str().to_owned())
    .collect();
    names.extend(extensions().read().scorers.keys().cloned());
    names
}

/// The built-in engine names (the configuration's documented values).
#[must_use]
pub fn builtin_engine_names() -> Vec<String> {
    engine::builtin().names().map(str::to_owned).collect()
}
