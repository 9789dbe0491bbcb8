//! Bad input gets one clear line and a non-zero exit; every exit path leaves no probe behind.
use std::{
    io::{Read as _, Seek as _, SeekFrom},
    os::unix::process::CommandExt as _,
    process::Command,
};

use crate::support::*;

#[test]
fn no_target_is_a_usage_error() {
    // Bare: the short usage and the examples, exit 2 as clap's usage errors.
    let out = heaptrace().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("Usage: heaptrace") && stderr.contains("Examples:"),
        "{stderr}"
    );
    let out = heaptrace().arg("--no-tui").output().unwrap();
    assert!(error_line(&out).contains("give a target"), "{out:?}");
    // A command where a target was expected: the line that traces it.
    let out = heaptrace().args(["ls", "-l"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        error_line(&out).contains("did you mean `heaptrace -- ls -l`?"),
        "{out:?}"
    );
}

#[test]
fn not_root_is_refused_with_a_clear_line() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let out = heaptrace().args(["--", "true"]).output().unwrap();
        assert!(error_line(&out).contains("must run as root"));
        return;
    }
    let mut cmd = heaptrace();
    cmd.args(["--", "true"]);
    // SAFETY: setuid between fork and exec; drops root for the child only.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    assert!(error_line(&out).contains("must run as root"), "{out:?}");
}

/// `setpriv` prefix: heaptrace as uid 65534 with CAP_BPF and CAP_PERFMON only.
fn with_bpf_caps_only(cmd: &mut Command) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=+bpf,+perfmon",
        "--ambient-caps=+bpf,+perfmon",
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            c.env(k, v);
        }
    }
    c
}

bpf_test!(
    exclusive,
    /// With CAP_BPF + CAP_PERFMON but not CAP_SYS_PTRACE: `-p` of another user's process is
    /// refused in one line naming the owner and the capability, before anything is attached; a
    /// process of its own uid is traced exactly; `--all` says what it counts without seeing.
    fn with_bpf_capabilities_only_heaptrace_says_what_it_cannot_trace() {
        let out = with_bpf_caps_only(heaptrace().args(["--no-tui", "-p", "1"]))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let line = error_line(&out);
        assert!(
            line.contains("cannot look into process 1: permission denied")
                && line.contains("it belongs to uid 0")
                && line.contains("lacks CAP_SYS_PTRACE"),
            "{line}"
        );
        assert!(!String::from_utf8_lossy(&out.stderr).contains("attached"));

        // A process of its own uid (the fixture, as uid 65534, in a directory it may write).
        let dir = std::env::temp_dir().join(format!("heaptrace-caps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let ready = dir.join("ready");
        let json = dir.join("run.json");
        let mut target = Command::new("setpriv");
        target
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(fixture("signals", "", &[]))
            .arg("handle")
            .arg(&ready);
        let mut target = spawn_with_libc(&mut target);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let pid = loop {
            if let Some(p) = std::fs::read_to_string(&ready)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
            {
                break p;
            }
            assert!(std::time::Instant::now() < deadline, "fixture not ready");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut cmd = with_bpf_caps_only(
            heaptrace()
                .args(["--no-tui", "-q", "--mode", "counts", "-p", &pid.to_string()])
                .arg("--json")
                .arg(&json),
        );
        let tracer = start_attached(&mut cmd);
        // SAFETY: signalling our own child; it frees its ten blocks and makes one of 777.
        unsafe { libc::kill(target.id() as i32, libc::SIGTERM) };
        target.wait().unwrap();
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        let doc = read_json(&json);
        assert_eq!(doc["functions"]["malloc"]["calls"], 1, "{stderr}");
        assert_eq!(doc["functions"]["malloc"]["bytes"], 777);
        assert_eq!(doc["functions"]["free"]["calls"], 11);
        assert_eq!(doc["functions"]["free"]["untracked"], 10);
        let _ = std::fs::remove_dir_all(&dir);

        let mut all = with_bpf_caps_only(heaptrace().args(["--no-tui", "-q", "--all"]));
        let tracer = start_attached(&mut all);
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(
            stderr.contains(
                "warning: without CAP_SYS_PTRACE, processes of users other than uid 65534 are \
                 counted but not looked into"
            ),
            "{stderr}"
        );
    }
);

bpf_test!(
    fn missing_pid_and_missing_command_are_errors() {
        let mut gone = Command::new("true").spawn().unwrap();
        let pid = gone.id();
        gone.wait().unwrap();
        let out = heaptrace().args(["-p", &pid.to_string()]).output().unwrap();
        assert!(!out.status.success());
        assert!(
            error_line(&out).contains(&format!("no such process: {pid}")),
            "{out:?}"
        );

        // Said before anything is attached (the probes went on first before).
        let plain = std::env::temp_dir().join(format!("heaptrace-plain-{}", std::process::id()));
        std::fs::write(&plain, "not a program\n").unwrap();
        let plain = plain.to_str().unwrap();
        // As a shell exits: 127 for no such command, 126 for one it cannot run.
        for (cmd, why, code) in [
            (
                "/nonexistent/prog",
                "No such file or directory (os error 2)",
                127,
            ),
            (plain, "Permission denied (os error 13)", 126),
            ("/etc", "Permission denied (os error 13)", 126),
        ] {
            let out = heaptrace().args(["--", cmd]).output().unwrap();
            assert_eq!(out.status.code(), Some(code), "{out:?}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                stderr.trim(),
                format!("heaptrace: error: cannot execute {cmd}: {why}"),
                "{out:?}"
            );
        }
        let _ = std::fs::remove_file(plain);
        // Executable but no program: exec says so.
        let script = std::env::temp_dir().join(format!("heaptrace-noexec-{}", std::process::id()));
        std::fs::write(&script, "not a program\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let out = heaptrace().arg("--").arg(&script).output().unwrap();
        let _ = std::fs::remove_file(&script);
        assert_eq!(out.status.code(), Some(126), "{out:?}");
        assert!(error_line(&out).contains("Exec format error"), "{out:?}");
        let out = heaptrace()
            .args(["--", "heaptrace-no-such-command"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(127), "{out:?}");
        assert!(error_line(&out).contains("command not found"), "{out:?}");
    }
);

bpf_test!(
    shared,
    fn launched_command_exit_status_is_heaptraces() {
        let out = heaptrace()
            .args(["--no-tui", "-q", "--", "sh", "-c", "exit 3"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("exited with status 3"), "{stderr}");
    }
);

/// The address of `func`+`at` in process `pid`'s memory and the byte its file has there.
pub(crate) fn code_byte(pid: u32, func: &str, at: u64) -> (u64, u8) {
    let provider = heaptrace::targets::allocator::for_pid(pid).unwrap();
    let site = provider
        .sites
        .iter()
        .find(|s| s.func.name() == func)
        .unwrap();
    file_byte(pid, &provider.path, site.file_offset + at)
}

/// Where the byte at `file_offset` of `path` is in process `pid`, and what the file has there.
fn file_byte(pid: u32, path: &std::path::Path, file_offset: u64) -> (u64, u8) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let shown = path.display().to_string();
    let addr = maps
        .lines()
        .filter(|l| l.ends_with(&shown))
        .find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let (lo, hi) = cols[0].split_once('-')?;
            let lo = u64::from_str_radix(lo, 16).ok()?;
            let hi = u64::from_str_radix(hi, 16).ok()?;
            let off = u64::from_str_radix(cols[2], 16).ok()?;
            (file_offset >= off && file_offset < off + (hi - lo)).then(|| lo + file_offset - off)
        })
        .expect("mapping of the probed code");
    let file = std::fs::read(path).unwrap();
    (addr, file[file_offset as usize])
}

/// The memory syscalls' probe points in the process's libc: after each syscall, and munmap's
/// and mremap's entries.
fn syscall_bytes(pid: u32) -> Vec<(u64, u8)> {
    let provider = heaptrace::targets::allocator::for_pid(pid).unwrap();
    let sites = heaptrace::probe::syscall_sites::find(&provider.file)
        .unwrap()
        .expect("glibc's wrappers");
    let mut out = Vec::new();
    for s in &sites {
        out.push(file_byte(pid, &provider.path, s.probe_offset()));
        if s.releases() {
            out.push(file_byte(pid, &provider.path, s.file_offset));
        }
    }
    out
}

pub(crate) fn read_byte(pid: u32, addr: u64) -> u8 {
    let mut f = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    f.seek(SeekFrom::Start(addr)).unwrap();
    let mut b = [0u8];
    f.read_exact(&mut b).unwrap();
    b[0]
}

pub(crate) const INT3: u8 = 0xcc;

bpf_test!(
    /// Attach to a running process, SIGTERM heaptrace: the summary is printed and the target's code
    /// is byte-for-byte its file again (a uprobe is an int3 written into the target's text).
    /// free's probe is checked where placement put it (after its NULL check in glibc 2.36).
    fn sigterm_detaches_every_probe() {
        sigterm_detaches(&[]);
    }
);

bpf_test!(
    /// The same through perf-event uprobes, the fallback where the kernel has no uprobe_multi.
    fn sigterm_detaches_every_perf_event_probe() {
        sigterm_detaches(&["--perf-uprobes"]);
    }
);

fn sigterm_detaches(flags: &[&str]) {
    let _g = exclusive();
    let mut spin = Command::new(fixture("spin", "", &[])).spawn().unwrap();
    let pid = spin.id();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let placed = planned_probes(Some(pid)).1["free"].entry;
    let (malloc_at, malloc_byte) = code_byte(pid, "malloc", 0);
    let (free_at, free_byte) = code_byte(pid, "free", placed);
    let (free_entry_at, free_entry_byte) = code_byte(pid, "free", 0);
    assert_eq!(
        read_byte(pid, malloc_at),
        malloc_byte,
        "probed before we started"
    );

    let tracer = start_attached(heaptrace().args(flags).args([
        "--no-tui",
        "--interval",
        "100ms",
        "-p",
        &pid.to_string(),
    ]));
    assert_eq!(
        read_byte(pid, malloc_at),
        INT3,
        "no uprobe on malloc while attached"
    );
    assert_eq!(
        read_byte(pid, free_at),
        INT3,
        "no uprobe at free+{placed} while attached"
    );
    if placed > 0 {
        assert_eq!(
            read_byte(pid, free_entry_at),
            free_entry_byte,
            "free's entry probed though its probe is at +{placed}"
        );
    }
    let syscalls = syscall_bytes(pid);
    assert_eq!(syscalls.len(), 6);
    for (at, _) in &syscalls {
        assert_eq!(
            read_byte(pid, *at),
            INT3,
            "no uprobe at {at:#x} (memory syscalls)"
        );
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    tracer.signal(libc::SIGTERM);
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("terminated; detached"), "{stderr}");
    assert!(stderr.contains("malloc"), "no summary: {stderr}");

    assert_eq!(
        read_byte(pid, malloc_at),
        malloc_byte,
        "malloc still probed"
    );
    assert_eq!(read_byte(pid, free_at), free_byte, "free still probed");
    assert_eq!(read_byte(pid, free_entry_at), free_entry_byte);
    for (at, byte) in &syscalls {
        assert_eq!(
            read_byte(pid, *at),
            *byte,
            "{at:#x} still probed (memory syscalls)"
        );
    }
    // The target is unharmed and still running.
    assert!(spin.try_wait().unwrap().is_none());
    spin.kill().unwrap();
    spin.wait().unwrap();
}

bpf_test!(
    fn process_without_malloc_is_an_error() {
        let bin = fixture("nomalloc", "", &["-static", "-nostdlib", "-O2"]);
        let mut target = Command::new(&bin).spawn().unwrap();
        let out = heaptrace()
            .args(["-p", &target.id().to_string()])
            .output()
            .unwrap();
        target.kill().unwrap();
        target.wait().unwrap();
        assert!(!out.status.success());
        let line = error_line(&out);
        assert!(line.contains("no malloc found in process"), "{line}");
        assert!(line.contains(&bin.display().to_string()), "{line}");
    }
);
