//! `--serve`: real consumers read a running trace. Debian's Prometheus scrapes
//! `heaptrace --all --serve` every second and its own HTTP API must give an oracle process's
//! exact counts; `go tool pprof` fetches the heap and allocs profiles itself and must find the
//! oracle's sites on top. Bad flags are refused before anything is attached.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{
    expect::{Expected, Fixture},
    services::present,
    support::*,
    system::start_all,
};

/// A port free now on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `path` over a new connection: (status, body).
pub fn get(port: u16, path: &str) -> (u16, Vec<u8>) {
    let (status, _, body) = request(port, "GET", path);
    (status, body)
}

/// `method path` over a new connection: (status, header, body).
pub fn request(port: u16, method: &str, path: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {}", String::from_utf8_lossy(&raw)));
    let status = std::str::from_utf8(&raw[9..12]).unwrap().parse().unwrap();
    let header = String::from_utf8_lossy(&raw[..end]).into_owned();
    (status, header, raw[end + 4..].to_vec())
}

/// Waits until `port` answers `/metrics` with 200 (after the first round).
pub fn wait_served(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() || get(port, "/metrics").0 != 200 {
        assert!(Instant::now() < deadline, "nothing served on {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One value of a `/metrics` text: the series named exactly so.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// The oracle: allocs.c on its main thread, its work done, living on ("hold").
fn oracle(iterations: u64, leaks: u64) -> (Child, Expected) {
    let bin = fixture("allocs", "", &[]);
    let mut child = Command::new(&bin)
        .args(["0", &iterations.to_string(), &leaks.to_string(), "hold"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "done\n");
    (
        child,
        Expected::of(&Fixture::main_thread(iterations, leaks)),
    )
}

/// The series Prometheus must hold for the oracle, from what it called.
fn want_series(w: &Expected) -> Vec<(&'static str, u64)> {
    let allocating = w.funcs.values();
    let calls: u64 = allocating.clone().map(|f| f.calls - f.failed).sum();
    vec![
        (
            "heaptrace_process_allocations_total",
            calls - w.realloc_freed,
        ),
        (
            "heaptrace_process_frees_total",
            w.free_calls + w.realloc_freed,
        ),
        (
            "heaptrace_process_allocated_bytes_total",
            allocating.clone().map(|f| f.bytes).sum(),
        ),
        (
            "heaptrace_process_allocation_failures_total",
            allocating.map(|f| f.failed).sum(),
        ),
        ("heaptrace_process_live_blocks", w.live_blocks),
        ("heaptrace_process_live_bytes", w.live_bytes),
    ]
}

/// A Prometheus server of the test's own, scraping `target` every second; killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A directory removed when dropped.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Prometheus {
    fn start(target: u16) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("heaptrace-prom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  \
                 - job_name: heaptrace\n    static_configs:\n      \
                 - targets: ['127.0.0.1:{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus");
        Prometheus {
            child,
            port,
            _dir: tempdir::Dir(dir),
        }
    }

    /// The value of an instant query's single series, if it has one.
    fn query(&self, q: &str) -> Option<u64> {
        let enc: String = q
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        if TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            return None;
        }
        let (status, body) = get(self.port, &format!("/api/v1/query?query={enc}"));
        let doc: Value = serde_json::from_slice(&body).ok()?;
        let result = doc["data"]["result"].as_array()?;
        if status != 200 || result.len() != 1 {
            return None;
        }
        result[0]["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

bpf_test!(
    exclusive,
    /// Prometheus's own API gives the oracle's exact counts from `--all --serve`, and `go tool
    /// pprof` finds its allocating and leaking functions on top of the profiles it fetches.
    fn prometheus_and_pprof_read_an_oracle_from_all_serve() {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let (tracer, json) = start_all("serve-all", &["--serve", &addr]);
        wait_served(port);
        let (mut child, want) = oracle(1000, 3);
        let pid = child.id();
        let series = want_series(&want);
        if present("prometheus") {
            let prom = Prometheus::start(port);
            let deadline = Instant::now() + Duration::from_secs(60);
            for (name, value) in &series {
                let q = format!("{name}{{pid=\"{pid}\"}}");
                let mut got = None;
                while got != Some(*value) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(250));
                    got = prom.query(&q);
                }
                assert_eq!(got, Some(*value), "{q}");
            }
            let up = prom.query("up{job=\"heaptrace\"}");
            assert_eq!(up, Some(1));
        }
        if present("go") {
            let base = format!("http://{addr}/debug/pprof");
            let leak_bytes = want.live_bytes;
            let allocated = series[2].1;
            let (text, first) = pprof_top(
                &format!("{base}/allocs?pid={pid}"),
                &["-sample_index=alloc_space"],
            );
            assert!(text.contains("Type: alloc_space"), "{text}");
            let want_first = format!("{}B", allocated - leak_bytes);
            assert!(
                first.trim_start().starts_with(&want_first) && first.contains("one_iteration"),
                "want {want_first} in one_iteration: {text}"
            );
            let (text, first) = pprof_top(
                &format!("{base}/heap?pid={pid}"),
                &["-sample_index=inuse_space"],
            );
            assert!(text.contains("Type: inuse_space"), "{text}");
            assert!(
                first.trim_start().starts_with(&format!("{leak_bytes}B"))
                    && first.ends_with("work"),
                "{text}"
            );
            // By command name too: the same process alone.
            let (_, by_comm) = pprof_top(
                &format!("{base}/heap?comm=allocs&pid={pid}"),
                &["-sample_index=inuse_space"],
            );
            assert_eq!(by_comm, first);
        }
        drop(child.stdin.take());
        child.wait().unwrap();
        let _ = crate::system::stop(tracer, &json);
    }
);

/// An address other than loopback without a token is refused in one line, before anything is
/// attached; so are a token file that cannot be read and an address that is not one.
#[test]
fn a_non_loopback_bind_without_a_token_is_refused() {
    let refused = |args: &[&str]| {
        let out = heaptrace()
            .args(["--all", "--no-tui"])
            .args(args)
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(0), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        // One line that says what is wrong (clap adds its pointer to --help).
        assert_eq!(
            err.lines().filter(|l| l.contains("error")).count(),
            1,
            "{err}"
        );
        assert!(!err.contains("attached"), "{err}");
        err
    };
    let err = refused(&["--serve", "0.0.0.0:9464"]);
    assert!(err.contains("--serve-token-file"), "{err}");
    let err = refused(&["--serve", "[::]:9464"]);
    assert!(err.contains("--serve-token-file"), "{err}");
    let err = refused(&[
        "--serve",
        "0.0.0.0:9464",
        "--serve-token-file",
        "/nonexistent/t",
    ]);
    assert!(err.contains("/nonexistent/t"), "{err}");
    let err = refused(&["--serve", "localhost:x"]);
    assert!(err.contains("not an address"), "{err}");
}
