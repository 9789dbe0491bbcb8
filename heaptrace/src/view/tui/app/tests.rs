use ratatui::crossterm::event::KeyEvent;

use super::*;
use crate::run_info::{Mode, RunInfo, TargetKind};
use crate::{
    drain::round::{FnTotals, Round},
    profile::ProcProfile,
    targets::procfs::Mem,
};

pub fn frame(function: &str, file: &str, line: u32, module: &str) -> Frame {
    crate::symbolize::FrameInfo {
        function: function.into(),
        file: (!file.is_empty()).then(|| file.into()),
        line: (line > 0).then_some(line),
        module: module.into(),
        offset: 0x1000 + line as u64,
        inlined: false,
    }
    .into()
}

pub fn info(target: TargetKind) -> Info {
    let all = target == TargetKind::All;
    Info {
        target: if all {
            "all processes".into()
        } else {
            "./sites 1000 (pid 4242)".into()
        },
        run: RunInfo {
            mode: Mode::Stacks,
            target,
            interval_ms: 1000,
            provider: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(),
            pids: if all { vec![] } else { vec![4242] },
            command: vec!["./sites".into(), "1000".into()],
            aliases: vec![(Func::Memalign, Func::AlignedAlloc)],
            temporary: crate::run_info::Temporary::Allocs(1),
            ..RunInfo::default()
        },
        attached: vec![],
        probe_count: 21,
        output: None,
    }
}

fn site(calls: u64, bytes: u64, live: i64, temp: u64) -> SiteTotals {
    let mut t = SiteTotals {
        calls,
        bytes,
        frees: calls - (live.max(0) as u64 * calls / bytes.max(1)).min(calls),
        live_blocks: if live > 0 { calls as i64 } else { 0 },
        live_bytes: live,
        temp_blocks: temp,
        temp_bytes: temp * (bytes / calls.max(1)),
        ..Default::default()
    };
    t.sizes.set(log2_bucket(bytes / calls.max(1)), calls);
    t.lifetimes.set(10, calls);
    t
}

/// The stacks of `sites_round`'s three sites in pid 4242, new in its first round.
fn sites_stacks(r: &mut Round) {
    let mk = |fs: Vec<Frame>| crate::drain::round::NewStack {
        locations: Vec::new(),
        ips: vec![],
        frames: fs.into(),
    };
    r.stacks.insert(
        (4242, 1),
        mk(vec![
            frame("alloc_a", "/src/sites.c", 19, "sites"),
            frame("main", "/src/sites.c", 48, "sites"),
        ]),
    );
    r.stacks.insert(
        (4242, 2),
        mk(vec![
            frame("alloc_b", "/src/sites.c", 27, "sites"),
            frame("main", "/src/sites.c", 49, "sites"),
        ]),
    );
    r.stacks.insert(
        (4242, 3),
        mk(vec![
            frame("__libc_strdup", "", 0, "libc.so.6"),
            frame("helper_c", "/src/sites.c", 31, "sites"),
            (*frame("inlined_c", "/src/sites.h", 3, "sites"))
                .clone()
                .inlined(true)
                .into(),
            frame("alloc_c", "/src/sites.c", 36, "sites"),
            frame("main", "/src/sites.c", 50, "sites"),
        ]),
    );
}

/// A round of the sites fixture: three sites in pid 4242 (plus one in pid 7 when `two`).
pub fn sites_round(index: u64, scale: u64, two: bool) -> Round {
    let mut r = Round {
        index,
        elapsed_ms: index * 1000,
        ..Default::default()
    };
    let mut d = Totals::default();
    d.funcs[Func::Malloc as usize] = FnTotals {
        calls: 2 * scale,
        bytes: 444 * scale,
        failed: 0,
    };
    d.funcs[Func::Calloc as usize] = FnTotals {
        calls: scale,
        bytes: 100 * scale,
        failed: 0,
    };
    d.funcs[Func::Free as usize].calls = scale;
    d.funcs[Func::Free as usize].bytes = 111 * scale;
    d.live_blocks = 2 * scale as i64;
    d.live_bytes = 433 * scale as i64;
    r.procs.insert(
        4242,
        crate::drain::round::ProcRound {
            comm: "sites".into(),
            delta: d,
            cgroup: String::new(),
        },
    );
    r.mem.insert(
        4242,
        Mem {
            rss_kb: 1800 + index * 10,
            virt_kb: 4000,
        },
    );
    r.reserved.insert(
        4242,
        crate::reserve::Reserved {
            heap: 132 << 10,
            arenas: 64 << 20,
            mmapped: 0,
            pymalloc: 0,
        },
    );
    r.sizes.insert((4242, 0, 111, 1), scale);
    r.sizes.insert((4242, 0, 333, 1), scale);
    r.sizes.insert((4242, 1, 100, 1), scale);
    r.sites
        .insert((4242, 1, 0), site(scale, 111 * scale, 0, scale));
    r.sites.insert(
        (4242, 2, 1),
        site(scale, 100 * scale, 100 * scale as i64, 0),
    );
    r.sites.insert(
        (4242, 3, 0),
        site(scale, 333 * scale, 333 * scale as i64, 0),
    );
    r.latency[0][8] = 2 * scale;
    r.latency[1][9] = scale;
    r.latency[3][7] = scale;
    if index == 1 {
        sites_stacks(&mut r);
    }
    if two {
        let mut d = Totals::default();
        d.funcs[Func::Malloc as usize] = FnTotals {
            calls: 5 * scale,
            bytes: 5000 * scale,
            failed: 1,
        };
        r.procs.insert(
            7,
            crate::drain::round::ProcRound {
                comm: "other".into(),
                delta: d,
                cgroup: String::new(),
            },
        );
        r.sites
            .insert((7, 9, 0), site(5 * scale, 5000 * scale, 0, 0));
        r.sizes.insert((7, 0, 1000, 1), 5 * scale);
        if index == 1 {
            r.stacks.insert(
                (7, 9),
                crate::drain::round::NewStack {
                    locations: Vec::new(),
                    ips: vec![],
                    frames: vec![frame("other_alloc", "/src/other.c", 5, "other")].into(),
                },
            );
        }
    }
    r
}

/// An empty Profile of a trace of libc's malloc (`info`'s provider): its frames are the
/// allocator's own, passed over in naming a site.
pub fn traced() -> Profile {
    Profile::default().with_wrapper_rule(crate::profile::wrappers::WrapperRule::new(
        &[],
        false,
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ))
}

pub fn published(rounds: u64, two: bool) -> Arc<Published> {
    let mut p = traced();
    for i in 1..=rounds {
        p.apply(&sites_round(i, 1000, two));
    }
    Arc::new(Published {
        elapsed_ms: rounds * 1000,
        cpu_percent: Some(0.4),
        profile: p,
        ended: None,
        exit_code: None,
        notice: None,
    })
}

fn key(c: char) -> KeyEvent {
    KeyEvent::from(KeyCode::Char(c))
}

fn code(c: KeyCode) -> KeyEvent {
    KeyEvent::from(c)
}

fn names(app: &App) -> Vec<String> {
    app.site_rows()
        .iter()
        .map(|r| r.frame().function.to_string())
        .collect()
}

#[test]
fn sites_sort_by_each_key_and_name_the_meaningful_frame() {
    let mut app = App::new(info(TargetKind::Command), published(2, false));
    assert_eq!(app.screen, Screen::Sites);
    // helper_c's first frame is in libc.so.6 (the allocator's module): skipped.
    assert_eq!(names(&app), ["helper_c", "alloc_a", "alloc_b"]);
    app.on_key(key('s'));
    assert_eq!(app.site_sort, SiteSort::Calls);
    // Equal calls: ties go by bytes.
    assert_eq!(names(&app), ["helper_c", "alloc_a", "alloc_b"]);
    app.on_key(key('s'));
    assert_eq!(app.site_sort, SiteSort::Live);
    assert_eq!(names(&app), ["helper_c", "alloc_b", "alloc_a"]);
    app.on_key(key('s'));
    assert_eq!(app.site_sort, SiteSort::Temporary);
    assert_eq!(names(&app)[0], "alloc_a");
    app.on_key(key('s'));
    assert_eq!(app.site_sort, SiteSort::Leaks);
    assert!(app.site_rows().iter().all(|r| r.leak.is_none()));
    app.on_key(key('s'));
    assert_eq!(app.site_sort, SiteSort::Bytes);
    assert_eq!(app.status, "sorted by bytes");
}

#[test]
fn figures_are_the_profiles() {
    let app = App::new(info(TargetKind::Command), published(3, false));
    let rows = app.site_rows();
    assert_eq!(rows[0].totals.calls, 3000);
    assert_eq!(rows[0].totals.bytes, 999_000);
    let f = app.func_rows();
    assert_eq!(f[0].name, "malloc");
    assert_eq!(f[0].calls, 6000);
    assert!(f.iter().any(|r| r.name == "aligned_alloc/memalign"));
    assert!(!f.iter().any(|r| r.name == "memalign"));
    assert_eq!(f.iter().find(|r| r.name == "free").unwrap().failed, None);
    assert!(f[0].latency.is_some());
    assert_eq!(app.totals(), app.view().totals());
    assert_eq!(app.timeline().len(), 3);
    let classes = app.size_classes();
    assert_eq!(
        classes.iter().map(|c| c.from).collect::<Vec<_>>(),
        vec![64, 256]
    );
    assert_eq!(classes[0].count, 6000); // 100 and 111
}

#[test]
fn filter_matches_function_or_module_substrings() {
    let mut app = App::new(info(TargetKind::Command), published(1, false));
    app.on_key(key('/'));
    assert!(app.editing_filter);
    for c in "ALLOC_b".chars() {
        app.on_key(key(c));
    }
    assert_eq!(names(&app), ["alloc_b"]);
    app.on_key(code(KeyCode::Enter));
    assert!(!app.editing_filter);
    assert_eq!(app.filter, "ALLOC_b");
    // A module matches too: every site whose stack runs through libc.so.6.
    app.on_key(key('/'));
    for c in "libc.so".chars() {
        app.on_key(key(c));
    }
    app.on_key(code(KeyCode::Enter));
    assert_eq!(names(&app), ["helper_c"]);
    // The function column: calloc.
    app.on_key(key('/'));
    for c in "calloc".chars() {
        app.on_key(key(c));
    }
    assert_eq!(names(&app), ["alloc_b"]);
    app.on_key(code(KeyCode::Backspace));
    app.on_key(code(KeyCode::Esc));
    assert!(app.filter.is_empty());
    assert_eq!(app.site_rows().len(), 3);
    // Esc with nothing open quits.
    assert_eq!(app.on_key(code(KeyCode::Esc)), Action::Quit);
}

#[test]
fn selection_moves_clamps_and_follows_its_site() {
    let mut app = App::new(info(TargetKind::Command), published(1, false));
    assert_eq!(app.selected(Screen::Sites), 0);
    app.on_key(code(KeyCode::Up));
    assert_eq!(app.selected(Screen::Sites), 0);
    app.on_key(key('j'));
    app.on_key(key('j'));
    app.on_key(key('j'));
    assert_eq!(app.selected(Screen::Sites), 2);
    assert_eq!(&*app.current_site().unwrap().frame().function, "alloc_b");
    app.on_key(key('k'));
    assert_eq!(&*app.current_site().unwrap().frame().function, "alloc_a");
    // Enter opens the stack; Esc closes it without quitting.
    app.on_key(code(KeyCode::Enter));
    assert_eq!(app.detail, Some((4242, 1, 0)));
    assert_eq!(app.on_key(code(KeyCode::Esc)), Action::None);
    assert_eq!(app.detail, None);
    // A new round where alloc_a grows past helper_c: the cursor stays on alloc_a.
    let mut p = app.latest.profile.clone();
    let mut r = sites_round(2, 1000, false);
    r.sites
        .insert((4242, 1, 0), site(10_000, 100_000_000, 0, 0));
    p.apply(&r);
    app.update(Arc::new(Published {
        profile: p,
        ..Default::default()
    }));
    assert_eq!(names(&app)[0], "alloc_a");
    assert_eq!(app.selected(Screen::Sites), 0);
    assert_eq!(&*app.current_site().unwrap().frame().function, "alloc_a");
}

#[test]
fn pause_freezes_the_view_while_snapshots_arrive() {
    let mut app = App::new(info(TargetKind::Command), published(1, false));
    app.on_key(key('p'));
    assert!(app.paused);
    assert!(app.status.starts_with("paused: "), "{}", app.status);
    app.update(published(2, false));
    assert_eq!(app.shown().round(), 1);
    assert_eq!(app.latest_round(), 2);
    assert_eq!(app.totals().func(Func::Malloc).calls, 2000);
    app.on_key(key('p'));
    assert!(!app.paused);
    assert_eq!(app.shown().round(), 2);
    assert_eq!(app.totals().func(Func::Malloc).calls, 4000);
    // The end of the trace shows even while paused.
    app.on_key(key('p'));
    let mut end = (*published(3, false)).clone();
    end.ended = Some("pid 4242 exited with status 0".into());
    app.update(Arc::new(end));
    assert_eq!(app.shown().round(), 3);
}

#[test]
fn reset_counts_from_the_baseline() {
    let mut app = App::new(info(TargetKind::Command), published(2, false));
    app.on_key(key('r'));
    assert_eq!(app.baseline_round(), Some(2));
    assert_eq!(app.totals().allocations(), 0);
    assert!(app.site_rows().is_empty());
    assert!(app.timeline().is_empty());
    app.update(published(3, false));
    assert_eq!(app.totals().func(Func::Malloc).calls, 2000);
    assert_eq!(app.site_rows()[0].totals.calls, 1000);
    assert_eq!(app.timeline().len(), 1);
    assert_eq!(app.size_rows().iter().map(|r| r.count).sum::<u64>(), 3000);
    app.on_key(key('R'));
    assert_eq!(app.baseline_round(), None);
    assert_eq!(app.totals().func(Func::Malloc).calls, 6000);
}

#[test]
fn focusing_a_process_narrows_every_screen() {
    // The view sees each round as it comes: its per-process timeline is made of them.
    let mut app = App::new(info(TargetKind::All), published(1, true));
    app.update(published(2, true));
    assert!(app.screens().contains(&Screen::Processes));
    app.on_key(key('5'));
    assert_eq!(app.screen, Screen::Processes);
    let rows = app.proc_rows();
    assert_eq!(rows[0].pid, 7); // the busiest first
    app.on_key(key('s'));
    app.on_key(key('s'));
    assert_eq!(app.proc_sort, ProcSort::Live);
    assert_eq!(app.proc_rows()[0].pid, 4242);
    // Row 0 is "all processes"; row 1 is pid 4242.
    app.on_key(key('j'));
    app.on_key(code(KeyCode::Enter));
    assert_eq!(app.focus(), Some(4242));
    assert_eq!(app.totals().func(Func::Malloc).calls, 4000);
    assert!(app.site_rows().iter().all(|r| r.id.0 == 4242));
    assert!(app.size_rows().iter().all(|r| r.size != 1000));
    assert_eq!(app.timeline().len(), 2);
    assert_eq!(app.timeline()[1].allocations, 3000);
    // The list still shows every process.
    assert_eq!(app.proc_rows().len(), 2);
    app.on_key(code(KeyCode::Enter));
    assert_eq!(app.focus(), None);
    assert_eq!(app.totals().func(Func::Malloc).calls, 14000);
    // Without --all there is no processes screen.
    let one = App::new(info(TargetKind::Pid), published(1, false));
    assert!(!one.screens().contains(&Screen::Processes));
}

#[test]
fn a_traced_process_with_children_gets_the_processes_screen() {
    // -p PID --follow-forks: one process at first, its children later.
    let mut app = App::new(info(TargetKind::Pid), published(1, false));
    assert!(!app.many_processes());
    app.update(published(2, true));
    assert!(app.many_processes());
    app.on_key(key('5'));
    assert_eq!(app.screen, Screen::Processes);
    assert_eq!(app.proc_rows().len(), 2);
    // Kept once seen: a child that ended does not take the screen away.
    app.update(published(3, false));
    assert!(app.screens().contains(&Screen::Processes));
}

#[test]
fn tab_cycles_screens_and_help_closes_on_any_key() {
    let mut app = App::new(info(TargetKind::Pid), published(1, false));
    let seen: Vec<Screen> = (0..4)
        .map(|_| {
            app.on_key(code(KeyCode::Tab));
            app.screen
        })
        .collect();
    assert_eq!(
        seen,
        [
            Screen::Sizes,
            Screen::Functions,
            Screen::Timeline,
            Screen::Sites
        ]
    );
    app.on_key(code(KeyCode::BackTab));
    assert_eq!(app.screen, Screen::Timeline);
    app.on_key(key('?'));
    assert!(app.help);
    assert_eq!(app.on_key(key('j')), Action::None);
    assert!(!app.help);
    assert_eq!(app.on_key(key('w')), Action::Write);
    assert_eq!(app.on_key(key('q')), Action::Quit);
}

#[test]
fn export_holds_the_rows_and_the_json_document_of_the_view() {
    let mut app = App::new(info(TargetKind::Command), published(2, false));
    let v = app.export().to_value();
    assert_eq!(v["view"]["screen"], "sites");
    assert_eq!(v["rows"][0]["frame"]["function"], "helper_c");
    assert_eq!(v["rows"][0]["calls"], 2000);
    assert_eq!(v["document"]["functions"]["malloc"]["calls"], 4000);
    assert_eq!(v["document"]["stacks"][0]["calls"], 2000);
    app.on_key(key('r'));
    app.update(published(3, false));
    let v = app.export().to_value();
    assert_eq!(v["view"]["since_round"], 2);
    assert_eq!(v["document"]["functions"]["malloc"]["calls"], 2000);
}

#[test]
fn long_cxx_symbols_are_shortened_for_one_line() {
    assert_eq!(
        short_symbol(
            "std::vector<std::basic_string<char>, std::allocator<std::basic_string<char>>>::_M_realloc_insert<std::basic_string<char> const&>(iter, std::basic_string<char> const&)"
        ),
        "std::vector<…>::_M_realloc_insert<…>(…)"
    );
    assert_eq!(short_symbol("main"), "main");
    assert_eq!(short_symbol("operator<<(a, b)"), "operator<<(a, b)");
    let frames = vec![
        frame("operator new(unsigned long)", "", 0, "libstdc++.so.6"),
        frame("make", "/a.cc", 3, "a"),
    ];
    let p = traced();
    assert_eq!(meaningful_frame(&p, &frames), 1);
    let only = vec![frame("strdup", "", 0, "libc.so.6")];
    assert_eq!(meaningful_frame(&p, &only), 0);
}

#[test]
fn per_process_history_is_bounded() {
    let mut app = App::new(info(TargetKind::All), published(1, true));
    let mut p = app.latest.profile.clone();
    for i in 2..(PROC_HISTORY as u64 + 10) {
        p.apply(&sites_round(i, 1, true));
        app.update(Arc::new(Published {
            profile: p.clone(),
            ..Default::default()
        }));
    }
    assert_eq!(app.history[&7].len(), PROC_HISTORY);
    assert_eq!(app.history[&7].back().unwrap().allocations, 4);
}

#[test]
fn leaks_show_once_the_trace_has_ended() {
    let mut end = (*published(1, false)).clone();
    let mut leaks = BTreeMap::new();
    leaks.insert(
        (4242, 2, 1),
        Leak {
            blocks: 1000,
            bytes: 100_000,
        },
    );
    end.profile.leaks = Some(leaks);
    end.ended = Some("pid 4242 exited with status 0".into());
    let mut app = App::new(info(TargetKind::Command), Arc::new(end));
    app.site_sort = SiteSort::Leaks;
    let rows = app.site_rows();
    assert_eq!(&*rows[0].frame().function, "alloc_b");
    assert_eq!(rows[0].leak.unwrap().bytes, 100_000);
    assert_eq!(rows[1].leak, Some(Leak::default()));
    let _ = ProcProfile::default();
}
