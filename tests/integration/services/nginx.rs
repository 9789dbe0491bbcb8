//! Debian's nginx: a master and two workers of the test's own on a loopback port, attached
//! with `-p --follow-forks` while a small client sends 1,000 GETs.
use std::{
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::{names, sites_past, whole_share};
use crate::support::*;

/// nginx's allocation layer, as its stacks show it (Debian 1.22, no symbol table).
const NGX: [&str; 6] = [
    "ngx_alloc",
    "ngx_calloc",
    "ngx_memalign",
    "ngx_create_pool",
    "ngx_palloc",
    "ngx_pcalloc",
];

/// nginx on `127.0.0.1:port`, serving `dir`; killed when dropped.
struct Nginx {
    child: Child,
    port: u16,
}

impl Nginx {
    fn start(dir: &Path) -> Nginx {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("index.html"), "hello\n").unwrap();
        // A free port: the kernel's pick, let go just before nginx binds it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.display();
        let temp: String = ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"]
            .iter()
            .map(|t| format!("{t}_temp_path {d}/{t};\n"))
            .collect();
        let conf = format!(
            "worker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{ access_log off;\n{temp}\
             server {{ listen 127.0.0.1:{port}; root {d}; location / {{ }} }} }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new("nginx")
            .arg("-p")
            .arg(dir)
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx");
        let nginx = Nginx { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while nginx.get().is_err() {
            assert!(Instant::now() < deadline, "nginx did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        nginx
    }

    /// One GET of `/` on a connection of its own; the whole response.
    fn get(&self) -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its workers before it exits.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether nginx is installed; under CI a missing one fails (setup installs it).
fn present() -> bool {
    let found = Path::new("/usr/sbin/nginx").exists();
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "nginx is missing (cargo xtask setup installs it)"
        );
        eprintln!("SKIPPED: no nginx");
    }
    found
}

bpf_test!(
    shared,
    /// nginx attached with its workers: each of its wrappers has one or two callers here, too
    /// few for detection; known by name, they are passed over, with the static helpers
    /// `ngx_palloc` jumps to, and the sites name nginx's callers (`ngx_event_accept`).
    fn nginx_sites_name_its_callers_not_its_pools() {
        if !present() {
            return;
        }
        let nginx = Nginx::start(&workspace().join("target/test-out/nginx"));
        let json = json_path("nginx");
        let running = start_attached(
            heaptrace()
                .args(["--no-tui", "--follow-forks", "--json"])
                .arg(&json)
                .args(["-p", &nginx.child.id().to_string()]),
        );
        for _ in 0..1000 {
            let r = nginx.get().expect("GET");
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        }
        running.signal(libc::SIGINT);
        let (code, summary) = running.wait();
        drop(nginx);
        assert_eq!(code, 0, "{summary}");
        let doc = read_json(&json);
        let known = names(&doc["wrappers"]["known"]);
        assert!(known.contains(&"ngx_create_pool"), "{:?}", doc["wrappers"]);
        let through = sites_past(&doc, &NGX);
        assert!(through >= 2_000, "{through} calls through nginx's wrappers");
        // No site is the symbol-less helper ngx_palloc jumps to, right above the wrapper
        // that calls the allocator (ngx_palloc_large above ngx_alloc).
        for s in doc["stacks"].as_array().unwrap() {
            let f = &s["frames"];
            if s["site_frame"] == 1
                && ["ngx_alloc", "ngx_memalign"].contains(&f[0]["function"].as_str().unwrap_or(""))
            {
                let name = f[1]["function"].as_str().unwrap();
                assert!(!name.starts_with("nginx+0x"), "{s}");
            }
        }
        let sites: Vec<&str> = doc["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["site"].as_str())
            .collect();
        assert!(sites.contains(&"ngx_event_accept"), "{sites:?}");
        let whole = whole_share(&doc);
        assert!(whole >= 0.99, "{:.1}% of calls reach main", whole * 100.0);
    }
);
