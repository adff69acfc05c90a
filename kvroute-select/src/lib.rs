//! # kvroute-select
#![deny(missing_docs)]
