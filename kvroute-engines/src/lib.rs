//! # kvroute-engines
#![deny(missing_docs)]

pub mod events;
pub mod prompt;

pub mod transport;
