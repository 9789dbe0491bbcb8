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
}

impl Kind {
    pub const TRACED: [Kind; 10] = [
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
            Kind::Calls | Kind::Counts | Kind::Sizes | Kind::Record
        )
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub workloads: Vec<String>,
    pub threads: Vec<u32>,
    pub reps: usize,
    pub scale: f64,
    pub kinds: Vec<Kind>,
    /// The recording-size runs instead of the timing batches.
    pub sizes: bool,
    /// For `--sizes`: how long the looped recording runs.
    pub seconds: f64,
}

pub const USAGE: &str = "\
usage: cargo xtask bench [--quick] [--workloads a,b] [--threads 1,2,4] [--reps N] [--scale F]
                         [--only calls,counts,sizes,stacks,attach-calls,attach-counts,
                                 attach-sizes,attach,record,heaptrack]
       cargo xtask bench --sizes [--workloads a,b] [--threads 8] [--seconds 60] [--scale F]
  --quick    P = 1 only, scale 0.2 (a few minutes)
  --sizes    recording sizes: each workload once under heaptrace record and heaptrack, then
             under heaptrace record looping for --seconds (see BENCHMARKS.md)";

impl Options {
    pub fn parse(args: &[String]) -> Result<Options> {
        let mut o = Options {
            workloads: WORKLOADS.iter().map(|s| s.to_string()).collect(),
            threads: vec![1, 2, 4],
            reps: 1,
            scale: 1.0,
            kinds: Kind::TRACED.to_vec(),
            sizes: false,
            seconds: 60.0,
        };
        let (mut quick, mut threads, mut scale) = (false, None, None);
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = || {
                it.next()
                    .cloned()
                    .with_context(|| format!("{a} needs a value"))
            };
            match a.as_str() {
                "--quick" => quick = true,
                "--sizes" => o.sizes = true,
                "--workloads" => {
                    o.workloads = list(&value()?);
                    if let Some(w) = o
                        .workloads
                        .iter()
                        .find(|w| !WORKLOADS.contains(&w.as_str()))
                    {
                        bail!("unknown workload {w} (known: {})", WORKLOADS.join(","));
                    }
                }
                "--threads" | "-P" => {
                    threads = Some(
                        list(&value()?)
                            .iter()
                            .map(|p| p.parse::<u32>().ok().filter(|p| *p >= 1))
                            .collect::<Option<Vec<_>>>()
                            .context("--threads takes numbers >= 1")?,
                    )
                }
                "--reps" => {
                    o.reps = value()?
                        .parse()
                        .ok()
                        .filter(|r| *r >= 1)
                        .context("--reps takes a number >= 1")?
                }
                "--scale" => {
                    scale = Some(
                        value()?
                            .parse::<f64>()
                            .ok()
                            .filter(|s| *s > 0.0)
                            .context("--scale takes a number > 0")?,
                    )
                }
                "--seconds" => {
                    o.seconds = value()?
                        .parse::<f64>()
                        .ok()
                        .filter(|s| *s > 0.0)
                        .context("--seconds takes a number > 0")?
                }
                "--only" => {
                    o.kinds = list(&value()?)
                        .iter()
                        .map(|k| Kind::parse(k))
                        .collect::<Option<Vec<_>>>()
                        .context(
                            "--only takes calls,counts,sizes,stacks,attach-calls,attach-counts,attach-sizes,\
                             attach,record,heaptrack",
                        )?;
                    o.kinds.sort();
                    o.kinds.dedup();
                }
                _ => bail!("unknown argument {a}\n{USAGE}"),
            }
        }
        if quick {
            o.threads = vec![1];
            o.scale = 0.2;
        }
        if o.sizes {
            o.threads = vec![8];
        }
        if let Some(t) = threads {
            o.threads = t;
        }
        if let Some(s) = scale {
            o.scale = s;
        }
        Ok(o)
    }
}

fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
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

/// The workload's summary line: `bench: NAME P=.. scale=.. reps=.. elapsed=S cpu=S`.
pub fn parse_summary(out: &str) -> Option<(f64, f64)> {
    let line = out.lines().rev().find(|l| l.starts_with("bench: "))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((field("elapsed=")?, field("cpu=")?))
}

/// The parts of heaptrace's `--json` the tables use. The document can be large (binary-trees'
/// is over 100 MB), so it is read as a stream into these alone.
#[derive(Deserialize, Default)]
struct HeaptraceDoc {
    #[serde(default)]
    rounds: u64,
    #[serde(default)]
    functions: BTreeMap<String, FunctionDoc>,
    #[serde(default)]
    lost: BTreeMap<String, u64>,
    #[serde(default)]
    stacks: Vec<IgnoredAny>,
}

#[derive(Deserialize)]
struct FunctionDoc {
    #[serde(default)]
    calls: u64,
}

/// From heaptrace's `--json`: (calls of every function, rounds, all lost, lost stacks, stacks).
pub fn parse_heaptrace_json(r: impl std::io::Read) -> Result<(u64, u64, u64, u64, u64)> {
    let d: HeaptraceDoc = serde_json::from_reader(std::io::BufReader::new(r))?;
    Ok((
        d.functions.values().map(|f| f.calls).sum(),
        d.rounds,
        d.lost.values().sum(),
        d.lost.get("stack").copied().unwrap_or(0),
        d.stacks.len() as u64,
    ))
}

/// `utime stime cutime cstime` of /proc/PID/stat, in seconds.
pub fn parse_stat_times(stat: &str, ticks_per_s: f64) -> Option<[f64; 4]> {
    // Fields after the command name, which may hold spaces and parentheses: state is field 3,
    // utime 14, stime 15, cutime 16, cstime 17.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i)?.parse::<f64>().ok().map(|v| v / ticks_per_s);
    Some([t(11)?, t(12)?, t(13)?, t(14)?])
}

pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

// ---- processes -------------------------------------------------------------------------------

/// What the kernel says about a finished process.
struct Exited {
    wall: f64,
    code: i32,
    /// Its own user+system time, and its reaped children's.
    self_cpu: f64,
    children_cpu: f64,
    /// The largest VmHWM seen while polling it every 10 ms. (wait4's ru_maxrss would not do:
    /// it includes the children's, and the pre-exec image's, which is a fork of this process.)
    hwm_kb: u64,
}

struct Running {
    pid: i32,
    start: Instant,
    stop: Arc<AtomicBool>,
    poller: thread::JoinHandle<u64>,
}

fn spawn(cmd: &mut Command) -> Result<Running> {
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| format!("cannot run {cmd:?}"))?;
    let pid = child.id() as i32;
    // The Child is not waited for through std: finish() reaps it with wait4.
    drop(child);
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let poller = thread::spawn(move || {
        let mut max = 0;
        while !s.load(Ordering::Relaxed) {
            if let Some(kb) = vm_hwm_kb(pid) {
                max = max.max(kb);
            }
            thread::sleep(Duration::from_millis(10));
        }
        max
    });
    Ok(Running {
        pid,
        start,
        stop,
        poller,
    })
}

fn vm_hwm_kb(pid: i32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn exited_nowait(pid: i32, block: bool) -> Result<bool> {
    // SAFETY: waitid on our own child with a zeroed siginfo it fills in.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOWAIT | if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: as above.
        let r = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) };
        if r == 0 {
            // SAFETY: si_pid is set when a child was found, 0 otherwise (WNOHANG).
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).context("waitid");
        }
    }
}

/// Waits for the exit without reaping first, so /proc/PID/stat still holds the process's own
/// times apart from its children's (a launched workload is heaptrace's child); then reaps it.
fn finish(r: Running) -> Result<Exited> {
    exited_nowait(r.pid, true)?;
    let wall = r.start.elapsed().as_secs_f64();
    r.stop.store(true, Ordering::Relaxed);
    let hwm_kb = r.poller.join().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let times = fs::read_to_string(format!("/proc/{}/stat", r.pid))
        .ok()
        .and_then(|s| parse_stat_times(&s, ticks))
        .unwrap_or_default();
    let mut st = 0;
    // SAFETY: reaps our own child.
    if unsafe { libc::waitpid(r.pid, &mut st, 0) } != r.pid {
        bail!("waitpid: {}", std::io::Error::last_os_error());
    }
    let code = if libc::WIFEXITED(st) {
        libc::WEXITSTATUS(st)
    } else {
        128 + libc::WTERMSIG(st)
    };
    Ok(Exited {
        wall,
        code,
        self_cpu: times[0] + times[1],
        children_cpu: times[2] + times[3],
        hwm_kb,
    })
}

fn file_out(path: &Path) -> Result<Stdio> {
    Ok(File::create(path)
        .with_context(|| format!("cannot create {}", path.display()))?
        .into())
}

/// Waits until `pred` holds, checking every 10 ms.
fn wait_until(what: &str, timeout: Duration, mut pred: impl FnMut() -> Result<bool>) -> Result<()> {
    let t0 = Instant::now();
    while !pred()? {
        if t0.elapsed() > timeout {
            bail!("timed out waiting for {what}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn proc_state(pid: i32) -> Option<char> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..]
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

// ---- running the workloads -------------------------------------------------------------------

struct Bench {
    heaptrace: PathBuf,
    bin: PathBuf,
    logs: PathBuf,
    heaptrack: bool,
    scale: f64,
}

impl Bench {
    fn workload(&self, w: &str) -> PathBuf {
        self.bin.join(w)
    }

    fn log(&self, w: &str, p: u32, kind: &str, rep: usize, ext: &str) -> PathBuf {
        self.logs.join(format!("{w}-P{p}-{kind}-{rep}.{ext}"))
    }

    /// The timing runs scale each workload by `base_scale` as well; the looped size runs do not
    /// (their length is their time).
    fn args(&self, w: &str, p: u32, seconds: Option<f64>) -> Vec<String> {
        let scale = match seconds {
            None => self.scale * base_scale(w),
            Some(_) => self.scale,
        };
        let mut a = vec![p.to_string(), scale.to_string()];
        if let Some(s) = seconds {
            a.push(s.to_string());
        }
        a
    }

    /// One run of `kind`; `seconds` loops the workload (the size runs).
    fn run(&self, w: &str, p: u32, kind: Kind, rep: usize, seconds: Option<f64>) -> Result<Run> {
        let files = self.files(w, p, kind, rep, seconds);
        let _ = fs::remove_file(&files.json);
        let mut run = Run {
            workload: w.to_string(),
            threads: p,
            kind: (kind != Kind::Native).then_some(kind),
            rep,
            ..Run::default()
        };
        let exited = self.launch(w, p, kind, seconds, &files, &mut run)?;
        let stdout = fs::read_to_string(&files.out).unwrap_or_default();
        if exited.code != 0 {
            bail!(
                "{w} P={p} {} exited with {} (see {} and {})",
                files.name,
                exited.code,
                files.out.display(),
                files.err.display()
            );
        }
        let (elapsed, cpu) = parse_summary(&stdout)
            .with_context(|| format!("no summary line in {}", files.out.display()))?;
        run.elapsed = elapsed;
        run.cpu = cpu;
        run.wall = exited.wall;
        if kind == Kind::Heaptrack {
            // The whole command's CPU (workload, heaptrack_interpret, compression) minus the
            // workload's own.
            run.daemon_cpu = run.daemon_cpu.map(|c| (c - cpu).max(0.0));
        }
        if kind == Kind::Record {
            self.report(&files)?;
        }
        if kind.counted() {
            read_counts(&files.json, &mut run)?;
        }
        if kind == Kind::Record {
            run.file_bytes = Some(fs::metadata(&files.rec)?.len());
        }
        Ok(run)
    }

    /// Where one run's output goes.
    fn files(&self, w: &str, p: u32, kind: Kind, rep: usize, seconds: Option<f64>) -> RunFiles {
        let name = if seconds.is_some() {
            format!("{}-loop", kind.name())
        } else {
            kind.name().to_string()
        };
        RunFiles {
            out: self.log(w, p, &name, rep, "out"),
            err: self.log(w, p, &name, rep, "err"),
            json: self.log(w, p, &name, rep, "json"),
            rec: self.logs.join(format!("{w}-P{p}-{name}.rec")),
            name,
        }
    }

    /// Runs the workload as `kind` runs it, to its end; heaptrace's (or heaptrack's) own cost
    /// goes into `run`.
    fn launch(
        &self,
        w: &str,
        p: u32,
        kind: Kind,
        seconds: Option<f64>,
        files: &RunFiles,
        run: &mut Run,
    ) -> Result<Exited> {
        let exe = self.workload(w);
        let args = self.args(w, p, seconds);
        let (out, err) = (&files.out, &files.err);
        Ok(match kind {
            Kind::Native => finish(spawn(
                Command::new(&exe)
                    .args(&args)
                    .stdout(file_out(out)?)
                    .stderr(file_out(err)?),
            )?)?,
            Kind::Calls | Kind::Counts | Kind::Sizes | Kind::Stacks | Kind::Record => {
                let mut c = Command::new(&self.heaptrace);
                if kind == Kind::Record {
                    let _ = fs::remove_file(&files.rec);
                    c.arg("record")
                        .arg("-o")
                        .arg(&files.rec)
                        .args(files.ht_flags("stacks"));
                } else {
                    c.args(files.ht_flags(kind.name()));
                }
                c.arg("--").arg(&exe).args(&args);
                let e = finish(spawn(c.stdout(file_out(out)?).stderr(file_out(err)?))?)?;
                run.daemon_cpu = Some(e.self_cpu);
                run.daemon_rss_kb = Some(e.hwm_kb);
                e
            }
            Kind::AttachCalls | Kind::AttachCounts | Kind::AttachSizes | Kind::Attach => {
                let mode = kind.attach_mode().expect("an attached kind");
                let (e, wl) = self.attach(&exe, &args, out, err, files.ht_flags(mode))?;
                if wl != 0 {
                    bail!("{w} exited with {wl} under attach (see {})", out.display());
                }
                run.daemon_cpu = Some(e.self_cpu);
                run.daemon_rss_kb = Some(e.hwm_kb);
                e
            }
            Kind::Heaptrack => self.heaptrack(w, p, &exe, &args, files, run)?,
        })
    }

    /// The workload under heaptrack; its file's size goes into `run`, and the whole command's
    /// CPU time (the workload's is taken off once known).
    fn heaptrack(
        &self,
        w: &str,
        p: u32,
        exe: &Path,
        args: &[String],
        files: &RunFiles,
        run: &mut Run,
    ) -> Result<Exited> {
        let base = self.logs.join(format!("{w}-P{p}-heaptrack"));
        for ext in ["zst", "gz", ""] {
            let _ = fs::remove_file(with_ext(&base, ext));
        }
        let e = finish(spawn(
            Command::new("heaptrack")
                .arg("-o")
                .arg(&base)
                .arg(exe)
                .args(args)
                .stdout(file_out(&files.out)?)
                .stderr(file_out(&files.err)?),
        )?)?;
        run.file_bytes = ["zst", "gz", ""]
            .iter()
            .find_map(|ext| fs::metadata(with_ext(&base, ext)).ok())
            .map(|m| m.len());
        run.daemon_cpu = Some(e.self_cpu + e.children_cpu);
        Ok(e)
    }

    /// A record run's figures: `heaptrace report` of its recording, as JSON.
    fn report(&self, files: &RunFiles) -> Result<()> {
        let rep = Command::new(&self.heaptrace)
            .arg("report")
            .arg(&files.rec)
            .args(["--format", "json"])
            .stdout(file_out(&files.json)?)
            .status()?;
        if !rep.success() {
            bail!("heaptrace report {} failed: {rep}", files.rec.display());
        }
        Ok(())
    }

    /// The workload starts with HEAPTRACE_BENCH_STOP and stops itself before its timer; once
    /// heaptrace says it attached, SIGCONT. Returns heaptrace's exit and the workload's code.
    fn attach(
        &self,
        exe: &Path,
        args: &[String],
        out: &Path,
        err: &Path,
        flags: Vec<String>,
    ) -> Result<(Exited, i32)> {
        let mut target = Command::new(exe)
            .args(args)
            .env("HEAPTRACE_BENCH_STOP", "1")
            .stdout(file_out(out)?)
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot run {}", exe.display()))?;
        let pid = target.id() as i32;
        let stopped = wait_until("the workload to stop", Duration::from_secs(10), || {
            Ok(proc_state(pid) == Some('T'))
        });
        if let Err(e) = stopped {
            let _ = target.kill();
            let _ = target.wait();
            return Err(e);
        }
        let ht = spawn(
            Command::new(&self.heaptrace)
                .args(flags)
                .arg("-p")
                .arg(pid.to_string())
                .stdout(Stdio::null())
                .stderr(file_out(err)?),
        )?;
        let attached = wait_until("heaptrace to attach", Duration::from_secs(60), || {
            if fs::read_to_string(err).is_ok_and(|s| s.contains("heaptrace: attached")) {
                return Ok(true);
            }
            if exited_nowait(ht.pid, false)? {
                bail!(
                    "heaptrace -p exited before attaching (see {})",
                    err.display()
                );
            }
            Ok(false)
        });
        if let Err(e) = attached {
            let _ = target.kill();
            let _ = target.wait();
            return Err(e);
        }
        // SAFETY: signals our own child.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let code = target.wait()?.code().unwrap_or(128);
        Ok((finish(ht)?, code))
    }
}

/// The files of one run.
struct RunFiles {
    /// The kind's name, with `-loop` for a looped run.
    name: String,
    /// The command's stdout and stderr.
    out: PathBuf,
    err: PathBuf,
    /// heaptrace's JSON document.
    json: PathBuf,
    /// A record run's recording.
    rec: PathBuf,
}

impl RunFiles {
    /// heaptrace's flags in `mode`. The JSON document is asked for in calls, counts and sizes
    /// modes only, where it is small. In stacks mode it holds every stack with its frames
    /// (over 100 MB for binary-trees), and writing it would count in the daemon's cost; the
    /// record run's figures come from `heaptrace report` on the recording after the run
    /// instead.
    fn ht_flags(&self, mode: &str) -> Vec<String> {
        let mut f = vec!["-q".into(), "--mode".into(), mode.into()];
        if mode != "stacks" {
            // A rerun writes over the last run's logs.
            f.extend([
                "--force".into(),
                "--json".into(),
                self.json.display().to_string(),
            ]);
        }
        f
    }
}

/// A counted run's figures, from heaptrace's JSON document at `path`.
fn read_counts(path: &Path, run: &mut Run) -> Result<()> {
    let f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (calls, rounds, lost, lost_stack, stacks) =
        parse_heaptrace_json(f).with_context(|| format!("bad JSON in {}", path.display()))?;
    // Keep the logs small: binary-trees' documents are over 100 MB each.
    if fs::metadata(path).is_ok_and(|m| m.len() > 16 << 20) {
        let _ = fs::remove_file(path);
    }
    run.calls = Some(calls);
    run.rounds = Some(rounds);
    run.lost = Some(lost);
    run.lost_stack = Some(lost_stack);
    run.stacks = Some(stacks);
    Ok(())
}

fn with_ext(base: &Path, ext: &str) -> PathBuf {
    if ext.is_empty() {
        base.to_path_buf()
    } else {
        PathBuf::from(format!("{}.{ext}", base.display()))
    }
}

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

/// The recording-size runs: each workload once (its natural work) under `heaptrace record` and
/// heaptrack, then under `heaptrace record` looping for `--seconds`.
fn sizes(b: &Bench, o: &Options, out: &Path) -> Result<ExitCode> {
    let mut meta = machine();
    meta["scale"] = json!(o.scale);
    meta["seconds"] = json!(o.seconds);
    meta["loadavg_start"] = json!(loadavg());
    let mut rows = Vec::new();
    let mut waited = Duration::ZERO;
    for w in &o.workloads {
        for &p in &o.threads {
            let _lock = quiet_host(&mut waited)?;
            let once = b.run(w, p, Kind::Record, 0, None)?;
            let htk = if b.heaptrack {
                Some(b.run(w, p, Kind::Heaptrack, 0, None)?)
            } else {
                None
            };
            let looped = b.run(w, p, Kind::Record, 0, Some(o.seconds))?;
            eprintln!(
                "xtask: sizes {w} P={p}: record {} B, heaptrack {} B, {:.0} s loop {} B",
                once.file_bytes.unwrap_or(0),
                htk.as_ref().and_then(|h| h.file_bytes).unwrap_or(0),
                looped.elapsed,
                looped.file_bytes.unwrap_or(0)
            );
            rows.push((once, htk, looped));
        }
    }
    meta["loadavg_end"] = json!(loadavg());
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Recording sizes, stacks mode, scale {}; {}\n",
        o.scale,
        describe(&meta)
    );
    let _ = writeln!(
        t,
        "| workload | P | calls | heaptrace recording | heaptrack (.zst) | heaptrace, {:.0} s loop: calls | rounds | recording | stacks | lost stacks |",
        o.seconds
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|---|---|");
    for (once, htk, looped) in &rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            once.workload,
            once.threads,
            count(once.calls),
            bytes(once.file_bytes),
            htk.as_ref().map_or("-".into(), |h| bytes(h.file_bytes)),
            count(looped.calls),
            count(looped.rounds),
            bytes(looped.file_bytes),
            count(looped.stacks),
            count(looped.lost_stack),
        );
    }
    println!("{t}");
    fs::write(out.join("sizes.md"), &t)?;
    let all: Vec<Value> = rows
        .iter()
        .flat_map(|(a, h, l)| {
            [Some(a), h.as_ref(), Some(l)]
                .into_iter()
                .flatten()
                .map(Run::to_json)
        })
        .collect();
    fs::write(
        out.join("sizes.json"),
        serde_json::to_string_pretty(&json!({ "machine": meta, "runs": all }))?,
    )?;
    Ok(ExitCode::SUCCESS)
}

// ---- the tables ------------------------------------------------------------------------------

fn count(v: Option<u64>) -> String {
    let Some(v) = v else { return "-".into() };
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn bytes(v: Option<u64>) -> String {
    match v {
        None => "-".into(),
        Some(b) if b < 10 * 1024 => format!("{b} B"),
        Some(b) if b < 10 * 1024 * 1024 => format!("{:.0} KiB", b as f64 / 1024.0),
        Some(b) => format!("{:.1} MiB", b as f64 / 1048576.0),
    }
}

fn ratio(r: f64) -> String {
    if r >= 9.95 {
        format!("{r:.0}x")
    } else {
        format!("{r:.1}x")
    }
}

fn describe(meta: &Value) -> String {
    let notes = meta["notes"]
        .as_array()
        .filter(|n| !n.is_empty())
        .map(|n| {
            let n: Vec<&str> = n.iter().filter_map(Value::as_str).collect();
            format!("; disturbed: {}", n.join(", "))
        })
        .unwrap_or_default();
    format!(
        "{} CPUs, kernel {}, {}, heaptrace {}, {}; load average {} at the start, {} at the end{notes}",
        meta["cpus"],
        meta["kernel"].as_str().unwrap_or("?"),
        meta["glibc"].as_str().unwrap_or("?"),
        meta["commit"].as_str().unwrap_or("?"),
        meta["heaptrack"].as_str().unwrap_or("no heaptrack"),
        meta["loadavg_start"].as_str().unwrap_or("?"),
        meta["loadavg_end"].as_str().unwrap_or("?"),
    )
}

/// Medians per (workload, P, kind) and the three tables of BENCHMARKS.md.
pub fn summary(runs: &[Run], meta: &Value) -> String {
    let m = Medians::new(runs);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "`{}`, scale {}, {} rep(s); {}; {:.0} s in all, {:.0} s of it waiting for the lock.\n",
        meta["command"].as_str().unwrap_or("cargo xtask bench"),
        meta["scale"],
        meta["reps"],
        describe(meta),
        meta["duration_s"].as_f64().unwrap_or(0.0),
        meta["waited_s"].as_f64().unwrap_or(0.0)
    );
    slowdown_table(&mut t, &m);
    added_time_table(&mut t, &m);
    own_cost_table(&mut t, &m);
    t
}

/// A batch: its workload's place in `WORKLOADS`, and P.
type Key = (usize, u32);

/// The runs grouped by batch and kind, for their medians.
struct Medians<'a> {
    by: BTreeMap<(Key, Kind), Vec<&'a Run>>,
    /// Every batch, in table order, with its workload's name.
    batches: Vec<(Key, String)>,
    /// The traced kinds that ran, in table order.
    kinds: Vec<Kind>,
}

impl<'a> Medians<'a> {
    fn new(runs: &'a [Run]) -> Medians<'a> {
        let order = |w: &str| WORKLOADS.iter().position(|x| *x == w).unwrap_or(usize::MAX);
        let mut by: BTreeMap<(Key, Kind), Vec<&Run>> = BTreeMap::new();
        for r in runs {
            by.entry(((order(&r.workload), r.threads), r.kind()))
                .or_default()
                .push(r);
        }
        let mut batches: Vec<(Key, String)> = runs
            .iter()
            .map(|r| ((order(&r.workload), r.threads), r.workload.clone()))
            .collect();
        batches.sort();
        batches.dedup();
        let mut kinds: Vec<Kind> = runs.iter().filter_map(|r| r.kind).collect();
        kinds.sort();
        kinds.dedup();
        Medians { by, batches, kinds }
    }

    /// The median of `f` over a batch's runs of `kind`.
    fn med(&self, k: Key, kind: Kind, f: &dyn Fn(&Run) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self
            .by
            .get(&(k, kind))?
            .iter()
            .filter_map(|r| f(r))
            .collect();
        median(&v)
    }

    /// Calls per batch: the median over heaptrace's counted runs (the others make the same
    /// calls: the workloads are deterministic).
    fn calls(&self, k: Key) -> Option<f64> {
        let v: Vec<f64> = self
            .kinds
            .iter()
            .filter(|kd| kd.counted())
            .filter_map(|kd| self.by.get(&(k, *kd)))
            .flatten()
            .filter_map(|r| r.calls.map(|c| c as f64))
            .collect();
        median(&v)
    }

    /// A table's header: the `first` columns (and their `rule`), then one per kind.
    fn header(&self, t: &mut String, first: &str, rule: &str) {
        let _ = write!(t, "{first}");
        for k in &self.kinds {
            let _ = write!(t, " {} |", k.name());
        }
        let _ = write!(t, "\n{rule}");
        for _ in &self.kinds {
            let _ = write!(t, "---|");
        }
        t.push('\n');
    }
}

/// 1. Slowdown: each kind's elapsed time over the natives', per batch and its mean per P.
fn slowdown_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "Slowdown: the workload's own elapsed time (median) over the median of the native runs \
         interleaved in the same batch.\n"
    );
    m.header(
        t,
        "| workload | P | calls | native elapsed (cpu) |",
        "|---|---|---|---|",
    );
    let mut sums: BTreeMap<(u32, Kind), (f64, usize)> = BTreeMap::new();
    for (k, w) in &m.batches {
        let native = m.med(*k, Kind::Native, &|r| Some(r.elapsed));
        let _ = write!(
            t,
            "| {w} | {} | {} | {} ({}) |",
            k.1,
            count(m.calls(*k).map(|c| c as u64)),
            native.map_or("-".into(), |n| format!("{n:.3} s")),
            m.med(*k, Kind::Native, &|r| Some(r.cpu))
                .map_or("-".into(), |n| format!("{n:.3} s")),
        );
        for kind in &m.kinds {
            match (m.med(*k, *kind, &|r| Some(r.elapsed)), native) {
                (Some(e), Some(n)) if n > 0.0 => {
                    let _ = write!(t, " {} |", ratio(e / n));
                    let s = sums.entry((k.1, *kind)).or_default();
                    s.0 += e / n;
                    s.1 += 1;
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
    let mut ps: Vec<u32> = m.batches.iter().map(|(k, _)| k.1).collect();
    ps.sort();
    ps.dedup();
    for p in ps {
        let _ = write!(t, "| **mean** | {p} | | |");
        for kind in &m.kinds {
            match sums.get(&(p, *kind)) {
                Some((s, n)) if *n > 0 => {
                    let _ = write!(t, " **{}** |", ratio(s / *n as f64));
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
}

/// 2. Added time per call, from the elapsed time and from the CPU time.
fn added_time_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "\nAdded time per malloc-family call, ns: (median elapsed - native median) / calls, and \
         in parentheses the same from the workload's CPU time (all its threads, kernel time in \
         the probes included).\n"
    );
    m.header(t, "| workload | P |", "|---|---|");
    for (k, w) in &m.batches {
        let _ = write!(t, "| {w} | {} |", k.1);
        let n_el = m.med(*k, Kind::Native, &|r| Some(r.elapsed));
        let n_cpu = m.med(*k, Kind::Native, &|r| Some(r.cpu));
        for kind in &m.kinds {
            let el = m.med(*k, *kind, &|r| Some(r.elapsed));
            let cpu = m.med(*k, *kind, &|r| Some(r.cpu));
            match (el, cpu, n_el, n_cpu, m.calls(*k)) {
                (Some(e), Some(c), Some(ne), Some(nc), Some(n)) if n > 0.0 => {
                    let _ = write!(
                        t,
                        " {:.0} ({:.0}) |",
                        (e - ne) / n * 1e9,
                        (c - nc) / n * 1e9
                    );
                }
                _ => t.push_str(" - |"),
            }
        }
        t.push('\n');
    }
}

/// 3. The daemon's own cost and the files, heaptrack's beside.
fn own_cost_table(t: &mut String, m: &Medians) {
    let _ = writeln!(
        t,
        "\nheaptrace's own cost (medians): CPU seconds (user+system) and peak RSS (VmHWM, \
         polled every 10 ms) of the heaptrace process, launched in stacks mode, attached, and \
         recording; \"fixed\" is a stacks launch's wall time minus the workload's elapsed time \
         (start-up, attach, detach, final read, summary, exit). Then the recording: its rounds, \
         distinct stacks, allocations whose stack was lost, and size; and heaptrack's \
         compressed file for the same work, with the CPU time of heaptrack's helper processes \
         (the whole command's minus the workload's).\n"
    );
    let _ = writeln!(
        t,
        "| workload | P | stacks: CPU | RSS | fixed | attach: CPU | RSS | record: CPU | RSS | \
         rounds | stacks | lost stacks | recording | heaptrack file | heaptrack CPU |"
    );
    let _ = writeln!(
        t,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let secs = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2} s"));
    let mib = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0} MiB", v / 1024.0));
    let int = |v: Option<f64>| count(v.map(|v| v as u64));
    for (k, w) in &m.batches {
        let med = |kind: Kind, f: &dyn Fn(&Run) -> Option<f64>| m.med(*k, kind, f);
        let rss = |r: &Run| r.daemon_rss_kb.map(|v| v as f64);
        let _ = writeln!(
            t,
            "| {w} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.1,
            secs(med(Kind::Stacks, &|r| r.daemon_cpu)),
            mib(med(Kind::Stacks, &rss)),
            secs(med(Kind::Stacks, &|r| Some(r.wall - r.elapsed))),
            secs(med(Kind::Attach, &|r| r.daemon_cpu)),
            mib(med(Kind::Attach, &rss)),
            secs(med(Kind::Record, &|r| r.daemon_cpu)),
            mib(med(Kind::Record, &rss)),
            int(med(Kind::Record, &|r| r.rounds.map(|v| v as f64))),
            int(med(Kind::Record, &|r| r.stacks.map(|v| v as f64))),
            int(med(Kind::Record, &|r| r.lost_stack.map(|v| v as f64))),
            bytes(med(Kind::Record, &|r| r.file_bytes.map(|v| v as f64)).map(|v| v as u64)),
            bytes(med(Kind::Heaptrack, &|r| r.file_bytes.map(|v| v as f64)).map(|v| v as u64)),
            secs(med(Kind::Heaptrack, &|r| r.daemon_cpu)),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_line() {
        let out =
            "heaptrack output\nbench: queue P=2 scale=1 reps=1 elapsed=0.250000 cpu=0.490000\n";
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
}
