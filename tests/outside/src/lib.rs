//! Nothing here: `tests/route.rs` uses kvroute the way a dependent crate
//! outside the kvroute workspace does (see `Cargo.toml`).
