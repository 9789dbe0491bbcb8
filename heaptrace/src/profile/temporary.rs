//! What makes a freed block temporary.
//!
//! heaptrace counts it as heaptrack and memray do: a block freed by the thread that allocated
//! it with fewer than N of that thread's allocations in between (N = 1: none). The probes count
//! it exactly from a per-thread allocation count, with no clock read. Recordings before format
//! 7 counted a block freed within a time of its allocation instead, and are shown with that
//! rule.
use std::fmt;

use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Temporary {
    /// Fewer than this many of the freeing thread's allocations in between (`--temporary-allocs`).
    Allocs(u32),
    /// Freed within this many milliseconds of its allocation (recordings before format 7).
    WithinMs(u64),
}

impl Default for Temporary {
    fn default() -> Temporary {
        Temporary::Allocs(1)
    }
}

impl Temporary {
    /// The rule's fields in the JSON document's `temporary` object.
    pub fn json(&self) -> Vec<(&'static str, Value)> {
        match *self {
            Temporary::Allocs(n) => vec![
                ("rule", json!("freed by its own thread")),
                ("allocations_between_below", json!(n)),
            ],
            Temporary::WithinMs(ms) => vec![("threshold_ms", json!(ms))],
        }
    }
}

impl fmt::Display for Temporary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Temporary::Allocs(1) => write!(f, "freed before its thread's next allocation"),
            Temporary::Allocs(n) => write!(
                f,
                "freed with fewer than {n} allocations of its thread in between"
            ),
            Temporary::WithinMs(ms) => write!(f, "freed within {ms} ms"),
        }
    }
}
