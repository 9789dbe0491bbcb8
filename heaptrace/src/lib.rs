//! heaptrace: a system-wide heap tracer.
//!
//! The folders follow the data flow, and each imports only the ones before it:
//!
//! ```text
//! bpf        the kernel interface: bpf(2), links, mappable arrays, BTF, kfuncs
//! targets    which processes, which allocator file, a command started stopped
//! heap       a census of glibc's heap, read from a process's memory or a core file
//! unwind     unwind rows from .eh_frame, loaded per file for stacks without frame pointers
//! probe      load the programs, place and attach the probes
//! symbolize  stacks of addresses to named frames
//! reserve    the memory behind malloc (mmap, brk), from the syscall events
//! drain      each round: the kernel maps read, minus the last read
//! profile    the rounds folded into the one Profile every view reads
//! record     rounds to a file, and back
//! view       round lines, summary, site tables, JSON, live view, exports
//! daemon     the loop of rounds and the events between them
//! cmd        the subcommands; `main` only parses and dispatches
//! ```
//!
//! `run_info` (the mode, the target, one description of a run), `exit_status` (how a process
//! ended), `error` and `output` (files created safely for a tracer run as root) are shared by
//! all, and `progress` (bars for long start-up work, on a terminal only).
//! `docs/architecture.md` draws the flow.
/// `eprintln!` that never panics: with stderr closed or full (`2>&- | head`, `2>/dev/full`) a
/// line is lost, not the trace, the command or the JSON document.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `eprint!` that never panics (`say!` without the newline).
#[macro_export]
macro_rules! say_part {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

pub mod bpf;
pub mod cli;
pub mod cmd;
pub mod daemon;
pub mod drain;
pub mod error;
pub mod exit_status;
pub mod heap;
pub mod output;
pub mod probe;
pub mod profile;
pub mod progress;
pub mod record;
pub mod reserve;
pub mod run_info;
pub mod serve;
pub mod symbolize;
pub mod targets;
pub mod unwind;
pub mod view;

pub use error::{Error, Result};
