//! A launched command under heaptrace's ptrace supervision, on both collection paths: job
//! control (SIGCONT, SIGSTOP, Ctrl-Z and `fg`) works as without heaptrace; a signal sent to
//! heaptrace's whole process group (`timeout`, `kill -- -PGID`) reaches the command once; a
//! command that takes 20,000 signals a second runs on, let go of by its tracer.
//!
//! Fixtures: `supervise.c` (`run`: ten blocks of 1000 bytes held while it runs, freed at the
//! end; `timer`: a 20 kHz SIGALRM over fixed work with one malloc(48) every 16 rounds) and
//! `signals.c` (`handle`: exits with 10 + the signals it handled, after 11 mallocs of 10,777
//! bytes in all).
use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    signals::{function, ready_pid},
    support::*,
    tui::*,
};

const IN_PROCESS: &str = "--in-process";
/// A run that used to hang for ever is given this long.
const HANG: Duration = Duration::from_secs(60);

fn supervise() -> PathBuf {
    fixture("supervise", "", &[])
}

/// A process of the test's (heaptrace, or `timeout` running it), killed with its process
/// group if the test fails first; its stderr in a file.
struct Run {
    child: Child,
    stderr: PathBuf,
    json: PathBuf,
    /// The file the fixture writes its pid to once ready.
    ready: PathBuf,
}

impl Run {
    /// `prefix` (`timeout ...`, or nothing) running heaptrace with `flags` on `fixture ARGS
    /// READY_FILE`, in a process group of its own.
    fn start(tag: &str, prefix: &[&str], flags: &[&str], fixture: &Path, args: &[&str]) -> Run {
        let json = json_path(tag);
        let ready = json.with_extension("ready");
        let stderr = json.with_extension("stderr");
        let _ = std::fs::remove_file(&ready);
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(env!("CARGO_BIN_EXE_heaptrace"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_heaptrace")),
        };
        cmd.env("RUST_LOG", "warn")
            .args(["--no-tui", "--mode", "counts", "--json"])
            .arg(&json)
            .args(flags)
            .arg("--")
            .arg(fixture)
            .args(args)
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0);
        let child = cmd.spawn().expect("spawn heaptrace");
        Run {
            child,
            stderr,
            json,
            ready,
        }
    }

    /// The fixture's pid once it is ready.
    fn ready(&self) -> u32 {
        ready_pid(&self.ready)
    }

    /// Waits for the end, within `HANG`; (exit code, stderr).
    fn finish(mut self) -> (i32, String) {
        let deadline = Instant::now() + HANG;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                return (status.code().unwrap_or(-1), stderr);
            }
            if Instant::now() > deadline {
                let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                panic!("still running after {HANG:?} (it used to hang): {stderr}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A signal to its whole process group, as `kill -SIG -- -PGID` sends it.
    fn signal_group(&self, sig: i32) {
        // SAFETY: signalling the process group our child leads.
        unsafe { libc::kill(-(self.child.id() as i32), sig) };
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal_group(libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// A process's state letter (`/proc/PID/stat`), or None once it is gone.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: signalling a process of this test's.
    unsafe { libc::kill(pid as i32, sig) };
}

/// The `run` fixture's known calls: ten blocks of 1000 bytes, all freed.
fn assert_run_counts(doc: &Value, what: &str) {
    assert_eq!(doc["target"]["exit_code"], 0, "{what}");
    assert_eq!(function(doc, "malloc"), (10, 10_000), "{what}");
    assert_eq!(function(doc, "free"), (10, 10_000), "{what}");
    assert_eq!(doc["live"]["blocks"], 0, "{what}");
}

/// SIGCONT to a running command (no stop before it): it runs on and exits normally. It used
/// to stay stopped for good (a `PTRACE_EVENT_STOP` answered with `PTRACE_LISTEN`).
fn sigcont_lets_it_run_on(flags: &[&str]) {
    let run = Run::start("sup-cont", &[], flags, &supervise(), &["run", "1000"]);
    let pid = run.ready();
    signal(pid, libc::SIGCONT);
    let json = run.json.clone();
    let (code, stderr) = run.finish();
    assert_eq!(code, 0, "{stderr}");
    assert_run_counts(&read_json(&json), &stderr);
}

bpf_test!(
    shared,
    fn sigcont_to_a_launched_command_lets_it_run_on() {
        sigcont_lets_it_run_on(&[]);
    }
);

#[test]
fn sigcont_to_an_in_process_command_lets_it_run_on() {
    let _g = shared();
    sigcont_lets_it_run_on(&[IN_PROCESS]);
}

/// SIGSTOP from another process stops the command (and keeps it stopped); SIGCONT resumes
/// it, and it finishes.
fn stop_then_cont(flags: &[&str]) {
    let run = Run::start("sup-stop", &[], flags, &supervise(), &["run", "1000"]);
    let pid = run.ready();
    signal(pid, libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(state(pid), Some('t' | 'T')) {
        assert!(Instant::now() < deadline, "pid {pid} did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Still stopped a while later, and heaptrace still waiting for it.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(matches!(state(pid), Some('t' | 'T')), "{:?}", state(pid));
    signal(pid, libc::SIGCONT);
    let json = run.json.clone();
    let (code, stderr) = run.finish();
    assert_eq!(code, 0, "{stderr}");
    assert_run_counts(&read_json(&json), &stderr);
}

bpf_test!(
    shared,
    fn sigstop_then_sigcont_stops_and_resumes_a_launched_command() {
        stop_then_cont(&[]);
    }
);

#[test]
fn sigstop_then_sigcont_stops_and_resumes_an_in_process_command() {
    let _g = shared();
    stop_then_cont(&[IN_PROCESS]);
}

/// Ctrl-Z in an interactive shell stops heaptrace and its command; `fg` resumes both, the
/// command finishes and heaptrace exits with its status.
fn ctrl_z_then_fg(tag: &str, flags: &[&str]) {
    if !tmux_or_skip(tag) {
        return;
    }
    let dir = out_dir(tag);
    let ready = dir.join("ready");
    let json = dir.join("run.json");
    let t = Tmux::start(
        tag,
        160,
        40,
        "env -i PATH=/usr/bin:/bin TERM=screen PS1='$ ' bash --norc --noprofile -i",
    );
    let mut line = format!(
        "cd {} && RUST_LOG=warn {} --no-tui -q --mode counts --json {}",
        quote(&dir.display().to_string()),
        quote(env!("CARGO_BIN_EXE_heaptrace")),
        quote(&json.display().to_string()),
    );
    for a in flags {
        line.push(' ');
        line.push_str(a);
    }
    line.push_str(&format!(
        " -- {} run 2000 {}",
        quote(&supervise().display().to_string()),
        quote(&ready.display().to_string())
    ));
    t.wait_for("the prompt", 10, |s| s.contains('$'));
    t.keys(&[&line, "Enter"]);
    let pid = ready_pid(&ready);
    t.keys(&["C-z"]);
    t.wait_for("the job stopped", 10, |s| s.contains("Stopped"));
    std::thread::sleep(Duration::from_millis(500));
    assert!(matches!(state(pid), Some('t' | 'T')), "{}", t.history());
    let status = dir.join("status");
    t.keys(&[
        &format!(
            "fg; echo exit=$? > {}",
            quote(&status.display().to_string())
        ),
        "Enter",
    ]);
    assert_eq!(wait_status(&dir), "exit=0", "{}", t.history());
    assert_run_counts(&read_json(&json), &t.history());
}

bpf_test!(
    shared,
    fn ctrl_z_then_fg_resumes_a_launched_command() {
        ctrl_z_then_fg("sup-ctrl-z", &[]);
    }
);

#[test]
fn ctrl_z_then_fg_resumes_an_in_process_command() {
    let _g = shared();
    ctrl_z_then_fg("sup-ctrl-z-inproc", &[IN_PROCESS]);
}

mod group;
mod storm;
