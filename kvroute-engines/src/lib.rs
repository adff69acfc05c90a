//! # kvroute-engines
#![deny(missing_docs)]
