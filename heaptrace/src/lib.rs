//! heaptrace: a system-wide heap tracer.
//!
//! Data flow: `probe` (attach) -> `drain` (read kernel maps into snapshots) -> `model` (round
//! deltas) -> `merge` (kernel stacks shown the same are one site) -> `incarnation` (processes
//! that had one pid kept apart) -> `aggregate` (one Profile) -> views (`report`, `json`). `run` is the daemon tying them together; `allocator`, `elf`,
//! `launch` and `procfs` find and start targets; `placement` decides where in each function its
//! entry probe goes.
pub mod aggregate;
pub mod allocator;
pub mod batch;
pub mod bpfsys;
pub mod btf;
pub mod cgroupfilter;
pub mod cgroups;
pub mod cli;
pub mod cmd;
pub mod drain;
pub mod elf;
pub mod error;
pub mod fold;
pub mod hist;
pub mod incarnation;
pub mod json;
pub mod keyedslots;
pub mod launch;
pub mod links;
pub mod liveslots;
pub mod mapped;
pub mod merge;
pub mod model;
pub mod modules;
pub mod multi;
pub mod pin;
pub mod placement;
pub mod probe;
pub mod procfs;
pub mod procslots;
pub mod progstats;
pub mod record;
pub mod report;
pub mod reserve;
pub mod run;
pub mod sampling;
pub mod symbolize;
pub mod symbols;
pub mod temporary;
pub mod tui;
pub mod views;
pub mod watch;

pub use error::{Error, Result};
