//! `heaptrace heap`: the census of tests/fixtures/heapcensus.c's known heap, live (running
//! and stopped, with and without debug symbols) and from a gcore of it, checked block by
//! block and against the fixture's mallinfo2(); other allocators and corrupt heaps refused
//! or reported, never a panic. No probes: these need no BPF, only ptrace rights (root).
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
};

use serde_json::Value;

use crate::support::{fixture, heaptrace};

/// The fixture running, with what it printed: usable size -> blocks kept, and mallinfo2.
struct Known {
    child: Child,
    live: BTreeMap<u64, u64>,
    mallinfo: BTreeMap<String, u64>,
}

impl Drop for Known {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(mode: &str, env: &[(&str, &str)]) -> Known {
    let bin = fixture("heapcensus", "", &[]);
    let mut child = Command::new(bin)
        .arg(mode)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut live = BTreeMap::new();
    let mut mallinfo = BTreeMap::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the fixture ended early"
        );
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("ready") => break,
            Some("live") => {
                *live.entry(words[1].parse().unwrap()).or_insert(0) +=
                    words[2].parse::<u64>().unwrap()
            }
            Some("mallinfo") => {
                for kv in words[1..].chunks(2) {
                    mallinfo.insert(kv[0].to_string(), kv[1].parse().unwrap());
                }
            }
            _ => {}
        }
    }
    Known {
        child,
        live,
        mallinfo,
    }
}

fn census(args: &[&str]) -> (Value, String) {
    let out = heaptrace()
        .arg("heap")
        .args(args)
        .args(["--json", "-"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "heaptrace heap {args:?}: {stderr}");
    (serde_json::from_slice(&out.stdout).unwrap(), stderr)
}

fn count_of(doc: &Value, usable: u64) -> u64 {
    doc["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["size"] == usable)
        .map_or(0, |s| s["count"].as_u64().unwrap())
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Everything the fixture did, exactly.
fn assert_exact(k: &Known, doc: &Value) {
    for (&usable, &count) in &k.live {
        assert_eq!(
            count_of(doc, usable),
            count,
            "blocks of usable size {usable}"
        );
    }
    assert_eq!(n(&doc["mmapped"]["blocks"]), 3);
    let kinds = &doc["free"]["by_kind"];
    // 5 x 72 and 7 of 12 x 40 and 7 of 9 x 500 (main thread), 3 x 104 (its other thread).
    assert_eq!(n(&kinds["tcache"]["blocks"]), 22);
    assert_eq!(n(&kinds["fastbin"]["blocks"]), 5);
    assert_eq!(n(&kinds["fastbin"]["bytes"]), 5 * 48);
    assert_eq!(n(&kinds["unsorted"]["blocks"]), 4);
    assert_eq!(n(&kinds["small"]["blocks"]), 2);
    assert_eq!(n(&kinds["small"]["bytes"]), 2 * 512);
    assert_eq!(n(&kinds["large"]["blocks"]), 3);
    assert!(kinds.get("unbinned").is_none(), "{kinds}");
    let mut tc: Vec<u64> = doc["tcaches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| n(&t["blocks"]))
        .collect();
    tc.sort();
    assert_eq!(tc, [3, 19]);
    assert_eq!(doc["arenas"].as_array().unwrap().len(), 2);
    assert_eq!(n(&doc["unreadable_bytes"]), 0);
    // mallinfo2 counts tcache chunks in use, and each top as one free block.
    let m = &k.mallinfo;
    let tcache = n(&kinds["tcache"]["bytes"]);
    let top = &doc["top"];
    assert_eq!(m["hblks"], n(&doc["mmapped"]["blocks"]));
    assert_eq!(m["hblkhd"], n(&doc["mmapped_chunk_bytes"]));
    assert_eq!(m["smblks"], n(&kinds["fastbin"]["blocks"]));
    assert_eq!(
        m["ordblks"],
        n(&doc["free"]["blocks"]) - 22 - 5 + n(&top["blocks"])
    );
    assert_eq!(
        m["fordblks"],
        n(&doc["free"]["bytes"]) - tcache + n(&top["bytes"])
    );
    let system: u64 = doc["arenas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| n(&a["system_mem"]))
        .sum();
    assert_eq!(m["arena"], system);
    assert_eq!(m["uordblks"], m["arena"] - m["fordblks"]);
}

#[test]
fn the_census_of_a_running_process_is_exact() {
    let k = start("", &[]);
    let pid = k.child.id().to_string();
    let (doc, _) = census(&["-p", &pid]);
    assert_exact(&k, &doc);
    assert!(doc["found_by"].get("symbols").is_some() || doc["found_by"] == "code_patterns");
    let (stopped, _) = census(&["-p", &pid, "--stop"]);
    assert_exact(&k, &stopped);
    assert_eq!(stopped["exact"], true);
    let (patterns, _) = census(&["-p", &pid, "--without-symbols"]);
    assert_exact(&k, &patterns);
    assert_eq!(patterns["found_by"], "code_patterns");
    // Held and let go: the process runs on, untraced.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("TracerPid:\t0"), "{status}");
}

#[test]
fn the_census_of_a_core_file_is_the_same() {
    let k = start("", &[]);
    let pid = k.child.id().to_string();
    let dir = std::env::temp_dir().join(format!("ht-heapcore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("core");
    let out = Command::new("gcore")
        .arg("-o")
        .arg(&prefix)
        .arg(&pid)
        .output()
        .expect("gcore (gdb): `cargo xtask` installs it");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let core = format!("{}.{pid}", prefix.display());
    let (doc, _) = census(&["--core", &core]);
    assert_exact(&k, &doc);
    let (patterns, _) = census(&["--core", &core, "--without-symbols"]);
    assert_exact(&k, &patterns);
    // Hostile cores: cut short, or not a core at all, give one error line.
    let data = std::fs::read(&core).unwrap();
    for (name, bytes) in [("cut", &data[..data.len() / 3]), ("head", &data[..100])] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let out = heaptrace()
            .args(["heap", "--core"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
    let out = heaptrace()
        .args(["heap", "--core", "/etc/passwd"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(crate::support::error_line(&out).contains("not an ELF file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn another_allocator_is_refused_in_one_line() {
    let jemalloc = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
    let k = start("", &[("LD_PRELOAD", jemalloc)]);
    let out = heaptrace()
        .args(["heap", "-p", &k.child.id().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = crate::support::error_line(&out);
    assert!(
        line.contains("libjemalloc.so.2, not glibc's malloc"),
        "{line}"
    );
    // A static executable carries its own malloc.
    let bin = fixture("heapcensus", "static", &["-static"]);
    let mut child = Command::new(bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out_r = BufReader::new(child.stdout.take().unwrap());
    while line != "ready\n" {
        line.clear();
        assert!(out_r.read_line(&mut line).unwrap() > 0);
    }
    let out = heaptrace()
        .args(["heap", "-p", &child.id().to_string()])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(out.status.code(), Some(1));
    // It is glibc's malloc, linked in: what is missing is a libc.so.6 to read it by.
    let line = crate::support::error_line(&out);
    assert!(
        line.contains("statically linked with glibc's malloc") && line.contains("libc.so.6"),
        "{line}"
    );
}

#[test]
fn a_corrupt_chunk_is_counted_unreadable_not_a_crash() {
    let k = start("corrupt", &[]);
    let pid = k.child.id().to_string();
    let (doc, stderr) = census(&["-p", &pid, "--stop"]);
    assert!(n(&doc["unreadable_bytes"]) > 0, "{doc}");
    assert!(
        stderr.contains("could not be walked (corrupt heap)"),
        "{stderr}"
    );
    // The other thread's arena is whole.
    assert_eq!(count_of(&doc, 104), 40);
    assert_eq!(n(&doc["mmapped"]["blocks"]), 3);
}

#[test]
fn a_process_allocating_during_the_walk_gets_a_census_or_a_warning() {
    let k = start("churn", &[]);
    let pid = k.child.id().to_string();
    for _ in 0..5 {
        let (doc, stderr) = census(&["-p", &pid]);
        // The churning thread has an arena of its own: the others' blocks are still exact,
        // or the walk says it could not read them.
        let exact = count_of(&doc, 200) == 50 && count_of(&doc, 3000) == 30;
        assert!(exact || stderr.contains("warning"), "{stderr}\n{doc}");
    }
    let (doc, _) = census(&["-p", &pid, "--stop"]);
    for (&usable, &count) in &k.live {
        assert!(count_of(&doc, usable) >= count, "usable size {usable}");
    }
    assert_eq!(n(&doc["unreadable_bytes"]), 0);
}
