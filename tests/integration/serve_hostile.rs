//! `--serve` under a few thousand malformed requests over raw TCP (bad paths, methods and
//! queries, huge headers, garbage, half-closed and idle connections, more connections than
//! the cap): no panic, no hang, every connection answered or closed, the rounds go on, and the
//! server answers well afterwards (HEAD too: a GET's length, no body).
use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, TcpStream},
    process::Command,
    time::{Duration, Instant},
};

use crate::{
    serve::{free_port, get, metric, request, wait_served},
    support::*,
};

/// The interval of the trace under test.
const INTERVAL_MS: u64 = 200;
const REQUESTS: usize = 3000;
const THREADS: usize = 4;
const BARRAGE: Duration = Duration::from_secs(3);
/// Connections held idle from the start: more than the server's 32 slots.
const IDLE: usize = 40;

/// Request `i` of the barrage: what to write, and whether to half-close after it.
fn payload(i: usize) -> (Vec<u8>, bool) {
    let s = |t: &str| t.as_bytes().to_vec();
    match i % 16 {
        0 => (
            s(&format!(
                "GET /nope/{i}/../../etc HTTP/1.1\r\nHost: x\r\n\r\n"
            )),
            true,
        ),
        1 => (
            s("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"),
            true,
        ),
        2 => (s("BREW / HTTP/1.1\r\n\r\n"), true),
        3 => (
            s("GET /debug/pprof/heap?pid=abc&seconds=99999 HTTP/1.1\r\nConnection: close\r\n\r\n"),
            false,
        ),
        4 => (
            format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000)).into_bytes(),
            false,
        ),
        5 => (
            (0..200)
                .fold(s("GET / HTTP/1.1\r\n"), |mut v, k| {
                    v.extend(format!("X-{k}: v\r\n").bytes());
                    v
                })
                .into_iter()
                .chain(s("\r\n"))
                .collect(),
            false,
        ),
        6 => (
            (0..1024u32)
                .map(|k| (k.wrapping_mul(2654435761) >> 13) as u8)
                .collect(),
            true,
        ),
        7 => (s("GET /metr"), true),
        8 => (Vec::new(), true),
        9 => (
            format!("GET /{} HTTP/1.1\r\n\r\n", "p".repeat(10_000)).into_bytes(),
            true,
        ),
        10 => (s("GET /\r\n\r\n"), true),
        11 => (
            s("GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"),
            false,
        ),
        12 => (
            s(
                "GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n",
            ),
            false,
        ),
        13 => (s("GET /\0 HTTP/1.1\r\n\r\n"), true),
        14 => (
            s("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n"),
            true,
        ),
        _ => (
            s(
                "GET /debug/pprof/allocs?comm=%ZZ HTTP/1.1\r\nAuthorization: Bearer x\r\nConnection: close\r\n\r\n",
            ),
            false,
        ),
    }
}

/// Sends one request and reads until the server closes. Returns false if it neither answered
/// nor closed in time (a hang).
fn send(port: u16, i: usize) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return true; // refused for a moment (backlog full): not a hang
    };
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(15))).unwrap();
    let (bytes, half_close) = payload(i);
    let _ = s.write_all(&bytes);
    if half_close {
        let _ = s.shutdown(Shutdown::Write);
    }
    closed(s)
}

/// HEAD `path`: (status, Content-Length, bytes after the header).
fn head(port: u16, path: &str) -> (u16, usize, usize) {
    let (status, header, rest) = request(port, "HEAD", path);
    let length = header
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("a Content-Length");
    (status, length, rest.len())
}

/// Reads until the server closes: false if it did not within the read time-out.
fn closed(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut sink = [0u8; 65536];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false;
            }
            Err(_) => return true, // reset: closed
        }
    }
}

bpf_test!(
    shared,
    fn thousands_of_malformed_requests_neither_panic_nor_hang_nor_stop_the_rounds() {
        let mut sleeper = spawn_with_libc(Command::new("sleep").arg("600"));
        let port = free_port();
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--interval", &format!("{INTERVAL_MS}ms")])
            .args(["--serve", &format!("127.0.0.1:{port}")])
            .args(["-p", &sleeper.id().to_string()]);
        let mut tracer = start_attached(&mut cmd);
        wait_served(port);
        let rounds = || {
            let text = String::from_utf8(get(port, "/metrics").1).unwrap();
            (
                metric(&text, "heaptrace_rounds_total").unwrap(),
                metric(&text, "heaptrace_rounds_late_total").unwrap(),
                metric(&text, "heaptrace_round_gap_max_seconds").unwrap(),
            )
        };
        let (r0, late0, _) = rounds();
        let t0 = Instant::now();
        // At least REQUESTS, for at least BARRAGE: rounds to be taken meanwhile.
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                std::thread::spawn(move || {
                    let (mut i, mut hangs) = (t, 0);
                    while i < REQUESTS || t0.elapsed() < BARRAGE {
                        hangs += usize::from(!send(port, i));
                        i += THREADS;
                    }
                    (i / THREADS, hangs)
                })
            })
            .collect();
        let (sent, hangs) = workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        let barrage = t0.elapsed();
        // More idle connections than slots: the ones past the cap are told 503 and closed at
        // once, the others closed at the header time-out.
        let idle: Vec<TcpStream> = (0..IDLE)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let mut full = 0;
        for s in &idle {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 12];
            if matches!((&*s).read(&mut b), Ok(12) if &b == b"HTTP/1.1 503") {
                full += 1;
            }
            s.set_nonblocking(false).unwrap();
        }
        let idle_closed = idle
            .into_iter()
            .filter(|s| closed(s.try_clone().unwrap()))
            .count();
        let elapsed = t0.elapsed();
        let (r1, late1, gap) = rounds();
        eprintln!(
            "{sent} malformed requests in {:.1} s, then {IDLE} idle connections ({full} \
             told 503): {:.1} s, {} rounds ({:.0} due), {} late, longest gap {gap:.3} s",
            barrage.as_secs_f64(),
            elapsed.as_secs_f64(),
            r1 - r0,
            elapsed.as_secs_f64() * 1000.0 / INTERVAL_MS as f64,
            late1 - late0,
        );
        assert_eq!(hangs, 0, "connections neither answered nor closed");
        assert_eq!(idle_closed, IDLE);
        assert_eq!(full, IDLE - 32, "the connections past the cap");
        assert!(r1 > r0, "no round during the barrage");
        // Liveness, not speed: a barrage that stalled the daemon would leave a gap of many
        // intervals (the machine may be busy, so the bound is 25 of them).
        assert!(
            gap < 5.0,
            "rounds stalled for {gap:.3} s during the barrage"
        );
        assert!(
            tracer.child.try_wait().unwrap().is_none(),
            "heaptrace ended"
        );
        // Still serving, and well.
        let (status, body) = get(port, "/debug/pprof/heap");
        assert_eq!(status, 200);
        assert_eq!(&body[..2], &[0x1f, 0x8b]);
        // HEAD: a GET's length, no body.
        let (status, length, rest) = head(port, "/");
        assert_eq!((status, rest), (200, 0));
        assert_eq!(length, get(port, "/").1.len());
        let (status, length, rest) = head(port, "/debug/pprof/heap");
        assert_eq!((status, rest), (200, 0));
        assert!(
            length > 20,
            "HEAD /debug/pprof/heap: Content-Length {length}"
        );
        tracer.signal(libc::SIGINT);
        let (code, stderr) = tracer.wait();
        assert_eq!(code, 0, "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }
);
