//! Commands other than tracing itself (which is `run`), one module each.
pub mod probes;
pub mod report;
