//! `--all --comm X` and `--all --cgroup X` in the kernel (see `heaptrace_common::filter`): a
//! thread of a process left out stops at its in-flight record, before any clock, stack walk or
//! map it would have used.
use aya_ebpf::{
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_task, bpf_get_prandom_u32, bpf_probe_read_kernel,
    },
    macros::map,
    maps::HashMap,
};
use heaptrace_common::{
    InFlight, Loss,
    filter::{self, EXCLUDED, EXCLUDED_CGROUP, Pattern, TRACED, UNKNOWN},
};

use crate::{
    inflight,
    maps::{INFLIGHT, lose},
};

/// See `heaptrace_common::globals::COMM_FILTER`.
#[unsafe(no_mangle)]
static COMM_FILTER: [u64; 2] = [0; 2];
#[unsafe(no_mangle)]
static COMM_FILTER_MASK: [u64; 2] = [0; 2];

/// See `heaptrace_common::globals::TASK_GROUP_LEADER`.
#[unsafe(no_mangle)]
static TASK_GROUP_LEADER: u32 = 0;
#[unsafe(no_mangle)]
static TASK_COMM: u32 = 0;

/// See `heaptrace_common::globals::CGROUP_FILTER`.
#[unsafe(no_mangle)]
static CGROUP_FILTER: u32 = 0;

/// Cgroup id -> `TRACED` or `EXCLUDED_CGROUP`, written by user space (only it knows the
/// paths). A host has a few hundred cgroups; one missing here leaves its threads traced.
#[map]
pub static CGROUP_VERDICTS: HashMap<u64, u32> = HashMap::with_max_entries(16384, 0);

#[inline(always)]
fn pattern() -> Pattern {
    // SAFETY: plain reads of globals the loader wrote before load.
    unsafe {
        Pattern {
            bytes: core::ptr::read_volatile(&COMM_FILTER),
            mask: core::ptr::read_volatile(&COMM_FILTER_MASK),
        }
    }
}

#[inline(always)]
fn by_name() -> bool {
    // SAFETY: a plain read of a global the loader wrote before load.
    unsafe { core::ptr::read_volatile(&COMM_FILTER_MASK[0]) != 0 }
}

#[inline(always)]
fn by_cgroup() -> bool {
    // SAFETY: as above.
    unsafe { core::ptr::read_volatile(&CGROUP_FILTER) != 0 }
}

/// Whether the calling thread's process is left out (`id`: its pid_tgid). Judged at the
/// thread's first call and kept in its record; a thread with no record gets one here, so a
/// thread that only frees is judged once too.
#[inline(always)]
pub fn excluded(id: u64) -> bool {
    if crate::forks::following() {
        return crate::forks::excluded(id);
    }
    if !by_name() && !by_cgroup() {
        return false;
    }
    let f = inflight::get(id);
    let (known, was_in) = f.as_ref().map_or((UNKNOWN, 0), |f| (f.verdict, f.cgroup));
    // A helper call (~20 ns) where the verdict depends on the cgroup: the thread may have been
    // moved since (a process moved into the cgroup traced must be seen from then on).
    let cgroup = if known == EXCLUDED_CGROUP || (known == UNKNOWN && by_cgroup()) {
        // SAFETY: no preconditions.
        unsafe { bpf_get_current_cgroup_id() }
    } else {
        0
    };
    match known {
        TRACED => return false,
        EXCLUDED => return true,
        EXCLUDED_CGROUP if cgroup == was_in => return true,
        _ => {}
    }
    let mut verdict = if by_name() { judge_name() } else { TRACED };
    if verdict == TRACED && by_cgroup() {
        // SAFETY: the value is copied out at once.
        verdict = unsafe { CGROUP_VERDICTS.get(&cgroup) }
            .copied()
            .unwrap_or(UNKNOWN);
    }
    keep_verdict(id, f, verdict, cgroup);
    verdict == EXCLUDED || verdict == EXCLUDED_CGROUP
}

/// Keeps a thread's verdict in its record, making one for a thread that has none.
#[inline(always)]
pub fn keep_verdict(id: u64, f: Option<&mut InFlight>, verdict: u32, cgroup: u64) {
    match f {
        Some(f) => {
            f.verdict = verdict;
            f.cgroup = cgroup;
        }
        None => {
            let rec = InFlight {
                verdict,
                cgroup,
                // A thread's count starts anywhere (see `enter`).
                // SAFETY: no preconditions.
                seq: unsafe { bpf_get_prandom_u32() },
                ..InFlight::NONE
            };
            if !inflight::claim(id, &rec) && INFLIGHT.insert(id, rec, 0).is_err() {
                lose(Loss::InFlight);
            }
        }
    }
}

/// An exec gives the process a new name (and often comes right after a move to another
/// cgroup): its thread (the only one left, and its leader now) is judged again at its next
/// call.
#[inline(always)]
pub fn exec(id: u64) {
    if (by_name() || by_cgroup())
        && let Some(f) = inflight::get(id)
    {
        f.verdict = UNKNOWN;
    }
}

/// The verdict on the calling thread's process by its group leader's name. Where the kernel
/// will not give the name, the process is traced: user space judges every process it is shown
/// again, so a doubt costs room in the maps, never a process's figures.
#[inline(never)]
fn judge_name() -> u32 {
    // SAFETY: no preconditions.
    let task = unsafe { bpf_get_current_task() };
    // SAFETY: plain reads of globals the loader wrote before load.
    let (leader_at, comm_at) = unsafe {
        (
            core::ptr::read_volatile(&TASK_GROUP_LEADER),
            core::ptr::read_volatile(&TASK_COMM),
        )
    };
    // SAFETY: bpf_probe_read_kernel checks the addresses.
    let Ok(leader) =
        (unsafe { bpf_probe_read_kernel((task + u64::from(leader_at)) as *const u64) })
    else {
        return TRACED;
    };
    // SAFETY: as above.
    let Ok(comm) =
        (unsafe { bpf_probe_read_kernel((leader + u64::from(comm_at)) as *const [u64; 2]) })
    else {
        return TRACED;
    };
    if filter::comm_contains(comm, &pattern()) {
        TRACED
    } else {
        EXCLUDED
    }
}
