//! Whether a trace's counts are whole: the reasons known that they are not (the JSON's
//! `complete` and `incomplete`), and what the in-process region lost beyond the losses.
use serde::Serialize;

/// Why the counts are known to be incomplete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Incomplete {
    /// Calls were not counted, or not wholly (`lost` says which and how many).
    Lost,
    /// In process: the preloaded library never took its region in the command (its loader
    /// ignored LD_PRELOAD, or the command's environment did not keep it): nothing counted.
    LibraryNeverRan,
    /// In process: the command exec'ed and its new image did not take the region (the exec
    /// dropped LD_PRELOAD or the region's descriptor): nothing of that image counted.
    LibraryNotAfterExec,
    /// In process: the library found its region but could not map it (the command's address
    /// space: `ulimit -v`): nothing counted.
    RegionNotMapped,
}

impl Incomplete {
    /// One line for the summary's warning.
    pub fn says(self) -> &'static str {
        match self {
            Incomplete::Lost => "some calls were not counted (see the losses)",
            Incomplete::LibraryNeverRan => {
                "the preloaded library never ran in the command: nothing was counted in it \
                 (its loader ignored LD_PRELOAD, or its environment dropped it)"
            }
            Incomplete::LibraryNotAfterExec => {
                "the command exec'ed a program without heaptrace's library (the exec dropped \
                 LD_PRELOAD or the region's descriptor): nothing was counted after the exec"
            }
            Incomplete::RegionNotMapped => {
                "the preloaded library could not map its region in the command (its address \
                 space, ulimit -v?): nothing was counted in it"
            }
        }
    }
}

/// What the in-process region says beyond the loss counters (0 on the kernel path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RegionLost {
    /// Reads that found the region overwritten by the command (its header's settings, counts
    /// beyond its capacities or going down, entries no call writes): left out, the last good
    /// figures kept.
    pub region_overwritten: u64,
    /// Calls made by threads that share another's pthread data (raw `clone`), counted in the
    /// region's shared slot: their stacks are of one frame, their temporaries and latency not
    /// taken.
    pub raw_thread_calls: u64,
    /// Calls a signal handler made while it interrupted one of its thread's calls being
    /// counted: they went through uncounted (a lock-free count of them would race with the
    /// interrupted call's plain stores to the same thread's figures).
    pub nested_calls: u64,
}
