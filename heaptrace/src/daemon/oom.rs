//! OOM kills (the kernel's side: heaptrace-ebpf's oom.rs). The OOM killer sends its victim
//! SIGKILL, then marks it; from then on the victim runs no code of its own, so its blocks in
//! the live map are its heap at the kill. They are taken as its leaks when it is found gone,
//! as any ended process's are, and it is never folded among `[N exited processes]`. With
//! `--oom-dir`, its report is written at once, in the round the kill is heard.
use std::path::PathBuf;

use super::*;
use crate::{output::NewFile, run_info::RunInfo};

/// `--oom-dir`: the directory, and the run described in each report.
pub struct OomReports {
    pub dir: PathBuf,
    pub info: RunInfo,
}

impl Daemon {
    /// Marks the victims reported since the last round, after the round is applied (their
    /// counts are in the Profile) and before the processes gone are forgotten (their blocks
    /// are still in the live map).
    pub(super) fn oom_killed(&mut self) -> Result<()> {
        for pid in std::mem::take(&mut self.oom_pending) {
            self.oom_victims.insert(pid);
            let key = self.incarnations.key(pid);
            // Not traced (another program on the host), or killed before it counted anything.
            let Some(p) = self.profile.procs.get_mut(&key) else {
                continue;
            };
            p.oom_killed = true;
            let comm = p.comm.clone();
            let mut says = format!("pid {pid} ({comm}) was killed by the OOM killer");
            if let Some(r) = &self.oom_reports {
                let heap = self.heap_of(pid, key)?;
                match write_report(r, &self.profile, key, heap) {
                    Ok(path) => says.push_str(&format!("; its report: {}", path.display())),
                    Err(e) => says.push_str(&format!("; its report could not be written: {e}")),
                }
            }
            if !self.quiet && self.live.is_none() {
                crate::say!("heaptrace: {says}");
            }
            self.notice = Some(says);
        }
        Ok(())
    }

    /// A victim's blocks by site: in the live map, or among the ended processes' leaks if it
    /// was forgotten already (found gone in a round before its kill was heard).
    fn heap_of(&self, pid: u32, key: u32) -> Result<BTreeMap<SiteId, Leak>> {
        let live = self.maps.live_blocks(Some(&HashSet::from([pid])))?;
        let live = self
            .incarnations
            .rekey_sites(self.matching(self.same.leaks(live)));
        if !live.is_empty() {
            return Ok(live);
        }
        Ok(self
            .exited_leaks
            .iter()
            .filter(|(id, _)| id.0 == key)
            .map(|(id, l)| (*id, *l))
            .collect())
    }
}

/// Writes the report of process `key` (a JSON document as `--json`'s, of it alone) to
/// `oom-PID-COMM-UNIXTIME.json` in the directory; returns its path.
fn write_report(
    r: &OomReports,
    profile: &Profile,
    key: u32,
    heap: BTreeMap<SiteId, Leak>,
) -> std::io::Result<PathBuf> {
    let mut one = profile.only(key);
    one.set_leaks(heap);
    let comm = profile.procs.get(&key).map_or("", |p| p.comm.as_str());
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let path = r.dir.join(file_name(key, comm, secs));
    let out = NewFile::create(&path, false)?;
    let run = crate::view::json::Run::described(&r.info, None);
    crate::view::json::document(&one, &run).write_pretty(out.file())?;
    out.persist()?;
    Ok(path)
}

/// The report's file name; a command name is the process's own (hostile) bytes: only
/// letters, digits, `.`, `_` and `-` are kept, and never a leading dot.
fn file_name(key: u32, comm: &str, secs: u64) -> String {
    let comm: String = comm
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' | '-' => c,
            _ => '_',
        })
        .collect();
    let comm = comm.trim_start_matches('.');
    format!(
        "oom-{}-{comm}-{secs}.json",
        crate::profile::incarnation::Pid(key)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_named_by_its_process_with_safe_bytes_only() {
        assert_eq!(file_name(42, "leaky", 7), "oom-42-leaky-7.json");
        assert_eq!(file_name(42, "../x/y", 7), "oom-42-_x_y-7.json");
        assert_eq!(file_name(42, "a b\n", 7), "oom-42-a_b_-7.json");
    }
}
