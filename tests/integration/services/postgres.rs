//! Debian's PostgreSQL: a cluster of the test's own, run by the `postgres` user (it refuses
//! root), attached with `-p --follow-forks` while `pgbench` drives two backends.
use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::{names, sites_past, whole_share};
use crate::support::*;

/// PostgreSQL's memory-context layer, as its stacks show it (Debian 15, no symbol table).
const PALLOC: [&str; 8] = [
    "palloc",
    "palloc0",
    "repalloc",
    "pstrdup",
    "MemoryContextAlloc",
    "MemoryContextAllocZero",
    "MemoryContextAllocZeroAligned",
    "MemoryContextAllocExtended",
];

/// The newest `/usr/lib/postgresql/N/bin` with `postgres`, `initdb` and `pgbench`; None
/// (SKIPPED) outside CI when there is none.
fn bin_dir() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|b| {
            ["postgres", "initdb", "pgbench"]
                .iter()
                .all(|t| b.join(t).exists())
        })
        .collect();
    dirs.sort();
    let found = dirs.pop();
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "PostgreSQL is missing (cargo xtask setup installs postgresql)"
        );
        eprintln!("SKIPPED: no PostgreSQL");
    }
    found
}

/// The `postgres` user's ids.
fn postgres_user() -> (u32, u32) {
    // SAFETY: getpwnam's result is read before any other call that could overwrite it.
    unsafe {
        let pw = libc::getpwnam(c"postgres".as_ptr());
        assert!(
            !pw.is_null(),
            "no postgres user (the postgresql package makes it)"
        );
        ((*pw).pw_uid, (*pw).pw_gid)
    }
}

/// A postmaster of the test's own on a unix socket in `dir`; stopped when dropped.
struct Postgres {
    child: Child,
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
}

impl Postgres {
    fn start(bin: &Path, dir: &Path) -> Postgres {
        let (uid, gid) = postgres_user();
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).unwrap();
        let data = dir.join("data");
        let o = Command::new(bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync"])
            .uid(uid)
            .gid(gid)
            .output()
            .expect("initdb");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let port = 20000 + (std::process::id() % 20000) as u16;
        let child = Command::new(bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(dir)
            .args(["-p", &port.to_string(), "-c", "listen_addresses="])
            .args(["-c", "fsync=off"])
            .uid(uid)
            .gid(gid)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        let pg = Postgres {
            child,
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !pg.pgbench(&["-i", "-s", "1", "-q"]) {
            assert!(Instant::now() < deadline, "postgres did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        pg
    }

    /// Runs pgbench against this cluster; whether it succeeded.
    fn pgbench(&self, args: &[&str]) -> bool {
        Command::new(self.bin.join("pgbench"))
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-U", "postgres"])
            .args(args)
            .arg("postgres")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Fast shutdown: the backends end and the shared memory is released.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Traces `pg` with heaptrace's `args` (`--json` added) during `pgbench -c 2 -t 300`; the
/// document and the summary, after checking what both modes share: sites past palloc & co.,
/// backends' stacks whole, and no warning of short stacks.
fn traced(pg: &Postgres, tag: &str, args: &[&str]) -> (serde_json::Value, String) {
    let json = json_path(tag);
    let running = start_attached(
        heaptrace()
            .args(["--no-tui", "--json"])
            .arg(&json)
            .args(args),
    );
    assert!(pg.pgbench(&["-c", "2", "-t", "300"]), "pgbench failed");
    running.signal(libc::SIGINT);
    let (code, summary) = running.wait();
    assert_eq!(code, 0, "{summary}");
    let doc = read_json(&json);
    let known = names(&doc["wrappers"]["known"]);
    assert!(known.contains(&"palloc"), "{:?}", doc["wrappers"]);
    let through = sites_past(&doc, &PALLOC);
    assert!(through >= 5_000, "{through} calls through palloc & co.");
    let whole = whole_share(&doc);
    assert!(whole >= 0.95, "{:.1}% of calls reach main", whole * 100.0);
    assert!(!summary.contains("end before main"), "{summary}");
    (doc, summary)
}

bpf_test!(
    exclusive,
    /// The same under `--all --comm postgres`: every postgres process, this cluster's among
    /// them, from whenever the probes reach it.
    fn postgres_sites_name_its_callers_under_all() {
        let Some(bin) = bin_dir() else { return };
        let pg = Postgres::start(&bin, &workspace().join("target/test-out/postgres-all"));
        traced(&pg, "postgres-all", &["--all", "--comm", "postgres"]);
    }
);

bpf_test!(
    shared,
    /// PostgreSQL attached with its forks: sites are named past palloc and the memory
    /// context methods it calls through a pointer (`AllocSetAlloc`, no symbol), backends'
    /// stacks reach main, and the summary warns of no short stacks.
    fn postgres_sites_name_its_callers_not_palloc() {
        let Some(bin) = bin_dir() else { return };
        let pg = Postgres::start(&bin, &workspace().join("target/test-out/postgres"));
        let pid = pg.child.id().to_string();
        traced(&pg, "postgres", &["--follow-forks", "-p", &pid]);
    }
);
