//! `--allocator-symbols`: a program's own prefixed allocator, explicit names, and Rust's global
//! allocator shims, each counted exactly; bad specs and missing symbols are one-line errors.
use std::{
    collections::BTreeMap,
    io::Write as _,
    path::Path,
    process::{Child, Command},
};

use serde_json::Value;

use crate::{counts::launch, support::*};

/// (function -> (calls, bytes, failed)), free included.
type Funcs = BTreeMap<&'static str, (u64, u64, u64)>;

fn funcs_of(doc: &Value, names: &[&'static str]) -> Funcs {
    names
        .iter()
        .map(|n| {
            let f = &doc["functions"][*n];
            let v = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("{n}.{k}: {f}"));
            (
                *n,
                (
                    v("calls"),
                    v("bytes"),
                    if *n == "free" { 0 } else { v("failed") },
                ),
            )
        })
        .collect()
}

fn sizes_of(doc: &Value) -> BTreeMap<(String, u64), u64> {
    doc["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let f = s["function"].as_str().unwrap().to_string();
            (
                (f, s["size"].as_u64().unwrap()),
                s["count"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn probed_symbols(doc: &Value) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = doc["provider"]["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let s = |k: &str| p[k].as_str().unwrap().to_string();
            (s("func"), s("symbol"))
        })
        .collect();
    v.sort();
    v
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = v
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    v.sort();
    v
}

const N: u64 = 500;
const LEAKS: u64 = 7;

/// customalloc N LEAKS traced with `prefix:xx_`: each custom call counted once, the xx_malloc
/// inside xx_calloc as part of the calloc.
fn check_prefixed_counts(doc: &Value) {
    let want: Funcs = [
        ("malloc", (N + LEAKS, 100 * N + 64 * LEAKS, 0)),
        ("calloc", (N, 100 * N, 0)),
        ("realloc", (N, 300 * N, 0)),
        ("free", (2 * N, 400 * N, 0)),
    ]
    .into();
    assert_eq!(
        funcs_of(doc, &["malloc", "calloc", "realloc", "free"]),
        want
    );
}

bpf_test!(
    shared,
    /// tests/fixtures/customalloc.c with `prefix:xx_`: only the program's own xx_ functions are
    /// probed, in the program, not the libc they wrap. Each call counts once: the libc malloc
    /// inside xx_malloc is not probed, and xx_malloc inside xx_calloc is a nested call of the
    /// calloc. The fixture's direct libc malloc(50) is not the custom allocator's and does not
    /// show.
    fn prefixed_custom_allocator_counts_exactly() {
        let bin = fixture("customalloc", "", &[]);
        let args = [N.to_string(), LEAKS.to_string()];
        let doc = launch(
            "custom-prefix",
            &["--mode", "sizes", "--allocator-symbols", "prefix:xx_"],
            &bin,
            &args,
            &[],
        );
        assert_eq!(doc["provider"]["path"], bin.display().to_string());
        assert_eq!(
            probed_symbols(&doc),
            pairs(&[
                ("malloc", "xx_malloc"),
                ("calloc", "xx_calloc"),
                ("realloc", "xx_realloc"),
                ("free", "xx_free"),
            ])
        );
        check_prefixed_counts(&doc);
        let f = &doc["functions"];
        assert_eq!(f["free"]["untracked"], 0);
        assert_eq!(
            f["realloc"]["moved"].as_u64().unwrap() + f["realloc"]["in_place"].as_u64().unwrap(),
            N
        );
        let sizes: BTreeMap<(String, u64), u64> = [
            (("malloc".to_string(), 100), N),
            (("malloc".to_string(), 64), LEAKS),
            (("calloc".to_string(), 100), N),
            (("realloc".to_string(), 300), N),
        ]
        .into();
        assert_eq!(sizes_of(&doc), sizes);
        assert_eq!(doc["leaks"]["blocks"].as_u64(), Some(LEAKS));
        assert_eq!(doc["leaks"]["bytes"].as_u64(), Some(64 * LEAKS));
    }
);

/// gcc's flags for a 5-byte nop at each function's entry (`-mnop-mcount` wants no PIC).
const NOP5_FLAGS: &[&str] = &["-pg", "-mfentry", "-mnop-mcount", "-fno-pic", "-no-pie"];

bpf_test!(
    shared,
    /// The same allocator built with `gcc -pg -mfentry -mnop-mcount`: each function begins with a
    /// 5-byte nop, and Linux 6.18+ turns a probe there into a call to a trampoline once it is hit
    /// (half a trap's cost, BENCHMARKS.md). The probes stay on the nops, count exactly, and read
    /// the caller right on that path (its return address at [rsp], the stack pointer the kernel
    /// hands the program back from the trampoline).
    fn probes_on_five_byte_nops_count_exactly() {
        let bin = fixture("customalloc", "nop5", NOP5_FLAGS);
        let json = json_path("custom-nop5");
        let out = run_ok(
            heaptrace()
                .args(["--no-tui", "-q", "--json"])
                .arg(&json)
                .args(["--allocator-symbols", "prefix:xx_", "--"])
                .arg(&bin)
                .args([&N.to_string(), &LEAKS.to_string(), "maps"]),
        );
        let doc = read_json(&json);
        assert_eq!(doc["target"]["exit_code"], 0);
        for p in doc["provider"]["probes"].as_array().unwrap() {
            let at = &p["placement"];
            assert_eq!(
                (at["offset"].as_u64(), at["pushes"].as_u64()),
                (Some(0), Some(0)),
                "{p}"
            );
            assert!(
                at["instruction"].as_str().unwrap().starts_with("nopl"),
                "{p}"
            );
            assert!(at["why"].as_str().unwrap().contains("5-byte nop"), "{p}");
        }
        check_prefixed_counts(&doc);
        assert_eq!(doc["functions"]["free"]["untracked"], 0);
        assert_eq!(doc["leaks"]["blocks"].as_u64(), Some(LEAKS));
        let stacks = doc["stacks"].as_array().unwrap();
        assert_eq!(stacks.len(), 4, "{stacks:?}");
        for s in stacks {
            assert_eq!(s["frames"][0]["function"], "main", "{s}");
        }
        // That the kernel did turn the probes into calls, where it can: else this test would only
        // repeat the prefixed one.
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let stdout = String::from_utf8_lossy(&out.stdout);
        if kallsyms.contains(" arch_uprobe_optimize\n") {
            assert!(stdout.contains("[uprobes-trampoline]"), "{stdout}");
        } else {
            eprintln!("this kernel does not optimize uprobes on nops: tested as plain probes");
        }
    }
);

bpf_test!(
    shared,
    /// Detaching mid-run from probes the kernel turned into calls: it puts the nops back, and the
    /// process works on unprobed to a normal exit.
    fn detaching_from_five_byte_nop_probes_mid_run_leaves_the_process_whole() {
        let bin = fixture("customalloc", "nop5", NOP5_FLAGS);
        // Seconds of work probed, a fraction of one without.
        let n = 2_000_000u64;
        let mut child = ready(&bin, &[&n.to_string(), "0", "wait"]);
        let json = json_path("custom-nop5-detach");
        let tracer = start_attached(
            heaptrace()
                .args(["-p", &child.id().to_string(), "--no-tui", "-q"])
                .args(["--allocator-symbols", "prefix:xx_", "--json"])
                .arg(&json),
        );
        child.stdin.take().unwrap().write_all(b"g").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(child.wait().unwrap().success());
        let calls = read_json(&json)["functions"]["malloc"]["calls"]
            .as_u64()
            .unwrap();
        assert!(
            calls > 0 && calls < n,
            "{calls} mallocs seen: not detached mid-run"
        );
    }
);

bpf_test!(
    shared,
    /// Explicit names, without calloc: xx_calloc is then not probed, and the xx_malloc inside it is
    /// an outermost call of its own, counted as malloc.
    fn explicit_custom_names_count_exactly() {
        let bin = fixture("customalloc", "", &[]);
        let args = [N.to_string(), LEAKS.to_string()];
        let spec = "malloc=xx_malloc,realloc=xx_realloc,free=xx_free";
        let doc = launch(
            "custom-explicit",
            &["--mode", "counts", "--allocator-symbols", spec],
            &bin,
            &args,
            &[],
        );
        assert_eq!(
            probed_symbols(&doc),
            pairs(&[
                ("malloc", "xx_malloc"),
                ("realloc", "xx_realloc"),
                ("free", "xx_free"),
            ])
        );
        let want: Funcs = [
            ("malloc", (2 * N + LEAKS, 200 * N + 64 * LEAKS, 0)),
            ("calloc", (0, 0, 0)),
            ("realloc", (N, 300 * N, 0)),
            ("free", (2 * N, 400 * N, 0)),
        ]
        .into();
        assert_eq!(
            funcs_of(&doc, &["malloc", "calloc", "realloc", "free"]),
            want
        );
        assert_eq!(doc["live"]["blocks"].as_u64(), Some(LEAKS));
    }
);

/// Starts a fixture that says "ready" and waits for a byte on stdin.
fn ready(bin: &Path, args: &[&str]) -> Child {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    crate::support::ready(cmd)
}

/// `heaptrace probes -p PID --allocator-symbols SPEC`: (name column, file offset) per line.
fn planned(pid: u32, spec: &str) -> (String, BTreeMap<String, u64>) {
    let out = run_ok(heaptrace().args([
        "probes",
        "-p",
        &pid.to_string(),
        "--allocator-symbols",
        spec,
    ]));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let head = lines.next().unwrap().to_string();
    lines.next();
    let rows = lines
        .take_while(|l| !l.starts_with("memory syscalls"))
        .map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let off = u64::from_str_radix(cols[1].trim_start_matches("0x"), 16).unwrap();
            (cols[0].to_string(), off)
        })
        .collect();
    (head, rows)
}

/// The symbol table's address of each function whose name ends with one of `names`.
fn nm(bin: &Path, names: &[&str]) -> BTreeMap<String, u64> {
    let out = Command::new("nm").arg(bin).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut found = BTreeMap::new();
    for l in text.lines() {
        let cols: Vec<&str> = l.split_whitespace().collect();
        if cols.len() == 3
            && let Some(n) = names.iter().find(|n| cols[2].ends_with(*n))
        {
            found.insert(n.to_string(), u64::from_str_radix(cols[0], 16).unwrap());
        }
    }
    found
}

bpf_test!(
    fn probes_lists_the_custom_functions() {
        let bin = fixture("customalloc", "", &[]);
        let mut child = ready(&bin, &["0", "0", "wait"]);
        let (head, rows) = planned(child.id(), "prefix:xx_");
        child.stdin.take().unwrap().write_all(b"g").unwrap();
        assert!(child.wait().unwrap().success());
        assert!(head.starts_with(&bin.display().to_string()), "{head}");
        // In this PIE the text segment's addresses are its file offsets.
        let addr = nm(&bin, &["xx_malloc", "xx_calloc", "xx_realloc", "xx_free"]);
        let want: BTreeMap<String, u64> = [
            ("malloc:xx_malloc", addr["xx_malloc"]),
            ("calloc:xx_calloc", addr["xx_calloc"]),
            ("realloc:xx_realloc", addr["xx_realloc"]),
            ("free:xx_free", addr["xx_free"]),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
        assert_eq!(rows, want);
    }
);

bpf_test!(
    shared,
    /// Rust's global allocator: rustc emits `__rust_alloc` and its siblings as shims (v0-mangled,
    /// `..._7___rustc12___rust_alloc`) that jump to the System allocator's `__rdl_*`, and std calls
    /// them through the GOT: they are not inlined away, and `rust` probes them. The fixture waits
    /// until heaptrace is attached (-p), so only its own calls happen under the probes.
    fn rust_global_allocator_counts_exactly() {
        let bin = rust_fixture("rustfamily", "v0");
        let mut child = ready(&bin, &[&N.to_string(), &LEAKS.to_string()]);
        let pid = child.id();
        let (_, rows) = planned(pid, "rust");
        let names: Vec<&str> = rows.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "calloc:__rust_alloc_zeroed",
                "free:__rust_dealloc",
                "malloc:__rust_alloc",
                "realloc:__rust_realloc"
            ]
        );
        let json = json_path("custom-rust");
        let mut cmd = heaptrace();
        cmd.args([
            "--no-tui",
            "-q",
            "--mode",
            "sizes",
            "--allocator-symbols",
            "rust",
        ])
        .args(["-p", &pid.to_string(), "--json"])
        .arg(&json);
        let tracer = start_attached(&mut cmd);
        child.stdin.take().unwrap().write_all(b"g").unwrap();
        assert!(child.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        let doc = read_json(&json);
        let want: Funcs = [
            ("malloc", (N + LEAKS, 1000 * N + 777 * LEAKS, 0)),
            ("calloc", (N, 2000 * N, 0)),
            ("realloc", (N, 3000 * N, 0)),
            ("free", (2 * N, 5000 * N, 0)),
        ]
        .into();
        assert_eq!(
            funcs_of(&doc, &["malloc", "calloc", "realloc", "free"]),
            want
        );
        let sizes: BTreeMap<(String, u64), u64> = [
            (("malloc".to_string(), 1000), N),
            (("malloc".to_string(), 777), LEAKS),
            (("calloc".to_string(), 2000), N),
            (("realloc".to_string(), 3000), N),
        ]
        .into();
        assert_eq!(sizes_of(&doc), sizes);
        assert_eq!(doc["functions"]["free"]["untracked"], 0);
        assert_eq!(doc["leaks"]["blocks"].as_u64(), Some(LEAKS));
    }
);

#[test]
fn bad_allocator_symbols_are_one_line_errors() {
    let out = heaptrace()
        .args(["--allocator-symbols", "mallocx=a,free=b", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        error_line(&out).contains("unknown function \"mallocx\""),
        "{out:?}"
    );
    let out = heaptrace()
        .args(["--all", "--allocator-symbols", "rust"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(error_line(&out).contains("cannot be used with"), "{out:?}");
}

bpf_test!(
    fn allocator_symbols_missing_from_the_command_are_one_line_errors() {
        let bin = fixture("customalloc", "", &[]);
        let out = heaptrace()
            .args([
                "--no-tui",
                "--allocator-symbols",
                "malloc=xx_malloc,free=nope",
                "--",
            ])
            .arg(&bin)
            .args(["1", "1"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let line = error_line(&out);
        assert!(line.contains("nope (free) not found in"), "{line}");
        let out = heaptrace()
            .args(["--no-tui", "--allocator-symbols", "prefix:zz_", "--"])
            .arg(&bin)
            .args(["1", "1"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(
            error_line(&out).contains("zz_malloc (malloc) not found in"),
            "{out:?}"
        );
    }
);

bpf_test!(
    shared,
    /// A custom allocator in the program still reserves memory through libc's wrappers, which are
    /// probed in the libc the program maps (not the host-wide syscall tracepoints): the brk heap
    /// the wrapped malloc grows shows as a reservation of the custom malloc's site.
    fn a_custom_allocators_reservations_are_seen_at_libcs_wrappers() {
        let bin = fixture("customalloc", "", &[]);
        let args = [N.to_string(), LEAKS.to_string()];
        let doc = launch(
            "custom-reservations",
            &[
                "--mode",
                "stacks",
                "--probe-stats",
                "--allocator-symbols",
                "prefix:xx_",
            ],
            &bin,
            &args,
            &[],
        );
        assert!(
            program_runs(&doc, "mem_syscall") > 0,
            "{:#}",
            doc["heaptrace"]["programs"]
        );
        assert_eq!(program_runs(&doc, "mem_sys_enter"), 0);
        let brk: Vec<&Value> = doc["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["kind"] == "brk")
            .collect();
        assert!(
            brk.iter().any(|r| r["function"] == "malloc"),
            "{:#}",
            doc["reservations"]
        );
    }
);
