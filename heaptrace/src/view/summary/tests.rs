use super::*;

#[test]
fn formats_bytes_with_binary_units() {
    assert_eq!(bytes(0), "0 B");
    assert_eq!(bytes(1023), "1023 B");
    assert_eq!(bytes(1536), "1.5 KiB");
    assert_eq!(bytes(-3 * 1024 * 1024), "-3.0 MiB");
}

/// A group's longer name (`--group-by command`) widens the command column for every row,
/// so the figures stay in their columns.
#[test]
fn process_rows_keep_their_columns_with_long_group_names() {
    let mut p = Profile::default();
    for (pid, comm) in [(10, "cc1plus (40 processes)"), (11, "as"), (12, "ld")] {
        p.procs.entry(pid).or_default().comm = comm.into();
    }
    let text = processes(&p, 10);
    let header = text.lines().next().unwrap();
    // Every row's allocs figure (0) ends where the header's "allocs" does.
    let col = header.find("allocs").unwrap() + "allocs".len();
    assert_eq!(text.lines().count(), 4, "{text}");
    for line in text.lines().skip(1) {
        assert_eq!(&line[col - 2..col + 1], " 0 ", "{text}");
    }
}

#[test]
fn a_narrowed_system_wide_target_says_by_what() {
    assert_eq!(all_processes(None, None), "all processes");
    assert_eq!(
        all_processes(Some("nginx"), None),
        "all processes whose name contains \"nginx\""
    );
    assert_eq!(
        all_processes(Some("nginx"), Some("/web")),
        "all processes whose name contains \"nginx\" and cgroup path contains \"/web\""
    );
    assert_eq!(
        all_processes(None, Some("/web")),
        "all processes whose cgroup path contains \"/web\""
    );
}

#[test]
fn summary_merges_aliases_and_reports_losses() {
    let mut p = Profile::default();
    let mut t = crate::drain::round::Totals::default();
    t.funcs[Func::AlignedAlloc as usize].calls = 3;
    p.procs.insert(
        1,
        crate::profile::ProcProfile {
            comm: "x".into(),
            totals: t,
            ..Default::default()
        },
    );
    p.losses[Loss::LiveMap as usize] = 5;
    let s = summary(&p, None, &[(Func::Memalign, Func::AlignedAlloc)]);
    assert!(s.contains("aligned_alloc/memalign"), "{s}");
    assert!(!s.lines().any(|l| l.starts_with("memalign")), "{s}");
    assert!(
        s.contains("lost: live_map 5 (raise --live-map-size)"),
        "{s}"
    );
}

/// Under `--all` the blocks of processes that ended went with them: the total line counts
/// them apart, the processes table marks those processes; one process's summary does not.
#[test]
fn summary_tells_ended_processes_blocks_apart() {
    let mut p = Profile::default();
    for (pid, blocks, exited) in [(1, 3, false), (2, 5, true), (3, 0, true)] {
        let mut t = crate::drain::round::Totals::default();
        t.funcs[Func::Malloc as usize].calls = 10;
        (t.live_blocks, t.live_bytes) = (blocks, 100 * blocks);
        p.procs.insert(
            pid,
            crate::profile::ProcProfile {
                comm: format!("p{pid}"),
                totals: t,
                exited,
                leaks_at_exit: exited,
                ..Default::default()
            },
        );
    }
    let s = summary(&p, None, &[]);
    let want = "live 3 blocks / 300 B in running processes (ended ones left 5 blocks / 500 B)";
    assert!(s.contains(want), "{s}");
    let s = summary(&p, Some(2), &[]);
    assert!(s.contains("; live 5 blocks / 500 B\n"), "{s}");
    let table = processes(&p, 10);
    let ended: Vec<&str> = table.lines().filter(|l| l.ends_with("  ended")).collect();
    assert_eq!(ended.len(), 2, "{table}");
    assert!(ended.iter().all(|l| !l.contains(" p1 ")), "{table}");
    // No process ended holding blocks: the plain figure.
    p.procs.remove(&2);
    assert!(summary(&p, None, &[]).contains("; live 3 blocks / 300 B\n"));
}

/// Calls mode keeps no live map: the summary and round lines say what is not tracked and
/// show no live figures, rather than zeros.
#[test]
fn calls_mode_shows_no_live_figures() {
    let mut p = Profile::of_mode(crate::run_info::Mode::Calls, 0);
    assert!(p.calls);
    let mut t = crate::drain::round::Totals::default();
    t.funcs[Func::Malloc as usize].calls = 7;
    t.funcs[Func::Free as usize].calls = 5;
    p.procs.insert(
        1,
        crate::profile::ProcProfile {
            totals: t,
            ..Default::default()
        },
    );
    let s = summary(&p, None, &[]);
    assert!(s.starts_with(CALLS_LINE), "{s}");
    assert!(s.contains("total: 7 allocations, 5 frees"), "{s}");
    assert!(!s.contains("live 0") && !s.contains("not freed"), "{s}");
    let free = s.lines().find(|l| l.starts_with("free")).unwrap();
    assert_eq!(
        free.split_whitespace().collect::<Vec<_>>(),
        ["free", "5", "-", "-"]
    );
    let row = TimelineRow::default();
    assert!(!round_line(&row, &p).contains("live"));
    assert!(
        round_line(&row, &Profile::of_mode(crate::run_info::Mode::Counts, 0))
            .contains("live 0 blocks")
    );
}

#[test]
fn a_sum_of_rss_over_processes_says_so() {
    let p = Profile::of_mode(crate::run_info::Mode::Counts, 0);
    let mut row = TimelineRow {
        rss_kb: 2048,
        rss_processes: 1,
        ..Default::default()
    };
    assert!(
        round_line(&row, &p).ends_with(", RSS 2.0 MiB"),
        "{}",
        round_line(&row, &p)
    );
    row.rss_processes = 8;
    assert!(
        round_line(&row, &p).ends_with(", sum of RSS of 8 processes 2.0 MiB"),
        "{}",
        round_line(&row, &p)
    );
}

#[test]
fn an_attached_trace_says_what_it_cannot_know_of_the_memory_behind_malloc() {
    let mut p = Profile::of_mode(crate::run_info::Mode::Counts, 0);
    p.procs.insert(
        7,
        crate::profile::ProcProfile {
            comm: "redis-server".into(),
            reserved: Some(crate::reserve::Reserved::default()),
            ..Default::default()
        },
    );
    let launched = memory(&p, 10, false);
    assert!(
        launched.starts_with("memory behind malloc:\n"),
        "{launched}"
    );
    let attached = memory(&p, 10, true);
    assert!(
        attached.starts_with(
            "memory behind malloc (arenas and mapped blocks: those made since the attach"
        ),
        "{attached}"
    );
    assert!(attached.contains("pid 7 redis-server: "), "{attached}");
}
