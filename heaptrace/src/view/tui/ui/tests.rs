use std::sync::Arc;

use ratatui::{
    Terminal,
    backend::TestBackend,
    crossterm::event::{KeyCode, KeyEvent},
};

use super::*;
use crate::run_info::TargetKind;
use crate::{
    drain::round::{NewStack, Round, SiteTotals},
    profile::Profile,
    view::tui::app::{
        Published,
        tests::{frame, info, published, sites_round},
    },
};

fn render(app: &App, w: u16, h: u16) -> TestBackend {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| draw(f, app)).unwrap();
    t.backend().clone()
}

fn keys(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::from(KeyCode::Char(c)));
    }
}

fn screen(app: &mut App, s: Screen) {
    app.screen = s;
}

fn sites_app(target: TargetKind) -> App {
    let all = target == TargetKind::All;
    let mut app = App::new(info(target), published(1, all));
    app.update(published(3, all));
    app
}

/// `profile` 3 s into a trace that is still running.
fn running(profile: Profile) -> Arc<Published> {
    Arc::new(Published {
        elapsed_ms: 3000,
        cpu_percent: Some(0.4),
        profile,
        ended: None,
        exit_code: None,
        notice: None,
    })
}

#[test]
fn every_screen_at_80x24() {
    let mut app = sites_app(TargetKind::Command);
    for s in [
        Screen::Timeline,
        Screen::Sites,
        Screen::Sizes,
        Screen::Functions,
    ] {
        screen(&mut app, s);
        insta::assert_snapshot!(
            format!("narrow_{}", s.title().to_lowercase()),
            render(&app, 80, 24)
        );
    }
}

#[test]
fn every_screen_wide() {
    let mut app = sites_app(TargetKind::All);
    for s in Screen::ALL {
        screen(&mut app, s);
        insta::assert_snapshot!(
            format!("wide_{}", s.title().to_lowercase()),
            render(&app, 140, 36)
        );
    }
}

#[test]
fn every_screen_of_an_empty_profile() {
    let mut app = App::new(info(TargetKind::All), Arc::new(Published::default()));
    for s in Screen::ALL {
        screen(&mut app, s);
        insta::assert_snapshot!(
            format!("empty_{}", s.title().to_lowercase()),
            render(&app, 80, 24)
        );
    }
}

#[test]
fn stack_of_a_site_with_inlined_frames() {
    let mut app = sites_app(TargetKind::Command);
    app.on_key(KeyEvent::from(KeyCode::Enter));
    insta::assert_snapshot!("stack_narrow", render(&app, 80, 24));
    insta::assert_snapshot!("stack_wide", render(&app, 140, 30));
}

#[test]
fn long_tables_format_only_the_rows_on_screen() {
    let area = Rect::new(0, 0, 80, 13); // 10 rows between the borders and the header
    assert_eq!(window(0, 0, area), (0..0, None));
    assert_eq!(window(5, 2, area), (0..5, Some(2)));
    assert_eq!(window(100, 9, area), (0..10, Some(9)));
    assert_eq!(window(100, 10, area), (1..11, Some(9)));
    assert_eq!(window(100, 500, area), (90..100, Some(9)));
}

/// Calls mode keeps no live map: the header, the functions and processes screens and the
/// timeline say so or show a rate instead, never a live figure of zero.
#[test]
fn a_calls_mode_trace_shows_no_live_figures() {
    let mut info = info(TargetKind::All);
    info.run.mode = crate::run_info::Mode::Calls;
    let mut app = App::new(
        info,
        running(Profile::of_mode(crate::run_info::Mode::Calls, 0)),
    );
    // Each round is published as it ends, as a trace does: the processes screen's rate is
    // of the last one (3000 allocations in 1 s).
    let mut p = Profile::of_mode(crate::run_info::Mode::Calls, 0);
    for index in 1..=3u64 {
        let mut r = Round {
            index,
            elapsed_ms: 1000 * index,
            ..Default::default()
        };
        let mut delta = crate::drain::round::Totals::default();
        delta.funcs[heaptrace_common::Func::Malloc as usize].calls = 1000 * index;
        delta.funcs[heaptrace_common::Func::Malloc as usize].bytes = 64_000 * index;
        delta.funcs[heaptrace_common::Func::Free as usize].calls = 900 * index;
        r.procs.insert(
            4242,
            crate::drain::round::ProcRound {
                comm: "allocs".into(),
                delta,
                cgroup: String::new(),
            },
        );
        r.sizes
            .insert((4242, 0, 64, heaptrace_common::NO_SITE), 1000 * index);
        p.apply(&r);
        app.update(running(p.clone()));
    }
    assert_eq!(app.proc_rows()[0].rate, 3000);
    assert_eq!(app.all_rate(), 3000);
    for s in [Screen::Functions, Screen::Processes, Screen::Timeline] {
        screen(&mut app, s);
        let text = render(&app, 100, 24);
        let shown = format!("{text:?}");
        assert!(!shown.contains("live heap"), "{shown}");
        insta::assert_snapshot!(format!("calls_{}", s.title().to_lowercase()), text);
    }
}

#[test]
fn a_sampled_trace_says_its_rate_and_marks_estimates() {
    // 100,000 mallocs of 1 KiB, 1,564 of them sampled (about 1 in 64.5) at one site, 1,549
    // of those freed; 99,000 frees in all.
    let mut r = Round {
        index: 1,
        elapsed_ms: 1000,
        ..Default::default()
    };
    let mut delta = crate::drain::round::Totals::default();
    delta.funcs[heaptrace_common::Func::Malloc as usize].calls = 100_000;
    delta.funcs[heaptrace_common::Func::Malloc as usize].bytes = 100_000 * 1024;
    delta.funcs[heaptrace_common::Func::Free as usize].calls = 99_000;
    delta.untracked_frees = 98_000;
    r.procs.insert(
        4242,
        crate::drain::round::ProcRound {
            comm: "sites".into(),
            delta,
            cgroup: String::new(),
        },
    );
    r.sizes.insert((4242, 0, 1024, 7), 1564);
    r.sizes
        .insert((4242, 0, 1024, heaptrace_common::NOT_SAMPLED), 98_436);
    let mut site = SiteTotals {
        calls: 1564,
        bytes: 1564 * 1024,
        frees: 1549,
        freed_bytes: 1549 * 1024,
        live_blocks: 15,
        live_bytes: 15 * 1024,
        ..Default::default()
    };
    site.sizes.set(heaptrace_common::log2_bucket(1024), 1564);
    r.sites.insert((4242, 7, 0), site);
    r.stacks.insert(
        (4242, 7),
        NewStack {
            frames: vec![frame("alloc_a", "sites.c", 19, "sites")].into(),
            ..Default::default()
        },
    );
    let mut p = Profile::sampled(65536);
    p.apply(&r);
    let published = running(p);
    let mut app = App::new(info(TargetKind::Command), published);
    for s in [Screen::Sites, Screen::Functions] {
        screen(&mut app, s);
        let text = render(&app, 80, 24);
        insta::assert_snapshot!(format!("sampled_{}", s.title().to_lowercase()), text);
    }
}

#[test]
fn help_overlay() {
    let mut app = sites_app(TargetKind::Command);
    keys(&mut app, "?");
    insta::assert_snapshot!("help", render(&app, 80, 24));
}

#[test]
fn paused_reset_focused_and_filtered() {
    let mut app = sites_app(TargetKind::All);
    keys(&mut app, "5j");
    app.on_key(KeyEvent::from(KeyCode::Enter)); // focus on the busiest: pid 7
    keys(&mut app, "r");
    app.update(published(4, true));
    keys(&mut app, "p");
    app.update(published(5, true));
    keys(&mut app, "2/other");
    insta::assert_snapshot!("states", render(&app, 100, 24));
}

#[test]
fn ended_with_leaks_sorted_by_leaks() {
    let mut p = (*published(3, false)).clone();
    let mut leaks = std::collections::BTreeMap::new();
    leaks.insert(
        (4242, 2, 1),
        crate::drain::round::Leak {
            blocks: 3000,
            bytes: 300_000,
        },
    );
    p.profile.leaks = Some(leaks);
    p.ended = Some("pid 4242 exited with status 0".into());
    p.exit_code = Some(0);
    let mut app = App::new(info(TargetKind::Command), Arc::new(p));
    keys(&mut app, "ssss");
    insta::assert_snapshot!("ended_narrow", render(&app, 80, 24));
    insta::assert_snapshot!("ended_wide", render(&app, 120, 24));
}

/// C++ names of a few hundred characters: one line per site in the list (shortened), the
/// whole name, wrapped, in the stack.
#[test]
fn very_long_cxx_symbols() {
    let long = "std::vector<std::unordered_map<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::shared_ptr<myapp::detail::Node<int, std::less<int> > > >, std::allocator<std::unordered_map<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::shared_ptr<myapp::detail::Node<int, std::less<int> > > > > >::_M_realloc_insert<std::unordered_map<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, std::shared_ptr<myapp::detail::Node<int, std::less<int> > > > const&>(__gnu_cxx::__normal_iterator<std::unordered_map<std::__cxx11::basic_string<char> >*, std::vector<std::unordered_map<std::__cxx11::basic_string<char> > > >, std::unordered_map<std::__cxx11::basic_string<char> > const&)";
    let mut r = Round {
        index: 1,
        elapsed_ms: 1000,
        ..Default::default()
    };
    r.procs.insert(
        9,
        crate::drain::round::ProcRound {
            comm: "cxx".into(),
            delta: sites_round(1, 10, false).procs[&4242].delta,
            cgroup: String::new(),
        },
    );
    r.sites.insert(
        (9, 1, 0),
        SiteTotals {
            calls: 10,
            bytes: 12_345,
            live_blocks: 2,
            live_bytes: 2469,
            ..Default::default()
        },
    );
    r.stacks.insert(
        (9, 1),
        NewStack {
            locations: Vec::new(),
            ips: vec![],
            frames: vec![
                frame("operator new(unsigned long)", "", 0, "libstdc++.so.6.0.33"),
                frame(
                    "__gnu_cxx::new_allocator<std::unordered_map<std::__cxx11::basic_string<char> > >::allocate(unsigned long, void const*)",
                    "/usr/include/c++/12/ext/new_allocator.h",
                    127,
                    "cxx",
                ),
                frame(long, "/usr/include/c++/12/bits/vector.tcc", 440, "cxx"),
                frame("main", "/src/templates.cpp", 21, "cxx"),
            ]
            .into(),
        },
    );
    let mut p = crate::view::tui::app::tests::traced();
    p.apply(&r);
    let mut app = App::new(
        info(TargetKind::Command),
        Arc::new(Published {
            profile: p,
            elapsed_ms: 1000,
            ..Default::default()
        }),
    );
    insta::assert_snapshot!("cxx_sites", render(&app, 80, 24));
    app.on_key(KeyEvent::from(KeyCode::Enter));
    insta::assert_snapshot!("cxx_stack", render(&app, 80, 24));
}

/// The traced process exec'ed: the status line says so while the trace runs.
#[test]
fn an_exec_is_said_in_the_status_line() {
    let mut app = sites_app(TargetKind::Command);
    let mut p = (*published(4, false)).clone();
    p.notice = Some("pid 4242 exec'ed python3: its counts start over".into());
    app.update(Arc::new(p));
    let text = format!("{}", render(&app, 160, 24));
    assert!(
        text.contains("pid 4242 exec'ed python3: its counts start over"),
        "{text}"
    );
}

/// Under `--all`, processes that ended keep the blocks they had not freed: the header counts
/// them apart from the live ones, and the processes screen marks them.
#[test]
fn ended_processes_are_told_apart_from_the_live_ones() {
    let mut p = crate::view::tui::app::tests::traced();
    for (pid, comm, blocks, bytes, exited) in
        [(10, "alive", 3, 300, false), (11, "gone", 5, 5000, true)]
    {
        let mut totals = crate::drain::round::Totals::default();
        totals.funcs[heaptrace_common::Func::Malloc as usize].calls = 10;
        (totals.live_blocks, totals.live_bytes) = (blocks, bytes);
        p.procs.insert(
            pid,
            crate::profile::ProcProfile {
                comm: comm.into(),
                totals,
                exited,
                leaks_at_exit: exited,
                ..Default::default()
            },
        );
    }
    let mut app = App::new(info(TargetKind::All), running(p));
    screen(&mut app, Screen::Processes);
    let text = format!("{:?}", render(&app, 160, 24));
    assert!(
        text.contains("live 3 blocks / 300 B (+4.9 KiB left by ended processes)"),
        "{text}"
    );
    assert!(text.contains("gone (ended)"), "{text}");
    assert!(!text.contains("alive (ended)"), "{text}");
    // Sorted by live bytes, the running ones come first: what the ended hold is not live.
    app.proc_sort = crate::view::tui::app::ProcSort::Live;
    let order: Vec<u32> = app.proc_rows().iter().map(|r| r.pid).collect();
    assert_eq!(order, [10, 11]);
    // One process in focus: its own figure, as it is.
    app.set_focus(Some(11));
    let text = format!("{:?}", render(&app, 160, 24));
    assert!(text.contains("live 5 blocks / 4.9 KiB"), "{text}");
    assert!(!text.contains("left by ended"), "{text}");
}

/// The header's peak: the kernel's (exact, at the allocation that reached it), the focused
/// process's own in focus; a process the OOM killer killed is marked on the processes screen.
#[test]
fn the_header_shows_the_exact_peak_and_the_oom_victims_are_marked() {
    let mut p = crate::view::tui::app::tests::traced();
    let mut r = Round::default();
    r.stacks.insert(
        (11, 4),
        NewStack {
            frames: vec![frame("alloc_big", "leaky.c", 9, "leaky")].into(),
            ..Default::default()
        },
    );
    p.apply(&r);
    for (pid, comm, peak, oom) in [(10, "alive", 2 << 20, false), (11, "leaky", 48 << 20, true)] {
        p.procs.insert(
            pid,
            crate::profile::ProcProfile {
                comm: comm.into(),
                peak: Some(crate::drain::round::KernelPeak {
                    bytes: peak,
                    size: 1 << 20,
                    stack_id: 1,
                }),
                exited: oom,
                oom_killed: oom,
                ..Default::default()
            },
        );
    }
    // What held it, where kept: the site with the most then.
    let held = crate::drain::round::PeakHeld {
        bytes: 48 << 20,
        blocks: 3,
        sites: vec![(4, 0, 3, 48 << 20)],
    };
    p.procs.get_mut(&11).unwrap().peak_held = Some(held);
    p.peak = Some(crate::profile::Peak {
        live_bytes: 50 << 20,
        exact: true,
        sites: vec![((11, 4, 0), 2, 40 << 20)],
        held: true,
        ..Default::default()
    });
    let mut app = App::new(info(TargetKind::All), running(p));
    screen(&mut app, Screen::Processes);
    let text = format!("{:?}", render(&app, 160, 24));
    assert!(
        text.contains("  peak 50.0 MiB (exact), 40.0 MiB from alloc_big"),
        "{text}"
    );
    assert!(text.contains("leaky (OOM killed)"), "{text}");
    assert!(!text.contains("alive (OOM"), "{text}");
    app.set_focus(Some(11));
    let text = format!("{:?}", render(&app, 160, 24));
    assert!(
        text.contains("  peak 48.0 MiB (exact), 48.0 MiB from alloc_big"),
        "{text}"
    );
    // No room: left out whole.
    app.set_focus(None);
    let text = format!("{:?}", render(&app, 60, 24));
    assert!(!text.contains("peak"), "{text}");
}

/// `c` on the processes screen: a row per command, 36 cc1 as one with their sums; `c` again
/// a row per process. A command's row is no process to show alone.
#[test]
fn the_processes_screen_groups_by_command() {
    let mut p = crate::view::tui::app::tests::traced();
    for pid in 10..46 {
        let mut totals = crate::drain::round::Totals::default();
        totals.funcs[heaptrace_common::Func::Malloc as usize].calls = 100;
        p.procs.insert(
            pid,
            crate::profile::ProcProfile {
                comm: "cc1".into(),
                totals,
                ..Default::default()
            },
        );
    }
    p.procs.insert(
        99,
        crate::profile::ProcProfile {
            comm: "ld".into(),
            ..Default::default()
        },
    );
    let mut app = App::new(info(TargetKind::All), running(p));
    screen(&mut app, Screen::Processes);
    assert_eq!(app.proc_rows().len(), 37);
    keys(&mut app, "c");
    let rows = app.proc_rows();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].comm, "cc1 (36 processes)");
    assert_eq!(rows[0].totals.allocations(), 3600);
    let text = format!("{:?}", render(&app, 160, 24));
    assert!(text.contains("Commands: 2"), "{text}");
    assert!(text.contains("group cc1 (36 processes)"), "{text}");
    app.on_key(KeyEvent::from(KeyCode::Down));
    app.on_key(KeyEvent::from(KeyCode::Enter));
    assert_eq!(app.focus(), None);
    keys(&mut app, "c");
    assert_eq!(app.proc_rows().len(), 37);
}

/// A site's sizes in its stack pane: exact where the size histogram has them, an estimate
/// (marked) only without it, and never outside the buckets hit.
#[test]
fn a_sites_sizes_are_exact_where_known() {
    let mut p = crate::view::tui::app::tests::traced();
    let id = (9, 1, 1); // pid 9, stack 1, calloc
    p.sizes.insert((9, 1, 262_144, 1), 1);
    let mut log2 = [0u64; heaptrace_common::LOG2_BUCKETS];
    log2[heaptrace_common::log2_bucket(262_144)] = 1;
    assert_eq!(sites::site_sizes(&p, &id, &log2), "; size 256.0 KiB");
    p.sizes.insert((9, 1, 100, 1), 3);
    p.sizes.insert((9, 1, 100, 2), 50); // another stack's: not this site's
    assert_eq!(
        sites::site_sizes(&p, &id, &log2),
        "; size p50 100 B (100 B to 256.0 KiB)"
    );
    // Without the exact histogram (byte sampling): the estimate stays in the bucket hit.
    let sampled = Profile::sampled(65536);
    let est = sites::site_sizes(&sampled, &id, &log2);
    assert!(est.starts_with("; size p50 ~"), "{est}");
    let shown: f64 = est
        .trim_start_matches("; size p50 ~")
        .trim_end_matches(" KiB")
        .parse()
        .unwrap();
    assert!((256.0..512.0).contains(&shown), "{est}");
}

/// Every column header a screen shows (its underlined header row, on a wide terminal) is
/// explained in the help overlay of that screen.
#[test]
fn every_column_header_is_explained_in_help() {
    use ratatui::style::Modifier;
    let mut app = sites_app(TargetKind::All);
    for s in Screen::ALL {
        screen(&mut app, s);
        let b = render(&app, 160, 40);
        let buf = b.buffer();
        let mut header = String::new();
        for y in 0..buf.area.height {
            for x in 0..buf.area.width {
                let c = &buf[(x, y)];
                if c.modifier.contains(Modifier::UNDERLINED) {
                    header.push_str(c.symbol());
                } else {
                    header.push(' ');
                }
            }
        }
        let explained: String = columns(s).iter().map(|(k, _)| format!(" {k} ")).collect();
        let words: Vec<&str> = header.split_whitespace().collect();
        assert!(
            !words.is_empty() || s == Screen::Timeline,
            "{s:?}: no header found"
        );
        for w in words {
            assert!(
                explained.contains(&format!(" {w} ")) || explained.contains(&format!(" {w}")),
                "{s:?}: column {w:?} is not explained in help ({explained})"
            );
        }
        keys(&mut app, "?");
        let shown = format!("{:?}", render(&app, 80, 24));
        for (k, _) in columns(s) {
            assert!(shown.contains(k), "{s:?}: {k} not in the overlay:\n{shown}");
        }
        keys(&mut app, "?");
    }
}

/// The header says how the figures are counted: by how many probes, or in process.
#[test]
fn the_header_says_in_process_instead_of_probes() {
    let app = sites_app(TargetKind::Command);
    let text = format!("{}", render(&app, 160, 24));
    assert!(text.contains(" probes"), "{text}");
    let mut i = info(TargetKind::Command);
    i.run.collector = crate::run_info::Collector::InProcess;
    let mut app = App::new(i, published(1, false));
    app.update(published(3, false));
    let text = format!("{}", render(&app, 160, 24));
    assert!(text.contains("in process"), "{text}");
    assert!(!text.contains(" probes"), "{text}");
}
