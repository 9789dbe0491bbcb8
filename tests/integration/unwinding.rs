//! Whole stacks through code built without frame pointers: unwound from `.eh_frame` in the
//! kernel (docs/unwinding.md), frame-pointer frames interleaved, counts exact per site.
use serde_json::Value;

use crate::support::*;

/// Unwinding on (off by default for now), unless the test's options size it.
const UNWIND: [&str; 2] = ["--unwind-table-size", "1048576"];

fn trace(tag: &str, bin: &std::path::Path, opts: &[&str]) -> Value {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q"]);
    if !opts.contains(&"--unwind-table-size") {
        cmd.args(UNWIND);
    }
    cmd.args(opts).arg("--json").arg(&json).arg("--").arg(bin);
    run_ok(&mut cmd);
    read_json(&json)
}

/// tests/fixtures/unwinddeep.c built -O2, its library with `lib_fp` frame pointers and the
/// program with `prog_fp`.
pub(crate) fn unwinddeep(lib_fp: bool, prog_fp: bool) -> std::path::PathBuf {
    let fp = |on: bool| {
        if on {
            "-fno-omit-frame-pointer"
        } else {
            "-fomit-frame-pointer"
        }
    };
    let tag = |on: bool| if on { "fp" } else { "nofp" };
    let lib = fixture(
        "unwindlib",
        &format!("-{}.so", tag(lib_fp)),
        &["-O2", fp(lib_fp), "-shared", "-fPIC"],
    );
    fixture(
        "unwinddeep",
        &format!("-{}-{}", tag(prog_fp), tag(lib_fp)),
        // Named before the source: not dropped as unneeded for that.
        &[
            "-O2",
            fp(prog_fp),
            "-Wl,--no-as-needed",
            lib.to_str().unwrap(),
        ],
    )
}

/// A site's frames' function names, `.localalias` (gcc's alias of a recursive function in a
/// shared library) dropped.
pub(crate) fn names(site: &Value) -> Vec<String> {
    site["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let n = f["function"].as_str().unwrap_or("");
            n.trim_end_matches(".localalias").to_string()
        })
        .collect()
}

/// A stack's function names up to `main`, or all of them where it has none.
pub(crate) fn upto_main(all: &[String]) -> Vec<String> {
    all.iter()
        .position(|f| f == "main")
        .map_or(all.to_vec(), |i| all[..=i].to_vec())
}

/// The three sites of unwinddeep, by bytes: (calls, frames up to main).
pub(crate) fn sites(doc: &Value) -> Vec<(u64, u64, Vec<String>, Vec<String>)> {
    let mut out: Vec<_> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == "malloc")
        .map(|s| {
            let all = names(s);
            let upto = upto_main(&all);
            let rest = all[upto.len()..].to_vec();
            (
                s["bytes"].as_u64().unwrap(),
                s["calls"].as_u64().unwrap(),
                upto,
                rest,
            )
        })
        .collect();
    out.sort();
    out
}

/// malloc <- lib_down x (depth + 1) <- lib_alloc <- via_program <- lib_call <- round_of <- main.
pub(crate) fn expected(depth: usize) -> Vec<String> {
    let mut f = vec!["lib_down".to_string(); depth + 1];
    f.extend(
        ["lib_alloc", "via_program", "lib_call", "round_of", "main"]
            .iter()
            .map(|s| s.to_string()),
    );
    f
}

/// `unwinddeep`'s three sites (its stacks only, not a shell's), each whole, and no walk late.
fn whole_from_the_first_call(mut doc: Value) {
    let mine: Vec<Value> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| names(s).iter().any(|f| f == "round_of"))
        .cloned()
        .collect();
    doc["stacks"] = Value::Array(mine);
    let got: Vec<_> = sites(&doc)
        .into_iter()
        .map(|(b, c, f, _)| (b, c, f))
        .collect();
    let want: Vec<(u64, u64, Vec<String>)> = vec![
        (1600, 100, expected(0)),
        (6400, 200, expected(2)),
        (14400, 300, expected(4)),
    ];
    assert_eq!(got, want);
    assert_eq!(doc["lost"]["unwind_late"], 0, "{}", doc["lost"]);
}

fn check_whole(doc: &Value) {
    let got = sites(doc);
    let want: Vec<(u64, u64, Vec<String>)> = vec![
        (1600, 100, expected(0)),
        (6400, 200, expected(2)),
        (14400, 300, expected(4)),
    ];
    let shown: Vec<_> = got.iter().map(|(b, c, f, _)| (*b, *c, f.clone())).collect();
    assert_eq!(shown, want, "{got:?}");
    // Past main, libc's start and the executable's _start, where the walk ends cleanly.
    for (_, _, _, rest) in &got {
        assert_eq!(rest.last().map(String::as_str), Some("_start"), "{rest:?}");
        assert!(rest.len() <= 4, "{rest:?}");
    }
    assert_eq!(doc["lost"]["unwind_no_rule"], 0);
    assert_eq!(doc["lost"]["unwind_table"], 0);
    assert_eq!(doc["lost"]["stack_depth"], 0);
    assert_eq!(doc["lost"]["stack"], 0);
}

bpf_test!(
    shared,
    /// Program and library -O2 -fomit-frame-pointer: every frame is unwound from its table,
    /// each site's stack is whole to main and the walk ends at `_start`.
    fn stacks_without_frame_pointers_reach_main_with_exact_counts() {
        let doc = trace("unwind-nofp", &unwinddeep(false, false), &[]);
        check_whole(&doc);
    }
);

bpf_test!(
    shared,
    /// A library's constructor mallocs, run by ld.so from `_dl_start_user`, which has no FDE
    /// and clears rbp first: the stack is whole there, not counted as cut for want of a rule.
    fn a_library_constructor_s_stack_ends_at_ld_so_s_start_whole() {
        let lib = fixture(
            "ctorlib",
            ".so",
            &["-O2", "-fomit-frame-pointer", "-shared", "-fPIC"],
        );
        let bin = fixture(
            "ctorprog",
            "",
            &["-O2", "-Wl,--no-as-needed", lib.to_str().unwrap()],
        );
        let doc = trace("unwind-ctor", &bin, &[]);
        let ctor: Vec<&Value> = doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["function"] == "malloc" && names(s).contains(&"ctor_alloc".into()))
            .collect();
        assert_eq!(ctor.len(), 1, "{ctor:?}");
        assert_eq!(ctor[0]["calls"], 100);
        let all = names(ctor[0]);
        assert_eq!(
            all.first().map(String::as_str),
            Some("ctor_alloc"),
            "{all:?}"
        );
        assert_eq!(
            all.last().map(String::as_str),
            Some("_dl_start_user"),
            "{all:?}"
        );
        assert_eq!(doc["lost"]["unwind_no_rule"], 0, "{}", doc["lost"]);
    }
);

bpf_test!(
    shared,
    /// The program keeps frame pointers, its library has none (and the other way round):
    /// frame-pointer steps and table steps interleave in one stack.
    fn frame_pointer_and_table_frames_interleave() {
        let doc = trace("unwind-mixed", &unwinddeep(false, true), &[]);
        check_whole(&doc);
        let doc = trace("unwind-mixed2", &unwinddeep(true, false), &[]);
        check_whole(&doc);
    }
);

bpf_test!(
    shared,
    /// A running process traced with -p: its entry is written at the daemon's first read of
    /// its mappings, within the first round; it allocates after that.
    fn a_running_process_gets_whole_stacks() {
        use std::io::Write as _;
        let mut cmd = std::process::Command::new(unwinddeep(false, false));
        cmd.arg("wait");
        let mut target = ready(cmd);
        let json = json_path("unwind-pid");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--interval", "200ms"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .args(["-p", &target.id().to_string()]);
        let tracer = start_attached(&mut cmd);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut stdin = target.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        // Alive for a few rounds: its stacks are named from its mappings while it lives.
        std::thread::sleep(std::time::Duration::from_millis(800));
        drop(stdin);
        assert!(target.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        check_whole(&read_json(&json));
    }
);

bpf_test!(
    shared,
    /// `--unwind-table-size 0` walks by frame pointer only: without them, a stack stops at
    /// the allocating function, its counts still exact.
    fn without_tables_a_walk_stops_where_frame_pointers_end() {
        let doc = trace(
            "unwind-off",
            &unwinddeep(false, false),
            &["--unwind-table-size", "0"],
        );
        let got = sites(&doc);
        let calls: u64 = got.iter().map(|s| s.1).sum();
        assert_eq!(calls, 600, "{got:?}");
        assert!(
            got.iter().all(|s| !s.2.contains(&"main".to_string())),
            "{got:?}"
        );
    }
);

bpf_test!(
    shared,
    /// A frame of 600,000 bytes (CFA rsp + 600,016: more words than 16 bits hold) is unwound
    /// by its row like any other, to main.
    fn a_frame_past_512_kib_is_unwound() {
        let bin = fixture("bigframe", "-nofp", &["-O2", "-fomit-frame-pointer"]);
        let doc = trace("unwind-bigframe", &bin, &[]);
        let got = sites(&doc);
        let calls: u64 = got.iter().map(|s| s.1).sum();
        assert_eq!(calls, 100, "{got:?}");
        for (_, _, frames, _) in &got {
            assert_eq!(frames, &["big", "main"], "{got:?}");
        }
        assert_eq!(doc["lost"]["unwind_no_rule"], 0);
    }
);

bpf_test!(
    shared,
    /// cc1plus's table (~420,000 rows) is larger than a chunk of the kernel's rows (262,144),
    /// so it spans two: g++'s compiler, followed from the launched driver at the defaults,
    /// has every listed stack whole, and no walk is lost to the tables.
    fn a_table_larger_than_a_chunk_is_walked_whole() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/templates.cpp");
        let out = json_path("unwind-gpp").with_extension("o");
        let json = json_path("unwind-gpp");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--json"])
            .arg(&json)
            .args(["--", "g++", "-O2", "-c"])
            .arg(&src)
            .arg("-o")
            .arg(&out);
        run_ok(&mut cmd);
        let doc = read_json(&json);
        for loss in ["unwind_table", "unwind_late", "unwind_no_rule", "stack"] {
            assert_eq!(doc["lost"][loss], 0, "{loss}: {}", doc["lost"]);
        }
        let cc1plus: Vec<u64> = doc["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["comm"] == "cc1plus")
            .map(|p| p["pid"].as_u64().unwrap())
            .collect();
        assert_eq!(cc1plus.len(), 1, "{}", doc["processes"]);
        let bottoms = ["main", "_start", "__libc_start_call_main"];
        let mut listed = 0;
        for s in doc["stacks"].as_array().unwrap() {
            if s["pid"].as_u64() != Some(cc1plus[0]) {
                continue;
            }
            listed += 1;
            let frames = names(s);
            assert!(
                frames.iter().any(|f| bottoms.contains(&f.as_str())),
                "{frames:?}"
            );
        }
        assert!(listed > 100, "{listed} cc1plus stacks listed");
    }
);

bpf_test!(
    shared,
    /// rustc's two libraries take ~2.6 M rows (the kernel's table held 1 M before it grew as
    /// needed), and its `run_compiler` closures' frames take 527 KiB: at the defaults no walk
    /// is lost to the table's room, and next to none to rows without a rule (~420 walks
    /// through LLVM's functions whose CFA is another register's, 1 % of a debug build's).
    fn rustcs_tables_fit_at_the_defaults() {
        let dir = json_path("unwind-rustc").with_extension("d");
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("hello.rs");
        std::fs::write(&src, "fn main() { println!(\"{:?}\", vec![1, 2, 3]); }\n").unwrap();
        let json = json_path("unwind-rustc");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--json"])
            .arg(&json)
            .args(["--", "rustc", "--out-dir"])
            .arg(&dir)
            .arg(&src);
        run_ok(&mut cmd);
        let doc = read_json(&json);
        let calls = doc["totals"]["allocations"].as_u64().unwrap();
        assert!(calls > 10_000, "{calls}");
        assert_eq!(doc["lost"]["unwind_table"], 0, "{}", doc["lost"]);
        let no_rule = doc["lost"]["unwind_no_rule"].as_u64().unwrap();
        assert!(no_rule * 50 < calls, "{no_rule} of {calls}");
    }
);

bpf_test!(
    shared,
    /// A table too big for `--unwind-table-size` (one row here): the walk stops at the first
    /// frame in its file, rather than follow frame pointers it does not keep into junk
    /// frames, and the stack says so. Counts stay exact.
    fn a_table_without_room_cuts_the_stack_there_and_says_so() {
        let doc = trace(
            "unwind-noroom",
            &unwinddeep(false, false),
            &["--unwind-table-size", "1"],
        );
        let got = sites(&doc);
        let calls: u64 = got.iter().map(|s| s.1).sum();
        assert_eq!(calls, 600, "{got:?}");
        for (_, _, frames, _) in &got {
            let last = frames.last().map(String::as_str).unwrap_or("");
            assert!(
                last.contains("no room for this file's unwind rows")
                    && last.contains("--unwind-table-size"),
                "{got:?}"
            );
            // The allocating frame, then the mark: nothing read from the junk above it.
            assert_eq!(frames.len(), 2, "{got:?}");
        }
        assert!(doc["lost"]["unwind_table"].as_u64().unwrap() >= 600);
    }
);

bpf_test!(
    shared,
    /// Through libstdc++ (no frame pointers) from a program built without them:
    /// operator new <- (inlined allocator frames) <- vector::_M_realloc_insert <- main, 400
    /// calls of 60 bytes a vector.
    fn cpp_stacks_through_libstdcxx_reach_main() {
        let bin = cpp_fixture_with("cppvector", "-nofp", &["-O2", "-fomit-frame-pointer", "-g"]);
        let doc = trace("unwind-cpp", &bin, &[]);
        let site = doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["calls"] == 400)
            .unwrap_or_else(|| panic!("no site of 400 calls: {}", doc["stacks"]));
        assert_eq!(site["bytes"], 6000);
        let f = names(site);
        assert_eq!(f[0], "operator new(unsigned long)", "{f:?}");
        let realloc = f.iter().position(|n| n.contains("_M_realloc_insert"));
        let main = f.iter().position(|n| n == "main");
        assert!(
            matches!((realloc, main), (Some(r), Some(m)) if r < m),
            "{f:?}"
        );
        assert_eq!(f.last().map(String::as_str), Some("_start"), "{f:?}");
    }
);

bpf_test!(
    shared,
    /// Debian's python3 (stripped, no frame pointers): at least 95 % of its allocation calls
    /// have stacks that reach `Py_BytesMain` or `main`.
    fn python3_stacks_reach_main() {
        let python = std::path::Path::new("/usr/bin/python3");
        if !python.exists() {
            panic!("/usr/bin/python3 missing");
        }
        let json = json_path("unwind-python");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .args([
                "--",
                "/usr/bin/python3",
                "-c",
                "import json\nx = [json.dumps({'a': i, 'b': [i] * 3}) for i in range(20000)]",
            ]);
        run_ok(&mut cmd);
        let doc = read_json(&json);
        let (mut all, mut whole) = (0, 0);
        for s in doc["stacks"].as_array().unwrap() {
            let calls = s["calls"].as_u64().unwrap();
            all += calls;
            if names(s).iter().any(|n| n == "Py_BytesMain" || n == "main") {
                whole += calls;
            }
        }
        assert!(all > 1000, "{all} calls");
        assert!(whole * 100 >= all * 95, "{whole} of {all} calls reach main");
    }
);

bpf_test!(
    shared,
    /// A thread's stack ends cleanly where its start routine was called: work <- libc's
    /// start_thread <- clone3, whose table marks the outermost frame. Every one of them.
    fn thread_stacks_end_at_their_start() {
        let bin = fixture("threadchurn", "-O2-nofp", &["-O2", "-fomit-frame-pointer"]);
        let json = json_path("unwind-threads");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .arg("--")
            .arg(&bin)
            .args(["4", "2", "50000", "64"]);
        run_ok(&mut cmd);
        let doc = read_json(&json);
        let (mut all, mut whole) = (0, 0);
        for s in doc["stacks"].as_array().unwrap() {
            let calls = s["calls"].as_u64().unwrap();
            if names(s).first().map(String::as_str) != Some("work") {
                continue; // the C library's own, starting threads
            }
            all += calls;
            let modules: Vec<&str> = s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["module"].as_str().unwrap_or(""))
                .collect();
            if modules[1..] == ["libc.so.6", "libc.so.6"] {
                whole += calls;
            }
        }
        assert_eq!(all, 200_000, "4 threads x 50000");
        assert_eq!(whole, all);
        assert_eq!(doc["lost"]["unwind_no_rule"], 0);
    }
);

bpf_test!(
    shared,
    /// A followed fork that execs (a shell running the program): its new image is held at its
    /// start until its unwind tables are in, so its stacks are whole from its first call and
    /// no walk is made before them.
    fn an_execed_fork_gets_its_tables_before_its_first_call() {
        let bin = unwinddeep(false, false);
        let json = json_path("unwind-forkexec");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .args(["--", "sh", "-c"])
            .arg(format!("{}; true", bin.display()));
        run_ok(&mut cmd);
        whole_from_the_first_call(read_json(&json));
    }
);

bpf_test!(
    shared,
    /// The same under `-p SHELL --follow-forks`: the seized shell's fork is held until it has
    /// links, and its new image at its start until its tables are in.
    fn an_attached_shell_s_execed_fork_gets_its_tables_before_its_first_call() {
        let bin = unwinddeep(false, false);
        let mut sh = std::process::Command::new("sh");
        sh.arg("-c")
            .arg(format!("echo ready; read x; {}; true", bin.display()));
        let (mut shell, _out, line) = piped(&mut sh);
        assert_eq!(line, "ready\n");
        let json = json_path("unwind-pid-forkexec");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--interval", "100ms", "--follow-forks"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json)
            .args(["-p", &shell.id().to_string()]);
        let tracer = start_attached(&mut cmd);
        use std::io::Write as _;
        shell.stdin.take().unwrap().write_all(b"go\n").unwrap();
        assert!(shell.wait().unwrap().success());
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        whole_from_the_first_call(read_json(&json));
    }
);

bpf_test!(
    exclusive,
    /// `--all`: a process that ends before its unwind entry can be written walks each frame's
    /// file by its mapping (`bpf_find_vma`), with the rows loaded for another process that maps
    /// the same files (here one running since before the attach): its stacks are whole and
    /// no walk is late (before: 145 to 1,286 of 18,000 calls cut, in runs of 30).
    fn all_walks_a_process_without_an_entry_by_its_mappings() {
        let bin = unwinddeep(false, false);
        let mut cmd = std::process::Command::new(&bin);
        cmd.arg("wait");
        let (mut first, _out, line) = piped(&mut cmd);
        assert_eq!(line, "ready\n");
        let json = json_path("unwind-all-vma");
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--all", "--comm", "unwinddeep"])
            .args(UNWIND)
            .arg("--json")
            .arg(&json);
        let tracer = start_attached(&mut cmd);
        const RUNS: u64 = 20;
        for _ in 0..RUNS {
            assert!(std::process::Command::new(&bin).status().unwrap().success());
        }
        use std::io::Write as _;
        let mut stdin = first.stdin.take().unwrap();
        stdin.write_all(b"g").unwrap();
        drop(stdin);
        assert!(first.wait().unwrap().success());
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        let doc = read_json(&json);
        let (mut all, mut whole) = (0, 0);
        for s in doc["stacks"].as_array().unwrap() {
            let f = names(s);
            if s["pid"] == first.id() || !f.iter().any(|f| f == "round_of") {
                continue;
            }
            let calls = s["calls"].as_u64().unwrap();
            all += calls;
            whole += calls * u64::from(f.iter().any(|f| f == "main"));
        }
        assert_eq!(all, RUNS * 600, "{stderr}");
        assert_eq!(whole, all, "{}", doc["lost"]);
        assert_eq!(doc["lost"]["unwind_late"], 0, "{}", doc["lost"]);
    }
);
