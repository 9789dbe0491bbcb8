//! What heaptrace may do with its capabilities: load the programs (CAP_BPF + CAP_PERFMON, or
//! CAP_SYS_ADMIN), and look into other users' processes (CAP_SYS_PTRACE: their /proc maps,
//! files and memory). The probes count every process that runs the probed code whatever its
//! owner; without CAP_SYS_PTRACE only processes of heaptrace's own uid can be named, their
//! stacks symbolized and their memory read. Said before anything is attached.
use std::fs;

use crate::error::{Error, Result};

const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The effective capabilities and the uid that count for /proc's access checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Privileges {
    euid: u32,
    effective: u64,
}

impl Privileges {
    /// heaptrace's own, from /proc/self/status; none if it cannot be read.
    pub fn own() -> Privileges {
        let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
        Privileges::parse(&status)
    }

    fn parse(status: &str) -> Privileges {
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name));
        Privileges {
            euid: field("Uid:")
                .and_then(|v| v.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(u32::MAX),
            effective: field("CapEff:")
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .unwrap_or(0),
        }
    }

    fn has(&self, cap: u32) -> bool {
        self.effective & (1 << cap) != 0
    }

    /// Whether the programs can be loaded and attached.
    pub fn can_load(&self) -> bool {
        self.euid == 0 || self.has(CAP_SYS_ADMIN) || (self.has(CAP_BPF) && self.has(CAP_PERFMON))
    }

    /// Whether processes of other users can be looked into.
    pub fn sees_other_users(&self) -> bool {
        self.has(CAP_SYS_PTRACE)
    }

    pub fn euid(&self) -> u32 {
        self.euid
    }

    /// `-p PID`: an error naming what is missing if its /proc entries cannot be read. A process
    /// of the same uid is readable without CAP_SYS_PTRACE (unless it made itself
    /// undumpable).
    pub fn check_pid(&self, pid: u32) -> Result<()> {
        // Both: CAP_PERFMON lets another user's maps be read, not the files it maps (which
        // heaptrace opens through map_files), and "no malloc found" was all that said so.
        let maps = format!("/proc/{pid}/maps");
        let files = format!("/proc/{pid}/map_files");
        let denied = fs::File::open(&maps)
            .err()
            .map(|e| (maps, e))
            .or_else(|| fs::read_dir(&files).err().map(|e| (files, e)));
        let Some((path, e)) = denied else {
            return Ok(());
        };
        if !matches!(e.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)) {
            return Ok(()); // gone, or another problem the next step says better
        }
        let owner = owner_uid(pid);
        let reason = if self.sees_other_users() {
            "it is not readable even with CAP_SYS_PTRACE (a Yama ptrace_scope or LSM policy?)"
                .to_string()
        } else if owner.is_some_and(|u| u != self.euid) {
            format!(
                "it belongs to uid {}, and heaptrace (uid {}) lacks CAP_SYS_PTRACE, which looking \
                 into another user's process needs: run it as root or add CAP_SYS_PTRACE",
                owner.unwrap_or(0),
                self.euid
            )
        } else {
            "the process made itself undumpable (prctl PR_SET_DUMPABLE), which only \
             CAP_SYS_PTRACE overrides"
                .to_string()
        };
        Err(Error::NoAccess {
            pid,
            reason: format!("permission denied reading {path}: {reason}"),
        })
    }

    /// `--all`: what is counted but cannot be looked into, when that is anything.
    pub fn all_warning(&self) -> Option<String> {
        if self.sees_other_users() {
            return None;
        }
        Some(format!(
            "without CAP_SYS_PTRACE, processes of users other than uid {} are counted but not \
             looked into: their frames stay unnamed (file+offset), their mappings and memory \
             unread",
            self.euid
        ))
    }
}

/// The real uid of a process, from /proc/PID/status (readable for any process).
fn owner_uid(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(uid: u32, caps: u64) -> String {
        format!("Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapEff:\t{caps:016x}\n")
    }

    #[test]
    fn capabilities_decide_what_can_be_loaded_and_seen() {
        let root = Privileges::parse(&status(0, 0x1ff_ffff_ffff));
        assert!(root.can_load() && root.sees_other_users());
        assert_eq!(root.all_warning(), None);
        let bpf = Privileges::parse(&status(1000, (1 << CAP_BPF) | (1 << CAP_PERFMON)));
        assert!(bpf.can_load() && !bpf.sees_other_users());
        assert!(bpf.all_warning().unwrap().contains("uid 1000"));
        let only_bpf = Privileges::parse(&status(1000, 1 << CAP_BPF));
        assert!(!only_bpf.can_load());
        let nothing = Privileges::parse("garbage");
        assert!(!nothing.can_load() && nothing.euid() == u32::MAX);
    }

    #[test]
    fn a_readable_process_passes_the_check() {
        Privileges::own().check_pid(std::process::id()).unwrap();
    }
}
