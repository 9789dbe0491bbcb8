//! Recordings: a recorded trace reports the same numbers as the live one, every view and export
//! works (checked by the tools people use: go tool pprof, ms_print), and bad files give one
//! line and exit code 2.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

use crate::support::*;

const N: u64 = 2000;

fn out(tag: &str, ext: &str) -> PathBuf {
    json_path(tag).with_extension(ext)
}

/// Records the sites fixture (with the live JSON alongside); returns (recording, live JSON).
fn record_sites(tag: &str, n: u64) -> (PathBuf, Value) {
    record_sites_with(tag, n, &[])
}

/// `record_sites` with extra flags (`--in-process`).
fn record_sites_with(tag: &str, n: u64, flags: &[&str]) -> (PathBuf, Value) {
    let bin = fixture("sites", "", &[]);
    let rec = out(tag, "bin");
    let live = json_path(tag);
    let o = run_ok(
        heaptrace()
            .args(["record", "-o"])
            .arg(&rec)
            .args(["-q", "--temporary-allocs", "2", "--json"])
            .arg(&live)
            .args(flags)
            .arg("--")
            .arg(&bin)
            .arg(n.to_string()),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("recorded 1 rounds") || stderr.contains("recorded"),
        "{stderr}"
    );
    (rec, read_json(&live))
}

fn report(args: &[&str]) -> std::process::Output {
    heaptrace().arg("report").args(args).output().unwrap()
}

/// `report REC --export KIND [EXTRA] -o FILE` (FILE named for the test and KIND); its text.
fn export(rec: &str, tag: &str, kind: &str, extra: &[&str]) -> (PathBuf, String) {
    let path = out(tag, kind);
    let mut args = vec![rec, "--export", kind];
    args.extend_from_slice(extra);
    args.extend(["-o", path.to_str().unwrap()]);
    report_ok(&args);
    let text = std::fs::read(&path).map_or_else(
        |_| String::new(),
        |b| String::from_utf8_lossy(&b).into_owned(),
    );
    (path, text)
}

pub(crate) fn report_ok(args: &[&str]) -> String {
    let o = report(args);
    assert!(
        o.status.success(),
        "report {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

pub(crate) fn report_json(args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["--format", "json"]);
    serde_json::from_str(&report_ok(&a)).unwrap()
}

bpf_test!(
    shared,
    /// The same numbers live and offline, and the fixture's exact ones.
    fn a_recording_reports_what_the_live_trace_saw() {
        recording_agrees_with_the_live_trace("rec-agree", &[]);
    }
);

/// In process too: the same rounds, and the report says what counted them.
#[test]
fn an_in_process_recording_reports_what_the_live_trace_saw() {
    let _g = shared();
    let rec = recording_agrees_with_the_live_trace("rec-agree-inproc", &["--in-process"]);
    let text = report_ok(&[rec.to_str().unwrap()]);
    assert!(text.contains("mode stacks, counted in process"), "{text}");
}

/// The same numbers live and offline, and the fixture's exact ones; the recording.
fn recording_agrees_with_the_live_trace(tag: &str, flags: &[&str]) -> PathBuf {
    let (rec, live) = record_sites_with(tag, N, flags);
    let r = rec.to_str().unwrap();
    let off = report_json(&[r]);
    for key in [
        "functions",
        "sizes",
        "live",
        "leaks",
        "totals",
        "lost",
        "temporary",
        "max_round_gap_ms",
    ] {
        assert_eq!(off[key], live[key], "{key} differs between live and report");
    }
    assert_eq!(stacks_by_function(&off), stacks_by_function(&live));
    // And the fixture's own numbers.
    assert_eq!(off["functions"]["malloc"]["calls"].as_u64(), Some(2 * N));
    assert_eq!(off["functions"]["calloc"]["calls"].as_u64(), Some(N));
    assert_eq!(off["leaks"]["blocks"].as_u64(), Some(N + 3));
    assert_eq!(off["leaks"]["bytes"].as_u64(), Some(100 * N + 3 * 444));
    // The recording is small: strings and stacks once, rounds deflated.
    let size = std::fs::metadata(&rec).unwrap().len();
    assert!(size < 16 * 1024, "recording of {size} bytes");
    rec
}

bpf_test!(
    shared,
    fn every_view_answers_in_text_and_json() {
        let (rec, _) = record_sites("rec-views", N);
        let r = rec.to_str().unwrap();
        for view in [
            "overview",
            "timeline",
            "histogram",
            "tree",
            "hotspots",
            "flame",
            "leaks",
            "temporary",
            "peak",
        ] {
            let text = report_ok(&[r, view]);
            assert!(!text.trim().is_empty(), "{view}: empty");
            let _ = report_json(&[r, view]);
        }
        let filter = report_json(&[r, "filter", "--size", "444"]);
        let f = filter.as_array().unwrap();
        assert_eq!(f.len(), 1, "{filter}");
        assert_eq!(
            (f[0]["count"].as_u64(), f[0]["function"].as_str()),
            (Some(3), Some("realloc"))
        );
        assert_eq!(f[0]["frames"][0]["function"], "leak_d");
        let flame = report_ok(&[r, "flame", "--by", "count"]);
        assert!(
            flame
                .lines()
                .any(|l| l.ends_with(";main;alloc_c;helper_c;malloc 2000")),
            "{flame}"
        );
        let live = report_ok(&[r, "flame", "--by", "live"]);
        assert!(
            live.lines()
                .any(|l| l.ends_with(";main;alloc_b;calloc 200000")),
            "{live}"
        );
        assert!(!live.contains("alloc_a"), "{live}");
        let tree = report_ok(&[r, "tree", "--reverse"]);
        assert!(tree.contains("main (sites.c:"), "{tree}");
        let hist = report_json(&[r, "histogram"]);
        let n111 = hist
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["size"] == 111)
            .unwrap();
        assert_eq!(n111["count"].as_u64(), Some(N));
        // Window and process filters.
        let none = report_json(&[r, "--pid", "1"]);
        assert_eq!(none["functions"]["malloc"]["calls"], 0);
        // A window with no round in it is an error, not an empty answer.
        let early = report(&[r, "timeline", "--to", "1ms"]);
        assert_eq!(early.status.code(), Some(1));
        assert!(
            error_line(&early).contains("ends between the start and 1ms"),
            "{early:?}"
        );
        // A reader that is gone (`| head` having read enough) ends a report quietly; it was a
        // panic with a backtrace in text, an error in JSON.
        for args in [&[r, "tree"][..], &[r, "overview", "--format", "json"]] {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            let o = heaptrace()
                .arg("report")
                .args(args)
                .stdout(writer)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success() && stderr.is_empty(), "{args:?}: {o:?}");
        }
    }
);

fn tool(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

bpf_test!(
    shared,
    fn exports_are_read_by_pprof_ms_print_and_as_svg() {
        let (rec, _) = record_sites("rec-export", N);
        let r = rec.to_str().unwrap();
        let ci = std::env::var_os("CI").is_some();

        let (pb, _) = export(r, "rec-export", "pprof", &[]);
        if tool("go") || ci {
            let (text, first) = pprof_top(pb.to_str().unwrap(), &[]);
            assert!(text.contains("Type: inuse_space"), "{text}");
            assert!(
                first.contains("200000B") && first.ends_with("alloc_b"),
                "{text}"
            );
            let (text, first) = pprof_top(pb.to_str().unwrap(), &["-sample_index=alloc_space"]);
            assert!(
                first.contains(&format!("{}B", 333 * N)) && first.ends_with("helper_c"),
                "{text}"
            );
        } else {
            eprintln!("SKIPPED the pprof check: no go (cargo xtask setup installs golang-go)");
        }

        let (massif, _) = export(r, "rec-export", "massif", &[]);
        if tool("ms_print") || ci {
            let o = Command::new("ms_print")
                .arg(&massif)
                .output()
                .expect("ms_print");
            let text = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert!(text.contains("(200,000B) 0x"), "{text}");
            assert!(text.contains("alloc_b (sites.c:"), "{text}");
            // The kernel's peak, and the allocation that reached it, in the description.
            assert!(text.contains("(exact), reached by "), "{text}");
        } else {
            eprintln!("SKIPPED the ms_print check: no valgrind");
        }

        let (_, text) = export(r, "rec-export", "svg", &["--by", "count"]);
        assert!(
            text.starts_with("<?xml") && text.contains("<svg"),
            "not an svg"
        );
        assert!(text.contains("helper_c") && text.contains("alloc_b"));

        let (_, text) = export(r, "rec-export", "folded", &["--by", "count"]);
        assert!(
            text.lines()
                .any(|l| l.ends_with(";main;alloc_a;malloc 2000")),
            "{text}"
        );
    }
);

bpf_test!(
    shared,
    fn diff_compares_two_recordings_per_site() {
        let (a, _) = record_sites("rec-diff-a", 2000);
        let (b, _) = record_sites("rec-diff-b", 1000);
        let d = report_json(&[a.to_str().unwrap(), "--diff", b.to_str().unwrap()]);
        let sites = d["sites"].as_array().unwrap();
        let a_site = sites
            .iter()
            .find(|s| {
                s["site"]
                    .as_str()
                    .unwrap()
                    .starts_with("malloc <- alloc_a <- main")
            })
            .unwrap();
        assert_eq!(a_site["bytes"], serde_json::json!([111 * 2000, 111 * 1000]));
        assert_eq!(a_site["calls"], serde_json::json!([2000, 1000]));
        // In text, the change in human units: 111,000 bytes fewer.
        let text = report_ok(&[a.to_str().unwrap(), "--diff", b.to_str().unwrap()]);
        let row = text
            .lines()
            .find(|l| l.contains("malloc <- alloc_a <- main"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(row.trim_start().starts_with("-108.4 KiB"), "{row}");
        // A view that is not per site cannot be compared: one line, before anything is read.
        let o = report(&[
            a.to_str().unwrap(),
            "timeline",
            "--diff",
            b.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(1));
        let err = error_line(&o);
        assert!(
            err.contains("--diff compares sites: it works with the views overview, hotspots, leaks, not timeline"),
            "{err}"
        );
        // A window that is inverted, or holds no round, is an error, not an empty report.
        let o = report(&[a.to_str().unwrap(), "--from", "4s", "--to", "2s"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(error_line(&o).contains("--from 4.0s is after --to 2.0s"));
        let o = report(&[a.to_str().unwrap(), "--from", "3000s"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            error_line(&o).contains("ends between 3000.0s and the end (its last ends at"),
            "{o:?}"
        );
    }
);

bpf_test!(
    shared,
    /// A recorder killed with SIGKILL leaves a file that reads up to its last complete round.
    fn a_recording_cut_short_still_reads() {
        let mut spin = spawn_with_libc(&mut Command::new(fixture("spin", "", &[])));
        let rec = out("rec-killed", "bin");
        let tracer = start_attached(heaptrace().args(["record", "-o"]).arg(&rec).args([
            "-q",
            "--interval",
            "100ms",
            "-p",
            &spin.id().to_string(),
        ]));
        std::thread::sleep(std::time::Duration::from_millis(700));
        tracer.signal(libc::SIGKILL);
        let _ = tracer.wait();
        spin.kill().unwrap();
        spin.wait().unwrap();
        let o = report(&[rec.to_str().unwrap(), "timeline", "--format", "json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let rows: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(rows.as_array().unwrap().len() >= 2, "{rows}");
        assert!(rows[0]["allocations"].as_u64().unwrap() > 0);
    }
);

fn bad_file_is_rejected(tag: &str, bytes: &[u8], expect: &str) {
    let path = out(tag, "bin");
    std::fs::write(&path, bytes).unwrap();
    let o = report(&[path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{tag}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{tag}: {stderr}");
    assert!(stderr.contains(expect), "{tag}: {stderr}");
}

#[test]
fn bad_recordings_give_one_line_and_exit_code_2() {
    bad_file_is_rejected("empty", b"", "empty file");
    bad_file_is_rejected(
        "elf",
        b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0",
        "not a heaptrace recording",
    );
    let mut future = b"HEAPTRC\0".to_vec();
    future.extend([0xff, 0xff, 0, 0]);
    bad_file_is_rejected("future", &future, "newer than this heaptrace");
    let old = b"HEAPTRC\0\x01\0\0\0".to_vec();
    bad_file_is_rejected("old", &old, "older than this heaptrace reads");
    // A header frame claiming 4 GiB.
    let mut huge = b"HEAPTRC\0\x02\0\0\0".to_vec();
    huge.extend([1, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    bad_file_is_rejected("huge", &huge, "exceeds");
    // An unknown record kind.
    let mut kind = b"HEAPTRC\0\x02\0\0\0".to_vec();
    kind.extend([99, 0, 0, 0, 0, 0, 0, 0, 0]);
    bad_file_is_rejected("kind", &kind, "unknown record kind");
    let o = report(&["/nonexistent/trace.bin"]);
    assert_eq!(o.status.code(), Some(2));
}

bpf_test!(
    shared,
    fn a_flipped_byte_is_caught_by_the_checksum() {
        let (rec, _) = record_sites("rec-flip", 100);
        let mut data = std::fs::read(&rec).unwrap();
        let last = data.len() - 3;
        data[last] ^= 0xff;
        bad_file_is_rejected("flip", &data, "checksum mismatch");
    }
);

/// Opens `page` in Debian's headless chromium: the DOM once its script ran, and a screenshot
/// beside the page. None (outside CI) where chromium is missing.
fn chromium(page: &Path) -> Option<String> {
    if !tool("chromium") {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is missing (cargo xtask setup installs it)"
        );
        eprintln!("SKIPPED the browser check: no chromium");
        return None;
    }
    let profile = page.with_extension("chromium");
    let _ = std::fs::remove_dir_all(&profile);
    let flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,2400",
    ];
    let url = format!("file://{}", page.display());
    let run = |extra: &[String]| {
        let o = Command::new("chromium")
            .args(flags)
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(extra)
            .arg(&url)
            .output()
            .expect("chromium");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o
    };
    let dom = String::from_utf8_lossy(&run(&["--dump-dom".into()]).stdout).into_owned();
    let shot = page.with_extension("png");
    run(&[format!("--screenshot={}", shot.display())]);
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000),
        "no screenshot at {}",
        shot.display()
    );
    let _ = std::fs::remove_dir_all(&profile);
    Some(dom)
}

bpf_test!(
    shared,
    /// `--export html`: one file a browser opens offline, whose script draws the run, the
    /// charts, the flame graph and the tables from the recording's figures.
    fn the_html_report_opens_in_a_browser_with_the_sites() {
        let (rec, _) = record_sites("rec-html", N);
        let (page, text) = export(rec.to_str().unwrap(), "rec-html", "html", &[]);
        assert!(text.starts_with("<!DOCTYPE html>"), "not a page");
        for needle in ["src=", "href=", "<link", "@import", "fetch("] {
            assert!(!text.contains(needle), "the page would load {needle}");
        }
        let Some(dom) = chromium(&page) else {
            return;
        };
        // The tables are built by the script: their rows are in the DOM, not in the file.
        let row = |site: &str| {
            dom.split("<tr>")
                .find(|r| r.contains(site) && r.contains("class=\"site\""))
                .unwrap_or_else(|| panic!("no row for {site} in the DOM"))
                .to_string()
        };
        // alloc_a: 2000 x malloc(111), every one freed; alloc_b: 2000 x calloc(2, 50), leaked.
        let a = row("malloc &lt;- alloc_a");
        assert!(a.contains(">216.8 KiB<") && a.contains(">2,000<"), "{a}");
        let leaks = dom.split("id=\"leaks\"").nth(1).unwrap();
        let leaks = leaks.split("</table>").next().unwrap();
        assert!(
            leaks.contains("calloc &lt;- alloc_b") && leaks.contains(">195.3 KiB<"),
            "{leaks}"
        );
        // The flame graph's frames and the charts' lines.
        let frames = dom.matches("class=\"fr").count();
        assert!(frames >= 6, "{frames} flame-graph frames");
        assert!(dom.contains(">helper_c<") && dom.contains(">main<"));
        assert!(dom.matches("<polyline").count() >= 3, "charts missing");
        assert!(dom.contains("<td>traced</td>"), "the run's header");
        // One process: no pid column.
        let sites = dom.split("id=\"sites\"").nth(1).unwrap();
        let sites = sites.split("</table>").next().unwrap();
        assert!(
            !sites.contains(">pid</th>"),
            "a pid column for one process: {sites}"
        );
    }
);

bpf_test!(
    shared,
    /// Several processes (`--follow-forks`): the page counts them, lists them, says whose each
    /// site is, and the folded stacks give each a root frame unless merged.
    fn the_html_report_and_flame_tell_processes_apart() {
        let bin = fixture("forkers", "", &[]);
        let rec = out("rec-html-forks", "bin");
        run_ok(
            heaptrace()
                .args(["record", "-q", "--follow-forks", "-o"])
                .arg(&rec)
                .arg("--")
                .arg(&bin)
                .arg("300"),
        );
        let rec = rec.to_str().unwrap();
        // Workers 0, 1, 2 malloc 300 blocks of 1000, 1100 and 1200 bytes.
        let flame = report(&[rec, "flame", "--by", "count"]);
        let text = String::from_utf8_lossy(&flame.stdout);
        let mut workers: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(";worker;") && l.ends_with(";malloc 300"))
            .map(|l| l.split(';').next().unwrap())
            .collect();
        workers.sort();
        workers.dedup();
        assert_eq!(workers.len(), 3, "a root frame per worker: {text}");
        assert!(
            workers
                .iter()
                .all(|w| w.starts_with("pid ") && w.ends_with(" forkers"))
        );
        let merged = report(&[rec, "flame", "--by", "count", "--merge-processes"]);
        let merged = String::from_utf8_lossy(&merged.stdout);
        assert!(merged.lines().all(|l| !l.starts_with("pid ")), "{merged}");
        let lines: Vec<&str> = merged
            .lines()
            .map(|l| l.rsplit_once(' ').unwrap().0)
            .collect();
        let mut unique = lines.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(lines.len(), unique.len(), "a stack repeated: {merged}");
        let worker_calls: u64 = merged
            .lines()
            .filter(|l| l.contains(";worker;") && l.contains(";malloc "))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
            .sum();
        assert_eq!(worker_calls, 900, "{merged}");

        let (page, _) = export(rec, "rec-html-forks", "html", &[]);
        let Some(dom) = chromium(&page) else {
            return;
        };
        let procs = dom.split("id=\"procs\"").nth(1).unwrap();
        let procs = procs.split("</table>").next().unwrap();
        assert_eq!(procs.matches(">forkers").count(), 4, "{procs}");
        assert!(dom.contains("<td>4</td>"), "the processes' count");
        let sites = dom.split("id=\"sites\"").nth(1).unwrap();
        let sites = sites.split("</table>").next().unwrap();
        assert!(sites.contains("<th class=\"num\">pid</th>"), "{sites}");
        assert!(sites.contains("<th>command</th>"), "{sites}");
    }
);
