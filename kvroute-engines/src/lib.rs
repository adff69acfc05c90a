//! # kvroute-engines
#![deny(missing_docs)]

pub mod events;
mod load_report;
pub mod prompt;

pub mod transport;

pub use load_report::{
    fuzzing as load_report_fuzzing, parse_load, EngineLoadReport, LoadReportError, MetricsDialect,
    MAX_METRICS_BODY_BYTES, MAX_RANKS,
};
