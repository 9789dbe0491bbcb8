//! The header: the target, the mode, the totals and the state of the run.
use super::*;

pub(super) fn draw_header(f: &mut Frame, app: &App, area: Rect) {
    let info = &app.info;
    let shown = app.shown();
    let interval = nanos(info.run.interval_ms * 1_000_000)
        .replace(".0 ", " ")
        .replace(".00 ", " ");
    let how = match info.run.collector {
        crate::run_info::Collector::Kernel => format!("{} probes", info.probe_count()),
        crate::run_info::Collector::InProcess => "in process".into(),
        crate::run_info::Collector::InProcessAttached => "in process, attached".into(),
    };
    let run = format!(
        "  {} mode{}, every {interval}, {how}",
        info.run.mode,
        match app.view().sample_bytes {
            0 => String::new(),
            n => format!(" sampled 1/{n} B (~: estimated)"),
        },
    );
    // Where the probes are, when the line has room for it.
    let place = format!(" in {}", info.run.allocator_module());
    let used = "heaptrace ".len() + info.target.chars().count() + run.chars().count();
    let mut l1 = vec![
        Span::styled("heaptrace ", Style::new().bold()),
        Span::raw(info.target.clone()),
        Span::raw(run),
    ];
    if used + place.chars().count() <= area.width as usize {
        l1.push(Span::raw(place));
    }
    if let Some(out) = &info.output {
        l1.push(Span::raw(format!(", output to {out}")));
    }
    let l2 = status_line(app, shown);
    let mut l3 = totals_line(app);
    // Whole or not at all: a cut figure would read as another.
    let peak = peak(app);
    if l3.chars().count() + peak.chars().count() <= area.width as usize {
        l3.push_str(&peak);
    }
    let text = vec![Line::from(l1), Line::from(l2), Line::from(l3)];
    f.render_widget(Paragraph::new(text), area);
}

/// The header's second line: the round, the time, heaptrace's cost, what was lost, and what
/// the view is showing (paused, since a reset, one process, the end).
pub(super) fn status_line(app: &App, shown: &Published) -> Vec<Span<'static>> {
    let cpu = shown
        .cpu_percent
        .map_or("-".to_string(), |c| format!("{c:.1}%"));
    let losses = app.losses();
    let lost = if losses.is_empty() {
        Span::raw("lost: none")
    } else {
        Span::styled(
            format!("lost: {}", losses.join(", ")),
            Style::new().yellow().bold(),
        )
    };
    let mem = app
        .memory()
        .map(|(rss, virt, n)| match n {
            1 => format!("RSS {}  VIRT {}  ", kib(rss), kib(virt)),
            // Shared pages count once per process: a sum, not the host's memory.
            n => format!("sum of {n} RSS {}  VIRT {}  ", kib(rss), kib(virt)),
        })
        .unwrap_or_default();
    let mut line = vec![
        Span::raw(format!(
            "round {}  {:.1}s  {mem}heaptrace cpu {cpu}  ",
            shown.round(),
            shown.elapsed_ms as f64 / 1000.0
        )),
        lost,
    ];
    if app.paused {
        line.push(Span::styled(
            format!("  PAUSED (live: round {})", app.latest_round()),
            Style::new().black().on_yellow(),
        ));
    }
    if let Some(r) = app.baseline_round() {
        line.push(Span::styled(
            format!("  since round {r}"),
            Style::new().cyan().bold(),
        ));
    }
    if let Some(pid) = app.focus() {
        let comm = app
            .view()
            .procs
            .get(&pid)
            .map(|p| p.comm.clone())
            .unwrap_or_default();
        line.push(Span::styled(
            format!(
                "  pid {} {comm} only",
                crate::profile::incarnation::Pid(pid)
            ),
            Style::new().magenta().bold(),
        ));
    }
    if let Some(notice) = shown.notice.as_ref().filter(|_| shown.ended.is_none()) {
        line.push(Span::styled(format!("  {notice}"), Style::new().cyan()));
    }
    if let Some(end) = &shown.ended {
        line.push(Span::styled(
            format!("  {end}; q quits"),
            Style::new().green().bold(),
        ));
    }
    line
}

/// The header's third line: the totals of what is shown.
pub(super) fn totals_line(app: &App) -> String {
    let t = app.totals();
    let sample_bytes = app.view().sample_bytes;
    let mut line = format!(
        "allocs {}  frees {}  allocated {}",
        t.allocations(),
        t.frees(),
        bytes(t.bytes_allocated() as i64),
    );
    if app.view().calls {
        line.push_str("  live: not tracked in calls mode");
    } else {
        // One process in focus keeps its own figure; all of them tell the ended ones apart,
        // last, where a narrow terminal cuts the line.
        let ended = match app.focus() {
            None => app.view().ended_live(),
            Some(_) => (0, 0),
        };
        let e = crate::view::summary::est(sample_bytes);
        let untracked = crate::view::lower_bound::untracked(app.view(), app.focus());
        line.push_str(&format!(
            "  live {}{e}{} blocks / {e}{}",
            crate::view::lower_bound::prefix(untracked),
            t.live_blocks - ended.0,
            bytes(t.live_bytes - ended.1)
        ));
        if ended != (0, 0) {
            line.push_str(&format!(
                " (+{e}{} left by ended processes)",
                bytes(ended.1)
            ));
        }
        if let Some(b) = app.view().before_attach {
            line.push_str(&format!(
                "  (live at attach {} blocks / {})",
                b.blocks,
                bytes(b.bytes as i64)
            ));
        }
    }
    line
}

/// The highest live heap so far: the trace's, or the process's in focus (the kernel's, at
/// the allocation that reached it; "exact"), else the highest at a round's end.
pub(super) fn peak(app: &App) -> String {
    let view = app.view();
    // And the site that held the most of it, where the kernel kept what held it (`PeakHeld`).
    let (live, exact, top) = match app.focus() {
        Some(pid) => match view.procs.get(&pid).and_then(|p| p.peak.map(|k| (k, p))) {
            Some((k, p)) => {
                let top = p.peak_held.as_ref().map(|h| {
                    let mut peak = crate::profile::Peak::default();
                    peak.set_held(pid, h);
                    peak.sites.first().copied()
                });
                (k.bytes as i64, true, top.flatten())
            }
            None => return String::new(),
        },
        None => match view.peak.as_ref() {
            Some(p) => (
                p.live_bytes,
                p.exact,
                p.sites.first().copied().filter(|_| p.held),
            ),
            None => return String::new(),
        },
    };
    if live <= 0 {
        return String::new();
    }
    let how = if exact { " (exact)" } else { "" };
    // Blocks the live map had no room for are in neither figure: the flag that avoids it.
    let untracked = crate::view::lower_bound::untracked(view, app.focus());
    let raise = if untracked > 0 {
        " (raise --live-map-size)"
    } else {
        ""
    };
    let held = top.map_or(String::new(), |(id, _, b)| {
        let frames = view.frames(&id);
        let at = view.wrappers().site(&frames);
        let f = at.frame(&frames).filter(|_| id.1 >= 0);
        let name = f.map_or("?".to_string(), |f| f.function.to_string());
        format!(", {} from {name}", bytes(b))
    });
    format!(
        "  peak {}{}{}{how}{raise}{held}",
        crate::view::lower_bound::prefix(untracked),
        crate::view::summary::est(view.sample_bytes),
        bytes(live)
    )
}

/// The processes screen's live column: live bytes, or in calls mode, which keeps no live map,
/// the allocations per second of the last round.
pub(super) fn live_or_rate(app: &App, live: i64, rate: u64) -> String {
    if app.view().calls {
        rate.to_string()
    } else {
        bytes(live)
    }
}
