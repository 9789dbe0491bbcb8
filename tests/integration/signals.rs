//! Signals to heaptrace while it traces: passed on to a launched command (once: a terminal's
//! reach the command by themselves), which is waited for and whose true status becomes
//! heaptrace's; a second signal ends the trace at once and the command with it; SIGKILL of
//! heaptrace takes its command along; a `-p` target killed by a signal is reported with it.
//!
//! The fixture (`signals.c`) holds ten blocks of 1000 bytes; when it handles the signal it frees
//! them, allocates and frees 777 bytes, and exits with 10 + the signals it received.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{support::*, tui::*};

pub(crate) fn bin() -> PathBuf {
    fixture("signals", "", &[])
}

/// The fixture's pid, once it holds its blocks and waits.
pub(crate) fn ready_pid(path: &Path) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && let Ok(pid) = s.trim().parse()
        {
            return pid;
        }
        assert!(Instant::now() < deadline, "the fixture never got ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// heaptrace launching the fixture in `mode`; (heaptrace, the fixture's pid, the JSON path).
fn launch(tag: &str, mode: &str) -> (Running, u32, PathBuf) {
    let json = json_path(tag);
    let ready = json.with_extension("ready");
    let _ = std::fs::remove_file(&ready);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--mode", "counts", "--json"])
        .arg(&json)
        .arg("--")
        .arg(bin())
        .arg(mode)
        .arg(&ready);
    let running = start_attached(&mut cmd);
    let pid = ready_pid(&ready);
    (running, pid, json)
}

pub(crate) fn function(doc: &Value, name: &str) -> (u64, u64) {
    let f = &doc["functions"][name];
    (f["calls"].as_u64().unwrap(), f["bytes"].as_u64().unwrap())
}

/// Whether `pid` is gone (or a zombie nobody reaped yet), waiting up to five seconds.
fn ends_soon(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(s)
                if s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z')) =>
            {
                return true;
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    false
}

bpf_test!(
    shared,
    /// SIGTERM, SIGHUP and SIGINT sent to heaptrace (as `kill`, `timeout` or systemd send them)
    /// reach the command once; heaptrace keeps counting until it ends, writes the JSON and
    /// exits with the command's status.
    fn each_signal_is_passed_on_once_and_the_commands_status_kept() {
        for (sig, name) in [
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGHUP, "SIGHUP"),
            (libc::SIGINT, "SIGINT"),
        ] {
            let (tracer, _, json) = launch(&format!("signal-{name}"), "handle");
            tracer.signal(sig);
            let (code, stderr) = tracer.wait();
            // 10 + one signal: passed on exactly once.
            assert_eq!(code, 11, "{name}: {stderr}");
            assert!(
                stderr.contains(&format!("{name} passed on to pid")),
                "{stderr}"
            );
            assert!(
                stderr.contains(&format!("exited with status 11 after {name}")),
                "{stderr}"
            );
            let doc = read_json(&json);
            assert_eq!(doc["target"]["exit_code"], 11, "{name}");
            assert_eq!(doc["target"]["signal"], Value::Null);
            // Counted to the end: the frees and the block after the signal too.
            assert_eq!(function(&doc, "malloc"), (11, 10 * 1000 + 777), "{name}");
            assert_eq!(function(&doc, "free"), (11, 10 * 1000 + 777), "{name}");
            assert_eq!(doc["live"]["blocks"], 0);
        }
    }
);

bpf_test!(
    shared,
    /// A command the signal kills: heaptrace exits 128 + the signal, and the JSON says which
    /// signal and what it left live.
    fn a_command_killed_by_the_signal_passed_on_is_reported_so() {
        let (tracer, pid, json) = launch("signal-kills", "default");
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 128 + libc::SIGINT, "{stderr}");
        assert!(
            stderr.contains(&format!("pid {pid} was killed by SIGINT after SIGINT")),
            "{stderr}"
        );
        let doc = read_json(&json);
        assert_eq!(doc["target"]["exit_code"], 130);
        assert_eq!(doc["target"]["signal"], "SIGINT");
        assert_eq!(function(&doc, "malloc"), (10, 10_000));
        assert_eq!(doc["live"]["blocks"], 10);
        assert_eq!(doc["live"]["bytes"], 10_000);
    }
);

bpf_test!(
    shared,
    /// A command that ignores the signal: a second one ends the trace at once, and the command
    /// goes too (it would run on untraced otherwise).
    fn a_second_signal_stops_at_once_and_the_command_goes_with_it() {
        let (tracer, pid, json) = launch("signal-twice", "stubborn");
        tracer.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !tracer.stderr.lock().unwrap().contains("passed on") {
            assert!(
                Instant::now() < deadline,
                "the first SIGTERM was not passed on"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(!ends_soon_now(pid), "the command ignores SIGTERM");
        tracer.signal(libc::SIGTERM);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 128 + libc::SIGKILL, "{stderr}");
        assert!(
            stderr.contains(&format!(
                "SIGTERM again: detached; pid {pid} was killed by SIGKILL"
            )),
            "{stderr}"
        );
        assert!(ends_soon(pid), "pid {pid} still runs");
        let doc = read_json(&json);
        assert_eq!(doc["target"]["signal"], "SIGKILL");
        assert_eq!(doc["live"]["blocks"], 10);
    }
);

/// Whether `pid` is gone right now.
fn ends_soon_now(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

bpf_test!(
    shared,
    /// SIGKILL of heaptrace: the kernel ends the command it launched (PTRACE_O_EXITKILL)
    /// rather than leave it running untraced.
    fn sigkill_of_heaptrace_takes_its_command_along() {
        let (tracer, pid, _) = launch("signal-kill9", "stubborn");
        tracer.signal(libc::SIGKILL);
        let (code, _) = tracer.wait();
        assert_eq!(code, -1, "killed by a signal");
        assert!(ends_soon(pid), "pid {pid} runs on untraced");
    }
);

bpf_test!(
    shared,
    /// A `-p` target killed by a signal (and reaped at once by its parent, this test) is
    /// reported with that signal; heaptrace itself ends normally.
    fn a_p_target_killed_by_a_signal_is_reported_with_it() {
        let json = json_path("signal-p");
        let ready = json.with_extension("ready");
        let _ = std::fs::remove_file(&ready);
        let mut target = spawn_with_libc(Command::new(bin()).arg("default").arg(&ready));
        let pid = ready_pid(&ready);
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--mode", "counts", "-p", &pid.to_string()])
            .arg("--json")
            .arg(&json);
        let tracer = start_attached(&mut cmd);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        target.wait().unwrap();
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(
            stderr.contains(&format!("pid {pid} was killed by SIGKILL")),
            "{stderr}"
        );
        let doc = read_json(&json);
        assert_eq!(doc["target"]["exit_code"], 128 + libc::SIGKILL);
        assert_eq!(doc["target"]["signal"], "SIGKILL");
    }
);

bpf_test!(
    shared,
    /// Ctrl-C in the terminal reaches the command by itself (the same process group):
    /// heaptrace does not send it a second one, and ends with the command's status.
    fn ctrl_c_in_the_terminal_reaches_the_command_once() {
        if !tmux_or_skip("ctrl_c_in_the_terminal_reaches_the_command_once") {
            return;
        }
        let dir = out_dir("signal-ctrl-c");
        let ready = dir.join("ready");
        let json = dir.join("run.json");
        let t = Tmux::start(
            "ctrl-c",
            120,
            40,
            &shell(
                &dir,
                &[
                    "--no-tui",
                    "--json",
                    &json.display().to_string(),
                    "--",
                    &bin().display().to_string(),
                    "handle",
                    &ready.display().to_string(),
                ],
            ),
        );
        ready_pid(&ready);
        t.keys(&["C-c"]);
        assert_eq!(wait_status(&dir), "exit=11", "{}", t.history());
        let doc = read_json(&json);
        assert_eq!(doc["target"]["exit_code"], 11);
        assert_eq!(function(&doc, "malloc"), (11, 10_777));
    }
);

bpf_test!(
    shared,
    /// Under `timeout` (its own, background, process group) the live view would stop on SIGTTOU
    /// at its first change of the terminal: heaptrace prints rounds instead, and says so.
    fn a_live_view_in_the_background_prints_rounds_instead() {
        if !tmux_or_skip("a_live_view_in_the_background_prints_rounds_instead") {
            return;
        }
        let dir = out_dir("signal-background");
        let ready = dir.join("ready");
        let t = Tmux::start(
            "background",
            120,
            40,
            &shell_env(
                &dir,
                "timeout 60 ",
                &[
                    "--",
                    &bin().display().to_string(),
                    "handle",
                    &ready.display().to_string(),
                ],
            ),
        );
        let pid = ready_pid(&ready);
        t.wait_history("the fallback message", 10, |s| {
            s.contains("not in the terminal's foreground")
        });
        // SAFETY: a signal to the fixture, which then ends the trace by exiting.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        assert_eq!(wait_status(&dir), "exit=11", "{}", t.history());
    }
);
