use super::*;

#[test]
fn summary_line() {
    let out = "heaptrack output\nbench: queue P=2 scale=1 reps=1 elapsed=0.250000 cpu=0.490000\n";
    assert_eq!(parse_summary(out), Some((0.25, 0.49)));
    assert_eq!(parse_summary("nothing"), None);
}

#[test]
fn stat_times_skip_the_command_name() {
    let stat = "42 (a (b) c) Z 1 2 3 4 5 6 7 8 9 10 150 50 300 100 20 0";
    assert_eq!(parse_stat_times(stat, 100.0), Some([1.5, 0.5, 3.0, 1.0]));
}

#[test]
fn heaptrace_json() {
    let doc = json!({
        "rounds": 3,
        "functions": { "malloc": { "calls": 10, "bytes": 5 }, "free": { "calls": 9 }, "valloc": { "calls": 0 } },
        "lost": { "stack": 4, "live_map": 1 },
        "stacks": [{ "frames": [] }, { "calls": 1 }],
        "other": [1, 2]
    });
    let text = doc.to_string();
    assert_eq!(
        parse_heaptrace_json(text.as_bytes()).unwrap(),
        (19, 3, 5, 4, 2)
    );
}

#[test]
fn options() {
    let o = Options::parse(&[]).unwrap();
    assert_eq!(o.threads, [1, 2, 4]);
    assert_eq!(o.kinds, Kind::TRACED);
    let a = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    let q = Options::parse(&a("--quick --workloads queue,shbench --reps 2")).unwrap();
    assert_eq!((q.threads.as_slice(), q.scale, q.reps), (&[1][..], 0.2, 2));
    assert_eq!(q.workloads, ["queue", "shbench"]);
    let s = Options::parse(&a("--sizes --seconds 5 --only stacks,counts")).unwrap();
    assert_eq!((s.threads.as_slice(), s.seconds), (&[8][..], 5.0));
    assert_eq!(s.kinds, [Kind::Counts, Kind::Stacks]);
    let c = Options::parse(&a("--only counts,calls")).unwrap();
    assert_eq!(c.kinds, [Kind::Calls, Kind::Counts]);
    assert!(Options::parse(&a("--workloads nope")).is_err());
    assert!(Options::parse(&a("--reps 0")).is_err());
}

/// Every workload builds, runs at a tiny scale at P = 3 and prints its summary line, and one
/// stops itself under HEAPTRACE_BENCH_STOP until SIGCONT. No probes, no timing.
#[test]
fn workloads_build_and_run() {
    let dir = std::env::temp_dir().join(format!("xtask-bench-test-{}", std::process::id()));
    let c: Vec<String> = WORKLOADS
        .iter()
        .filter(|w| **w != "parse-json")
        .map(|w| w.to_string())
        .collect();
    build_workloads(&dir, &c).unwrap();
    for w in &c {
        let out = Command::new(dir.join(w))
            .args(["3", "0.01"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{w}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.starts_with(&format!("bench: {w} P=3 scale=0.01 reps=1 ")),
            "{text}"
        );
        assert!(parse_summary(&text).is_some(), "{text}");
    }
    // SECONDS repeats the work.
    let out = Command::new(dir.join("queue"))
        .args(["1", "0.001", "0.05"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("reps=1 "), "{text}");

    let child = Command::new(dir.join("shbench"))
        .args(["2", "0.01"])
        .env("HEAPTRACE_BENCH_STOP", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    wait_until("the stop", Duration::from_secs(10), || {
        Ok(proc_state(pid) == Some('T'))
    })
    .unwrap();
    // SAFETY: signals our own child.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(parse_summary(&String::from_utf8_lossy(&out.stdout)).is_some());

    // parse-json needs Debian's nlohmann-json3-dev, which only the benchmark installs.
    if Path::new("/usr/include/nlohmann/json.hpp").exists() {
        status(
            Command::new("g++")
                .args(["-std=c++17", "-fsyntax-only", "-Wall"])
                .arg(root().join("bench/workloads/parse-json.cpp")),
        )
        .unwrap();
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn tables() {
    let run = |kind: Option<Kind>, elapsed: f64, cpu: f64| Run {
        workload: "queue".into(),
        threads: 1,
        kind,
        elapsed,
        cpu,
        wall: elapsed + 2.0,
        calls: kind.map(|_| 1_000_000),
        daemon_cpu: kind.map(|_| 0.5),
        daemon_rss_kb: kind.map(|_| 20480),
        file_bytes: (kind == Some(Kind::Record)).then_some(20000),
        ..Run::default()
    };
    let runs = [
        run(None, 0.1, 0.1),
        run(Some(Kind::Stacks), 4.1, 4.0),
        run(None, 0.1, 0.1),
        run(Some(Kind::Record), 4.1, 4.0),
        run(None, 0.3, 0.1),
    ];
    let t = summary(&runs, &json!({ "command": "cargo xtask bench", "reps": 1 }));
    assert!(
        t.contains("| queue | 1 | 1,000,000 | 0.100 s (0.100 s) | 41x | 41x |"),
        "{t}"
    );
    assert!(
        t.contains("| queue | 1 | 4000 (3900) | 4000 (3900) |"),
        "{t}"
    );
    assert!(
        t.contains("| **mean** | 1 | | | **41x** | **41x** |"),
        "{t}"
    );
    assert!(
        t.contains("| 0.50 s | 20 MiB | 2.00 s | - | - | 0.50 s | 20 MiB |"),
        "{t}"
    );
    assert!(t.contains("| 20000 B |") || t.contains("| 20 KiB |"), "{t}");
}
