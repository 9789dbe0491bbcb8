//! Loading the eBPF programs: the options, the size of every map and slot table, the globals
//! the loader sets, and the object with its kfunc calls patched in.
use super::*;

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// What the probes collect.
    pub mode: Mode,
    /// A benchmark floor instead: its mode's probes, programs that only count.
    pub floor: Option<Floor>,
    /// `--temporary-allocs`.
    pub temporary_allocs: u32,
    pub live_map_size: u32,
    pub size_map_size: u32,
    pub proc_map_size: u32,
    pub inflight_map_size: u32,
    /// Process slots per CPU (`heaptrace_common::procs`): a power of two, at most 256.
    pub proc_slots: u32,
    pub stack_map_size: u32,
    pub site_map_size: u32,
    /// `--unwind-table-size`: rows of unwind tables in the kernel (0: off).
    pub unwind_rows: u32,
    /// `--sample-bytes` (0: every allocation).
    pub sample_bytes: u64,
    /// `--latency-every`: one call in this many, on average, is timed (1: every call).
    pub latency_every: u32,
    /// The one process traced, whose execs alone the kernel reports (0: every process's).
    pub watch_tgid: u32,
    /// Only the processes in the kernel's followed set count, and each one they fork joins
    /// it (`probe::follow`).
    pub follow_forks: bool,
    /// The memory syscalls are traced: the kernel marks execs among their events.
    pub reservations: bool,
    /// `--all --comm`: the kernel leaves out the processes whose name does not contain this.
    pub comm: Option<String>,
    /// `--all --cgroup` on a host with a cgroup2 hierarchy: the kernel leaves out the threads
    /// of the cgroups user space judges not to match (`probe::cgroup_filter`).
    pub cgroup: Option<String>,
    /// Count with preemption off and plain adds where the kernel allows it (`bpf::kfunc`); false
    /// (`--atomic-counters`): atomic adds throughout.
    pub preempt_off: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            mode: Mode::Stacks,
            floor: None,
            temporary_allocs: 1,
            live_map_size: 1 << 22,
            size_map_size: 65536,
            proc_map_size: 4096,
            inflight_map_size: 16384,
            proc_slots: heaptrace_common::procs::slots(4096),
            stack_map_size: 16384,
            site_map_size: 16384,
            unwind_rows: 0,
            sample_bytes: 0,
            latency_every: 1,
            watch_tgid: 0,
            follow_forks: false,
            comm: None,
            cgroup: None,
            reservations: false,
            preempt_off: true,
        }
    }
}

impl LoadOptions {
    /// The mode whose probes go on: a floor's, or the mode's.
    pub fn probes(&self) -> Mode {
        self.floor.map_or(self.mode, Floor::probes_of)
    }

    /// Whether malloc is counted at its entry, with no return probe and no live map (calls
    /// mode and its floor).
    pub fn at_entry(&self) -> bool {
        self.probes().at_entry()
    }

    /// Every process (`--all`): neither one process nor a followed tree.
    pub fn all_processes(&self) -> bool {
        self.watch_tgid == 0 && !self.follow_forks
    }

    /// Whether the stack walk unwinds by tables where code has no frame pointers.
    pub fn unwinds(&self) -> bool {
        self.floor.is_none()
            && self.kernel_mode() >= heaptrace_common::mode::STACKS
            && self.unwind_rows > 0
    }

    /// The programs' MODE global (`heaptrace_common::mode`). Calls mode collects the size
    /// histogram, as sizes mode does; the CALLS_MODE global does the rest.
    fn kernel_mode(&self) -> u32 {
        use heaptrace_common::mode;
        match (self.floor, self.mode) {
            (Some(_), _) => mode::BARE,
            (None, Mode::Calls | Mode::Sizes) => mode::SIZES,
            (None, Mode::Counts) => mode::COUNTS,
            (None, Mode::Stacks) => mode::STACKS,
        }
    }
}

/// The site map is per CPU and preallocated (a non-preallocated per-CPU hash map was seen
/// losing fresh elements under bursts of inserts, without an error to count): 65,536 sites
/// (it holds about two rounds' sites, `drain/retire.rs`: g++ -O2 of a 1,000-line file lost
/// 160,095 site updates at 24,576 and none at 49,152), within a 64 MiB budget, at least 1024.
pub fn default_site_map_size() -> u32 {
    const BUDGET: usize = 64 << 20;
    const SITES: usize = 65536;
    let cpus = aya::util::nr_cpus().unwrap_or(1).max(1);
    let per_site = std::mem::size_of::<heaptrace_common::SiteCounters>() * cpus;
    (BUDGET / per_site).clamp(1024, SITES) as u32
}

/// Checks what loading needs before trying, so the error names the cause.
pub fn preflight() -> Result<()> {
    if !has_bpf_caps() {
        return Err(Error::NotPermitted);
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(Error::NoBtf);
    }
    if !std::path::Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        return Err(Error::NoUprobes);
    }
    Ok(())
}

fn has_bpf_caps() -> bool {
    crate::targets::access::Privileges::own().can_load()
}

/// The object as loaded: its placeholders rewritten for this kernel (`bpf::kfunc`), once a process.
fn object(preempt_off: bool) -> Result<&'static crate::bpf::kfunc::Patched> {
    static PREEMPT_OFF: OnceLock<crate::bpf::kfunc::Patched> = OnceLock::new();
    static ATOMIC: OnceLock<crate::bpf::kfunc::Patched> = OnceLock::new();
    let cell = if preempt_off { &PREEMPT_OFF } else { &ATOMIC };
    if let Some(p) = cell.get() {
        return Ok(p);
    }
    let p = crate::bpf::kfunc::patched(EBPF_OBJECT, preempt_off).map_err(Error::Load)?;
    Ok(cell.get_or_init(|| p))
}

/// The programs' object loaded into aya (maps created, programs not yet verified).
pub struct Loaded {
    pub ebpf: Ebpf,
    /// The bytes aya loaded, for the uprobe_multi copies of the programs.
    pub(super) object: &'static [u8],
    /// The return and free programs count with preemption off (`bpf::kfunc`).
    pub preempt_off: bool,
    /// See `Probes::oom_victim`.
    pub oom_victim: std::result::Result<u32, String>,
}

/// The capacities of the whole-stack map (STACK_OWNERS: `--stack-map-size` stacks, allocated
/// as they come; FRAMES, `frames_unread`) and of the map of callers (one-frame stacks, for
/// the allocations whose whole stack is lost). The callers' is a kernel stack map, preallocated, in buckets numbered by
/// the frame's hash: half the capacity, and a power of two is asked for one more, which gives
/// twice the buckets for one more frame's memory.
pub fn stack_maps(opts: &LoadOptions) -> (u32, u32) {
    if opts.kernel_mode() < heaptrace_common::mode::STACKS {
        return (1, 1);
    }
    let half = (opts.stack_map_size / 2).max(1);
    let callers = if half.is_power_of_two() && half > 1 {
        half + 1
    } else {
        half
    };
    (opts.stack_map_size.max(1), callers)
}

/// The capacity of FRAMES, the frames of the stacks stored since user space last read them (a
/// round's new stacks; STACK_OWNERS holds every stack's id, `stacks` of them): half as many,
/// at most 65,536. A stack's frames take 1 KiB there, and the map is read once a quarter
/// full (`drain::relief`), so more room would be kernel memory for bursts alone.
pub fn frames_unread(stacks: u32) -> u32 {
    (stacks / 2).clamp(1, 1 << 16)
}

/// The live slots in front of the live map (`heaptrace_common::live`): one where no mode
/// keeps live blocks (calls mode, the floors).
pub fn live_slots(opts: &LoadOptions) -> u32 {
    if opts.at_entry() || opts.floor.is_some() {
        1
    } else {
        heaptrace_common::live::slots(opts.live_map_size)
    }
}

/// The slot tables' rows (`heaptrace_common::procs`, `heaptrace_common::keyed`): the CPUs
/// with a row, and log2 of each table's slots a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRows {
    /// 0: the tables are off (bare mode, or more CPUs than an exec's program marks).
    pub cpus: u32,
    pub procs: u32,
    pub sites: u32,
    pub sizes: u32,
    /// The stack cache (`heaptrace_common::stack::cache_word`).
    pub stacks: u32,
}

impl SlotRows {
    /// The array's entries for a table of `1 << shift` slots a row (one where it is off).
    pub fn entries(&self, shift: u32) -> u32 {
        (self.cpus << shift).max(1)
    }
}

pub fn slot_rows(opts: &LoadOptions) -> Result<SlotRows> {
    use heaptrace_common::{keyed, mode, procs};
    let cpus = aya::util::nr_cpus().map_err(|(path, e)| Error::Read {
        path: path.into(),
        source: e,
    })? as u32;
    if !opts.proc_slots.is_power_of_two() || opts.proc_slots > procs::MAX_SLOTS {
        return Err(Error::Usage(format!(
            "--proc-slots {}: not a power of two up to {}",
            opts.proc_slots,
            procs::MAX_SLOTS
        )));
    }
    if opts.floor.is_some() || cpus > procs::MAX_CPUS {
        return Ok(SlotRows {
            cpus: 0,
            procs: 0,
            sites: 0,
            sizes: 0,
            stacks: 0,
        });
    }
    // Tables a mode does not use get a slot a row.
    let (sites, stacks) = if opts.kernel_mode() >= mode::STACKS {
        (
            keyed::shift(opts.site_map_size, size_of::<keyed::SiteSlot>(), cpus),
            heaptrace_common::stack::cache_shift(opts.stack_map_size),
        )
    } else {
        (0, 0)
    };
    let sizes = if opts.kernel_mode() >= mode::SIZES {
        keyed::shift(opts.size_map_size, size_of::<keyed::SizeSlot>(), cpus)
    } else {
        0
    };
    Ok(SlotRows {
        cpus,
        procs: opts.proc_slots.trailing_zeros(),
        sites,
        sizes,
        stacks,
    })
}

/// What a floor's return program does of the stack (`globals::BARE_STACK`).
fn bare_stack(floor: Option<Floor>) -> u32 {
    match floor {
        Some(Floor::Bare) => globals::BARE_WALK,
        Some(Floor::BareRead) => globals::BARE_READ,
        _ => 0,
    }
}

pub fn load(opts: &LoadOptions) -> Result<Loaded> {
    let me = std::process::id();
    let object = object(opts.preempt_off)?;
    // Maps a mode does not use get one entry: a stack map is preallocated at full size.
    let stacks = opts.kernel_mode() >= heaptrace_common::mode::STACKS;
    let sizes = opts.kernel_mode() >= heaptrace_common::mode::SIZES;
    let (frames, callers) = stack_maps(opts);
    let scale = sampling::gap_scale(opts.sample_bytes);
    let live_slots = live_slots(opts);
    let inflight_slots = if opts.floor.is_some() {
        1
    } else {
        heaptrace_common::inflight_slots(opts.inflight_map_size)
    };
    let rows = slot_rows(opts)?;
    let proc_states = heaptrace_common::proc_state::slots(opts.proc_map_size);
    let (pattern, task) = comm_filter(opts);
    let (ids, oom_victim) = task_offsets(opts)?;
    let vma = vma_offsets(opts);
    let mut ebpf = EbpfLoader::new()
        .override_global(globals::COMM_FILTER, &pattern.bytes, true)
        .override_global(globals::COMM_FILTER_MASK, &pattern.mask, true)
        .override_global(globals::TASK_GROUP_LEADER, &task.group_leader, true)
        .override_global(globals::TASK_COMM, &task.comm, true)
        .override_global(
            globals::CGROUP_FILTER,
            &u32::from(opts.cgroup.is_some()),
            true,
        )
        .override_global(globals::SELF_TGID, &me, true)
        .override_global(globals::PREEMPT_OFF, &u32::from(object.preempt_off), true)
        .override_global(globals::SAMPLE_BYTES, &opts.sample_bytes, true)
        .override_global(globals::SAMPLE_SCALE, &scale, true)
        .override_global(globals::LATENCY_EVERY, &opts.latency_every.max(1), true)
        .override_global(globals::MODE, &opts.kernel_mode(), true)
        .override_global(
            globals::TEMPORARY_ALLOCS,
            &opts.temporary_allocs.max(1),
            true,
        )
        .override_global(globals::CALLS_MODE, &u32::from(opts.at_entry()), true)
        .override_global(globals::BARE_STACK, &bare_stack(opts.floor), true)
        .override_global(globals::WATCH_TGID, &opts.watch_tgid, true)
        .override_global(globals::FOLLOW_FORKS, &u32::from(opts.follow_forks), true)
        .override_global(globals::TASK_PID, &ids.pid, true)
        .override_global(globals::TASK_TGID, &ids.tgid, true)
        .override_global(globals::OOM_VICTIM, &oom_victim.clone().unwrap_or(0), true)
        .override_global(globals::RESERVATIONS, &u32::from(opts.reservations), true)
        .override_global(globals::LIVE_SLOTS_MASK, &(live_slots - 1), true)
        .map_max_entries(maps::LIVE, opts.live_map_size)
        .map_max_entries(maps::LIVE_SLOTS, live_slots)
        .override_global(globals::INFLIGHT_SLOTS_MASK, &(inflight_slots - 1), true)
        .map_max_entries(maps::INFLIGHT_SLOTS, inflight_slots)
        .map_max_entries(maps::SIZES, if sizes { opts.size_map_size } else { 1 })
        .map_max_entries(maps::PROCS, opts.proc_map_size)
        .override_global(globals::SLOT_CPUS, &rows.cpus, true)
        .override_global(globals::PROC_SLOTS_SHIFT, &rows.procs, true)
        .map_max_entries(maps::PROC_SLOTS, rows.entries(rows.procs))
        .override_global(globals::SITE_SLOTS_SHIFT, &rows.sites, true)
        .map_max_entries(maps::SITE_SLOTS, rows.entries(rows.sites))
        .override_global(globals::SIZE_SLOTS_SHIFT, &rows.sizes, true)
        .map_max_entries(maps::SIZE_SLOTS, rows.entries(rows.sizes))
        .override_global(globals::STACK_CACHE_SHIFT, &rows.stacks, true)
        .map_max_entries(maps::STACK_CACHE, rows.entries(rows.stacks))
        .map_max_entries(maps::EXECS, opts.proc_map_size)
        .map_max_entries(maps::PEAKS, opts.proc_map_size)
        .override_global(globals::PROC_STATE_MASK, &(proc_states - 1), true)
        .map_max_entries(maps::PROC_STATE, proc_states)
        .map_max_entries(maps::INFLIGHT, opts.inflight_map_size)
        .map_max_entries(maps::STACK_OWNERS, frames)
        .map_max_entries(maps::FRAMES, frames_unread(frames))
        .map_max_entries(maps::CALLERS, callers)
        .map_max_entries(maps::SITES, if stacks { opts.site_map_size } else { 1 })
        .override_global(globals::UNWIND, &u32::from(opts.unwinds()), true)
        .override_global(globals::VMA_ROWS, &u32::from(vma.is_some()), true)
        .override_global(globals::VMA_OFFSETS, &vma.unwrap_or_default(), true)
        .map_max_entries(
            maps::FILE_ROWS,
            vma.map_or(1, |_| heaptrace_common::unwind::FILE_ROWS_ENTRIES),
        )
        .map_max_entries(
            maps::UNWIND_CACHE,
            if opts.unwinds() {
                rows.entries(heaptrace_common::unwind::RULE_CACHE_SHIFT)
            } else {
                1
            },
        )
        .map_max_entries(
            maps::UNWIND_PROCS,
            if opts.unwinds() {
                opts.proc_map_size
            } else {
                1
            },
        )
        .load(object.bytes())
        .map_err(|e| {
            let msg = format!("{e:#}");
            if msg.contains("Operation not permitted") {
                Error::NotPermitted
            } else {
                Error::Load(msg)
            }
        })?;
    if opts.sample_bytes > 0 {
        // Before any probe is attached: a draw before the table is there would read zeros.
        fill_log2_table(&mut ebpf)?;
    }
    Ok(Loaded {
        ebpf,
        object: object.bytes(),
        preempt_off: object.preempt_off,
        oom_victim,
    })
}

/// Where the kernel's task_struct keeps a thread's ids, and how the OOM program finds its
/// victim (or why it cannot: it reads the victim's tgid at these offsets too).
fn task_offsets(
    opts: &LoadOptions,
) -> Result<(crate::bpf::btf::IdOffsets, std::result::Result<u32, String>)> {
    let ids = if opts.follow_forks {
        crate::bpf::btf::id_offsets()?
    } else {
        crate::bpf::btf::id_offsets().unwrap_or_default()
    };
    let oom_victim = crate::bpf::btf::oom_victim()
        .map_err(|e| e.to_string())
        .and_then(|how| match how {
            heaptrace_common::OOM_TASK if ids.tgid == 0 => {
                Err("no tgid in the kernel's task_struct".to_string())
            }
            how => Ok(how),
        });
    Ok((ids, oom_victim))
}

/// Where a walk before a process's entry reads its frames' mappings: under `--all`, where a
/// process that execs is not held until its entry is written, with tables on and the
/// kernel's BTF naming every field (else those walks go by frame pointer, counted late).
/// Elsewhere the verifier is spared that walk's loop (0.1 s of every start).
fn vma_offsets(opts: &LoadOptions) -> Option<[u32; heaptrace_common::unwind::vma::COUNT]> {
    if !opts.unwinds() || !opts.all_processes() {
        return None;
    }
    crate::bpf::btf::vma_offsets()
        .inspect_err(|e| log::debug!("no walks by mapping before an entry: {e}"))
        .ok()
}

/// Sampling's table of log2 values, which the programs draw from.
fn fill_log2_table(ebpf: &mut aya::Ebpf) -> Result<()> {
    let mut table: aya::maps::Array<_, u64> = ebpf
        .map_mut(maps::LOG2_TABLE)
        .ok_or_else(|| Error::Load(format!("map {} missing", maps::LOG2_TABLE)))?
        .try_into()
        .map_err(|e| Error::Load(format!("{}: {e}", maps::LOG2_TABLE)))?;
    for (j, v) in sampling::log2_table().into_iter().enumerate() {
        table
            .set(j as u32, v, 0)
            .map_err(|e| Error::Load(format!("{}: {e}", maps::LOG2_TABLE)))?;
    }
    Ok(())
}

/// The kernel's `--comm` filter: the pattern (a zero one: off) and where a thread finds its
/// process's name. Without the kernel's BTF for task_struct, user space alone filters, as it
/// does anyway (it judges every process it is shown).
fn comm_filter(opts: &LoadOptions) -> (Pattern, crate::bpf::btf::TaskOffsets) {
    let off = (
        Pattern {
            bytes: [0; 2],
            mask: [0; 2],
        },
        crate::bpf::btf::TaskOffsets::default(),
    );
    let Some(pattern) = opts
        .comm
        .as_deref()
        .and_then(heaptrace_common::filter::pattern)
    else {
        return off;
    };
    match crate::bpf::btf::task_offsets() {
        Ok(task) => (pattern, task),
        Err(e) => {
            crate::say!(
                "heaptrace: warning: {e}: --comm filters in user space only (the other \
                 processes' stacks take room in the maps)"
            );
            off
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn maps(mode: Mode, stack_map_size: u32) -> (u32, u32) {
        stack_maps(&LoadOptions {
            mode,
            stack_map_size,
            ..LoadOptions::default()
        })
    }

    /// FRAMES holds half the stacks' ids, within 1 KiB stacks' bound.
    #[test]
    fn frames_hold_half_the_stacks_up_to_65536() {
        assert_eq!(frames_unread(1), 1);
        assert_eq!(frames_unread(16384), 8192);
        assert_eq!(frames_unread(131072), 65536);
        assert_eq!(frames_unread(1 << 18), 65536);
        assert_eq!(frames_unread(1 << 24), 65536);
    }

    /// (whole stacks, callers): the callers' stack map gets one more for a power of two.
    #[test]
    fn the_callers_map_is_half_and_a_power_of_two_half_gets_one_more() {
        assert_eq!(maps(Mode::Stacks, 16384), (16384, 8193));
        assert_eq!(maps(Mode::Stacks, 65536), (65536, 32769));
        assert_eq!(maps(Mode::Stacks, 20000), (20000, 10000));
        assert_eq!(maps(Mode::Stacks, 2), (2, 1));
        assert_eq!(maps(Mode::Counts, 16384), (1, 1));
    }
}
