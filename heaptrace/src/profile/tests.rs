use heaptrace_common::Func;

use super::*;
use crate::drain::round::ProcRound;

fn round(index: u64, pid: u32, mallocs: u64, bytes: u64, frees: u64, live: i64) -> Round {
    let mut delta = Totals::default();
    delta.funcs[Func::Malloc as usize].calls = mallocs;
    delta.funcs[Func::Malloc as usize].bytes = bytes;
    delta.funcs[Func::Free as usize].calls = frees;
    delta.live_blocks = mallocs as i64 - frees as i64;
    delta.live_bytes = live;
    let mut r = Round {
        index,
        elapsed_ms: index * 1000,
        ..Default::default()
    };
    r.procs.insert(
        pid,
        ProcRound {
            comm: "fx".into(),
            delta,
            cgroup: String::new(),
        },
    );
    r.sizes.insert(
        (pid, Func::Malloc as u32, bytes / mallocs.max(1), 1),
        mallocs,
    );
    r.mem.insert(
        pid,
        Mem {
            rss_kb: 100 * index,
            virt_kb: 1000,
        },
    );
    r.sites.insert(
        (pid, 1, 0),
        SiteTotals {
            calls: mallocs,
            bytes,
            live_bytes: live,
            ..Default::default()
        },
    );
    r
}

#[test]
fn folds_rounds_into_totals_timeline_and_sizes() {
    let mut p = Profile::default();
    p.apply(&round(1, 10, 4, 400, 1, 300));
    p.apply(&round(2, 10, 2, 200, 3, -100));
    p.apply(&round(2, 11, 5, 50, 0, 50));
    let t = p.totals();
    assert_eq!(t.func(Func::Malloc).calls, 11);
    assert_eq!(t.func(Func::Malloc).bytes, 650);
    assert_eq!(t.frees(), 4);
    assert_eq!(t.live_bytes, 250);
    assert_eq!(p.rounds.len(), 3);
    assert_eq!(p.rounds[1].allocations, 2);
    assert_eq!(p.rounds[1].frees, 3);
    assert_eq!(p.rounds[1].live_bytes, 200);
    assert_eq!(p.procs[&10].peak_rss_kb, 200);
    let sizes = p.sizes_by_func(None);
    assert_eq!(sizes[&(Func::Malloc as u32, 100)], 6);
    assert_eq!(sizes[&(Func::Malloc as u32, 10)], 5);
    assert_eq!(p.sizes_by_func(Some(11)).len(), 1);
    assert_eq!(p.sites[&(10, 1, 0)].calls, 6);
    assert_eq!(p.sites[&(10, 1, 0)].live_bytes, 200);
}

#[test]
fn a_long_timeline_is_coarsened_and_keeps_every_rounds_activity() {
    let mut p = Profile::default();
    // Round i allocates i bytes in i mallocs and frees one block; live bytes grow by i.
    let n = 2 * TIMELINE_ROWS as u64 + 3;
    let mut live = 0;
    for i in 1..=n {
        live += i as i64;
        p.apply(&round(i, 10, i, i, 1, i as i64));
        assert!(p.rounds.len() <= TIMELINE_ROWS, "round {i}");
    }
    assert_eq!(p.timeline_step, 4);
    assert_eq!(p.round_count(), n);
    assert_eq!(p.rounds.len(), (n as usize).div_ceil(4));
    let sum = |f: fn(&TimelineRow) -> u64| p.rounds.iter().map(f).sum::<u64>();
    assert_eq!(sum(|r| r.allocations), n * (n + 1) / 2);
    assert_eq!(sum(|r| r.frees), n);
    assert_eq!(sum(|r| r.bytes_allocated), n * (n + 1) / 2);
    // Every row but the last covers the step; each ends where its last round ended.
    for (k, r) in p.rounds.iter().enumerate() {
        let last = (k as u64 + 1) * 4;
        if k + 1 < p.rounds.len() {
            assert_eq!((r.rounds, r.index, r.elapsed_ms), (4, last, last * 1000));
        }
    }
    let end = p.rounds.last().unwrap();
    assert_eq!((end.index, end.rounds), (n, n % 4));
    assert_eq!(end.live_bytes, live);
    assert!(end.covers(n) && end.covers(n - n % 4 + 1) && !end.covers(n - n % 4));
    // The peak (the last round: live bytes only grow) lies in the last row.
    assert_eq!(p.peak.as_ref().map(|pk| pk.round), Some(n));
    // The next round goes on in the open row.
    p.apply(&round(n + 1, 10, 1, 1, 0, 1));
    assert_eq!(p.rounds.last().unwrap().rounds, n % 4 + 1);
    assert_eq!(p.round_count(), n + 1);
}

#[test]
fn a_restarted_process_keeps_only_what_came_after() {
    let mut p = Profile::default();
    p.apply(&round(1, 10, 4, 400, 1, 300));
    p.apply(&round(1, 11, 5, 50, 0, 50));
    p.restart(10);
    p.apply(&round(2, 10, 2, 60, 0, 60));
    let t = &p.procs[&10].totals;
    assert_eq!(t.func(Func::Malloc).calls, 2);
    assert_eq!(t.func(Func::Malloc).bytes, 60);
    assert_eq!(t.frees(), 0);
    assert_eq!(t.live_bytes, 60);
    assert_eq!(p.procs[&10].comm, "fx");
    assert_eq!(p.sizes_by_func(Some(10)).len(), 1);
    assert_eq!(p.sizes_by_func(Some(10))[&(Func::Malloc as u32, 30)], 2);
    assert_eq!(p.sites[&(10, 1, 0)].calls, 2);
    // Others keep theirs, and the totals are the sum of what is left.
    assert_eq!(p.procs[&11].totals.func(Func::Malloc).calls, 5);
    assert_eq!(p.totals().func(Func::Malloc).calls, 7);
}

/// Sampled: the earlier image's sampled counters and weights go too, or its sites would
/// be estimated again from them when the new image counts at the same site.
#[test]
fn a_restarted_sampled_process_keeps_only_what_came_after() {
    let mut p = Profile::sampled(1024);
    p.apply(&round(1, 10, 4, 4000, 0, 4000));
    p.apply(&round(1, 11, 5, 5000, 0, 5000));
    assert!(p.samples.contains_key(&(10, 1, 0)) && p.weights.contains_key(&(10, 1, 0)));
    p.restart(10);
    assert!(!p.samples.contains_key(&(10, 1, 0)) && !p.weights.contains_key(&(10, 1, 0)));
    assert!(p.samples.contains_key(&(11, 1, 0)) && p.weights.contains_key(&(11, 1, 0)));
    p.apply(&round(2, 10, 2, 2000, 0, 2000));
    assert_eq!(p.samples[&(10, 1, 0)].calls, 2);
}

#[test]
fn peak_keeps_the_highest_round_and_its_sites() {
    let mut p = Profile::default();
    p.apply(&round(1, 10, 4, 400, 0, 300));
    p.apply(&round(2, 10, 1, 100, 0, 100)); // live 400: the peak
    p.apply(&round(3, 10, 0, 0, 3, -350)); // live 50
    let peak = p.peak.as_ref().unwrap();
    assert_eq!((peak.live_bytes, peak.round), (400, 2));
    assert_eq!(peak.sites, vec![((10, 1, 0), 0, 400)]);
}

#[test]
fn leak_totals_filter_by_process() {
    let mut p = Profile::default();
    assert_eq!(p.leak_totals(None), None);
    let mut leaks = BTreeMap::new();
    leaks.insert(
        (1, 3, 0),
        Leak {
            blocks: 2,
            bytes: 20,
        },
    );
    leaks.insert(
        (1, 4, 1),
        Leak {
            blocks: 1,
            bytes: 5,
        },
    );
    leaks.insert(
        (2, 3, 0),
        Leak {
            blocks: 4,
            bytes: 40,
        },
    );
    p.leaks = Some(leaks);
    assert_eq!(
        p.leak_totals(None),
        Some(Leak {
            blocks: 7,
            bytes: 65
        })
    );
    assert_eq!(
        p.leak_totals(Some(1)),
        Some(Leak {
            blocks: 3,
            bytes: 25
        })
    );
    assert_eq!(
        p.leaks_by_func(Some(2))[0],
        Leak {
            blocks: 4,
            bytes: 40
        }
    );
    assert_eq!(p.top_leaks(1)[0].0, (2, 3, 0));
}

#[test]
fn since_gives_the_differences_and_only_one_process() {
    let mut p = Profile::of_mode(crate::run_info::Mode::Calls, 0).with_latency_every(16);
    p.apply(&round(1, 10, 4, 400, 1, 300));
    p.losses[0] = 2;
    let base = p.clone();
    p.apply(&round(2, 10, 2, 200, 3, -100));
    p.apply(&round(3, 11, 5, 50, 0, 50));
    p.losses[0] = 7;
    let d = p.since(&base);
    assert_eq!(d.procs[&10].totals.func(Func::Malloc).calls, 2);
    assert_eq!(d.procs[&10].totals.live_bytes, -100);
    assert_eq!(d.procs[&11].totals.func(Func::Malloc).calls, 5);
    assert_eq!(d.totals().allocations(), 7);
    assert_eq!(d.losses[0], 5);
    // What the trace was stays: a TUI baseline of a calls-mode trace still knows no live
    // figures (the views say so), and how many calls were timed.
    assert!(d.calls);
    assert_eq!(d.latency_sampled(), Some(16));
    assert_eq!(
        d.rounds.iter().map(|r| r.index).collect::<Vec<_>>(),
        vec![2, 3]
    );
    assert_eq!(d.sites[&(10, 1, 0)].calls, 2);
    assert_eq!(d.sizes[&(10, Func::Malloc as u32, 100, 1)], 2);
    assert!(!d.sizes.contains_key(&(10, Func::Malloc as u32, 100 + 1, 1)));
    // Nothing happened since the last round: every counter is zero.
    let none = p.since(&p);
    assert_eq!(none.totals().allocations(), 0);
    assert!(none.sites.is_empty() && none.sizes.is_empty() && none.rounds.is_empty());

    let one = p.only(11);
    assert_eq!(one.procs.keys().copied().collect::<Vec<_>>(), vec![11]);
    assert_eq!(one.totals().allocations(), 5);
    assert!(one.sites.keys().all(|k| k.0 == 11));
    assert!(one.sizes.keys().all(|k| k.0 == 11));
    assert_eq!(one.rounds.len(), 3);
    assert!(one.calls);
    assert_eq!(one.latency_sampled(), Some(16));
}

#[test]
fn sampled_sites_become_estimates_and_so_do_live_figures() {
    let n = 65536;
    let mut p = Profile::sampled(n);
    // 1000 mallocs of 1 KiB, 10 of them sampled at site 5; 4 sampled ones freed.
    let mut r = round(1, 10, 1000, 1024 * 1000, 0, 0);
    r.sizes.clear();
    r.sizes.insert((10, 0, 1024, 5), 10);
    r.sizes
        .insert((10, 0, 1024, heaptrace_common::NOT_SAMPLED), 990);
    r.sites.clear();
    r.sites.insert(
        (10, 5, 0),
        SiteTotals {
            calls: 10,
            bytes: 10240,
            frees: 4,
            freed_bytes: 4096,
            ..Default::default()
        },
    );
    p.apply(&r);
    let w = crate::profile::sampling::weight(1024, n);
    let site = &p.sites[&(10, 5, 0)];
    assert_eq!(site.calls, (10.0 * w).round() as u64);
    assert_eq!(site.frees, (4.0 * w).round() as u64);
    assert_eq!(p.samples[&(10, 5, 0)].calls, 10);
    // The process's live figures are the sites' estimates, not the sampled blocks'.
    assert_eq!(p.procs[&10].totals.live_blocks, site.live_blocks);
    assert_eq!(p.rounds[0].live_bytes, site.live_bytes);
    // Exact figures stay exact.
    assert_eq!(p.totals().func(Func::Malloc).calls, 1000);
    assert_eq!(p.sizes_by_func(None)[&(0, 1024)], 1000);
    let mut leaks = BTreeMap::new();
    leaks.insert(
        (10, 5, 0),
        Leak {
            blocks: 6,
            bytes: 6144,
        },
    );
    p.set_leaks(leaks);
    let l = p.leak_totals(None).unwrap();
    assert_eq!(l.blocks, (6.0 * w).round() as u64);
    assert_eq!(l.bytes, (6144.0 * w).round() as u64);
}

/// An ended process's blocks leave the timeline's live memory and the peak (they went
/// with it); its own figures keep them, as not freed at its end.
#[test]
fn ended_processes_leave_the_live_memory() {
    let mut p = Profile::default();
    let mut one = round(1, 10, 1, 100, 0, 100);
    one.procs.extend(round(1, 11, 1, 100, 0, 100).procs);
    one.sites.extend(round(1, 11, 1, 100, 0, 100).sites);
    p.apply(&one);
    assert!(p.end(10));
    p.apply(&round(2, 11, 0, 0, 0, 0));
    p.apply(&round(3, 11, 1, 50, 0, 50));
    let live: Vec<i64> = p.rounds.iter().map(|r| r.live_bytes).collect();
    assert_eq!(live, [200, 100, 150]);
    let peak = p.peak.as_ref().unwrap();
    assert_eq!((peak.round, peak.live_bytes), (1, 200));
    assert_eq!(p.procs[&10].totals.live_bytes, 100);
    assert_eq!(p.totals().live_bytes, 250);
    // A new peak lists the live processes' sites only.
    p.apply(&round(4, 11, 1, 100, 0, 100));
    let peak = p.peak.as_ref().unwrap();
    assert_eq!((peak.round, peak.live_bytes), (4, 250));
    assert_eq!(peak.sites, [((11, 1, 0), 0, 250)]);
}

/// A process that ends within the round that first sees it (it lived between two reads)
/// is ended as that round applies: its row and the peak leave its blocks out already.
#[test]
fn a_process_ended_in_its_first_round_is_not_live_at_it() {
    let mut p = Profile::default();
    p.apply(&round(1, 11, 1, 100, 0, 100));
    let mut two = round(2, 10, 1, 500, 0, 500);
    two.procs.extend(round(2, 11, 0, 0, 0, 0).procs);
    two.ended = vec![10, 99];
    p.apply(&two);
    let live: Vec<i64> = p.rounds.iter().map(|r| r.live_bytes).collect();
    assert_eq!(live, [100, 100]);
    assert_eq!(p.peak.as_ref().map(|k| k.round), Some(1));
    assert!(p.procs[&10].exited && p.procs[&10].leaks_at_exit);
    assert_eq!(p.procs[&10].totals.live_bytes, 500);
    // A key the Profile never had is no process of it.
    assert!(!p.procs.contains_key(&99));
}

#[test]
fn lost_stacks_get_a_frame_that_says_so() {
    let p = Profile::default();
    let full =
        "[stack lost: no room in the stack maps, even for its caller; raise --stack-map-size]";
    for errno in [libc::E2BIG, libc::ENOMEM, libc::EEXIST] {
        let f = p.frames(&(1, -errno, 0));
        assert_eq!(&*f[0].function, full, "errno {errno}");
    }
    let f = p.frames(&(1, -libc::EBUSY, 0));
    assert!(
        f[0].function.contains("cut by another"),
        "{}",
        f[0].function
    );
    let f = p.frames(&(1, -libc::EFAULT, 0));
    assert_eq!(&*f[0].function, "[stack lost: errno 14]");
    let f = p.frames(&(1, heaptrace_common::NO_SITE, 0));
    assert_eq!(&*f[0].function, "[no stack: not collected in this mode]");
}

/// The stack loss shown is that of the processes shown: their sites under an errno and
/// those that kept their caller alone. The kernel's count (every process) stays beside it.
#[test]
fn stack_losses_are_those_of_the_processes_shown() {
    let mut p = Profile::default();
    let f = crate::symbolize::test_frames(&["f"])[0].clone();
    p.stacks.insert((1, 5), vec![f, Frame::more_lost()].into());
    p.stacks
        .insert((1, 6), crate::symbolize::test_frames(&["f", "main"]));
    let calls = |n| SiteTotals {
        calls: n,
        ..Default::default()
    };
    for (site, n) in [
        ((1, -17, 0), 3),
        ((1, 5, 0), 2),
        ((1, 6, 0), 10),
        ((1, 7, 0), 20), // frames not known: not said to be lost
        ((1, heaptrace_common::NO_SITE, 0), 7),
        ((2, -12, 2), 4),
    ] {
        p.sites.insert(site, calls(n));
    }
    p.losses[Loss::Stack as usize] = 100;
    p.losses[Loss::SiteMap as usize] = 1;
    let all = p.losses_of(None);
    assert_eq!(all[Loss::Stack as usize], 9);
    assert_eq!(all[Loss::SiteMap as usize], 1);
    assert_eq!(p.losses_of(Some(1))[Loss::Stack as usize], 5);
    assert_eq!(p.losses_of(Some(2))[Loss::Stack as usize], 4);
    assert_eq!(p.only(2).losses_of(None)[Loss::Stack as usize], 4);
    assert_eq!(p.losses[Loss::Stack as usize], 100);
    // Sampled: the sampled allocations, as the kernel counts them, not the estimates.
    p.sample_bytes = 4096;
    p.samples.insert((1, -17, 0), calls(1));
    assert_eq!(p.losses_of(None)[Loss::Stack as usize], 1);
    assert_eq!(
        crate::view::summary::losses(&p, None),
        [
            "stack 1 (100 in all processes traced, raise --stack-map-size)",
            "site_map 1 (raise --site-map-size)"
        ]
    );
    // Rounds read 1 s apart, then one 4.5 s after the one before: the loss says so.
    for (index, elapsed_ms) in [(1, 1000), (2, 2000), (3, 3000), (4, 7500)] {
        let mut r = crate::drain::round::Round {
            index,
            elapsed_ms,
            ..Default::default()
        };
        r.losses = [0; heaptrace_common::LOSS_COUNT];
        p.apply(&r);
    }
    assert_eq!(p.max_round_gap_ms, 4500);
    assert_eq!(
        crate::view::summary::losses(&p, None)[1],
        "site_map 1 (raise --site-map-size; the reads came up to 4.5 s apart)"
    );
}
