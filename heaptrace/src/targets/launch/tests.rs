use std::time::Duration;

use super::*;

fn run(argv: &[&str]) -> (Vec<Event>, u32) {
    let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
    let child = spawn_stopped(Path::new("/bin/sh"), &argv, None).unwrap();
    let mut child = child.resume().unwrap();
    let mut seen = Vec::new();
    while let Some(e) = child.events.blocking_recv() {
        if e == Event::Exiting {
            // The mappings are still readable while it is held.
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.pid)).unwrap();
            assert!(maps.contains("libc.so.6"), "{maps}");
            let _ = child.ack.send(());
        }
        if e == Event::Started {
            // Held at its loader's thread set-up: its libraries are mapped.
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.pid)).unwrap();
            assert!(maps.contains("libc.so.6"), "{maps}");
            let _ = child.ack.send(());
        }
        if e == Event::Exec {
            // Held before its first instruction: the loader is mapped, libc not yet.
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.pid)).unwrap();
            assert!(
                maps.contains("ld-linux") && !maps.contains("libc.so.6"),
                "{maps}"
            );
            let _ = child.ack.send(());
        }
        let done = matches!(e, Event::Exited(_));
        seen.push(e);
        if done {
            break;
        }
    }
    (seen, child.pid)
}

#[test]
fn runs_a_command_held_at_exit_and_reports_its_exit_code() {
    let (events, _) = run(&["sh", "-c", "exit 7"]);
    assert_eq!(
        events,
        vec![
            Event::Started,
            Event::Exiting,
            Event::Exited(Some(ExitStatus::Code(7)))
        ]
    );
}

#[test]
fn holds_a_command_at_each_exec_after_its_own() {
    let (events, _) = run(&["sh", "-c", "exec sh -c 'exit 3'"]);
    assert_eq!(
        events,
        vec![
            Event::Started,
            Event::Exec,
            Event::Started,
            Event::Exiting,
            Event::Exited(Some(ExitStatus::Code(3)))
        ]
    );
}

#[test]
fn signals_reach_the_command() {
    // The shell sends itself SIGTERM: the tracer must pass it on, and the exit shows it.
    let (events, _) = run(&["sh", "-c", "kill -TERM $$; sleep 5"]);
    assert_eq!(
        events.last(),
        Some(&Event::Exited(Some(ExitStatus::Signal {
            signal: libc::SIGTERM,
            core_dumped: false
        })))
    );
}

#[test]
fn redirects_output_to_a_file_and_input_from_dev_null() {
    let out = std::env::temp_dir().join(format!("heaptrace-launch-{}.out", std::process::id()));
    let argv = vec![
        "sh".to_string(),
        "-c".into(),
        "echo to-out; echo to-err >&2; cat; echo done".into(),
    ];
    let r = Redirect::to(&out, true).unwrap();
    let child = spawn_stopped(Path::new("/bin/sh"), &argv, Some(&r)).unwrap();
    drop(r); // the child has its own copies since the fork
    let mut child = child.resume().unwrap();
    let mut code = None;
    while let Some(e) = child.events.blocking_recv() {
        match e {
            Event::Exiting
            | Event::Finalizing(_)
            | Event::Exec
            | Event::Started
            | Event::ForkStarted(_) => {
                let _ = child.ack.send(());
            }
            Event::Released { .. } => {}
            Event::Exited(c) => {
                code = Some(c);
                break;
            }
        }
    }
    assert_eq!(code, Some(Some(ExitStatus::Code(0))));
    let text = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    assert_eq!(text, "to-out\nto-err\ndone\n");
}

#[test]
fn exec_failure_is_an_error_naming_the_command() {
    let argv = vec!["nope".to_string()];
    let child = spawn_stopped(Path::new("/nonexistent/nope"), &argv, None).unwrap();
    let err = child.resume().err().unwrap().to_string();
    assert!(err.contains("cannot execute nope"), "{err}");
}

/// `run`, failing after 30 s rather than hanging.
fn run_within_30s(argv: &'static [&'static str]) -> Vec<Event> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run(argv).0);
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{argv:?} still stopped after 30 s"))
}

#[test]
fn job_control_leaves_the_command_running() {
    // SIGCONT reaches a seized command as a PTRACE_EVENT_STOP that is no group-stop: it was
    // answered as a group-stop (PTRACE_LISTEN), and the command stayed stopped for good.
    let events = run_within_30s(&["sh", "-c", "kill -CONT $$; exit 4"]);
    assert_eq!(
        events.last(),
        Some(&Event::Exited(Some(ExitStatus::Code(4))))
    );
    // Stopped by itself, continued by its child.
    let events = run_within_30s(&[
        "sh",
        "-c",
        "(sleep 0.3; kill -CONT $$) & kill -STOP $$; exit 5",
    ]);
    assert_eq!(
        events.last(),
        Some(&Event::Exited(Some(ExitStatus::Code(5))))
    );
}
