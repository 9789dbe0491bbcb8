//! Helpers for the tests that run the real heaptrace binary against C fixtures.
use std::{
    cell::Cell,
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Mutex, OnceLock, RwLock, RwLockWriteGuard},
    time::{Duration, Instant},
};

use serde_json::Value;

/// Tests that probe every process (`--all`) or look at a target's code for breakpoints must not
/// overlap with any other probing test, in this test binary or in another checkout's: an flock
/// on a file every run shares. The others take it shared and run side by side.
pub struct SystemLock {
    /// Holding the open file holds the lock.
    _file: std::fs::File,
    /// An exclusive holder also keeps this binary's other tests from building fixtures.
    _builds: Option<RwLockWriteGuard<'static, ()>>,
}

/// Fixture builds take this shared; a test that traces every process takes it exclusively
/// (`exclusive`). gcc, g++ and rustc allocate from many stacks, and under `--all` theirs
/// went into the same stack map as the fixture traced (the `--comm` filter is user space's):
/// a build by another test thread once left a traced run without room for its stacks (CI:
/// 0 of 255 kept).
static BUILDS: RwLock<()> = RwLock::new(());

thread_local! {
    /// This thread holds `BUILDS` exclusively: its own builds go ahead.
    static BUILDING_ALONE: Cell<bool> = const { Cell::new(false) };
}

impl Drop for SystemLock {
    fn drop(&mut self) {
        if self._builds.is_some() {
            BUILDING_ALONE.with(|b| b.set(false));
        }
    }
}

fn system_lock(op: i32) -> SystemLock {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/heaptrace-tests.lock")
        .expect("lock file");
    // SAFETY: flock on a descriptor we own; released when the file closes.
    let r = unsafe { libc::flock(f.as_raw_fd(), op) };
    assert_eq!(r, 0, "flock: {}", std::io::Error::last_os_error());
    SystemLock {
        _file: f,
        _builds: None,
    }
}

pub fn shared() -> SystemLock {
    system_lock(libc::LOCK_SH)
}

/// The flock first, then the builds: a test holding the flock shared may be building, and
/// builds take no flock, so neither waits on the other in a circle.
pub fn exclusive() -> SystemLock {
    let mut lock = system_lock(libc::LOCK_EX);
    lock._builds = Some(BUILDS.write().unwrap_or_else(|e| e.into_inner()));
    BUILDING_ALONE.with(|b| b.set(true));
    lock
}

/// A test that loads and attaches BPF programs, optionally holding the system lock:
///
/// ```ignore
/// bpf_test!(
///     exclusive, // or shared, or nothing: the lock held for the whole test
///     /// Doc comments and attributes pass through.
///     fn name() { ... }
/// );
/// ```
///
/// Where heaptrace/build.rs found no BPF (and CI is unset) the test is built ignored, so the
/// runner counts it as such rather than as passed. Parentheses, not braces, keep the test
/// under rustfmt.
macro_rules! bpf_test {
    (shared, $($test:tt)+) => {
        $crate::support::bpf_test!(@lock $crate::support::shared(); $($test)+);
    };
    (exclusive, $($test:tt)+) => {
        $crate::support::bpf_test!(@lock $crate::support::exclusive(); $($test)+);
    };
    ($(@lock $lock:expr;)? $(#[$attr:meta])* fn $name:ident() $body:block) => {
        #[test]
        #[cfg_attr(heaptrace_no_bpf, ignore = "needs root, BTF and uprobes")]
        $(#[$attr])*
        fn $name() {
            $crate::support::require_bpf(stringify!($name));
            $(let _lock = $lock;)?
            $body
        }
    };
}
pub(crate) use bpf_test;

/// Fails the test unless this machine lets us load and attach BPF programs. Tests built where
/// it could not are ignored instead; one that gets here without BPF runs in CI, was built
/// where BPF was, or was asked for with `--ignored`.
pub fn require_bpf(test: &str) {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    let uprobe = Path::new("/sys/bus/event_source/devices/uprobe").exists();
    if root && btf && uprobe {
        return;
    }
    let what =
        format!("{test}: needs root, BTF and uprobes (root={root} btf={btf} uprobe={uprobe})");
    if std::env::var_os("CI").is_some() {
        panic!("{what}; CI must run the BPF tests");
    }
    if cfg!(heaptrace_no_bpf) {
        panic!("{what}");
    }
    panic!("{what}; built where they were present: touch heaptrace/build.rs to rebuild");
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds tests/fixtures/NAME.c once per variant (flags) and returns the binary's path.
pub fn fixture(name: &str, variant: &str, flags: &[&str]) -> PathBuf {
    build_once(
        name,
        variant,
        |tmp, src| {
            Command::new("gcc")
                .args([
                    "-O1",
                    "-g",
                    "-fno-builtin",
                    "-fno-omit-frame-pointer",
                    "-pthread",
                ])
                .args(flags)
                .arg("-o")
                .arg(tmp)
                .arg(src)
                .output()
                .expect("gcc")
        },
        "c",
    )
}

/// Builds a C++ fixture with g++ (frame pointers, debug info).
pub fn cpp_fixture(name: &str) -> PathBuf {
    build_once(
        name,
        "",
        |tmp, src| {
            Command::new("g++")
                .args(["-O1", "-g", "-fno-omit-frame-pointer", "-o"])
                .arg(tmp)
                .arg(src)
                .output()
                .expect("g++")
        },
        "cpp",
    )
}

/// Builds a Rust fixture with rustc, with the given symbol mangling ("v0" or "legacy"; legacy
/// needs -Z unstable-options, so it goes through the nightly the project installs anyway).
pub fn rust_fixture(name: &str, mangling: &str) -> PathBuf {
    build_once(
        name,
        &format!("-{mangling}"),
        |tmp, src| {
            let mut c = if mangling == "legacy" {
                let mut c = Command::new("rustup");
                c.args(["run", "nightly", "rustc", "-Z", "unstable-options"]);
                c
            } else {
                Command::new("rustc")
            };
            c.args(["-C", "opt-level=1", "-C", "force-frame-pointers=yes", "-g"])
                .arg(format!("-Csymbol-mangling-version={mangling}"))
                .args(["--crate-name", "fixture", "-o"])
                .arg(tmp)
                .arg(src)
                .output()
                .expect("rustc")
        },
        "rs",
    )
}

/// Builds a C++ fixture with g++ and `flags` alone, once per variant.
pub fn cpp_fixture_with(name: &str, variant: &str, flags: &[&str]) -> PathBuf {
    build_once(
        name,
        variant,
        |tmp, src| {
            Command::new("g++")
                .args(flags)
                .arg("-o")
                .arg(tmp)
                .arg(src)
                .output()
                .expect("g++")
        },
        "cpp",
    )
}

fn build_once(
    name: &str,
    variant: &str,
    build: impl Fn(&Path, &Path) -> Output,
    ext: &str,
) -> PathBuf {
    let _builds =
        (!BUILDING_ALONE.with(Cell::get)).then(|| BUILDS.read().unwrap_or_else(|e| e.into_inner()));
    static BUILT: OnceLock<Mutex<()>> = OnceLock::new();
    let _g = BUILT
        .get_or_init(|| Mutex::new(()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = workspace().join("target/fixtures");
    std::fs::create_dir_all(&dir).unwrap();
    let src = workspace().join(format!("tests/fixtures/{name}.{ext}"));
    let bin = dir.join(format!("{name}{variant}"));
    let fresh = bin.metadata().and_then(|b| b.modified()).ok()
        >= src.metadata().and_then(|s| s.modified()).ok();
    if !fresh || !bin.exists() {
        let tmp = dir.join(format!(".{name}{variant}.tmp"));
        let out = build(&tmp, &src);
        assert!(
            out.status.success(),
            "building {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&tmp, &bin).unwrap();
    }
    bin
}

pub fn heaptrace() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_heaptrace"));
    c.env("RUST_LOG", "warn");
    c
}

/// One line of `heaptrace probes`.
#[derive(Clone, Debug)]
pub struct PlannedProbe {
    pub file_offset: u64,
    /// Where the entry probe goes, from the function's start.
    pub entry: u64,
    pub uretprobe: bool,
    pub instruction: String,
}

/// Runs `heaptrace probes [-p PID]`; returns the provider's path and a line per function
/// (aliases joined with '=' in the name).
pub fn planned_probes(pid: Option<u32>) -> (PathBuf, BTreeMap<String, PlannedProbe>) {
    planned_probes_with(pid, &[])
}

/// `heaptrace probes` with extra flags (`--mode calls`).
pub fn planned_probes_with(
    pid: Option<u32>,
    flags: &[&str],
) -> (PathBuf, BTreeMap<String, PlannedProbe>) {
    let mut cmd = heaptrace();
    cmd.arg("probes").args(flags);
    if let Some(pid) = pid {
        cmd.args(["-p", &pid.to_string()]);
    }
    let out = run_ok(&mut cmd);
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let head = lines.next().expect("provider line");
    let path = PathBuf::from(head.split(" (").next().unwrap());
    assert!(lines.next().unwrap().starts_with("function"), "{text}");
    let mut probes = BTreeMap::new();
    for line in lines {
        // The memory syscalls' wrappers follow, in the same columns.
        if line.starts_with("memory syscalls") {
            continue;
        }
        let cols: Vec<&str> = line.split_whitespace().collect();
        let hex = cols[1].strip_prefix("0x").expect("hex file offset");
        let probe = PlannedProbe {
            file_offset: u64::from_str_radix(hex, 16).unwrap(),
            entry: cols[2].strip_prefix('+').unwrap().parse().unwrap(),
            uretprobe: cols[3] == "yes",
            instruction: cols[4].to_string(),
        };
        probes.insert(cols[0].to_string(), probe);
    }
    (path, probes)
}

/// Launches `bin args` under heaptrace with `opts`, which must succeed: the JSON document and
/// heaptrace's output.
pub fn launch(tag: &str, bin: &Path, args: &[&str], opts: &[&str]) -> (Value, Output) {
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q"])
        .args(opts)
        .arg("--json")
        .arg(&json)
        .arg("--")
        .arg(bin)
        .args(args);
    let out = run_ok(&mut cmd);
    (read_json(&json), out)
}

/// A new path for one output: heaptrace replaces no existing file without --force, and tests
/// that share a tag run side by side (a leftover of an earlier run's same pid is removed).
pub fn json_path(tag: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = workspace().join("target/test-out");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{tag}-{}-{n}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// The function names of a JSON stack's (or site's) frames, innermost first.
pub fn function_names(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .map(|frames| {
            frames
                .iter()
                .filter_map(|f| f["function"].as_str())
                .collect()
        })
        .unwrap_or_default()
}

pub fn read_json(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Runs heaptrace to completion; panics with its stderr if it failed.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run heaptrace");
    assert!(
        out.status.success(),
        "heaptrace failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Starts heaptrace and waits until it says its probes are attached. Returns the child and
/// the stderr lines read so far (a thread keeps draining the rest into the returned handle).
pub struct Running {
    pub child: Child,
    pub stderr: std::sync::Arc<Mutex<String>>,
}

pub fn start_attached(cmd: &mut Command) -> Running {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn heaptrace");
    let stderr = child.stderr.take().unwrap();
    let text = std::sync::Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = text.clone();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("attached")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(());
            }
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    if rx.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        panic!("heaptrace did not attach: {}", text.lock().unwrap());
    }
    Running {
        child,
        stderr: text,
    }
}

/// A test that panics leaves no heaptrace behind (its probes would disturb the next tests).
impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Running {
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits for exit; returns (exit code, all of stderr).
    pub fn wait(mut self) -> (i32, String) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100)); // let the reader finish
                return (
                    status.code().unwrap_or(-1),
                    self.stderr.lock().unwrap().clone(),
                );
            }
            assert!(Instant::now() < deadline, "heaptrace did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The one line of a failed run's stderr that says "error" (there must be exactly one).
pub fn error_line(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "want one error line: {stderr}");
    errors[0].to_string()
}

/// Spawns a dynamically linked fixture and waits until its libc is mapped: `-p` on a process
/// the dynamic loader has not finished with finds no malloc yet.
pub fn spawn_with_libc(cmd: &mut Command) -> std::process::Child {
    let child = cmd.spawn().expect("spawn");
    let maps = format!("/proc/{}/maps", child.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read_to_string(&maps).is_ok_and(|m| m.contains("libc.so")) {
        assert!(std::time::Instant::now() < deadline, "libc never mapped");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child
}

/// A program's entry in the `--probe-stats` part of a JSON document; panics if it never ran.
pub fn program<'a>(doc: &'a Value, name: &str) -> &'a Value {
    let progs = doc["heaptrace"]["programs"]
        .as_array()
        .expect("--probe-stats");
    progs
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {progs:?}"))
}

/// Traces the C fixture `name`, launched in stacks mode with `opts`; returns the JSON document.
pub fn trace_stacks(tag: &str, name: &str, opts: &[&str]) -> Value {
    let bin = fixture(name, "", &[]);
    let json = json_path(tag);
    let mut cmd = heaptrace();
    cmd.args(["--no-tui", "-q", "--mode", "stacks"])
        .args(opts)
        .arg("--json")
        .arg(&json)
        .arg("--")
        .arg(&bin);
    run_ok(&mut cmd);
    read_json(&json)
}

/// The runs of a program in the `--probe-stats` part of a JSON document (0 if it never ran).
pub fn program_runs(doc: &Value, program: &str) -> u64 {
    doc["heaptrace"]["programs"]
        .as_array()
        .expect("--probe-stats")
        .iter()
        .filter(|p| p["name"] == program)
        .map(|p| p["runs"].as_u64().unwrap())
        .sum()
}

/// Starts `cmd` with its stdin and stdout piped; returns it, its stdout and its first line.
pub fn piped(cmd: &mut Command) -> (Child, BufReader<std::process::ChildStdout>, String) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    (child, out, line)
}

/// Starts a fixture in "wait" mode and reads its "ready" line.
pub fn ready(mut cmd: Command) -> Child {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    child
}

/// How many calls of `function` asked for `size` bytes, by the document's size histogram.
pub fn sized(doc: &Value, function: &str, size: u64) -> u64 {
    doc["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["function"] == function && s["size"] == size)
        .map(|s| s["count"].as_u64().unwrap())
        .sum()
}

/// A document's stacks as (innermost function, calls, bytes), sorted: two documents of the
/// same run compare equal whatever order their stacks came in.
pub fn stacks_by_function(doc: &serde_json::Value) -> Vec<(String, u64, u64)> {
    let mut v: Vec<_> = doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["frames"][0]["function"].as_str().unwrap().to_string(),
                s["calls"].as_u64().unwrap(),
                s["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// `go tool pprof -top -unit=B [EXTRA] SOURCE` (a file or a URL): its text and the first row
/// of its table (empty if it has none).
pub fn pprof_top(source: &str, extra: &[&str]) -> (String, String) {
    let o = Command::new("go")
        .args(["tool", "pprof", "-top", "-unit=B"])
        .args(extra)
        .arg(source)
        .env(
            "PPROF_TMPDIR",
            std::env::temp_dir().join("heaptrace-pprof-home"),
        )
        .output()
        .expect("go tool pprof");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (text, first)
}
