//! Loading the eBPF programs and attaching them to a provider's malloc family.
//!
//! Drop detaches everything: every exit path (return, error, panic unwinding) that drops the
//! `Probes` removes the uprobes, and the kernel removes them when the process dies anyway.
//!
//! Detaching is the slow part. Closing a perf-event uprobe waits for grace periods under a
//! kernel-wide mutex: about 0.1 s per probe here, one after the other. So the probes go on as
//! uprobe_multi links (`bpf::uprobe_multi`) where the kernel has them: one per program, each unregistered
//! behind one grace period. `Probes` owns its links and closes them from one thread each, so
//! those waits overlap too. Perf-event uprobes remain the fallback.
pub mod cgroup_filter;
pub mod placement;
pub mod sampling;
pub mod syscall_sites;
use std::{
    num::NonZeroU32,
    path::{Path, PathBuf},
    sync::OnceLock,
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{
        UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
    },
};
use heaptrace_common::{COOKIE_NO_RETURN, Func, filter::Pattern, globals, maps};
use iced_x86::Register;

use crate::{
    bpf::links::{self, Link},
    bpf::uprobe_multi::MultiPrograms,
    error::{Error, Result},
    probe::placement::Placement,
    run_info::{Floor, Mode},
    targets::allocator::Provider,
    targets::custom_symbols::Abi,
    targets::elf::{self, FuncSite},
};

/// Which processes the probes fire for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// One process and all its threads, present and future (uprobe filters match the mm).
    Process(u32),
    /// Every process that maps the provider's file.
    All,
}

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
    /// `--sample-bytes` (0: every allocation).
    pub sample_bytes: u64,
    /// `--latency-every`: one call in this many, on average, is timed (1: every call).
    pub latency_every: u32,
    /// The one process traced, whose execs alone the kernel reports (0: every process's).
    pub watch_tgid: u32,
    /// The memory syscalls are traced: the kernel marks execs among their events.
    pub reservations: bool,
    /// `--all --comm`: the kernel leaves out the processes whose name does not contain this.
    pub comm: Option<String>,
    /// `--all --cgroup` on a host with a cgroup2 hierarchy: the kernel leaves out the threads
    /// of the cgroups user space judges not to match (`probe::cgroup_filter`).
    pub cgroup: Option<String>,
    /// Count with preemption off and plain adds where the kernel allows it (`bpf::kfunc`); false
    /// (`--atomic-counters`): atomic adds throughout.
    pub pin: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            mode: Mode::Stacks,
            floor: None,
            temporary_allocs: 1,
            live_map_size: 1 << 20,
            size_map_size: 65536,
            proc_map_size: 4096,
            inflight_map_size: 16384,
            proc_slots: heaptrace_common::procs::slots(4096),
            stack_map_size: 16384,
            site_map_size: 16384,
            sample_bytes: 0,
            latency_every: 1,
            watch_tgid: 0,
            comm: None,
            cgroup: None,
            reservations: false,
            pin: true,
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
/// losing fresh elements under bursts of inserts, without an error to count): size it to a
/// 64 MiB budget, at least 1024 sites, and at most what the stack maps can name: each of
/// their stacks, and a caller for as many more (`stack_maps`).
pub fn default_site_map_size(stack_map_size: u32) -> u32 {
    const BUDGET: usize = 64 << 20;
    let cpus = aya::util::nr_cpus().unwrap_or(1).max(1);
    let per_site = std::mem::size_of::<heaptrace_common::SiteCounters>() * cpus;
    let most = stack_map_size.saturating_add(stack_map_size / 2).max(1024);
    (BUDGET / per_site).clamp(1024, most as usize) as u32
}

/// One attached probe, for `--verbose` and the JSON document.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Attached {
    /// The family function it is counted as.
    pub func: &'static str,
    /// The probed symbol: `func` itself, or its `--allocator-symbols` stand-in.
    pub symbol: String,
    pub aliases: Vec<&'static str>,
    pub path: PathBuf,
    /// The function's offset in the file; its probes are `placement.offset` past it.
    pub offset: u64,
    pub uretprobe: bool,
    /// Where the entry probe is, from the function's start, and why.
    pub placement: Placement,
}

/// Where one function's probes go.
#[derive(Clone, Debug)]
pub struct Planned {
    pub site: FuncSite,
    /// Allocating functions have one (their result and size meet there), except malloc in
    /// calls mode; free does not.
    pub uretprobe: bool,
    pub placement: Placement,
}

impl Planned {
    /// Where in the file the entry probe goes, and the uretprobe with it (`placement::choose`:
    /// a place where the return address is still at [rsp], the two sharing one trap).
    pub fn file_offset(&self) -> u64 {
        self.site.file_offset + self.placement.offset
    }

    /// The entry probe's cookie: the pushes before the probe point, and whether the call is
    /// counted at its entry (see heaptrace_common::COOKIE_NO_RETURN).
    pub fn cookie(&self) -> u64 {
        let at_entry = !self.uretprobe && self.site.func != Func::Free;
        u64::from(self.placement.pushes) | if at_entry { COOKIE_NO_RETURN } else { 0 }
    }
}

/// Whether a function needs a return probe. In calls mode malloc does without one: it is
/// counted at its entry. That takes a trap off every malloc, and is exact as long as malloc
/// runs no other family member inside it, which holds for the C allocators (glibc, jemalloc,
/// tcmalloc). Every other function keeps its return probe: it may run malloc or free inside
/// (realloc(NULL, n), small-alignment posix_memalign), and only its return closes the window
/// in which such a nested call is told apart. A custom allocator's malloc (`--allocator-symbols`)
/// may wrap anything, and keeps its return probe too.
fn needs_uretprobe(provider: &Provider, site: &FuncSite, calls: bool) -> bool {
    match site.func {
        Func::Free => false,
        Func::Malloc if calls => !(provider.abi == Abi::C && site.symbol == "malloc"),
        _ => true,
    }
}

/// Decides where each function's entry probe goes, from the provider file's code.
/// `at_entry` keeps every probe at its function's entry; `calls` is calls mode.
pub fn plan(provider: &Provider, at_entry: bool, calls: bool) -> Result<Vec<Planned>> {
    provider
        .sites
        .iter()
        .map(|site| {
            let uretprobe = needs_uretprobe(provider, site, calls);
            let code = elf::code(&provider.attach_path, site, placement::WINDOW)?;
            let placement = if at_entry {
                placement::entry(&code, "entry: --probe-at-entry")
            } else {
                let reads = match (provider.abi, site.func) {
                    (Abi::Rust, Func::Realloc) => &[Register::RDI, Register::RCX][..],
                    (Abi::Rust, Func::Calloc) => &[Register::RDI][..],
                    _ => placement::reads(site.func),
                };
                placement::choose(&code, site.func, uretprobe, reads)
            };
            Ok(Planned {
                site: site.clone(),
                uretprobe,
                placement,
            })
        })
        .collect()
}

/// How the return and free programs add to their CPU's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Counting {
    /// Plain adds with preemption off (`bpf_preempt_disable`), where the kernel allows it.
    PreemptionOff,
    /// Atomic adds throughout.
    Atomic,
}

pub struct Probes {
    pub ebpf: Ebpf,
    /// The return and free programs count with preemption off (`bpf::kfunc`).
    pub pinned: bool,
    pub attached: Vec<Attached>,
    /// Every uprobe link, owned here (not by its program) so that Drop can close them at once.
    links: Vec<Link>,
    /// The programs loaded again for uprobe_multi links; None where the kernel refused them.
    multi: Option<MultiPrograms>,
    /// Calls mode: see [`plan`].
    calls: bool,
    /// Probe the memory syscalls' wrappers of each allocator file that has them.
    reservations: bool,
    /// The memory syscalls' wrappers probed, by file (see `syscall_sites::find`).
    pub syscall_sites: Vec<(PathBuf, Vec<crate::probe::syscall_sites::SyscallSite>)>,
}

impl Drop for Probes {
    fn drop(&mut self) {
        links::detach_all(std::mem::take(&mut self.links));
    }
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
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    let Some(eff) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
    else {
        return false;
    };
    let has = |c: u32| eff & (1 << c) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heaptrace"));

/// The object as loaded: its placeholders rewritten for this kernel (`bpf::kfunc`), once a process.
fn object(pin: bool) -> Result<&'static crate::bpf::kfunc::Patched> {
    static PINNED: OnceLock<crate::bpf::kfunc::Patched> = OnceLock::new();
    static ATOMIC: OnceLock<crate::bpf::kfunc::Patched> = OnceLock::new();
    let cell = if pin { &PINNED } else { &ATOMIC };
    if let Some(p) = cell.get() {
        return Ok(p);
    }
    let p = crate::bpf::kfunc::patched(EBPF_OBJECT, pin).map_err(Error::Load)?;
    Ok(cell.get_or_init(|| p))
}

/// The programs' object loaded into aya (maps created, programs not yet verified).
pub struct Loaded {
    pub ebpf: Ebpf,
    /// The bytes aya loaded, for the uprobe_multi copies of the programs.
    object: &'static [u8],
    /// The return and free programs count with preemption off (`bpf::kfunc`).
    pub pinned: bool,
}

/// The capacities of the whole-stack map (FRAMES: `--stack-map-size` stacks, allocated as
/// they come) and of the map of callers (one-frame stacks, for the allocations whose whole
/// stack is lost). The callers' is a kernel stack map, preallocated, in buckets numbered by
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

pub fn load(opts: &LoadOptions) -> Result<Loaded> {
    let me = std::process::id();
    let object = object(opts.pin)?;
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
    let (pattern, task) = comm_filter(opts);
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
        .override_global(globals::PINNED, &u32::from(object.pinned), true)
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
        .override_global(
            globals::BARE_STACK,
            &u32::from(opts.floor == Some(Floor::Bare)),
            true,
        )
        .override_global(globals::WATCH_TGID, &opts.watch_tgid, true)
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
        .map_max_entries(maps::INFLIGHT, opts.inflight_map_size)
        .map_max_entries(maps::FRAMES, frames)
        .map_max_entries(maps::CALLERS, callers)
        .map_max_entries(maps::SITES, if stacks { opts.site_map_size } else { 1 })
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
    }
    Ok(Loaded {
        ebpf,
        object: object.bytes(),
        pinned: object.pinned,
    })
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
            eprintln!(
                "heaptrace: warning: {e}: --comm filters in user space only (the other \
                 processes' stacks take room in the maps)"
            );
            off
        }
    }
}

/// The entry program of a function: most read the C family's arguments; Rust's realloc and
/// zeroed allocation have their own (see the eBPF side).
fn entry_program(func: Func, abi: Abi) -> &'static str {
    match (abi, func) {
        (Abi::Rust, Func::Calloc) => return "alloc_zeroed_entry",
        (Abi::Rust, Func::Realloc) => return "rust_realloc_entry",
        _ => {}
    }
    match func {
        Func::Malloc => "malloc_entry",
        Func::Calloc => "calloc_entry",
        Func::Realloc => "realloc_entry",
        Func::Free => "free_entry",
        Func::PosixMemalign => "posix_memalign_entry",
        Func::AlignedAlloc => "aligned_alloc_entry",
        Func::Memalign => "memalign_entry",
        Func::Valloc => "valloc_entry",
        Func::Pvalloc => "pvalloc_entry",
    }
}

const RETURN_PROGRAM: &str = "alloc_return";
/// On the memory syscalls' wrappers (heaptrace-ebpf's mem.rs).
const SYSCALL_PROGRAM: &str = "mem_syscall";

/// The first line of a load error and the verifier's last words, not its whole log.
fn short(e: &dyn std::fmt::Display) -> String {
    let full = format!("{e:#}");
    let lines: Vec<&str> = full.lines().collect();
    if lines.len() <= 4 {
        return lines.join(" ");
    }
    let tail: Vec<&str> = lines
        .iter()
        .rev()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.starts_with("verification time")
                && !l.starts_with("processed")
        })
        .take(2)
        .copied()
        .collect();
    format!(
        "{} ... {}",
        lines[0],
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )
}

/// aya's copy of uprobe program `name`, loaded (and verified) on first use: where uprobe_multi
/// links work, aya's copies serve only as the fallback, and are never loaded.
fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let prog: &mut UProbe = program(ebpf, name)?;
    if prog.fd().is_err() {
        prog.load()
            .map_err(|e| Error::Load(format!("{name}: {}", short(&e))))?;
    }
    Ok(prog)
}

/// A program of the object, as its kind (uprobe, tracepoint...).
pub fn program<'a, P>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| Error::Load(format!("program {name} missing from the object")))?
        .try_into()
        .map_err(|e| Error::Load(format!("{name}: {e}")))
}

/// Attaches the thread-exit cleanup of in-flight records (heaptrace-ebpf's threads.rs) before
/// any uprobe can make one. Without it, the daemon's purge of records of threads that are gone
/// still bounds the map, a round later: a warning, not an error.
fn thread_exits(ebpf: &mut Ebpf) {
    let (prog, tp) = ("on_thread_exit", "sched_process_exit");
    let attached = program(ebpf, prog).map_err(|e| e.to_string()).and_then(
        |p: &mut aya::programs::RawTracePoint| {
            p.load().map_err(|e| format!("{prog}: {e}"))?;
            p.attach(tp).map_err(|e| format!("{prog} on {tp}: {e}"))
        },
    );
    if let Err(e) = attached {
        eprintln!("heaptrace: warning: no in-flight cleanup at thread exit ({e})");
    }
}

/// The memory syscalls' wrappers of one file, probed.
struct WrapperLinks {
    links: Vec<Link>,
    sites: Vec<crate::probe::syscall_sites::SyscallSite>,
}

fn uprobe_scope(scope: Scope) -> Result<UProbeScope> {
    Ok(match scope {
        Scope::All => UProbeScope::AllProcesses,
        Scope::Process(pid) => {
            UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or(Error::NoSuchProcess(0))?)
        }
    })
}

/// Takes a just-attached link from its program. Fails only if the id is unknown, which would be
/// a bug; the program still holds (and detaches) the link then.
fn own(prog: &mut UProbe, id: aya::programs::uprobe::UProbeLinkId) -> Result<UProbeLink> {
    prog.take_link(id)
        .map_err(|e| Error::Load(format!("taking an attached link: {e}")))
}

impl Probes {
    /// The ring buffer `name`, taken from the loaded object: its reader owns it from now on.
    pub fn take_ring(
        &mut self,
        name: &'static str,
    ) -> Result<aya::maps::RingBuf<aya::maps::MapData>> {
        let map = self
            .ebpf
            .take_map(name)
            .ok_or_else(|| Error::Load(format!("map {name} missing")))?;
        aya::maps::RingBuf::try_from(map).map_err(|e| Error::Map {
            map: name,
            reason: e.to_string(),
        })
    }

    pub fn counting(&self) -> Counting {
        match self.pinned {
            true => Counting::PreemptionOff,
            false => Counting::Atomic,
        }
    }

    /// Loads every program once (the uprobe_multi copies where the kernel has them, aya's
    /// otherwise); `attach` then puts them on as many allocator files as needed.
    /// `bpf::uprobe_multi` asks for uprobe_multi links where the kernel has them. Call before any map is
    /// taken out of `ebpf`: the uprobe_multi copies of the programs are pointed at its maps.
    /// `reservations`: also probe the memory syscalls' wrappers where the file has them.
    pub fn new(loaded: Loaded, multi: bool, calls: bool, reservations: bool) -> Result<Probes> {
        let Loaded {
            mut ebpf,
            object,
            pinned,
        } = loaded;
        let names: Vec<&str> = [RETURN_PROGRAM, SYSCALL_PROGRAM]
            .into_iter()
            .chain(Func::ALL.map(|f| entry_program(f, Abi::C)))
            .chain([
                entry_program(Func::Calloc, Abi::Rust),
                entry_program(Func::Realloc, Abi::Rust),
            ])
            .collect();
        thread_exits(&mut ebpf);
        let multi = if multi {
            MultiPrograms::load(object, &ebpf, &names)
                .inspect_err(|e| log::debug!("no uprobe_multi links, perf-event uprobes: {e}"))
                .ok()
        } else {
            None
        };
        // Verifying a program takes up to 0.1 s here: aya's copies are loaded now only when
        // they are what will be attached; as a fallback, `uprobe` loads one when first needed.
        if multi.is_none() {
            for name in &names {
                uprobe(&mut ebpf, name)?;
            }
        }
        Ok(Probes {
            ebpf,
            pinned,
            attached: Vec::new(),
            links: Vec::new(),
            multi,
            calls,
            reservations,
            syscall_sites: Vec::new(),
        })
    }

    /// Whether memory syscalls are seen at their wrappers; otherwise the syscall tracepoints
    /// must see them (`reserve::ring`).
    pub fn syscalls_probed(&self) -> bool {
        !self.syscall_sites.is_empty()
    }

    /// Probes the memory syscalls' wrappers in `provider`'s file, when it has them all.
    fn attach_syscalls(&mut self, provider: &Provider, scope: Scope) {
        self.attach_syscalls_in(&provider.path, &provider.attach_path, scope)
    }

    /// Probes the memory syscalls' wrappers in the file at `path` (`shown` as), when it has
    /// them all and reservations are traced. All or nothing: what cannot be probed is a
    /// warning, and the syscall tracepoints trace the memory syscalls unless other wrappers
    /// were probed (`reserve::ring`).
    pub fn attach_syscalls_in(&mut self, shown: &Path, path: &Path, scope: Scope) {
        if !self.reservations {
            return;
        }
        match self.syscall_links(path, scope) {
            Ok(Some(mut w)) => {
                self.links.append(&mut w.links);
                self.syscall_sites.push((shown.to_path_buf(), w.sites));
            }
            Ok(None) => {}
            Err(e) => eprintln!(
                "heaptrace: warning: memory syscalls not probed in {} ({e})",
                shown.display()
            ),
        }
    }

    /// The wrapper probes' links, attached, and how many probes they hold (None: no wrappers to
    /// probe). On an error the links made so far are closed (detached) on return.
    fn syscall_links(&mut self, path: &Path, scope: Scope) -> Result<Option<WrapperLinks>> {
        let Some(sites) = crate::probe::syscall_sites::find(path)? else {
            return Ok(None);
        };
        // After each syscall; and at the entry of those that release a range (see mem::BEGIN).
        let mut offsets: Vec<u64> = sites.iter().map(|s| s.probe_offset()).collect();
        let mut cookies: Vec<u64> = sites.iter().map(|s| u64::from(s.nr)).collect();
        for s in sites.iter().filter(|s| s.releases()) {
            offsets.push(s.file_offset);
            cookies.push(u64::from(s.nr) | heaptrace_common::mem::COOKIE_BEGIN);
        }
        if let Some(multi) = &self.multi {
            let pid = match scope {
                Scope::All => 0,
                Scope::Process(pid) => pid,
            };
            match multi.attach(SYSCALL_PROGRAM, path, &offsets, &cookies, false, pid) {
                Ok(fd) => {
                    return Ok(Some(WrapperLinks {
                        links: vec![Link::Multi(fd)],
                        sites,
                    }));
                }
                Err(e) => log::debug!("uprobe_multi on the syscall wrappers: {e}"),
            }
        }
        let scope = uprobe_scope(scope)?;
        let mut links = Vec::new();
        for (offset, cookie) in offsets.into_iter().zip(cookies) {
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(offset),
                cookie: Some(cookie),
            };
            let prog = uprobe(&mut self.ebpf, SYSCALL_PROGRAM)?;
            let id = prog
                .attach(point, path, scope)
                .map_err(|e| Error::Load(format!("{SYSCALL_PROGRAM}: {e}")))?;
            links.push(Link::Perf(own(prog, id)?));
        }
        Ok(Some(WrapperLinks { links, sites }))
    }

    /// One uprobe_multi link for every return probe, then one per entry program. All or
    /// nothing: on an error, the links made so far are closed (detached) on return.
    fn attach_multi(
        multi: &MultiPrograms,
        plan: &[Planned],
        provider: &Provider,
        pid: u32,
    ) -> std::result::Result<Vec<Link>, crate::bpf::uprobe_multi::MultiError> {
        let path = &provider.attach_path;
        let mut links = Vec::new();
        let returns: Vec<u64> = plan
            .iter()
            .filter(|p| p.uretprobe)
            .map(Planned::file_offset)
            .collect();
        if !returns.is_empty() {
            let cookies = vec![0; returns.len()];
            let fd = multi.attach(RETURN_PROGRAM, path, &returns, &cookies, true, pid)?;
            links.push(Link::Multi(fd));
        }
        for p in plan {
            let offset = p.file_offset();
            let cookie = p.cookie();
            let name = entry_program(p.site.func, provider.abi);
            let fd = multi.attach(name, path, &[offset], &[cookie], false, pid)?;
            links.push(Link::Multi(fd));
        }
        Ok(links)
    }

    fn record(&mut self, provider: &Provider, plan: &[Planned]) {
        for p in plan {
            self.attached.push(Attached {
                func: p.site.func.name(),
                symbol: p.site.symbol.clone(),
                aliases: p.site.aliases.iter().map(|a| a.name()).collect(),
                path: provider.path.clone(),
                offset: p.site.file_offset,
                uretprobe: p.uretprobe,
                placement: p.placement.clone(),
            });
        }
    }

    /// Attaches every function the provider defines, entry probes where `plan` puts them.
    /// Return probes go first: an entry seen without its return probe in place would leave a
    /// record that is never completed.
    pub fn attach(&mut self, provider: &Provider, scope: Scope, at_entry: bool) -> Result<()> {
        let plan = plan(provider, at_entry, self.calls)?;
        if let Some(multi) = &self.multi {
            let pid = match scope {
                Scope::All => 0,
                Scope::Process(pid) => pid,
            };
            match Self::attach_multi(multi, &plan, provider, pid) {
                Ok(mut links) => {
                    self.links.append(&mut links);
                    self.record(provider, &plan);
                    self.attach_syscalls(provider, scope);
                    return Ok(());
                }
                Err(e) => log::debug!(
                    "uprobe_multi on {}: {e}; perf-event uprobes instead",
                    provider.path.display()
                ),
            }
        }
        let family_scope = scope;
        let scope = uprobe_scope(scope)?;
        let path = &provider.attach_path;
        let attach_err = |func: Func, e: &dyn std::fmt::Display| Error::Attach {
            func: func.name(),
            path: provider.path.clone(),
            reason: format!("{e:#}"),
        };
        for p in plan.iter().filter(|p| p.uretprobe) {
            let prog = uprobe(&mut self.ebpf, RETURN_PROGRAM)?;
            let id = prog
                .attach(p.file_offset(), path, scope)
                .map_err(|e| attach_err(p.site.func, &e))?;
            self.links.push(Link::Perf(own(prog, id)?));
        }
        for p in &plan {
            let site = &p.site;
            let name = entry_program(site.func, provider.abi);
            // The cookie tells the program how many pushes ran before the probe point.
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(p.file_offset()),
                cookie: Some(p.cookie()),
            };
            let prog = uprobe(&mut self.ebpf, name)?;
            let id = prog
                .attach(point, path, scope)
                .map_err(|e| attach_err(site.func, &e))?;
            self.links.push(Link::Perf(own(prog, id)?));
        }
        self.record(provider, &plan);
        self.attach_syscalls(provider, family_scope);
        Ok(())
    }

    /// Every loaded program's kernel run-time statistics (see [`crate::bpf::prog_stats`]).
    pub fn program_stats(&self) -> Vec<crate::bpf::prog_stats::ProgStats> {
        use std::os::fd::AsFd as _;
        let aya_progs = self
            .ebpf
            .programs()
            .filter_map(|(name, p)| p.fd().ok().map(|fd| (name, fd.as_fd())));
        let multi = self.multi.iter().flat_map(|m| m.programs());
        crate::bpf::prog_stats::collect(aya_progs.chain(multi))
    }

    pub fn probe_count(&self) -> usize {
        self.attached
            .iter()
            .map(|a| 1 + usize::from(a.uretprobe))
            .sum::<usize>()
            + self
                .syscall_sites
                .iter()
                .flat_map(|(_, sites)| sites)
                .map(|s| 1 + usize::from(s.releases()))
                .sum::<usize>()
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

    /// The entry programs read the attach cookie only in calls mode (and free only with a
    /// call in flight): an allocating function with a return probe must have cookie 0, its
    /// probe past no push and counted at its return, whatever its prologue.
    #[test]
    fn a_function_with_a_return_probe_has_no_cookie() {
        let prologues: [&[u8]; 4] = [
            // push %rbx; test %rdi,%rdi; je +2; push %rbp; ...
            &[0x53, 0x48, 0x85, 0xff, 0x74, 0x02, 0x55, 0x5d, 0x5b, 0xc3],
            // push %rbp; mov %rsp,%rbp; push %rbx
            &[0x55, 0x48, 0x89, 0xe5, 0x53, 0xc3],
            // nop; push %r12; push %rbp
            &[0x90, 0x41, 0x54, 0x55, 0xc3],
            // cmpb $0x0,0x0(%rip); je +0; push %rbp
            &[0x80, 0x3d, 0, 0, 0, 0, 0, 0x74, 0x00, 0x55, 0xc3],
        ];
        for func in Func::ALL.into_iter().filter(|f| *f != Func::Free) {
            for code in prologues {
                let placement = crate::probe::placement::choose(
                    code,
                    func,
                    true,
                    crate::probe::placement::reads(func),
                );
                let planned = Planned {
                    site: crate::targets::elf::FuncSite {
                        func,
                        symbol: func.name().into(),
                        vaddr: 0x1000,
                        file_offset: 0x1000,
                        size: code.len() as u64,
                        aliases: Vec::new(),
                    },
                    uretprobe: true,
                    placement,
                };
                assert_eq!(
                    planned.cookie(),
                    0,
                    "{func:?} {code:x?}: {:?}",
                    planned.placement
                );
                // Without its return probe (calls mode's malloc) the same function has one.
                let at_entry = Planned {
                    uretprobe: false,
                    ..planned
                };
                assert_eq!(at_entry.cookie() & COOKIE_NO_RETURN, COOKIE_NO_RETURN);
            }
        }
        // And free, probed past a push before its NULL check, says how many.
        let code = [0x53, 0x48, 0x85, 0xff, 0x74, 0x02, 0x55, 0x5d, 0x5b, 0xc3];
        let reads = crate::probe::placement::reads(Func::Free);
        let placement = crate::probe::placement::choose(&code, Func::Free, false, reads);
        assert_eq!(placement.pushes, 1);
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
