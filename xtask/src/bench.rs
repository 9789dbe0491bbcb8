//! `cargo xtask bench`: the seven Heapprof workloads (`bench/workloads/`) natively, under
//! heaptrace (launched in each mode, attached, recording) and under heaptrack, with a native run
//! before each traced one; medians and ratios against the natives of the same batch. See
//! BENCHMARKS.md for what each number is.
//!
//! A batch is one workload at one thread count. It holds the integration tests' system-wide
//! lock (`/tmp/heaptrace-tests.lock`) exclusively, so no probing test runs during it (an `--all`
//! test would also trace the native runs); tests may run between batches.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs::{self, File},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, de::IgnoredAny};
use serde_json::{Value, json};

use crate::{apt_install, cargo, root, status};

/// The workloads, in Heapprof's order. Each is `bench/workloads/NAME.c` (or `.cpp`).
pub const WORKLOADS: &[&str] = &[
    "threadtest",
    "linux-scalability",
    "shbench",
    "binary-trees",
    "hash-table",
    "parse-json",
    "queue",
];

/// What makes a workload's native run at P = 1 take 0.2-0.3 s on the project's machine at
/// `--scale 1` (issue 6 asks for 0.2-1 s). Native P = 1 runs at these factors' 1 (three each,
/// 2026-11-22): threadtest 0.07 s, linux-scalability 0.14-0.17, shbench 0.06, binary-trees
/// 0.08-0.10, hash-table 0.25-0.41, parse-json 0.25-0.29, queue 0.08-0.13.
pub fn base_scale(w: &str) -> f64 {
    match w {
        "threadtest" => 3.5,
        "linux-scalability" => 1.6,
        "shbench" => 4.0,
        "binary-trees" => 3.0,
        "queue" => 2.5,
        _ => 1.0,
    }
}

/// Debian packages only the benchmark needs, installed when missing.
const BENCH_APT_PACKAGES: &[&str] = &["nlohmann-json3-dev", "heaptrack"];

/// Records in parse-json's generated input (about 2.9 MB).
const JSON_RECORDS: u32 = 5000;

const LOCK: &str = "/tmp/heaptrace-tests.lock";
mod options;
mod parse;
mod process;
mod runner;
mod sizes;
mod summary;

use sizes::sizes;

pub use options::*;
use runner::*;

pub use parse::*;
use process::*;
pub use summary::summary;
use summary::{bytes, count, describe};

/// How a workload is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Native,
    /// `heaptrace -q --mode calls -- W P`
    Calls,
    /// `heaptrace -q --mode counts -- W P`
    Counts,
    Sizes,
    Stacks,
    /// `heaptrace -q --mode calls -p PID` on the workload, stopped until attached.
    AttachCalls,
    /// The same in counts mode.
    AttachCounts,
    /// The same in sizes mode.
    AttachSizes,
    /// The same in stacks mode (named `attach`, as before the other modes were attached too).
    Attach,
    /// `heaptrace record -o FILE -q --mode stacks -- W P`
    Record,
    /// `heaptrack -o FILE W P`
    Heaptrack,
    /// `heaptrace -q --in-process --mode counts -- W P`: the preloaded library, no probes.
    InCounts,
    /// The same in stacks mode.
    InStacks,
}

impl Kind {
    pub const TRACED: [Kind; 12] = [
        Kind::Calls,
        Kind::Counts,
        Kind::Sizes,
        Kind::Stacks,
        Kind::AttachCalls,
        Kind::AttachCounts,
        Kind::AttachSizes,
        Kind::Attach,
        Kind::Record,
        Kind::Heaptrack,
        Kind::InCounts,
        Kind::InStacks,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Native => "native",
            Kind::Calls => "calls",
            Kind::Counts => "counts",
            Kind::Sizes => "sizes",
            Kind::Stacks => "stacks",
            Kind::AttachCalls => "attach-calls",
            Kind::AttachCounts => "attach-counts",
            Kind::AttachSizes => "attach-sizes",
            Kind::Attach => "attach",
            Kind::Record => "record",
            Kind::Heaptrack => "heaptrack",
            Kind::InCounts => "inproc-counts",
            Kind::InStacks => "inproc-stacks",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Kind::TRACED.into_iter().find(|k| k.name() == s)
    }

    /// The `--mode` of an attached run.
    fn attach_mode(self) -> Option<&'static str> {
        match self {
            Kind::AttachCalls => Some("calls"),
            Kind::AttachCounts => Some("counts"),
            Kind::AttachSizes => Some("sizes"),
            Kind::Attach => Some("stacks"),
            _ => None,
        }
    }

    /// The runs that count the calls (a JSON document of heaptrace's). Not the attached ones:
    /// the calls a workload makes before it stops itself are not seen there.
    fn counted(self) -> bool {
        matches!(
            self,
            Kind::Calls | Kind::Counts | Kind::Sizes | Kind::Record | Kind::InCounts
        )
    }

    /// The `--mode` of an in-process run.
    fn in_process_mode(self) -> Option<&'static str> {
        match self {
            Kind::InCounts => Some("counts"),
            Kind::InStacks => Some("stacks"),
            _ => None,
        }
    }
}

/// One run of one workload.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Run {
    pub workload: String,
    pub threads: u32,
    pub kind: Option<Kind>,
    pub rep: usize,
    /// The workload's own timer (start-up, attach, detach and exit left out), seconds.
    pub elapsed: f64,
    /// The workload's own user+system CPU seconds (getrusage at its end).
    pub cpu: f64,
    /// The whole command, from spawn to exit, seconds.
    pub wall: f64,
    /// heaptrace's own user+system CPU seconds (not its children's); for heaptrack, its helper
    /// processes' (the whole command's minus the workload's).
    pub daemon_cpu: Option<f64>,
    /// heaptrace's own peak RSS, KiB.
    pub daemon_rss_kb: Option<u64>,
    /// Calls of the malloc family, from heaptrace's JSON.
    pub calls: Option<u64>,
    pub rounds: Option<u64>,
    /// Everything in heaptrace's `lost`, and its `stack` part alone.
    pub lost: Option<u64>,
    pub lost_stack: Option<u64>,
    /// Distinct stacks in heaptrace's JSON.
    pub stacks: Option<u64>,
    /// The recording's (or heaptrack's compressed file's) size, bytes.
    pub file_bytes: Option<u64>,
    /// A recording's `report --export html` page, bytes.
    pub html_bytes: Option<u64>,
}

impl Run {
    fn kind(&self) -> Kind {
        self.kind.unwrap_or(Kind::Native)
    }

    pub fn to_json(&self) -> Value {
        json!({
            "workload": self.workload, "threads": self.threads, "kind": self.kind().name(),
            "rep": self.rep, "elapsed_s": self.elapsed, "cpu_s": self.cpu, "wall_s": self.wall,
            "daemon_cpu_s": self.daemon_cpu, "daemon_rss_kb": self.daemon_rss_kb,
            "calls": self.calls, "rounds": self.rounds, "lost": self.lost,
            "lost_stack": self.lost_stack, "stacks": self.stacks, "file_bytes": self.file_bytes,
            "html_bytes": self.html_bytes,
        })
    }

    const CSV_HEADER: &str = "workload,threads,kind,rep,elapsed_s,cpu_s,wall_s,daemon_cpu_s,\
                              daemon_rss_kb,calls,rounds,lost,lost_stack,stacks,file_bytes";

    fn csv(&self) -> String {
        fn o<T: ToString>(v: Option<T>) -> String {
            v.map(|v| v.to_string()).unwrap_or_default()
        }
        format!(
            "{},{},{},{},{:.6},{:.6},{:.6},{},{},{},{},{},{},{},{}",
            self.workload,
            self.threads,
            self.kind().name(),
            self.rep,
            self.elapsed,
            self.cpu,
            self.wall,
            o(self.daemon_cpu.map(|c| format!("{c:.3}"))),
            o(self.daemon_rss_kb),
            o(self.calls),
            o(self.rounds),
            o(self.lost),
            o(self.lost_stack),
            o(self.stacks),
            o(self.file_bytes)
        )
    }
}

// ---- processes -------------------------------------------------------------------------------

// ---- running the workloads -------------------------------------------------------------------

/// The integration tests' lock, held exclusively until dropped.
fn lock() -> Result<File> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK)
        .with_context(|| format!("cannot open {LOCK}"))?;
    // SAFETY: flock on a descriptor we own; released when the file closes.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!("flock {LOCK}: {}", std::io::Error::last_os_error());
    }
    Ok(f)
}

// ---- setup and build -------------------------------------------------------------------------

/// Installs the benchmark's packages when missing. A failure is not fatal: without heaptrack
/// its runs are left out, without nlohmann-json3-dev parse-json is.
fn bench_setup() -> (bool, bool) {
    if let Err(e) = apt_install(BENCH_APT_PACKAGES) {
        eprintln!("xtask: warning: {e:#}");
    }
    let heaptrack = Command::new("heaptrack")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let json = Path::new("/usr/include/nlohmann/json.hpp").exists();
    (heaptrack, json)
}

fn newer(src: &Path, out: &Path) -> bool {
    let m = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    match (m(src), m(out)) {
        (Some(s), Some(o)) => s > o,
        _ => true,
    }
}

/// Builds the workloads (when their source or bench.h changed) into `bin`, and parse-json's
/// input when missing.
fn build_workloads(bin: &Path, workloads: &[String]) -> Result<()> {
    fs::create_dir_all(bin)?;
    let src = root().join("bench/workloads");
    let header = src.join("bench.h");
    for w in workloads {
        let cpp = w == "parse-json";
        let source = src.join(format!("{w}.{}", if cpp { "cpp" } else { "c" }));
        let out = bin.join(w);
        if newer(&source, &out) || newer(&header, &out) {
            eprintln!("xtask: building {}", out.display());
            let mut c = Command::new(if cpp { "g++" } else { "gcc" });
            if cpp {
                c.arg("-std=c++17");
            }
            status(
                c.args([
                    "-O2",
                    "-g",
                    "-fno-omit-frame-pointer",
                    "-pthread",
                    "-Wall",
                    "-o",
                ])
                .arg(&out)
                .arg(&source),
            )?;
        }
        if cpp {
            let input = bin.join("parse-json.json");
            if newer(&out, &input) {
                status(
                    Command::new(&out)
                        .arg("--generate")
                        .arg(&input)
                        .arg(JSON_RECORDS.to_string()),
                )?;
            }
        }
    }
    Ok(())
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .current_dir(root())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine() -> Value {
    json!({
        "date": sh("date", &["-Is"]),
        "kernel": sh("uname", &["-r"]),
        "cpus": thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "commit": sh("git", &["rev-parse", "--short", "HEAD"]),
        "glibc": sh("ldd", &["--version"]).lines().next().unwrap_or("").to_string(),
        "heaptrack": sh("heaptrack", &["--version"]),
    })
}

// ---- the command -----------------------------------------------------------------------------

pub fn bench(args: &[String]) -> Result<ExitCode> {
    let mut o = Options::parse(args)?;
    let (heaptrack, json) = bench_setup();
    if !json && o.workloads.iter().any(|w| w == "parse-json") {
        eprintln!("xtask: warning: nlohmann-json3-dev is missing: leaving parse-json out");
        o.workloads.retain(|w| w != "parse-json");
    }
    if !heaptrack && o.kinds.contains(&Kind::Heaptrack) {
        eprintln!("xtask: warning: heaptrack is not installed: leaving its runs out");
        o.kinds.retain(|k| *k != Kind::Heaptrack);
    }
    status(cargo().args(["build", "--release", "-q", "-p", "heaptrace"]))?;
    let out = root().join("target/bench");
    let b = Bench {
        heaptrace: root().join("target/release/heaptrace"),
        bin: out.join("bin"),
        logs: out.join("logs"),
        heaptrack,
        scale: o.scale,
    };
    fs::create_dir_all(&b.logs)?;
    build_workloads(&b.bin, &o.workloads)?;
    if o.sizes {
        return sizes(&b, &o, &out);
    }

    let mut meta = machine();
    meta["command"] = json!(
        format!("cargo xtask bench {}", args.join(" "))
            .trim()
            .to_string()
    );
    meta["scale"] = json!(o.scale);
    meta["reps"] = json!(o.reps);
    meta["loadavg_start"] = json!(loadavg());
    let started = Instant::now();
    let mut runs: Vec<Run> = Vec::new();
    let mut waited = Duration::ZERO;
    let mut notes: Vec<String> = Vec::new();
    for w in &o.workloads {
        for &p in &o.threads {
            for attempt in 1.. {
                let _lock = quiet_host(&mut waited)?;
                let load = loadavg();
                let t0 = Instant::now();
                let (batch, disturbed) = run_batch(&b, &o, w, p)?;
                eprintln!(
                    "xtask: bench {w} P={p} done in {:.0} s (load average before: {load})",
                    t0.elapsed().as_secs_f64()
                );
                match disturbed {
                    Some(who) if attempt < 3 => {
                        eprintln!("xtask: another heaptrace ran during the batch ({who}): again")
                    }
                    _ => {
                        if let Some(who) = disturbed {
                            notes.push(format!("{w} P={p}: another heaptrace ran ({who})"));
                        }
                        runs.extend(batch);
                        break;
                    }
                }
            }
        }
    }
    meta["loadavg_end"] = json!(loadavg());
    meta["duration_s"] = json!(started.elapsed().as_secs_f64().round());
    meta["waited_s"] = json!(waited.as_secs_f64().round());
    meta["notes"] = json!(notes);

    let table = summary(&runs, &meta);
    println!("{table}");
    fs::write(out.join("summary.md"), &table)?;
    let mut csv = String::from(Run::CSV_HEADER);
    for r in &runs {
        csv.push('\n');
        csv.push_str(&r.csv());
    }
    csv.push('\n');
    fs::write(out.join("runs.csv"), csv)?;
    let doc = json!({ "machine": meta, "runs": runs.iter().map(Run::to_json).collect::<Vec<_>>() });
    fs::write(out.join("runs.json"), serde_json::to_string_pretty(&doc)?)?;
    eprintln!(
        "xtask: wrote {}/summary.md, runs.csv and runs.json ({:.0} s)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// One batch: a native run before each traced one, and one at the end. Also says whether a
/// heaptrace this bench did not start was seen between runs.
fn run_batch(b: &Bench, o: &Options, w: &str, p: u32) -> Result<(Vec<Run>, Option<String>)> {
    let mut runs = Vec::new();
    let mut disturbed = None;
    let look = |d: &mut Option<String>| {
        let t = foreign_tracers();
        if !t.is_empty() && d.is_none() {
            *d = Some(t.join("; "));
        }
    };
    for rep in 0..o.reps {
        for &kind in &o.kinds {
            runs.push(b.run(w, p, Kind::Native, rep, None)?);
            look(&mut disturbed);
            let r = b.run(w, p, kind, rep, None)?;
            look(&mut disturbed);
            eprintln!(
                "xtask: bench {w} P={p} {:9} elapsed {:7.3} s (native {:.3} s), wall {:7.3} s",
                kind.name(),
                r.elapsed,
                runs.last().map_or(0.0, |n| n.elapsed),
                r.wall
            );
            runs.push(r);
        }
    }
    runs.push(b.run(w, p, Kind::Native, o.reps, None)?);
    look(&mut disturbed);
    Ok((runs, disturbed))
}

/// Other sessions' `heaptrace --all` processes, as "PID: command line": they trace our runs too,
/// native ones included. (Between runs none of ours is left. A heaptrace with -p or -- traces
/// only its own target; it counts in the load average like any other work.)
fn foreign_tracers() -> Vec<String> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|c| c.is_ascii_digit()))
        else {
            continue;
        };
        if !fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "heaptrace") {
            continue;
        }
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        // A zombie has an empty command line.
        if cmd.split(|c| *c == 0).any(|a| a == b"--all") {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            v.push(format!("{pid}: {}", cmd.trim()));
        }
    }
    v
}

/// Waits until no other heaptrace runs, then takes the tests' lock, and checks again (a test
/// may have started one just before). After 10 minutes it goes on anyway (the batch will say
/// it was disturbed). The time spent waiting is added to `waited`.
fn quiet_host(waited: &mut Duration) -> Result<File> {
    let t0 = Instant::now();
    let mut said = false;
    loop {
        let others = foreign_tracers();
        if others.is_empty() || t0.elapsed() > Duration::from_secs(600) {
            let l = lock()?;
            if foreign_tracers().is_empty() || t0.elapsed() > Duration::from_secs(600) {
                *waited += t0.elapsed();
                return Ok(l);
            }
            continue;
        }
        if !said {
            eprintln!(
                "xtask: waiting for another session's heaptrace to exit: {}",
                others.join("; ")
            );
            said = true;
        }
        thread::sleep(Duration::from_secs(1));
    }
}

// ---- the tables ------------------------------------------------------------------------------

#[cfg(test)]
mod tests;
