//! Real services, as a new user traces them: Debian's Redis (jemalloc, its own `zmalloc`
//! wrapper), attached with `-p` while `redis-benchmark` drives it. The sites must name Redis's
//! callers, not its wrapper, through whole stacks, and none may read `malloc <- zmalloc`.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::support::*;

/// Whether `cmd` is on the PATH; under CI a missing one fails (setup installs it).
pub(crate) fn present(cmd: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{cmd} is missing (cargo xtask setup installs it)"
        );
        eprintln!("SKIPPED: no {cmd}");
    }
    found
}

/// A redis-server of the test's own, on a unix socket in `dir`; killed when dropped.
struct Redis {
    child: Child,
    socket: PathBuf,
}

impl Redis {
    fn start(dir: &Path) -> Redis {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("redis.sock");
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--unixsocket",
            ])
            .arg(&socket)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis { child, socket }
    }

    fn benchmark(&self, n: u32) {
        let o = Command::new("redis-benchmark")
            .arg("-s")
            .arg(&self.socket)
            .args(["-n", &n.to_string(), "-q", "-t", "set,get,lpush,hset"])
            .output()
            .expect("redis-benchmark");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

bpf_test!(
    shared,
    /// Redis attached: its sites are named past `zmalloc` (detected as its wrapper, kept in
    /// every stack), and the summary's site lines are all different.
    fn redis_sites_name_its_callers_not_its_wrapper() {
        if !present("redis-server") || !present("redis-benchmark") {
            return;
        }
        let dir = workspace().join("target/test-out/redis");
        let redis = Redis::start(&dir);
        let json = json_path("redis");
        let running = start_attached(
            heaptrace()
                .args(["--no-tui", "-p", &redis.child.id().to_string(), "--json"])
                .arg(&json),
        );
        redis.benchmark(5000);
        running.signal(libc::SIGINT);
        let (code, summary) = running.wait();
        assert_eq!(code, 0, "{summary}");
        let doc = read_json(&json);
        let detected: Vec<&str> = doc["wrappers"]["detected"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(detected.contains(&"zmalloc"), "{:?}", doc["wrappers"]);
        let stacks = doc["stacks"].as_array().unwrap();
        let through: Vec<&Value> = stacks
            .iter()
            .filter(|s| s["frames"][0]["function"] == "zmalloc")
            .collect();
        assert!(
            through.len() >= 10,
            "{} stacks through zmalloc",
            through.len()
        );
        for s in &through {
            assert_ne!(s["site"], "zmalloc", "{s}");
            assert_eq!(s["site_frame"].as_u64(), Some(1), "{s}");
        }
        let calls: u64 = through.iter().map(|s| s["calls"].as_u64().unwrap()).sum();
        assert!(calls >= 20_000, "{calls} calls through zmalloc");
        // Attached, its stacks are whole from the first counted call: none stops at its
        // caller (Redis has no frame pointers; its unwind rows are loaded before counting).
        let short: u64 = stacks
            .iter()
            .filter(|s| s["frames"].as_array().is_some_and(|f| f.len() <= 1))
            .map(|s| s["calls"].as_u64().unwrap())
            .sum();
        assert_eq!(short, 0, "calls with a one-frame stack");
        // Every site line of the summary differs from the others.
        let lines: Vec<&str> = summary
            .lines()
            .filter(|l| l.contains(" calls, live "))
            .map(|l| l.split_once("  ").map_or(l, |(_, site)| site).trim())
            .collect();
        assert!(!lines.is_empty(), "{summary}");
        assert!(
            lines.iter().all(|l| !l.starts_with("malloc <- zmalloc")),
            "{summary}"
        );
    }
);
