//! Processes in containers whose paths lie: a container made in the test (a root directory
//! with the fixture, its libc and its dynamic loader copied in, entered by the enter fixture:
//! a mount namespace of its own, pivot_root), whose files heaptrace must open as the process mapped them (through
//! /proc/PID/map_files), never where their paths lead from the host.
use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    support::*,
    system::{process, start_all, wait_for},
};

/// A root directory holding a fixture (allocs unless said) at `exe` (its path inside) and the
/// files ldd lists for it, at their own paths.
struct Container {
    root: PathBuf,
    exe: PathBuf,
    /// libc's path inside.
    libc: PathBuf,
}

impl Container {
    fn build(tag: &str, exe: &str) -> Container {
        Container::of(&fixture("allocs", "", &[]), tag, exe)
    }

    /// A container holding the fixture `bin` at `exe`.
    fn of(bin: &Path, tag: &str, exe: &str) -> Container {
        let root = workspace().join(format!("target/containers/{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let mut c = Container {
            root,
            exe: PathBuf::from(exe),
            libc: PathBuf::new(),
        };
        c.copy_in(bin, &c.exe.clone());
        for lib in ldd(bin) {
            if lib.file_name().unwrap().as_bytes().starts_with(b"libc.so") {
                c.libc = lib.clone();
            }
            c.copy_in(&lib, &lib);
        }
        assert!(c.libc.is_absolute(), "no libc in ldd's list");
        c
    }

    /// Where the file at `inside` is, seen from the host.
    fn host(&self, inside: &Path) -> PathBuf {
        self.root.join(inside.strip_prefix("/").unwrap())
    }

    fn copy_in(&self, from: &Path, inside: &Path) {
        let to = self.host(inside);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(from, &to).unwrap();
    }

    /// Starts the fixture inside, in "wait" and "hold" modes: once it says ready, its libc is
    /// mapped. `enter` execs the fixture: the same pid.
    fn start(&self, args: &[&str]) -> Inside {
        let mut child = Command::new(fixture("enter", "", &[]))
            .arg(&self.root)
            .arg(&self.exe)
            .args(args)
            .args(["wait", "hold"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        assert_eq!(line(&mut out), "ready");
        Inside { child, out }
    }
}

/// The fixture running in a container.
struct Inside {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Inside {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets it do its work, and end a while later: heaptrace reads its mappings, and names
    /// its frames, while it lives.
    fn run(mut self) {
        self.child.stdin.as_mut().unwrap().write_all(b"g").unwrap();
        assert_eq!(line(&mut self.out), "done");
        std::thread::sleep(Duration::from_millis(600));
        drop(self.child.stdin.take());
        assert!(self.child.wait().unwrap().success());
    }
}

fn line(out: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    line.trim_end().to_string()
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// The files ldd says `bin` loads (libc, the dynamic loader).
fn ldd(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().expect("ldd");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// A directory removed at the end of a test, passed or not.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn mkfifo(path: &Path) {
    let _ = fs::remove_file(path);
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "{path:?}");
}

/// The holdlib fixture with `path` mapped as code; asked, it says whether any byte of the
/// mapping differs from the file's (a uprobe's int3 does).
struct Holder {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Holder {
    fn map(path: &Path) -> Holder {
        let bin = fixture("holdlib", "", &[]);
        let mut child = Command::new(bin)
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        assert_eq!(line(&mut out), "ready");
        Holder { child, out }
    }

    /// "same", or "differs N (first at OFFSET)".
    fn ask(&mut self) -> String {
        self.child.stdin.as_mut().unwrap().write_all(b"?").unwrap();
        line(&mut self.out)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Interrupts heaptrace as Ctrl-C would: it must exit cleanly, and soon (one blocked in an
/// open() of a FIFO never did). Returns its stderr and JSON.
fn stop_soon(mut tracer: Running, json: &Path) -> (String, Value) {
    tracer.signal(libc::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tracer.child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = tracer.child.kill();
            panic!(
                "heaptrace ignored SIGINT for 20 s: {}",
                tracer.stderr.lock().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    (stderr, read_json(json))
}

/// The fixture's figures in process `pid`, exactly.
fn check_exact(doc: &Value, pid: u32, fx: &Fixture) {
    let p = process(doc, pid);
    let want = Expected::of(fx);
    assert_eq!(Expected::observed(p, &p["sizes"], &want), want);
}

/// The innermost frames (the fixture's callers of the family) of process `pid`'s stacks.
fn callers(doc: &Value, pid: u32) -> Vec<(String, String)> {
    doc["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .map(|s| {
            let f = &s["frames"][0];
            (
                f["module"].as_str().unwrap().to_string(),
                f["function"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

bpf_test!(
    exclusive,
    /// A container that swapped its libc's path for an absolute symlink to a host file, after
    /// mapping its own: heaptrace probes the libc it mapped (its calls counted exactly), and
    /// no probe lands in the host file the symlink leads to (a process mapping that file sees
    /// its bytes untouched, while one mapping the container's libc sees the probes).
    fn all_probes_a_containers_own_libc_not_where_its_symlink_leads() {
        let ct = Container::build("symlink", "/ctapp");
        let own = ct.host(&ct.libc);
        // Another name of the container's libc (the same inode), for the host to map.
        let own_too = ct.root.join("libc-own.so");
        fs::hard_link(&own, &own_too).unwrap();
        // A copy of libc on the host, at a path the container does not have.
        let decoy = ct.root.with_extension("decoy");
        let _gone = RemoveOnDrop(decoy.clone());
        let decoy = decoy.join("libc.so.6");
        fs::create_dir_all(decoy.parent().unwrap()).unwrap();
        let host_libc = heaptrace::targets::allocator::host_libc_path().unwrap();
        fs::copy(&host_libc, &decoy).unwrap();

        let fx = Fixture::main_thread(300, 3);
        let child = ct.start(&["0", "300", "3"]);
        let pid = child.pid();
        fs::remove_file(&own).unwrap();
        std::os::unix::fs::symlink(&decoy, &own).unwrap();
        let mut on_decoy = Holder::map(&decoy);
        let mut on_own = Holder::map(&own_too);
        assert_eq!(on_decoy.ask(), "same");
        assert_eq!(on_own.ask(), "same");

        // --comm: the holders map libc copies as code, which heaptrace would probe for them.
        let (tracer, json) = start_all("ct-symlink", &["--mode", "sizes", "--comm", "ctapp"]);
        wait_for(
            &tracer,
            &format!(
                "also tracing {} (first seen in pid {pid})",
                ct.libc.display()
            ),
        );
        assert_eq!(on_decoy.ask(), "same", "a probe in the host's file");
        assert!(on_own.ask().starts_with("differs"), "no probe in its libc");
        child.run();
        std::thread::sleep(Duration::from_millis(500));
        let (stderr, doc) = stop_soon(tracer, &json);
        check_exact(&doc, pid, &fx);
        assert_eq!(doc["lost"]["unsafe_files"], 0, "{stderr}");
    }
);

bpf_test!(
    exclusive,
    /// A container whose executable's path is a FIFO on the host (as a user and mount
    /// namespace can make it) and, once it runs, inside the container too. heaptrace never
    /// opens it: the file mapped is reached through map_files, its calls are counted exactly
    /// and its frames named, and SIGINT ends the trace. Where map_files is refused, the path
    /// is opened inside the container's root, without blocking: the FIFO there is skipped,
    /// said and counted, and libc is traced all the same.
    fn a_fifo_at_a_containers_executable_path_never_blocks_heaptrace() {
        let on_host = std::env::temp_dir().join(format!("heaptrace-fifo-{}", std::process::id()));
        fs::create_dir_all(&on_host).unwrap();
        let _gone = RemoveOnDrop(on_host.clone());
        let exe = on_host.join("ctapp");
        let ct = Container::build("fifo", exe.to_str().unwrap());
        mkfifo(&exe);
        let fx = Fixture::main_thread(200, 2);
        let bin = fixture("allocs", "", &[]);
        for refused in [false, true] {
            // The FIFO of the last run out of the way first: a copy onto it would block.
            let _ = fs::remove_file(ct.host(&exe));
            ct.copy_in(&bin, &exe);
            let child = ct.start(&["0", "200", "2"]);
            let pid = child.pid();
            mkfifo(&ct.host(&exe));
            let json = json_path("ct-fifo");
            let mut cmd = heaptrace();
            cmd.args(["--all", "--no-tui", "-q", "--interval", "200ms"])
                .args(["--mode", "stacks", "--comm", "ctapp", "--json"])
                .arg(&json);
            if refused {
                cmd.env("HEAPTRACE_NO_MAP_FILES", "1");
            }
            let tracer = start_attached(&mut cmd);
            wait_for(
                &tracer,
                &format!("also tracing {} (first seen in pid", ct.libc.display()),
            );
            child.run();
            std::thread::sleep(Duration::from_millis(500));
            let (stderr, doc) = stop_soon(tracer, &json);
            check_exact(&doc, pid, &fx);
            let callers = callers(&doc, pid);
            assert!(!callers.is_empty());
            let skipped = format!(
                "heaptrace: warning: skipped {} of pid {pid}: it is a FIFO, not a regular file",
                exe.display()
            );
            if refused {
                assert_eq!(stderr.matches(&skipped).count(), 1, "{stderr}");
                assert_eq!(doc["lost"]["unsafe_files"], 1);
                assert!(
                    callers
                        .iter()
                        .all(|(m, f)| m == "ctapp" && f.starts_with("ctapp+")),
                    "{callers:?}"
                );
            } else {
                assert!(!stderr.contains("skipped"), "{stderr}");
                assert_eq!(doc["lost"]["unsafe_files"], 0);
                assert!(
                    callers.contains(&("ctapp".into(), "one_iteration".into())),
                    "{callers:?}"
                );
                assert!(
                    callers
                        .iter()
                        .all(|(m, f)| m == "ctapp" && !f.starts_with("ctapp+")),
                    "{callers:?}"
                );
            }
        }
    }
);

bpf_test!(
    exclusive,
    /// A binary that exists only inside a container: its frames are named from its own
    /// symbols (they read `ctapp+0x1166` when it was looked for on the host).
    fn a_binary_only_in_a_container_has_its_frames_named() {
        let ct = Container::build("named", "/ctapp");
        assert!(!Path::new("/ctapp").exists());
        let fx = Fixture::main_thread(100, 1);
        let child = ct.start(&["0", "100", "1"]);
        let pid = child.pid();
        let (tracer, json) = start_all("ct-named", &["--mode", "stacks", "--comm", "ctapp"]);
        child.run();
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop_soon(tracer, &json);
        check_exact(&doc, pid, &fx);
        let callers = callers(&doc, pid);
        assert!(
            callers.contains(&("ctapp".into(), "one_iteration".into())),
            "{callers:?}"
        );
        assert!(
            callers
                .iter()
                .all(|(m, f)| m == "ctapp" && !f.starts_with("ctapp+")),
            "{callers:?}"
        );
    }
);

bpf_test!(
    exclusive,
    /// Processes of a container that live a millisecond past their first allocation (`recurse
    /// 7`), started after heaptrace: their executable, only in the container, is opened when
    /// their mappings are read right at their exec, and their frames are named from it after
    /// they are gone (without it, 8 of 8 runs read `ctapp+0x...`). Their libc is the host's,
    /// bind-mounted in: probed before their first call. --no-reservations: the daemon's own
    /// read at their first memory syscall often comes in time, and would hide a miss here.
    fn millisecond_processes_of_a_container_have_their_frames_named() {
        let ct = Container::of(&fixture("recurse", "", &[]), "shortlived", "/ctapp");
        let host_libc = heaptrace::targets::allocator::host_libc_path().unwrap();
        let (tracer, json) = start_all(
            "ct-short",
            &["--mode", "stacks", "--comm", "ctapp", "--no-reservations"],
        );
        let enter = fixture("enter", "", &[]);
        let script = format!(
            "mount --bind {} {} && exec {} {} /ctapp 7",
            host_libc.display(),
            ct.host(&ct.libc).display(),
            enter.display(),
            ct.root.display()
        );
        let pids: Vec<u32> = (0..8)
            .map(|_| {
                let mut c = Command::new("unshare")
                    .args(["--mount", "--propagation", "private", "sh", "-c", &script])
                    .spawn()
                    .unwrap();
                assert!(c.wait().unwrap().success());
                std::thread::sleep(Duration::from_millis(100));
                c.id()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let (_, doc) = stop_soon(tracer, &json);
        let unnamed: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|pid| !callers(&doc, *pid).contains(&("ctapp".into(), "node".into())))
            .collect();
        // The read at the exec races the process: one run of eight may miss it (as on the
        // host: system.rs).
        assert!(unnamed.len() <= 1, "unnamed: {unnamed:?} of {pids:?}");
    }
);

/// `-p PID --in-process` into a process in a container (a mount namespace of its own, its
/// root pivoted, its own /proc): the library and the region reach it as descriptors made in
/// it (memfds, opened by it through its own /proc/self/fd), never by a host path; its
/// counted phase is exact. Needs root (ptrace), not BPF.
#[test]
fn pid_in_process_attaches_into_a_container() {
    let _g = shared();
    let ct = Container::build("inproc", "/ctapp");
    fs::create_dir_all(ct.root.join("proc")).unwrap();
    let fx = Fixture::main_thread(300, 3);
    let child = ct.start(&["0", "300", "3"]);
    let pid = child.pid();
    let json = json_path("ct-in-process");
    let mut ht = heaptrace();
    ht.args([
        "--no-tui",
        "-q",
        "--in-process",
        "--mode",
        "sizes",
        "--json",
    ])
    .arg(&json)
    .args(["-p", &pid.to_string()]);
    let tracer = start_attached(&mut ht);
    child.run();
    let (code, stderr) = tracer.wait();
    assert_eq!(code, 0, "{stderr}");
    let doc = read_json(&json);
    assert_eq!(doc["heaptrace"]["collector"], "in-process-attached");
    let want = Expected::of(&fx);
    assert_eq!(Expected::observed(&doc, &doc["sizes"], &want), want);
}
