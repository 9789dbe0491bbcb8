//! Signal handlers that allocate while the code they interrupt is inside malloc: each call
//! counted once, the handler's as well as the interrupted one (`sighandler.c`). A handler's
//! call is taken for a nested call (glibc's realloc calling malloc) unless the delivery of the
//! signal set the interrupted call aside.
use std::{
    io::{BufRead, Read, Write},
    process::Command,
};

use serde_json::Value;

use crate::support::*;

const PAIRS: &str = "200000";
const MAIN_SIZE: u64 = 24;
const HANDLER_SIZE: u64 = 200;

/// The fixture's "done MAIN HANDLER" line: the malloc+free pairs of each.
fn made(line: &str) -> (u64, u64) {
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(v.len(), 2, "{line}");
    (v[0], v[1])
}

/// Every malloc and free of the run, counted once: `pairs` of each size made while traced.
fn check(doc: &Value, (main, handler): (u64, u64)) {
    assert!(handler > 0, "the timer never fired");
    let f = &doc["functions"];
    assert_eq!(f["malloc"]["calls"], main + handler);
    assert_eq!(
        f["malloc"]["bytes"],
        main * MAIN_SIZE + handler * HANDLER_SIZE
    );
    assert_eq!(f["free"]["calls"], main + handler);
    assert_eq!(doc["lost"]["in_flight"], 0);
}

/// Attaches with `-p` to the fixture waiting (its warm-up calls made), a signal every 100 us;
/// the JSON document and what the fixture made.
fn attached(mode: &str, extra: &[&str]) -> (Value, (u64, u64)) {
    let _g = shared();
    let (mut target, mut out, mut line) = piped(
        Command::new(fixture("sighandler", "", &[]))
            .args([PAIRS, "100", "wait"])
            .args(extra),
    );
    assert_eq!(line, "ready\n");
    let json = json_path(&format!("sighandler-{mode}{}", extra.concat()));
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--mode", mode, "--json"])
        .arg(&json)
        .args(["-p", &target.id().to_string()]);
    let tracer = start_attached(&mut cmd);
    target.stdin.take().unwrap().write_all(b"g").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert!(target.wait().unwrap().success());
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    (read_json(&json), made(&line))
}

bpf_test!(
    fn handler_calls_interrupting_malloc_count_exactly_attached() {
        let (doc, made) = attached("counts", &[]);
        check(&doc, made);
    }
);

bpf_test!(
    fn handler_calls_interrupting_malloc_count_exactly_in_stacks_mode() {
        let (doc, made) = attached("stacks", &[]);
        check(&doc, made);
    }
);

bpf_test!(
    /// The main code's realloc(NULL, 24) runs malloc nested inside (not counted), and the
    /// handler's mallocs that interrupt either are counted: each call once.
    fn handler_calls_interrupting_a_nested_call_count_exactly() {
        let (doc, (main, handler)) = attached("counts", &["realloc"]);
        assert!(handler > 0, "the timer never fired");
        let f = &doc["functions"];
        assert_eq!(f["realloc"]["calls"], main);
        assert_eq!(f["realloc"]["bytes"], main * MAIN_SIZE);
        assert_eq!(f["malloc"]["calls"], handler);
        assert_eq!(f["malloc"]["bytes"], handler * HANDLER_SIZE);
        assert_eq!(f["free"]["calls"], main + handler);
        assert_eq!(doc["lost"]["in_flight"], 0);
    }
);

bpf_test!(
    /// A handler on an alternate stack may run above or below the call it interrupts: that
    /// call cannot be told apart from its handler's, and each such interruption is a loss
    /// (`in_flight`), never "lost: none". The handler's one malloc is then the call missed.
    fn handler_calls_on_an_alternate_stack_are_counted_as_lost() {
        let (doc, (main, handler)) = attached("counts", &["altstack"]);
        let lost = doc["lost"]["in_flight"].as_u64().unwrap();
        assert!(lost > 0, "no interruption seen");
        let counted = doc["functions"]["malloc"]["calls"].as_u64().unwrap();
        assert_eq!(counted + lost, main + handler);
    }
);

bpf_test!(
    shared,
    /// Launched, at 1 kHz: the two warm-up pairs (one of each size) are counted too.
    fn handler_calls_interrupting_malloc_count_exactly_launched() {
        let json = json_path("sighandler-launched");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--mode", "counts", "--json"])
            .arg(&json)
            .arg("--")
            .arg(fixture("sighandler", "", &[]))
            .args([PAIRS, "1000"]);
        let mut tracer = start_attached(&mut cmd);
        let mut stdout = tracer.child.stdout.take().unwrap();
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        let mut line = String::new();
        stdout.read_to_string(&mut line).unwrap();
        let (main, handler) = made(&line);
        check(&read_json(&json), (main + 1, handler + 1));
    }
);

bpf_test!(
    /// A handler's stacks go on through the signal frame (`__restore_rt`, whose CFA is a
    /// DWARF expression) into the code it interrupted, to `_start`: on the thread's stack and
    /// on an alternate one. Where the signal came while the kernel's uretprobe trampoline ran
    /// (a probed malloc returning: its frame is in the `[uprobes]` page), the walk goes on by
    /// frame pointer from there and misses main; elsewhere main is in the stack.
    fn handler_stacks_go_on_through_the_signal_frame() {
        for extra in [&[][..], &["altstack"][..]] {
            let (doc, (_, handler)) = attached("stacks", extra);
            assert!(handler > 0, "the timer never fired");
            let (mut through, mut whole, mut main) = (0, 0, 0);
            for s in doc["stacks"].as_array().unwrap() {
                let frames = function_names(s);
                if frames.contains(&"on_alarm") {
                    let calls = s["calls"].as_u64().unwrap();
                    through += calls;
                    whole += calls * u64::from(frames.last() == Some(&"_start"));
                    main += calls * u64::from(frames.contains(&"main"));
                }
            }
            assert!(through > 0, "{extra:?}: no handler stacks");
            // A stack cut for want of a rule is counted.
            let cut = doc["lost"]["unwind_no_rule"].as_u64().unwrap();
            assert!(
                whole + cut >= through,
                "{extra:?}: {whole} of {through} reach _start"
            );
            assert!(
                whole * 100 >= through * 99,
                "{extra:?}: {whole} of {through}"
            );
            assert!(
                main * 10 >= through,
                "{extra:?}: {main} of {through} reach main"
            );
        }
    }
);

bpf_test!(
    /// The in-process library's walk goes through the signal frame too.
    fn in_process_handler_stacks_go_on_through_the_signal_frame() {
        let _g = shared();
        let json = json_path("sighandler-in-process");
        let out = heaptrace()
            .args([
                "--no-tui",
                "-q",
                "--in-process",
                "--mode",
                "stacks",
                "--json",
            ])
            .arg(&json)
            .arg("--")
            .arg(fixture("sighandler", "", &[]))
            .args([PAIRS, "100"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc = read_json(&json);
        let (mut through, mut whole) = (0, 0);
        for s in doc["stacks"].as_array().unwrap() {
            let frames = function_names(s);
            if frames.contains(&"on_alarm") {
                let calls = s["calls"].as_u64().unwrap();
                through += calls;
                whole += calls * u64::from(frames.last() == Some(&"_start"));
            }
        }
        assert!(through > 0, "no handler stacks");
        assert_eq!(whole, through, "handler calls reaching _start");
    }
);

bpf_test!(
    shared,
    /// A signal taken in a PLT stub (the lazy PLT's CFA is a DWARF expression): `pltfault`
    /// faults on fetching `labs@plt` 50 times, and its SIGSEGV handler mallocs each time.
    /// Both walks go on through the stub to `_start`, none cut.
    fn a_signal_in_a_plt_stub_is_unwound_through() {
        use object::{Object as _, ObjectSection as _};
        let bin = fixture("pltfault", "", &[]);
        let data = std::fs::read(&bin).unwrap();
        let file = object::File::parse(&data[..]).unwrap();
        let plt = file.section_by_name(".plt").expect("a lazy .plt");
        let plt = plt.address()..=plt.address() + plt.size();
        for how in [&[][..], &["--in-process"][..]] {
            // The fixture's 50 faults by default.
            let doc = trace_stacks(&format!("pltfault{}", how.concat()), "pltfault", how);
            let (mut handler, mut whole, mut in_plt) = (0, 0, 0);
            for s in doc["stacks"].as_array().unwrap() {
                let frames = function_names(s);
                let Some(at) = frames.iter().position(|f| *f == "on_fault") else {
                    continue;
                };
                if s["function"] != "malloc" {
                    continue;
                }
                let calls = s["calls"].as_u64().unwrap();
                handler += calls;
                whole += calls * u64::from(frames.last() == Some(&"_start"));
                // After the handler, __restore_rt; then the interrupted stub.
                let stub = &s["frames"][at + 2];
                let at_stub = stub["module"] == "pltfault"
                    && stub["offset"].as_u64().is_some_and(|o| plt.contains(&o));
                in_plt += calls * u64::from(at_stub);
            }
            assert_eq!(handler, 50, "{how:?}");
            assert_eq!(in_plt, 50, "{how:?}: interrupted in the stub");
            assert_eq!(whole, 50, "{how:?}: reaching _start");
            assert_eq!(doc["lost"]["unwind_no_rule"], 0, "{how:?}: {}", doc["lost"]);
        }
    }
);
