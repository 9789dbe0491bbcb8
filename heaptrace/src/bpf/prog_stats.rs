//! What heaptrace's own programs cost inside the kernel (`--probe-stats`): each program's runs
//! and its mean run time, from the kernel's BPF run-time statistics (what bpftop shows), and the
//! instructions the verifier went through to load it (most of heaptrace's start-up time).
//!
//! A wall-clock comparison of whole runs varies by 10-20 % between runs on a shared machine;
//! these figures separate the programs' work from the traps around them, which they do not
//! include. The kernel only counts while some process holds a stats fd, and counting adds two
//! clock reads to every run, so it is on only when asked for.
use std::os::fd::{AsRawFd as _, BorrowedFd, OwnedFd};

use aya_obj::generated::{bpf_attr, bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, bpf_prog_info};
use serde::Serialize;

use crate::bpf::sys::bpf;

/// One program's totals; programs loaded twice (aya's copy and the uprobe_multi one) are summed
/// by name, since only one copy runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProgStats {
    pub name: String,
    pub runs: u64,
    pub run_ns: u64,
    /// Runs the kernel skipped because the program was already running on the CPU.
    pub recursion_misses: u64,
    /// Instructions the verifier processed to load the program (the larger copy's).
    pub verified_insns: u32,
}

impl ProgStats {
    pub fn mean_ns(&self) -> Option<f64> {
        (self.runs > 0).then(|| self.run_ns as f64 / self.runs as f64)
    }
}

/// Turns the kernel's run-time statistics on until the returned fd is closed.
pub fn enable() -> std::io::Result<OwnedFd> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// The statistics of one loaded program.
fn read(fd: BorrowedFd<'_>) -> std::io::Result<bpf_prog_info> {
    // SAFETY: bpf_prog_info is plain data; zeroes are its unset values.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    // SAFETY: bpf_attr is plain data as well.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = std::mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = (&raw mut info) as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD as u32, &mut attr)?;
    Ok(info)
}

/// Sums `(name, fd)` pairs by name, sorted by name, leaving out programs that never ran.
pub fn collect<'a>(progs: impl IntoIterator<Item = (&'a str, BorrowedFd<'a>)>) -> Vec<ProgStats> {
    let mut out: Vec<ProgStats> = Vec::new();
    for (name, fd) in progs {
        let Ok(info) = read(fd) else {
            continue;
        };
        match out.iter_mut().find(|s| s.name == name) {
            Some(s) => {
                s.runs += info.run_cnt;
                s.run_ns += info.run_time_ns;
                s.recursion_misses += info.recursion_misses;
                s.verified_insns = s.verified_insns.max(info.verified_insns);
            }
            None => out.push(ProgStats {
                name: name.to_string(),
                runs: info.run_cnt,
                run_ns: info.run_time_ns,
                recursion_misses: info.recursion_misses,
                verified_insns: info.verified_insns,
            }),
        }
    }
    out.retain(|s| s.runs > 0 || s.recursion_misses > 0);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The text section of the summary.
pub fn text(stats: &[ProgStats]) -> String {
    let mut s = String::from(
        "probe programs (kernel run time, traps not included; the tracepoints run for every \
         process on the host; instructions the verifier went through to load each):\n",
    );
    if stats.is_empty() {
        s.push_str("  none ran\n");
    }
    for p in stats {
        s.push_str(&format!(
            "  {:<22} {:>12} runs {:>8} ns each {:>8} verified",
            p.name,
            p.runs,
            p.mean_ns().map_or("-".to_string(), |n| format!("{n:.1}")),
            p.verified_insns
        ));
        if p.recursion_misses > 0 {
            s.push_str(&format!(", {} skipped (recursion)", p.recursion_misses));
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lists_runs_and_means_and_says_when_none_ran() {
        let stats = [
            ProgStats {
                name: "malloc_entry".into(),
                runs: 1_000_042,
                run_ns: 64_002_688,
                recursion_misses: 0,
                verified_insns: 231,
            },
            ProgStats {
                name: "mem_sys_enter".into(),
                runs: 10,
                run_ns: 400,
                recursion_misses: 3,
                verified_insns: 362,
            },
        ];
        let t = text(&stats);
        assert!(t.contains("  malloc_entry"), "{t}");
        assert!(
            t.contains(" 1000042 runs     64.0 ns each      231 verified\n"),
            "{t}"
        );
        assert!(
            t.contains("40.0 ns each      362 verified, 3 skipped (recursion)\n"),
            "{t}"
        );
        assert!(text(&[]).ends_with("  none ran\n"));
        assert_eq!(ProgStats::default().mean_ns(), None);
    }
}
