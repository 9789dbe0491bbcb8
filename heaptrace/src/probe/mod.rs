//! Loading the eBPF programs and attaching them to a provider's malloc family.
//!
//! Drop detaches everything: every exit path (return, error, panic unwinding) that drops the
//! `Probes` removes the uprobes, and the kernel removes them when the process dies anyway.
//!
//! The programs count only while the COUNTING switch is on (`Probes::enable`, `Probes::detach`):
//! links go on one after the other, and a program that counted before the others were in place
//! (or after the first was removed) would count allocations whose frees it cannot see.
//!
//! Detaching is the slow part. Closing a perf-event uprobe waits for grace periods under a
//! kernel-wide mutex: about 0.1 s per probe here, one after the other. So the probes go on as
//! uprobe_multi links (`bpf::uprobe_multi`) where the kernel has them: one per program, each unregistered
//! behind one grace period. `Probes` owns its links and closes them from one thread each, so
//! those waits overlap too. Perf-event uprobes remain the fallback.
pub mod cgroup_filter;
pub mod follow;
pub mod held;
mod load;
pub mod placement;
mod plan;
mod programs;
mod py_hold;
pub mod sampling;
mod signals;
pub mod syscall_sites;

pub use load::{
    LoadOptions, Loaded, SlotRows, default_site_map_size, live_slots, load, preflight, slot_rows,
    stack_maps,
};
pub use plan::{Planned, plan, releasing_first};
pub use programs::program;
use programs::{thread_exits, uprobe};
use std::{num::NonZeroU32, path::PathBuf, sync::OnceLock};

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
    targets::target_file::TargetFile,
};

/// Which processes the probes fire for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// One process and all its threads, present and future (uprobe filters match the mm).
    Process(u32),
    /// Every process that maps the provider's file.
    All,
    /// A process and every process it forks, present and future, without uprobe_multi
    /// links: the probes fire in every process, and the kernel counts the followed ones
    /// (`follow`).
    Tree(u32),
    /// A process and every process it forks, each held at its fork by heaptrace's tracer (a
    /// launched command's, or the seized tree's under `-p --follow-forks`) and given links
    /// bound to it (`held`): no other process traps. The kernel counts the followed ones as
    /// for `Tree`.
    Held(u32),
}

impl Scope {
    /// The process the probes' links are bound to; 0: none (every process).
    pub fn probe_pid(self) -> u32 {
        match self {
            Scope::Process(pid) | Scope::Held(pid) => pid,
            Scope::All | Scope::Tree(_) => 0,
        }
    }

    /// The process traced first: one's, a tree's root; None for all.
    pub fn root(self) -> Option<u32> {
        match self {
            Scope::Process(pid) | Scope::Tree(pid) | Scope::Held(pid) => Some(pid),
            Scope::All => None,
        }
    }
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
    pub preempt_off: bool,
    pub attached: Vec<Attached>,
    /// Every uprobe link, owned here (not by its program) so that Drop can close them at once.
    links: Vec<Link>,
    /// The programs loaded again for uprobe_multi links; None where the kernel refused them.
    multi: Option<std::sync::Arc<MultiPrograms>>,
    /// A launched command's forks: the links made, remade for each fork followed.
    pub forks: std::sync::Arc<held::HeldForks>,
    /// Calls mode: see [`plan`].
    calls: bool,
    /// Probe the memory syscalls' wrappers of each allocator file that has them.
    reservations: bool,
    /// The memory syscalls' wrappers probed, by file (see `syscall_sites::find`).
    pub syscall_sites: Vec<(PathBuf, Vec<crate::probe::syscall_sites::SyscallSite>)>,
    /// The programs' switch (`heaptrace_common::maps::COUNTING`), off until `enable`.
    counting: aya::maps::Array<aya::maps::MapData, u32>,
    /// How the OOM victims are read (`heaptrace_common::globals::OOM_VICTIM`), or why they
    /// cannot be.
    pub oom_victim: std::result::Result<u32, String>,
    /// The links on the `Py_FinalizeEx` of each process and file (`py_hold.rs`).
    python_holds: std::collections::HashMap<(u32, crate::targets::target_file::FileId), Link>,
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.detach();
    }
}

pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/heaptrace"));

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

/// The memory syscalls' wrappers of one file, probed.
struct WrapperLinks {
    links: Vec<Link>,
    sites: Vec<crate::probe::syscall_sites::SyscallSite>,
}

fn uprobe_scope(scope: Scope) -> Result<UProbeScope> {
    Ok(match scope.probe_pid() {
        0 => UProbeScope::AllProcesses,
        pid => UProbeScope::OneProcess(NonZeroU32::new(pid).ok_or(Error::NoSuchProcess(0))?),
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

    /// Turns counting on. Call once the probes of the start are all in place (the target's
    /// allocator, the files of the processes already running under `--all`), before a
    /// launched command runs: what any of them counts from then on has its release probed.
    pub fn enable(&mut self) -> Result<()> {
        self.switch(true)
    }

    fn switch(&mut self, on: bool) -> Result<()> {
        self.counting
            .set(0, u32::from(on), 0)
            .map_err(|e| Error::Map {
                map: maps::COUNTING,
                reason: e.to_string(),
            })
    }

    /// Ends tracing, in the one order that keeps the figures consistent: counting off first,
    /// so that no program counts once any link is gone (a block counted before is live at the
    /// end, in the live figures and among the leaks alike); then every link closed. Closing a
    /// link waits for the programs running through it, so once this returns nothing changes
    /// the maps and the final round reads a settled state. Safe to call again; Drop calls it.
    pub fn detach(&mut self) {
        if let Err(e) = self.switch(false) {
            // Closing the links still ends tracing; only the last instants may be inconsistent.
            crate::say!("heaptrace: warning: counting not stopped before detaching ({e})");
        }
        let mut all = std::mem::take(&mut self.links);
        all.append(&mut self.forks.take_links());
        all.extend(self.python_holds.drain().map(|(_, l)| l));
        links::detach_all(all);
    }

    /// Whether the probes are uprobe_multi links, which a fork can have bound to it alone.
    pub fn multi_links(&self) -> bool {
        self.multi.is_some()
    }

    pub fn counting(&self) -> Counting {
        match self.preempt_off {
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
            preempt_off,
            oom_victim,
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
        signals::attach(&mut ebpf);
        let multi = if multi {
            MultiPrograms::load(object, &ebpf, &names)
                .inspect_err(|e| log::debug!("no uprobe_multi links, perf-event uprobes: {e}"))
                .ok()
                .map(std::sync::Arc::new)
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
        // After the uprobe_multi copies are pointed at the maps: taking it closes no fd.
        let counting = ebpf
            .take_map(maps::COUNTING)
            .ok_or_else(|| Error::Load(format!("map {} missing", maps::COUNTING)))?
            .try_into()
            .map_err(|e| Error::Map {
                map: maps::COUNTING,
                reason: format!("{e}"),
            })?;
        Ok(Probes {
            forks: std::sync::Arc::new(held::HeldForks::new(multi.clone())),
            counting,
            ebpf,
            preempt_off,
            attached: Vec::new(),
            links: Vec::new(),
            multi,
            calls,
            reservations,
            syscall_sites: Vec::new(),
            oom_victim,
            python_holds: Default::default(),
        })
    }

    /// Whether memory syscalls are seen at their wrappers; otherwise the syscall tracepoints
    /// must see them (`reserve::ring`).
    pub fn syscalls_probed(&self) -> bool {
        !self.syscall_sites.is_empty()
    }

    /// Probes the memory syscalls' wrappers in `provider`'s file, when it has them all.
    fn attach_syscalls(&mut self, provider: &Provider, scope: Scope) {
        self.attach_syscalls_in(&provider.file, scope)
    }

    /// Probes the memory syscalls' wrappers in `file`, when it has them all and reservations
    /// are traced. All or nothing: what cannot be probed is a warning, and the syscall
    /// tracepoints trace the memory syscalls unless other wrappers were probed
    /// (`reserve::ring`).
    pub fn attach_syscalls_in(&mut self, file: &std::sync::Arc<TargetFile>, scope: Scope) {
        if !self.reservations {
            return;
        }
        match self.syscall_links(file, scope) {
            Ok(Some(mut w)) => {
                self.links.append(&mut w.links);
                self.syscall_sites
                    .push((file.shown().to_path_buf(), w.sites));
            }
            Ok(None) => {}
            Err(e) => crate::say!(
                "heaptrace: warning: memory syscalls not probed in {} ({e})",
                file.shown().display()
            ),
        }
    }

    /// The wrapper probes' links, attached, and how many probes they hold (None: no wrappers to
    /// probe). On an error the links made so far are closed (detached) on return.
    fn syscall_links(
        &mut self,
        file: &std::sync::Arc<TargetFile>,
        scope: Scope,
    ) -> Result<Option<WrapperLinks>> {
        let Some(sites) = crate::probe::syscall_sites::find(file)? else {
            return Ok(None);
        };
        // The file read, not whatever its path leads to now.
        let path = &file.attach_path();
        // After each syscall; and at the entry of those that release a range (see mem::BEGIN).
        let mut offsets: Vec<u64> = sites.iter().map(|s| s.probe_offset()).collect();
        let mut cookies: Vec<u64> = sites.iter().map(|s| u64::from(s.nr)).collect();
        for s in sites.iter().filter(|s| s.releases()) {
            offsets.push(s.file_offset);
            cookies.push(u64::from(s.nr) | heaptrace_common::mem::COOKIE_BEGIN);
        }
        self.forks.record(held::Spec {
            prog: SYSCALL_PROGRAM,
            file: file.clone(),
            offsets: offsets.clone(),
            cookies: cookies.clone(),
            ret: false,
        });
        if let Some(multi) = &self.multi {
            let pid = scope.probe_pid();
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

    /// The links for `plan`: one for every return probe, then one per entry program,
    /// releasing functions first (`releasing_first`).
    fn specs(plan: &[Planned], provider: &Provider) -> Vec<held::Spec> {
        let spec = |prog, offsets: Vec<u64>, cookies, ret| held::Spec {
            prog,
            file: provider.file.clone(),
            offsets,
            cookies,
            ret,
        };
        let returns: Vec<u64> = plan
            .iter()
            .filter(|p| p.uretprobe)
            .map(Planned::file_offset)
            .collect();
        let mut specs = Vec::new();
        if !returns.is_empty() {
            let cookies = vec![0; returns.len()];
            specs.push(spec(RETURN_PROGRAM, returns, cookies, true));
        }
        for p in releasing_first(plan) {
            let name = entry_program(p.site.func, provider.abi);
            specs.push(spec(name, vec![p.file_offset()], vec![p.cookie()], false));
        }
        specs
    }

    /// One uprobe_multi link per spec. All or nothing: on an error, the links made so far
    /// are closed (detached) on return.
    fn attach_multi(
        multi: &MultiPrograms,
        specs: &[held::Spec],
        pid: u32,
    ) -> std::result::Result<Vec<Link>, crate::bpf::uprobe_multi::MultiError> {
        let mut links = Vec::new();
        for s in specs {
            let path = s.file.attach_path();
            let fd = multi.attach(s.prog, &path, &s.offsets, &s.cookies, s.ret, pid)?;
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
    /// record that is never completed. Then the entries, releasing functions first: a file
    /// attached while counting is on (`enable`) counts from its first link.
    pub fn attach(&mut self, provider: &Provider, scope: Scope, at_entry: bool) -> Result<()> {
        let plan = plan(provider, at_entry, self.calls)?;
        let specs = Self::specs(&plan, provider);
        if let Some(multi) = &self.multi {
            let pid = scope.probe_pid();
            match Self::attach_multi(multi, &specs, pid) {
                Ok(mut links) => {
                    self.links.append(&mut links);
                    specs.into_iter().for_each(|s| self.forks.record(s));
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
        let path = &provider.file.attach_path();
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
        for p in releasing_first(&plan) {
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
        specs.into_iter().for_each(|s| self.forks.record(s));
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
