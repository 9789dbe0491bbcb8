//! Signals sent to heaptrace's whole process group reach the command once: under `timeout`
//! (which signals its child, then the group, then sends SIGCONT to both) and with
//! `kill -- -PGID`. The `signals` fixture's handler counts them: it exits with 10 + the count.
use super::*;

fn handler() -> PathBuf {
    crate::signals::bin()
}

/// The handler ran once, heaptrace exited with the command's status, the JSON says so and
/// counted every call.
fn assert_handled_once(code: i32, stderr: &str, json: &Path, what: &str) {
    assert_eq!(code, 11, "{what}: {stderr}");
    assert!(!stderr.contains("again: detached"), "{what}: {stderr}");
    let doc = read_json(json);
    assert_eq!(doc["target"]["exit_code"], 11, "{what}");
    assert_eq!(function(&doc, "malloc"), (11, 10_777), "{what}");
    assert_eq!(function(&doc, "free"), (11, 10_777), "{what}");
}

/// heaptrace under `timeout ARGS`, which fires at 5 s.
fn under_timeout(flags: &[&str], timeout: &[&str], what: &str) {
    let mut prefix = vec!["timeout", "--preserve-status"];
    prefix.extend_from_slice(timeout);
    let run = Run::start("sup-timeout", &prefix, flags, &handler(), &["handle"]);
    run.ready();
    let json = run.json.clone();
    let (code, stderr) = run.finish();
    assert_handled_once(code, &stderr, &json, what);
}

/// Every way `timeout` ends a command: `-s INT`, `-s TERM`, its default (TERM), `-k` (which
/// must not be needed), `--foreground` (the child alone is signalled, heaptrace passes it on).
fn each_timeout(flags: &[&str]) {
    for timeout in [
        &["-s", "INT", "5"][..],
        &["-s", "TERM", "5"],
        &["5"],
        &["-k", "30", "-s", "INT", "5"],
        &["--foreground", "-s", "INT", "5"],
    ] {
        under_timeout(flags, timeout, &format!("timeout {timeout:?}"));
    }
}

bpf_test!(
    shared,
    fn timeout_ends_a_launched_command_once() {
        each_timeout(&[]);
    }
);

#[test]
fn timeout_ends_an_in_process_command_once() {
    let _g = shared();
    each_timeout(&[IN_PROCESS]);
}

/// SIGINT to `timeout` itself, which passes it to heaptrace and then to the group: the copy
/// heaptrace gets twice is one signal, not a second one that kills the command.
fn interrupted_timeout(flags: &[&str]) {
    let prefix = ["timeout", "--preserve-status", "60"];
    let run = Run::start("sup-timeout-int", &prefix, flags, &handler(), &["handle"]);
    run.ready();
    signal(run.child.id(), libc::SIGINT);
    let json = run.json.clone();
    let (code, stderr) = run.finish();
    assert_handled_once(code, &stderr, &json, "SIGINT to timeout");
}

bpf_test!(
    shared,
    fn sigint_to_timeout_reaches_a_launched_command_once() {
        interrupted_timeout(&[]);
    }
);

#[test]
fn sigint_to_timeout_reaches_an_in_process_command_once() {
    let _g = shared();
    interrupted_timeout(&[IN_PROCESS]);
}

/// `kill -INT -- -PGID` of heaptrace's group (heaptrace in a group of its own, as `setsid`
/// puts it): the command got it from the group, heaptrace does not send another. Twice, as
/// the duplicate came in 3 of 4 runs.
fn group_signal(flags: &[&str]) {
    for _ in 0..2 {
        let run = Run::start("sup-group", &[], flags, &handler(), &["handle"]);
        run.ready();
        run.signal_group(libc::SIGINT);
        let json = run.json.clone();
        let (code, stderr) = run.finish();
        assert_handled_once(code, &stderr, &json, "kill -INT -- -PGID");
        assert!(
            stderr.contains("SIGINT reached pid") && stderr.contains("sent to its process group"),
            "{stderr}"
        );
    }
}

bpf_test!(
    shared,
    fn a_signal_to_the_group_reaches_a_launched_command_once() {
        group_signal(&[]);
    }
);

#[test]
fn a_signal_to_the_group_reaches_an_in_process_command_once() {
    let _g = shared();
    group_signal(&[IN_PROCESS]);
}
