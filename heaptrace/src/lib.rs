//! heaptrace: a system-wide heap tracer.
//!
//! The folders follow the data flow, and each imports only the stages before it:
//!
//! ```text
//! target -> probe -> drain -> symbolize -> profile -> record -> view -> daemon -> cmd
//! (what)    (attach)  (read     (name       (fold      (write    (text,  (the      (sub-
//!                     maps)     stacks)     rounds)    rounds)   json,   rounds)   commands)
//!                                                                tui)
//! ```
//!
//! `bpf` is the kernel interface every stage below it uses; `reserve` is the memory behind
//! malloc, read beside the rounds. `docs/architecture.md` draws it.
pub mod bpf;
pub mod cli;
pub mod cmd;
pub mod daemon;
pub mod drain;
pub mod error;
pub mod probe;
pub mod profile;
pub mod record;
pub mod reserve;
pub mod symbolize;
pub mod target;
pub mod view;

pub use error::{Error, Result};
