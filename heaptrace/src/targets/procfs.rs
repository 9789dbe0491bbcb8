//! What heaptrace reads about processes from /proc.
use std::{
    fs, io,
    os::fd::{FromRawFd as _, OwnedFd},
};

/// The state letter from /proc/PID/stat (R, S, D, Z, X, ...), None if the process is gone.
pub fn state(pid: u32) -> Option<char> {
    state_in(&format!("/proc/{pid}/stat"))
}

/// The state letter of a stat file (a process's or a thread's).
fn state_in(stat_path: &str) -> Option<char> {
    let stat = fs::read_to_string(stat_path).ok()?;
    // comm may contain spaces and parentheses: the state follows the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.trim_start().chars().next()
}

/// A process counts as alive until it is a zombie (kill(pid, 0) succeeds on zombies). Its
/// leader alone being one is not enough: a main that called pthread_exit leaves a zombie
/// leader while the other threads run on (counted in its status's `Threads:`, the leader
/// with them until they are gone).
/// Whether processes `a` and `b` share one address space (a vfork child and its parent):
/// `kcmp(KCMP_VM)`; None where the kernel cannot say (no kcmp, either gone).
pub fn same_memory(a: u32, b: u32) -> Option<bool> {
    const KCMP_VM: libc::c_long = 1;
    // SAFETY: no pointers; kcmp only compares the two processes' mm.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            a as libc::pid_t,
            b as libc::pid_t,
            KCMP_VM,
            0,
            0,
        )
    };
    (r >= 0).then_some(r == 0)
}

pub fn alive(pid: u32) -> bool {
    match state(pid) {
        Some('Z') => fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| status_field(&s, "Threads:") > 1),
        Some(s) => s != 'X',
        None => false,
    }
}

/// The directory of a thread of `pid` that still runs, when its leader has exited: the
/// leader's maps, memory figures and links are empty then, a running thread's are whole.
fn running_thread(pid: u32) -> Option<String> {
    let leader = pid.to_string();
    fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|tid| *tid != leader)
        .map(|tid| format!("/proc/{pid}/task/{tid}"))
        .find(|dir| matches!(state_in(&format!("{dir}/stat")), Some(s) if s != 'Z' && s != 'X'))
}

/// Where to read the files of a process's address space (maps, memory figures, exe, root):
/// /proc/PID, or a running thread's directory when the leader has exited before it.
pub fn space_dir(pid: u32) -> String {
    match state(pid) {
        Some('Z') => running_thread(pid).unwrap_or_else(|| format!("/proc/{pid}")),
        _ => format!("/proc/{pid}"),
    }
}

/// /proc/PID/maps; a running thread's when the leader has exited (its own is empty then).
pub fn maps(pid: u32) -> io::Result<String> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    if !maps.is_empty() {
        return Ok(maps);
    }
    match running_thread(pid) {
        Some(dir) => fs::read_to_string(format!("{dir}/maps")),
        None => Ok(maps),
    }
}

/// The parent pid in a stat file's text; None for a malformed one.
fn ppid_in(stat: &str) -> Option<u32> {
    // After the comm's last ')': state, then ppid.
    stat[stat.rfind(')')? + 1..]
        .split_ascii_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Every process descended from `root` now (children, their children, ...), from each
/// process's parent in /proc/PID/stat.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            Some((pid, ppid_in(&stat)?))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

/// Whether thread `tid` of process `tgid` still runs.
pub fn thread_alive(tgid: u32, tid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{tgid}/task/{tid}")).exists()
}

/// The process's cgroup, e.g. a container's: see [`cgroup_path`].
pub fn cgroup(pid: u32) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroup_path(&text)
}

/// A cgroup path from /proc/PID/cgroup's text: the unified hierarchy's ("0::/path"), unless
/// that is the root and the v1 memory controller's line (`N:memory:/path`, maybe among other
/// controllers, `N:cpu,memory:/path`) has a path of its own: a hybrid host (systemd's, Docker on
/// cgroup v1) places processes by their v1 hierarchies, and its unified one says `/` for all.
/// On a v1-only host (no "0::" line) the memory controller's path, else `/`.
pub fn cgroup_path(text: &str) -> Option<String> {
    let mut v2 = None;
    let mut memory = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            memory = Some(path);
        }
    }
    let path = match (v2, memory) {
        (Some("/") | None, Some(m)) if m != "/" => m,
        (Some(v2), _) => v2,
        (None, Some(m)) => m,
        (None, None) => return None,
    };
    Some(path.to_string())
}

pub fn comm(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Memory figures of a process, in KiB, from /proc/PID/status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mem {
    pub rss_kb: u64,
    pub virt_kb: u64,
}

pub fn mem(pid: u32) -> Option<Mem> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    if status.contains("VmSize:") {
        return Some(parse_status(&status));
    }
    // A leader that exited has no memory lines; its running threads have the process's.
    let status = fs::read_to_string(format!("{}/status", running_thread(pid)?)).ok()?;
    Some(parse_status(&status))
}

/// heaptrace's own resident memory in KiB: now, and the highest it has been (VmHWM).
pub fn own_rss_kb() -> Option<(u64, u64)> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    Some((
        status_field(&status, "VmRSS:"),
        status_field(&status, "VmHWM:"),
    ))
}

/// The process that ptraces `pid` (its status's `TracerPid`, 0: none); None if it is gone.
pub fn tracer(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(status_field(&status, "TracerPid:") as u32)
}

pub(crate) fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn parse_status(status: &str) -> Mem {
    let field = |name: &str| status_field(status, name);
    Mem {
        rss_kb: field("VmRSS:"),
        virt_kb: field("VmSize:"),
    }
}

/// The process's brk heap: ([heap] start, end) from /proc/PID/maps; before the heap exists,
/// (start_brk, start_brk) from /proc/PID/stat. The end is the current break.
pub fn heap(pid: u32) -> Option<(u64, u64)> {
    use std::io::BufRead as _;
    // Read line by line, not whole: this runs every round for every traced process, the heap
    // comes right after the executable's mappings, and the kernel makes the file as it is read.
    let mut dir = format!("/proc/{pid}");
    let mut maps = io::BufReader::new(fs::File::open(format!("{dir}/maps")).ok()?).lines();
    let first = maps.next().and_then(Result::ok);
    if first.is_none() {
        // Empty: the leader has exited (its break reads 0 too); a running thread's then.
        dir = running_thread(pid)?;
        maps = io::BufReader::new(fs::File::open(format!("{dir}/maps")).ok()?).lines();
    }
    let mut lines = first.into_iter().chain(maps.map_while(Result::ok));
    if let Some(line) = lines.find(|l| l.ends_with("[heap]")) {
        return parse_range(&line);
    }
    let stat = fs::read_to_string(format!("{dir}/stat")).ok()?;
    let start_brk = start_brk(&stat)?;
    Some((start_brk, start_brk))
}

fn parse_range(line: &str) -> Option<(u64, u64)> {
    let (a, b) = line.split_whitespace().next()?.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

/// Field 47 of /proc/PID/stat (start_brk); the fields after comm count from its ')'.
fn start_brk(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(47 - 3)?.parse().ok()
}

/// CPU time this process has used so far (user + system, all threads), in seconds.
pub fn self_cpu_seconds() -> Option<f64> {
    let stat = fs::read_to_string("/proc/self/stat").ok()?;
    let ticks = cpu_ticks(&stat)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// utime + stime (fields 14 and 15 of /proc/PID/stat), in clock ticks.
fn cpu_ticks(stat: &str) -> Option<u64> {
    // Fields after the command name: state is field 3, so utime is the 12th after ')'.
    let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace().skip(11);
    let utime: u64 = rest.next()?.parse().ok()?;
    let stime: u64 = rest.next()?.parse().ok()?;
    Some(utime + stime)
}

/// A pidfd: becomes readable when the process exits, for any process (not only children).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned fd is owned by us.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_is_the_unified_path_or_else_the_v1_memory_one() {
        // Unified only (cgroup v2 host).
        assert_eq!(
            cgroup_path("0::/system.slice/nginx.service\n").as_deref(),
            Some("/system.slice/nginx.service")
        );
        // Hybrid, placed by v1: the unified line says "/".
        let hybrid = "9:name=systemd:/\n4:memory:/process_api/cf1d\n1:cpu:/\n0::/\n";
        assert_eq!(cgroup_path(hybrid).as_deref(), Some("/process_api/cf1d"));
        // Hybrid, placed in both: the unified path wins.
        let both = "4:memory:/docker/abc\n0::/system.slice/docker-abc.scope\n";
        assert_eq!(
            cgroup_path(both).as_deref(),
            Some("/system.slice/docker-abc.scope")
        );
        // v1 only, memory among other controllers on one hierarchy.
        let v1 = "5:cpu,cpuacct:/x\n3:blkio,memory:/docker/abc\n2:name=systemd:/docker/abc\n";
        assert_eq!(cgroup_path(v1).as_deref(), Some("/docker/abc"));
        // In no memory cgroup of its own.
        assert_eq!(cgroup_path("4:memory:/\n0::/\n").as_deref(), Some("/"));
        assert_eq!(cgroup_path("3:cpu:/x\n").as_deref(), None);
        // Hostile: a path with colons is whole; lines without fields are skipped.
        assert_eq!(cgroup_path("0::/a:b\ngarbage\n").as_deref(), Some("/a:b"));
        assert_eq!(cgroup_path(""), None);
    }

    #[test]
    fn the_parent_follows_the_last_parenthesis() {
        assert_eq!(ppid_in("42 (a) b) S 7 42 42 0"), Some(7));
        assert_eq!(ppid_in("42 (x) R 1 0"), Some(1));
        assert_eq!(ppid_in("42 (x"), None);
        assert_eq!(ppid_in("42 (x) S"), None);
    }

    #[test]
    fn this_test_is_among_its_parents_descendants() {
        let me = std::process::id();
        let parent = ppid_in(&fs::read_to_string("/proc/self/stat").unwrap()).unwrap();
        assert!(descendants(parent).contains(&me));
        assert!(!descendants(me).contains(&me));
    }

    #[test]
    fn the_heap_starts_at_start_brk() {
        // This test binary has a heap (Rust's allocator is glibc's malloc).
        let _keep = vec![0u8; 1000];
        let me = std::process::id();
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps
            .lines()
            .find(|l| l.ends_with("[heap]"))
            .expect("a heap");
        let (start, end) = parse_range(line).unwrap();
        let stat = fs::read_to_string("/proc/self/stat").unwrap();
        assert_eq!(start_brk(&stat), Some(start));
        let (s, e) = heap(me).unwrap();
        assert_eq!(s, start);
        assert!(e >= end);
    }

    #[test]
    fn parses_status_fields() {
        let s = "Name:\tx\nVmSize:\t  739156 kB\nVmRSS:\t     508 kB\nThreads:\t11\n";
        assert_eq!(
            parse_status(s),
            Mem {
                rss_kb: 508,
                virt_kb: 739156
            }
        );
    }

    #[test]
    fn reads_cpu_ticks_after_the_command_name() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 17 5 0 0 20 0 1 0 9 1 2";
        assert_eq!(cpu_ticks(stat), Some(22));
        assert!(self_cpu_seconds().is_some());
    }

    #[test]
    fn own_process_is_alive_and_has_memory() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(mem(me).unwrap().rss_kb > 0);
        let (rss, peak) = own_rss_kb().unwrap();
        assert!(rss > 0 && peak >= rss, "{rss} {peak}");
    }
}
