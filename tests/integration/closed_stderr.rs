//! heaptrace's stderr closed or full (`heaptrace ... 2>&1 >/dev/null | head -1`, `2>/dev/full`):
//! the lines are lost, the trace is not. The command runs to its end, the JSON document is
//! written with its exact counts, and heaptrace exits with the command's status.
use std::{
    os::fd::{FromRawFd as _, OwnedFd},
    process::Stdio,
};

use crate::{
    counts::{DTV, allocs, args},
    expect::{Expected, Fixture},
    support::*,
};

/// Where heaptrace writes, and how that fails.
#[derive(Clone, Copy, Debug)]
enum Sink {
    /// A pipe whose reader has gone: every write fails with EPIPE.
    ClosedPipe,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
}

/// A descriptor every write to which fails as `sink` says.
fn failing(sink: Sink) -> Stdio {
    match sink {
        Sink::ClosedPipe => {
            let mut fds = [0; 2];
            // SAFETY: a pipe into a two-int array; both ends are owned at once.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: fresh descriptors nothing else owns.
            let (read, write) =
                unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            drop(read);
            Stdio::from(write)
        }
        Sink::Full => Stdio::from(std::fs::File::create("/dev/full").expect("/dev/full")),
    }
}

/// The allocs fixture launched with `flags`, heaptrace's stderr to `sink`, round lines on (so
/// there is much to write): exact counts in the JSON and the command's exit status.
fn exact_with_stderr(sink: Sink, flags: &[&str]) {
    let fx = Fixture {
        threads: 2,
        iterations: 2000,
        leaks: 4,
        memalign_apart: false,
        no_pvalloc: false,
    };
    let json = json_path(&format!("stderr-{sink:?}{}", flags.concat()));
    let status = heaptrace()
        .args(["--no-tui", "--interval", "100ms", "--json"])
        .arg(&json)
        .args(flags)
        .arg("--")
        .arg(allocs())
        .args(args(&fx, &[]))
        .stdout(Stdio::null())
        .stderr(failing(sink))
        .status()
        .expect("run heaptrace");
    assert_eq!(
        status.code(),
        Some(0),
        "heaptrace's status with stderr {sink:?}"
    );
    let doc = read_json(&json);
    assert_eq!(doc["target"]["exit_code"], 0);
    let want = Expected::of(&fx).with_glibc_threads(fx.threads, DTV);
    assert_eq!(Expected::observed(&doc, &doc["sizes"], &want), want);
}

/// A command's own status comes through whatever heaptrace could not write.
fn status_with_stderr(sink: Sink, flags: &[&str]) {
    let status = heaptrace()
        .args(["--no-tui", "--interval", "100ms"])
        .args(flags)
        .args(["--", "sh", "-c", "ls / >/dev/null; exit 7"])
        .stdout(Stdio::null())
        .stderr(failing(sink))
        .status()
        .expect("run heaptrace");
    assert_eq!(
        status.code(),
        Some(7),
        "heaptrace's status with stderr {sink:?}"
    );
}

bpf_test!(
    shared,
    fn a_closed_stderr_loses_lines_not_the_trace() {
        exact_with_stderr(Sink::ClosedPipe, &[]);
        status_with_stderr(Sink::ClosedPipe, &[]);
    }
);

bpf_test!(
    shared,
    fn a_full_stderr_loses_lines_not_the_trace() {
        exact_with_stderr(Sink::Full, &[]);
        status_with_stderr(Sink::Full, &[]);
    }
);

#[test]
fn in_process_a_closed_or_full_stderr_loses_lines_not_the_trace() {
    for sink in [Sink::ClosedPipe, Sink::Full] {
        exact_with_stderr(sink, &["--in-process"]);
        status_with_stderr(sink, &["--in-process"]);
    }
}

bpf_test!(
    shared,
    /// `--json - | head -c 10`: the document's reader goes away; the command's status stays.
    fn a_closed_stdout_keeps_the_commands_status() {
        let status = heaptrace()
            .args(["--no-tui", "-q", "--json", "-"])
            .args(["--", "sh", "-c", "ls / >/dev/null; exit 7"])
            .stdout(failing(Sink::ClosedPipe))
            .stderr(Stdio::null())
            .status()
            .expect("run heaptrace");
        assert_eq!(status.code(), Some(7));
    }
);
