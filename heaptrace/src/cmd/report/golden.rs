//! Golden outputs of every view (insta snapshots), from a recording built by hand so that the
//! numbers, names and order are fixed.
use std::collections::BTreeMap;

use heaptrace_common::Func;

use super::*;
use crate::{
    cli::{FlameBy, View},
    drain::round::Leak,
    drain::round::{NewStack, ProcRound, SiteTotals, Totals},
    record::{Header, Recorder, format::EndRec},
    symbolize::Frame,
};

fn frame(function: &str, file: &str, line: u32, inlined: bool) -> Frame {
    crate::symbolize::FrameInfo::named(function)
        .at(&format!("/src/{file}"), line)
        .in_module("app", 0x1000 + u64::from(line))
        .inlined(inlined)
        .into()
}

fn round(index: u64, a: u64, b: u64, with_stacks: bool) -> Round {
    let mut delta = Totals::default();
    delta.funcs[Func::Malloc as usize].calls = a + b;
    delta.funcs[Func::Malloc as usize].bytes = 100 * a + 2000 * b;
    delta.funcs[Func::Free as usize].calls = a;
    delta.funcs[Func::Free as usize].bytes = 100 * a;
    delta.live_blocks = b as i64;
    delta.live_bytes = 2000 * b as i64;
    let mut r = Round {
        index,
        elapsed_ms: 1000 * index,
        ..Default::default()
    };
    r.procs.insert(
        7,
        ProcRound {
            comm: "app".into(),
            delta,
            cgroup: String::new(),
        },
    );
    r.sizes.insert((7, 0, 100, 1), a);
    r.sizes.insert((7, 0, 2000, 2), b);
    let mut sa = SiteTotals {
        calls: a,
        bytes: 100 * a,
        frees: a,
        freed_bytes: 100 * a,
        temp_blocks: a,
        temp_bytes: 100 * a,
        ..Default::default()
    };
    sa.sizes.set(heaptrace_common::log2_bucket(100), a);
    sa.lifetimes.set(3, a);
    r.sites.insert((7, 1, 0), sa);
    r.sites.insert(
        (7, 2, 0),
        SiteTotals {
            calls: b,
            bytes: 2000 * b,
            live_blocks: b as i64,
            live_bytes: 2000 * b as i64,
            ..Default::default()
        },
    );
    r.mem.insert(
        7,
        crate::targets::procfs::Mem {
            rss_kb: 1024 * index,
            virt_kb: 4096,
        },
    );
    // Site 2's big buffers are mapped blocks: reserved every round, one given back in round 2.
    use crate::reserve::{Area, Kind, ResTotals, Reserved};
    r.reservations.insert(
        (7, Kind::Mmap, 2, 0),
        ResTotals {
            calls: 1,
            bytes: 1 << 20,
        },
    );
    if index == 2 {
        r.reservations.insert(
            (7, Kind::Munmap { of: Area::Mmap }, 2, 0),
            ResTotals {
                calls: 1,
                bytes: 1 << 20,
            },
        );
    }
    r.reserved.insert(
        7,
        Reserved {
            heap: 132 << 10,
            arenas: 0,
            mmapped: 1 << 20,
            pymalloc: 0,
        },
    );
    if with_stacks {
        let stack = |frames: Vec<Frame>| NewStack {
            ips: vec![0; frames.iter().filter(|f| !f.inlined).count()],
            locations: vec![None; frames.iter().filter(|f| !f.inlined).count()],
            frames: frames.into(),
        };
        r.stacks.insert(
            (7, 1),
            stack(vec![
                frame("parse_token", "lexer.c", 41, false),
                frame("Parser<Json>::next()", "parser.cc", 88, false),
                frame("main", "main.c", 12, false),
            ]),
        );
        r.stacks.insert(
            (7, 2),
            stack(vec![
                frame("grow_buffer", "buf.h", 9, true),
                frame(
                    "Buffer::push(char const*, unsigned long)",
                    "buf.cc",
                    30,
                    false,
                ),
                frame("main", "main.c", 14, false),
            ]),
        );
    }
    r
}

fn recording() -> (Recording, Profile) {
    recording_in(crate::run_info::Mode::Stacks)
}

fn recording_in(mode: crate::run_info::Mode) -> (Recording, Profile) {
    // A directory per call: the tests run at once, and one writing the file while another
    // read it made the reader's recording "cut short" (a golden test failed 1 run in 6).
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("heaptrace-golden-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("g.bin");
    let header = Header {
        heaptrace_version: "0.1.0".into(),
        host: "host".into(),
        kernel: "6.18".into(),
        interval_ms: 1000,
        mode,
        target_mode: crate::run_info::TargetKind::Command,
        pids: vec![7],
        command: vec!["./app".into(), "input.json".into()],
        provider: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
        temporary_allocs: 1,
        aliases: vec![("memalign".into(), "aligned_alloc".into())],
        ..Default::default()
    };
    let mut w = Recorder::create_at(&path, &header).unwrap();
    w.round(&round(1, 300, 2, true)).unwrap();
    w.round(&round(2, 200, 3, false)).unwrap();
    let mut leaks = BTreeMap::new();
    leaks.insert(
        (7, 2, 0),
        Leak {
            blocks: 5,
            bytes: 10000,
        },
    );
    w.finish(
        Some(&leaks),
        &EndRec {
            elapsed_ms: 2100,
            exit_code: Some(0),
            reason: "pid 7 exited with status 0".into(),
        },
    )
    .unwrap();
    let rec = Recording::open(&path).unwrap();
    let p = rec.profile();
    (rec, p)
}

fn args(view: View) -> ReportArgs {
    ReportArgs {
        file: "g.bin".into(),
        view,
        format: Format::Text,
        size: Some(2000),
        reverse: false,
        top: 10,
        by: FlameBy::Bytes,
        merge_processes: false,
        just_function_name: false,
        shorten_templates: false,
        full_names: false,
        site_naming: crate::cli::SiteNaming::default(),
        pid: None,
        from: None,
        to: None,
        diff: None,
        group_by: crate::cli::GroupBy::Process,
        resymbolize: false,
        export: None,
        output: None,
        force: false,
    }
}

#[test]
fn golden_views() {
    let (rec, p) = recording();
    // Names as the report chooses them: short in text, whole in JSON and exports.
    let names = super::names(&args(View::Overview));
    for view in [
        View::Overview,
        View::Timeline,
        View::Histogram,
        View::Filter,
        View::Tree,
        View::Hotspots,
        View::Flame,
        View::Leaks,
        View::Temporary,
        View::Peak,
        View::Memory,
    ] {
        let text = render::text(view, &rec, &p, &names, &args(view)).unwrap();
        insta::assert_snapshot!(format!("{view:?}").to_lowercase(), text);
    }
    let mut rev = args(View::Tree);
    rev.reverse = true;
    let short = Names {
        style: crate::view::names::NameStyle::Function,
    };
    insta::assert_snapshot!(
        "tree_reverse_short",
        render::text(View::Tree, &rec, &p, &short, &rev).unwrap()
    );
    let (mut t1, mut t2) = (None, None);
    let names = Names::FULL;
    let json = render::json(View::Leaks, &rec, &p, &names, &args(View::Leaks), &mut t1).unwrap();
    insta::assert_json_snapshot!("leaks_json", json);
    let json = render::json(View::Memory, &rec, &p, &names, &args(View::Memory), &mut t2).unwrap();
    insta::assert_json_snapshot!("memory_json", json);
    let massif = crate::view::export::massif(&rec, &p, &names);
    insta::assert_snapshot!("massif", massif);
}

/// A recording says the mode it was made in, whichever: a calls-mode recording once read as
/// stacks mode.
#[test]
fn a_recording_reports_its_own_mode() {
    for mode in crate::run_info::Mode::ALL {
        let (rec, p) = recording_in(mode);
        let mut tree = None;
        let args = args(View::Overview);
        let doc = render::json(
            View::Overview,
            &rec,
            &p,
            &Names::default(),
            &args,
            &mut tree,
        )
        .unwrap()
        .to_value();
        assert_eq!(doc["mode"], mode.name());
        assert_eq!(doc["target"]["mode"], "command");
        let text = render::text(View::Overview, &rec, &p, &Names::default(), &args).unwrap();
        assert!(text.contains(&format!("mode {mode}\n")), "{text}");
    }
}

/// A timeline past `TIMELINE_ROWS` rounds is coarsened: the peak's round may end up inside a
/// row. massif still gets one peak snapshot, with the peak's own bytes and time.
#[test]
fn massif_keeps_the_peak_inside_a_coarsened_row() {
    let (rec, _) = recording();
    let mut p = Profile::of_mode(crate::run_info::Mode::Stacks, 0);
    let n = crate::profile::TIMELINE_ROWS as u64 + 10;
    // Odd: once rows hold two rounds, the peak is the first round of its row, not its last.
    let top = 2 * (n / 3) + 1;
    for i in 1..=n {
        let mut r = round(i, 1, 1, i == 1);
        if i > top {
            let d = &mut r.procs.get_mut(&7).unwrap().delta;
            d.live_bytes = -1000;
        }
        p.apply(&r);
    }
    assert_eq!(p.timeline_step, 2);
    let peak = p.peak.clone().unwrap();
    assert_eq!((peak.round, peak.live_bytes), (top, 2000 * top as i64));
    assert!(p.rounds.iter().all(|r| r.index != top));
    let m = crate::view::export::massif(&rec, &p, &Names::default());
    assert_eq!(m.matches("heap_tree=peak").count(), 1);
    assert_eq!(m.matches("snapshot=").count(), p.rounds.len() + 1);
    let at_peak = m
        .split("#-----------\nsnapshot=")
        .find(|s| s.contains("heap_tree=peak"));
    let at_peak = at_peak.unwrap();
    assert!(
        at_peak.contains(&format!("time={}\n", 1000 * top)),
        "{at_peak}"
    );
    assert!(
        at_peak.contains(&format!("mem_heap_B={}\n", 2000 * top)),
        "{at_peak}"
    );
}
