//! Engines by name: the built-in ones and any a host registers.

use std::sync::{Arc, OnceLock};

use super::{Engine, LlamaCpp, Sglang, Trtllm, Vllm};
use crate::UnknownName;

/// A name no engine of a [`Registry`] answers to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine {name:?}; expected {}", list(expected))]
pub struct UnknownEngine {
    /// The name given.
    pub name: String,
    /// The registry's engine names.
    pub expected: Vec<String>,
}

fn list(names: &[String]) -> String {
    match names {
        [] => "none (the registry is empty)".to_owned(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// An engine registered under a name (or alias) another engine already has.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("engine name {name:?} is already registered")]
pub struct EngineNameTaken {
    /// The name.
    pub name: String,
}

/// Engines by name: the built-in ones ([`Registry::builtin`]) plus any a
/// host registers. Hosts parse an endpoint's `engine = "..."` with
/// [`Registry::get`].
///
/// ```
/// use kvroute_engines::engine::Registry;
/// let r = Registry::builtin();
/// assert_eq!(r.names().collect::<Vec<_>>(), ["vllm", "sglang", "trtllm", "llama.cpp"]);
/// assert_eq!(r.get("llamacpp")?.name(), "llama.cpp");
/// let err = r.get("tgi").unwrap_err();
/// assert_eq!(err.to_string(), r#"unknown engine "tgi"; expected vllm, sglang, trtllm or llama.cpp"#);
/// # Ok::<(), kvroute_engines::engine::UnknownEngine>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Registry {
    engines: Vec<Arc<dyn Engine>>,
}

impl Registry {
    /// A registry without engines.
    #[must_use]
    pub fn empty() -> Self {
        Self::default()
    }

    /// vLLM, SGLang, TensorRT-LLM and llama.cpp.
    #[must_use]
    pub fn builtin() -> Self {
        Self {
            engines: vec![
                Arc::new(Vllm),
                Arc::new(Sglang),
                Arc::new(Trtllm),
                Arc::new(LlamaCpp),
            ],
        }
    }

    /// Adds `engine` under its name and aliases.
    ///
    /// # Errors
    /// [`EngineNameTaken`] when one of them is already registered.
    pub fn register(&mut self, engine: Arc<dyn Engine>) -> Result<&mut Self, EngineNameTaken> {
        let names = std::iter::once(engine.name()).chain(engine.aliases().iter().copied());
        for name in names {
            if self.find(name).is_some() {
                return Err(EngineNameTaken {
                    name: name.to_owned(),
                });
            }
        }
        self.engines.push(engine);
        Ok(self)
    }

    /// The engine named (or aliased) `name`.
    ///
    /// # Errors
    /// [`UnknownEngine`] listing the registered names.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Engine>, UnknownEngine> {
        self.find(name).cloned().ok_or_else(|| UnknownEngine {
            name: name.to_owned(),
            expected: self.names().map(str::to_owned).collect(),
        })
    }

    fn find(&self, name: &str) -> Option<&Arc<dyn Engine>> {
        self.engines
            .iter()
            .find(|e| e.name() == name || e.aliases().contains(&name))
    }

    /// The engines' names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.engines.iter().map(|e| e.name())
    }

    /// The engines, in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Engine>> {
        self.engines.iter()
    }
}

/// The built-in engines ([`Registry::builtin`]), built once.
#[must_use]
pub fn builtin() -> &'static Registry {
    static BUILTIN: OnceLock<Registry> = OnceLock::new();
    BUILTIN.get_or_init(Registry::builtin)
}

/// The built-in engine named (or aliased) `name`.
///
/// ```
/// use kvroute_engines::engine;
/// assert_eq!(engine::by_name("trtllm")?.name(), "trtllm");
/// let err = engine::by_name("tgi").unwrap_err();
/// assert_eq!(err.to_string(), r#"unknown engine "tgi"; expected vllm, sglang, trtllm or llama.cpp"#);
/// # Ok::<(), kvroute_engines::UnknownName>(())
/// ```
///
/// # Errors
/// [`UnknownName`] for any other name.
pub fn by_name(name: &str) -> Result<Arc<dyn Engine>, UnknownName> {
    builtin().get(name).map_err(|_| UnknownName {
        what: "engine",
        name: name.to_owned(),
        expected: BUILTIN_NAMES,
    })
}

const BUILTIN_NAMES: &str = "vllm, sglang, trtllm or llama.cpp";
