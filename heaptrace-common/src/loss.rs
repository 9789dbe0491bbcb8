//! What a bounded map or ring could not hold, counted by kind.

/// Indexes of the per-CPU loss counters: every bounded map that can fill counts what it dropped.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// An allocation could not be recorded in the live map (full): its free will be untracked.
    LiveMap = 0,
    /// A (process, function, size) triple did not fit in the size histogram.
    SizeHistogram = 1,
    /// A call could not be recorded in the in-flight map, or could not be set aside for a
    /// signal handler that interrupted it (on an alternate stack, or more than 4 deep): it was
    /// not counted.
    InFlight = 2,
    /// A process did not fit in the process map: its calls were not counted.
    ProcessMap = 3,
    /// An allocation's stack could not be stored (stack map full or a hash collision): it is
    /// counted under its caller alone (a site whose last frame says more frames were lost),
    /// or, when even that could not be stored, under a "stack lost" site of its process and
    /// function.
    Stack = 4,
    /// A site did not fit in the site map: its allocations are missing from the per-site views.
    SiteMap = 5,
    /// A process start did not fit in the event ring: a new allocator file it uses may be
    /// attached late (when another process using it starts).
    ProcessEvents = 6,
    /// A memory syscall (mmap, munmap, mremap, brk) or its call's site did not fit in the
    /// memory-event ring or the syscall map: the reserved-memory figures may be off.
    MemEvents = 7,
    /// A stack was cut at a frame whose unwind row has no rule heaptrace follows (a DWARF
    /// expression: a signal frame, a PLT stub) or at an address no row covers.
    UnwindNoRule = 8,
    /// A stack walked through a module whose unwind table did not fit (`--unwind-table-size`,
    /// or more code mappings than a process's table holds): by frame pointer there, and
    /// likely cut.
    UnwindTable = 9,
    /// A stack was cut at the walk's depth (127 frames) with frames left.
    StackDepth = 10,
    /// A stack was walked while unwinding was on but before its process's unwind tables were
    /// loaded (user space had not read its mappings yet): by frame pointer only, so cut at the
    /// first frame without one.
    UnwindLate = 11,
}

pub const LOSS_COUNT: usize = 12;

impl Loss {
    pub const ALL: [Loss; LOSS_COUNT] = [
        Loss::LiveMap,
        Loss::SizeHistogram,
        Loss::InFlight,
        Loss::ProcessMap,
        Loss::Stack,
        Loss::SiteMap,
        Loss::ProcessEvents,
        Loss::MemEvents,
        Loss::UnwindNoRule,
        Loss::UnwindTable,
        Loss::StackDepth,
        Loss::UnwindLate,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Loss::LiveMap => "live_map",
            Loss::SizeHistogram => "size_histogram",
            Loss::InFlight => "in_flight",
            Loss::ProcessMap => "process_map",
            Loss::Stack => "stack",
            Loss::SiteMap => "site_map",
            Loss::ProcessEvents => "process_events",
            Loss::MemEvents => "mem_events",
            Loss::UnwindNoRule => "unwind_no_rule",
            Loss::UnwindTable => "unwind_table",
            Loss::StackDepth => "stack_depth",
            Loss::UnwindLate => "unwind_late",
        }
    }
}
