//! What makes a freed block temporary.
//!
//! heaptrace counts it as heaptrack and memray do: a block freed by the thread that allocated
//! it with fewer than N of that thread's allocations in between (N = 1: none). The probes count
//! it exactly from a per-thread allocation count, with no clock read. Recordings before format
//! 7 counted a block freed within a time of its allocation instead, and are shown with that
//! rule.
use std::fmt;

use serde_json::{Value, json};

use crate::record::format::Header;

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
    /// The rule a recording's temporaries were counted by.
    pub fn of_header(h: &Header) -> Temporary {
        match h.temporary_allocs {
            0 => Temporary::WithinMs(h.temporary_ms),
            n => Temporary::Allocs(n),
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recordings_before_format_7_keep_their_time_rule() {
        let old = Header {
            temporary_ms: 250,
            ..Default::default()
        };
        assert_eq!(Temporary::of_header(&old), Temporary::WithinMs(250));
        assert_eq!(
            Temporary::of_header(&old).to_string(),
            "freed within 250 ms"
        );
        let new = Header {
            temporary_allocs: 4,
            ..Default::default()
        };
        assert_eq!(Temporary::of_header(&new), Temporary::Allocs(4));
        assert_eq!(
            Temporary::of_header(&new).to_string(),
            "freed with fewer than 4 allocations of its thread in between"
        );
        assert_eq!(
            Temporary::default().to_string(),
            "freed before its thread's next allocation"
        );
    }
}
