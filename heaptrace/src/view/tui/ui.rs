//! Drawing the live view: a header, the screen tabs, one function per screen, a status line,
//! and the help overlay. Reads the App only.
use ratatui::{
    Frame,
    layout::{Constraint, Layout, Rect},
    style::{Modifier, Style, Stylize as _},
    text::{Line, Span},
    widgets::{
        Block, Borders, Cell, Clear, Paragraph, Row, Sparkline, Table, TableState, Tabs, Wrap,
    },
};

use super::app::{
    App, ProcRow, Published, Screen, SiteRow, SiteSort, meaningful_frame, short_symbol,
};
use crate::{
    profile::histogram::percentiles,
    run_info::{Mode, TargetKind},
    symbolize::Frame as StackFrame,
    view::units::bytes,
    view::units::nanos,
};

const SELECTED: &str = "> ";

/// The rows of a bordered table with a header that fit in `area`, such that the selected one
/// shows, and the selected one's place among them. Only those rows are formatted: a trace can
/// have tens of thousands of sites or sizes.
fn window(len: usize, selected: usize, area: Rect) -> (std::ops::Range<usize>, Option<usize>) {
    if len == 0 {
        return (0..0, None);
    }
    let h = (area.height as usize).saturating_sub(3).max(1);
    let sel = selected.min(len - 1);
    let start = sel.saturating_sub(h - 1);
    (start..(start + h).min(len), Some(sel - start))
}

pub fn draw(f: &mut Frame, app: &App) {
    let [header, tabs, body, status] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(f.area());
    draw_header(f, app, header);
    draw_tabs(f, app, tabs);
    match app.screen {
        Screen::Timeline => draw_timeline(f, app, body),
        Screen::Sites => match app.detail {
            Some(_) => draw_stack(f, app, body),
            None => draw_sites(f, app, body),
        },
        Screen::Sizes => draw_sizes(f, app, body),
        Screen::Functions => draw_functions(f, app, body),
        Screen::Processes => draw_processes(f, app, body),
    }
    draw_status(f, app, status);
    if app.help {
        draw_help(f, f.area());
    }
}

fn kib(kb: u64) -> String {
    bytes(kb as i64 * 1024)
}

fn draw_header(f: &mut Frame, app: &App, area: Rect) {
    let info = &app.info;
    let shown = app.shown();
    let interval = nanos(info.run.interval_ms * 1_000_000)
        .replace(".0 ", " ")
        .replace(".00 ", " ");
    let mut l1 = vec![
        Span::styled("heaptrace ", Style::new().bold()),
        Span::raw(info.target.clone()),
        Span::raw(format!(
            "  {} mode{}, every {interval}, {} probes in {}",
            info.run.mode,
            match app.view().sample_bytes {
                0 => String::new(),
                n => format!(" sampled 1/{n} B (~: estimated)"),
            },
            info.probe_count(),
            info.run.allocator_module()
        )),
    ];
    if let Some(out) = &info.output {
        l1.push(Span::raw(format!(", output to {out}")));
    }
    let l2 = status_line(app, shown);
    let l3 = totals_line(app);
    let text = vec![Line::from(l1), Line::from(l2), Line::from(l3)];
    f.render_widget(Paragraph::new(text), area);
}

/// The header's second line: the round, the time, heaptrace's cost, what was lost, and what
/// the view is showing (paused, since a reset, one process, the end).
fn status_line(app: &App, shown: &Published) -> Vec<Span<'static>> {
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
        .map(|(rss, virt)| format!("RSS {}  VIRT {}  ", kib(rss), kib(virt)))
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
            format!("  PAUSED (at round {})", app.latest_round()),
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
fn totals_line(app: &App) -> String {
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
        line.push_str(&format!(
            "  live {e}{} blocks / {e}{}",
            t.live_blocks - ended.0,
            bytes(t.live_bytes - ended.1)
        ));
        if ended != (0, 0) {
            line.push_str(&format!(
                " (+{e}{} left by ended processes)",
                bytes(ended.1)
            ));
        }
    }
    line
}

/// The processes screen's live column: live bytes, or in calls mode, which keeps no live map,
/// the allocations per second of the last round.
fn live_or_rate(app: &App, live: i64, rate: u64) -> String {
    if app.view().calls {
        rate.to_string()
    } else {
        bytes(live)
    }
}

fn draw_tabs(f: &mut Frame, app: &App, area: Rect) {
    let screens = app.screens();
    let titles: Vec<String> = screens
        .iter()
        .enumerate()
        .map(|(i, s)| format!("{} {}", i + 1, s.title()))
        .collect();
    let selected = screens.iter().position(|s| *s == app.screen);
    let mut right = String::new();
    if let Some(s) = app.sort_name() {
        right.push_str(&format!("sort: {s}"));
    }
    if !app.filter.is_empty() {
        right.push_str(&format!("  filter: {}", app.filter));
    }
    let [left, rest] = Layout::horizontal([
        Constraint::Min(0),
        Constraint::Length(right.len() as u16 + 1),
    ])
    .areas(area);
    f.render_widget(
        Tabs::new(titles)
            .select(selected)
            .highlight_style(Style::new().reversed())
            .divider("|"),
        left,
    );
    f.render_widget(Paragraph::new(right).right_aligned(), rest);
}

fn draw_status(f: &mut Frame, app: &App, area: Rect) {
    let line = if app.editing_filter {
        Line::from(vec![
            Span::styled("filter: ", Style::new().bold()),
            Span::raw(app.filter.clone()),
            Span::raw("_   (function or module; Enter keeps it, Esc clears it)"),
        ])
    } else if !app.status.is_empty() {
        Line::from(app.status.clone())
    } else {
        Line::from(
            "q quit  ? help  Tab screen  j/k move  Enter stack  s sort  / filter  p pause  r reset  w write",
        )
    };
    f.render_widget(Paragraph::new(line).reversed(), area);
}

/// (title, values, how to show one value).
type Series = (&'static str, Vec<u64>, fn(u64) -> String);

fn draw_timeline(f: &mut Frame, app: &App, area: Rect) {
    let rows = app.timeline();
    if rows.is_empty() {
        f.render_widget(
            Paragraph::new("no round yet since the start (or the reset)")
                .block(Block::bordered().title("Timeline")),
            area,
        );
        return;
    }
    let rate = |n: u64, i: usize| -> u64 {
        let prev = i.checked_sub(1).map(|p| &rows[p]);
        crate::view::tui::app::per_second(n, &rows[i], prev, app.info.run.interval_ms)
    };
    let by = |n: u64| bytes(n as i64);
    let plain = |n: u64| n.to_string();
    // Calls mode keeps no live heap; the rate at which bytes are asked for takes its place.
    let first: Series = if app.view().calls {
        (
            "allocated/s",
            rows.iter()
                .enumerate()
                .map(|(i, r)| rate(r.bytes_allocated, i))
                .collect(),
            by,
        )
    } else {
        (
            "live heap",
            rows.iter().map(|r| r.live_bytes.max(0) as u64).collect(),
            by,
        )
    };
    let series: [Series; 5] = [
        first,
        ("RSS", rows.iter().map(|r| r.rss_kb * 1024).collect(), by),
        ("VIRT", rows.iter().map(|r| r.virt_kb * 1024).collect(), by),
        (
            "allocations/s",
            rows.iter()
                .enumerate()
                .map(|(i, r)| rate(r.allocations, i))
                .collect(),
            plain,
        ),
        (
            "frees/s",
            rows.iter()
                .enumerate()
                .map(|(i, r)| rate(r.frees, i))
                .collect(),
            plain,
        ),
    ];
    // A coarsened timeline's rows cover several rounds each.
    let covered: u64 = rows.iter().map(|r| r.rounds.max(1)).sum();
    let areas = Layout::vertical([Constraint::Ratio(1, 5); 5]).split(area);
    for ((title, values, show), area) in series.into_iter().zip(areas.iter()) {
        let [head, chart] =
            Layout::vertical([Constraint::Length(1), Constraint::Min(0)]).areas(*area);
        let now = values.last().copied().unwrap_or(0);
        let max = values.iter().copied().max().unwrap_or(0);
        let min = values.iter().copied().min().unwrap_or(0);
        f.render_widget(
            Paragraph::new(Line::from(vec![
                Span::styled(format!("{title:<14}"), Style::new().bold()),
                Span::raw(format!(
                    "now {}  min {}  max {}  ({covered} rounds)",
                    show(now),
                    show(min),
                    show(max),
                )),
            ])),
            head,
        );
        let skip = values.len().saturating_sub(chart.width as usize);
        f.render_widget(
            Sparkline::default()
                .data(&values[skip..])
                .max(max.max(1))
                .style(Style::new().cyan()),
            chart,
        );
    }
}

fn site_label(fr: &StackFrame) -> String {
    let name = short_symbol(&fr.function);
    match (&fr.file, fr.line) {
        (Some(file), Some(line)) => {
            let base = file.rsplit('/').next().unwrap_or(file);
            format!("{name} ({base}:{line})")
        }
        _ => name,
    }
}

fn draw_sites(f: &mut Frame, app: &App, area: Rect) {
    let rows = app.site_rows();
    let block = Block::bordered().title(format!(
        "Sites: {} (sorted by {}; Enter: stack){}",
        rows.len(),
        app.site_sort.name(),
        crate::view::site_tables::estimated(app.view())
    ));
    if !app.info.run.mode.has_stacks() {
        f.render_widget(
            Paragraph::new(format!(
                "no stacks in {} mode: run with --mode stacks",
                app.info.run.mode
            ))
            .block(block),
            area,
        );
        return;
    }
    let wide = area.width >= 100;
    let temp = wide || app.site_sort == SiteSort::Temporary;
    let leaks = wide || app.site_sort == SiteSort::Leaks;
    let pid = app.info.run.target == TargetKind::All;
    let mut header = vec![
        format!("{:>10}", "bytes"),
        format!("{:>9}", "calls"),
        format!("{:>10}", "live"),
    ];
    let mut widths = vec![
        Constraint::Length(10),
        Constraint::Length(9),
        Constraint::Length(10),
    ];
    if temp {
        header.push(format!("{:>9}", "temporary"));
        widths.push(Constraint::Length(9));
    }
    if leaks {
        header.push(format!("{:>10}", "leaked"));
        widths.push(Constraint::Length(10));
    }
    if pid {
        header.push(format!("{:>7}", "pid"));
        widths.push(Constraint::Length(7));
    }
    header.extend(["func".into(), "site".into()]);
    widths.extend([Constraint::Length(7), Constraint::Fill(1)]);
    let (shown, selected) = window(rows.len(), app.selected(Screen::Sites), area);
    let body: Vec<Row> = rows[shown]
        .iter()
        .map(|r| site_row(r, temp, leaks, pid))
        .collect();
    let header_row = Row::new(header).style(Style::new().bold().underlined());
    let empty = rows.is_empty();
    let table = Table::new(body, widths)
        .header(header_row)
        .block(block)
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol(SELECTED);
    let mut state = TableState::default().with_selected(selected);
    f.render_stateful_widget(table, area, &mut state);
    if empty {
        draw_no_site(f, app, area);
    }
}

/// A site's row; the optional columns as the sites screen shows them.
fn site_row(r: &SiteRow, temp: bool, leaks: bool, pid: bool) -> Row<'static> {
    let t = &r.totals;
    let mut cells = vec![
        Cell::from(format!("{:>10}", bytes(t.bytes as i64))),
        Cell::from(format!("{:>9}", t.calls)),
        Cell::from(format!("{:>10}", bytes(t.live_bytes))),
    ];
    if temp {
        cells.push(Cell::from(format!("{:>9}", t.temp_blocks)));
    }
    if leaks {
        cells.push(Cell::from(format!(
            "{:>10}",
            r.leak.map_or("-".into(), |l| bytes(l.bytes as i64))
        )));
    }
    if pid {
        cells.push(Cell::from(format!(
            "{:>7}",
            crate::profile::incarnation::Pid(r.id.0)
        )));
    }
    cells.push(Cell::from(r.func()));
    cells.push(Cell::from(site_label(r.frame())));
    Row::new(cells)
}

/// Why the sites table is empty, under its header.
fn draw_no_site(f: &mut Frame, app: &App, area: Rect) {
    let msg = if app.filter.is_empty() {
        "no allocation site yet"
    } else {
        "no site matches the filter"
    };
    let inner = Block::bordered().inner(area);
    if inner.height > 2 {
        f.render_widget(
            Paragraph::new(msg).italic(),
            Rect {
                y: inner.y + 2,
                height: 1,
                ..inner
            },
        );
    }
}

/// The full stack of the site opened with Enter: every frame with file:line, inlined ones
/// marked, the frame the site is named by pointed at.
fn draw_stack(f: &mut Frame, app: &App, area: Rect) {
    let Some(id) = app.detail else { return };
    let frames = app.site_frames(&id);
    let named = meaningful_frame(&frames, app.info.run.allocator_module());
    let func = heaptrace_common::Func::from_u32(id.2).map_or("?", |f| f.name());
    let mut lines: Vec<Line> = Vec::new();
    if let Some(t) = app.view().sites.get(&id) {
        lines.push(Line::from(format!(
            "{func} called {} times for {} ({} bytes); freed {} blocks / {}; live {} blocks / {}",
            t.calls,
            bytes(t.bytes as i64),
            t.bytes,
            t.frees,
            bytes(t.freed_bytes as i64),
            t.live_blocks,
            bytes(t.live_bytes)
        )));
        let mut l = format!(
            "temporary {} blocks / {}",
            t.temp_blocks,
            bytes(t.temp_bytes as i64)
        );
        if let Some(p) = percentiles(&t.sizes, 1) {
            l.push_str(&format!("; size p50 ~{}", bytes(p.p50 as i64)));
        }
        if let Some(p) = percentiles(&t.lifetimes, 1024) {
            let timed = match app.view().latency_sampled() {
                Some(n) => format!(" (1 in {n} timed)"),
                None => String::new(),
            };
            l.push_str(&format!(
                "; lifetime{timed} p50 {} p99 {}",
                nanos(p.p50),
                nanos(p.p99)
            ));
        }
        if let Some(leak) = app
            .view()
            .leaks
            .as_ref()
            .map(|l| l.get(&id).copied().unwrap_or_default())
        {
            l.push_str(&format!(
                "; not freed at the end {} blocks / {}",
                leak.blocks,
                bytes(leak.bytes as i64)
            ));
        }
        lines.push(Line::from(l));
    }
    lines.push(Line::from(""));
    for (i, fr) in frames.iter().enumerate() {
        let mark = if i == named { "> " } else { "  " };
        let loc = match (&fr.file, fr.line) {
            (Some(file), Some(line)) => format!("{file}:{line}"),
            (Some(file), None) => file.to_string(),
            _ => String::new(),
        };
        let style = if *fr.module == *app.info.run.allocator_module() {
            Style::new().dim()
        } else {
            Style::new()
        };
        let mut spans = vec![
            Span::raw(format!("{mark}#{i:<3} ")),
            Span::styled(fr.function.to_string(), style.bold()),
        ];
        if fr.inlined {
            spans.push(Span::styled(" [inlined]", Style::new().italic()));
        }
        lines.push(Line::from(spans).style(style));
        // A frame without a name already reads module+offset.
        let place = format!("{}+{:#x}", fr.module, fr.offset);
        let second = match (loc.is_empty(), *fr.function == *place) {
            (true, true) => None,
            (true, false) => Some(place),
            (false, _) => Some(format!("{loc}  {place}")),
        };
        if let Some(second) = second {
            lines.push(Line::from(format!("       {second}")).style(style.dim()));
        }
    }
    let title = format!(
        "Stack of {func} site {} in pid {} ({} frames; Esc/Enter back, j/k scroll)",
        id.1,
        crate::profile::incarnation::Pid(id.0),
        frames.len()
    );
    f.render_widget(
        Paragraph::new(lines)
            .block(Block::bordered().title(title))
            .wrap(Wrap { trim: false })
            .scroll((app.detail_scroll.min(u16::MAX as usize) as u16, 0)),
        area,
    );
}

fn draw_sizes(f: &mut Frame, app: &App, area: Rect) {
    let [left, right] = if area.width >= 100 {
        Layout::horizontal([Constraint::Percentage(50); 2]).areas(area)
    } else {
        Layout::vertical([Constraint::Percentage(50); 2]).areas(area)
    };
    let classes = app.size_classes();
    let block = Block::bordered().title("Requests by size class (all functions but free)");
    if classes.is_empty() {
        let msg = if app.info.run.mode == Mode::Counts {
            "no sizes in counts mode: run with --mode sizes or stacks"
        } else {
            "no request yet"
        };
        f.render_widget(Paragraph::new(msg).block(block), left);
    } else {
        let inner = block.inner(left);
        let max = classes.iter().map(|c| c.count).max().unwrap_or(1).max(1);
        let label_w = 20usize;
        let bar_w = (inner.width as usize).saturating_sub(label_w + 12).max(1);
        let lines: Vec<Line> = classes
            .iter()
            .map(|c| {
                let hi = if c.from == 0 { 0 } else { 2 * c.from - 1 };
                let label = format!("{:>9}-{:<9}", bytes(c.from as i64), bytes(hi as i64));
                let n = ((c.count as f64 / max as f64) * bar_w as f64).ceil() as usize;
                Line::from(vec![
                    Span::raw(format!("{label:<label_w$}")),
                    Span::styled("█".repeat(n.min(bar_w)), Style::new().cyan()),
                    Span::raw(format!(" {}", c.count)),
                ])
            })
            .collect();
        f.render_widget(Paragraph::new(lines).block(block), left);
    }
    let rows = app.size_rows();
    let (shown, selected) = window(rows.len(), app.selected(Screen::Sizes), right);
    let body: Vec<Row> = rows[shown]
        .iter()
        .map(|r| {
            Row::new(vec![
                Cell::from(format!("{:>10}", r.size)),
                Cell::from(r.func),
                Cell::from(format!("{:>10}", r.count)),
                Cell::from(format!("{:>10}", bytes((r.size * r.count) as i64))),
            ])
        })
        .collect();
    let table = Table::new(
        body,
        [
            Constraint::Length(10),
            Constraint::Length(14),
            Constraint::Length(10),
            Constraint::Length(10),
        ],
    )
    .header(
        Row::new(["      size", "function", "     count", "     bytes"])
            .style(Style::new().bold().underlined()),
    )
    .block(Block::bordered().title(format!(
        "Exact sizes: {} (sorted by {})",
        rows.len(),
        app.size_sort.name()
    )))
    .row_highlight_style(Style::new().reversed())
    .highlight_symbol(SELECTED);
    let mut state = TableState::default().with_selected(selected);
    f.render_stateful_widget(table, right, &mut state);
}

fn draw_functions(f: &mut Frame, app: &App, area: Rect) {
    let rows = app.func_rows();
    let wide = area.width >= 100;
    let [top, bottom] = Layout::vertical([
        Constraint::Length(rows.len() as u16 + 3),
        Constraint::Min(0),
    ])
    .areas(area);
    let body: Vec<Row> = rows
        .iter()
        .map(|r| {
            let lat = |get: fn(&crate::profile::histogram::Percentiles) -> u64| {
                r.latency.as_ref().map_or("-".into(), |p| nanos(get(p)))
            };
            let mut cells = vec![
                Cell::from(r.name.clone()),
                Cell::from(format!("{:>11}", r.calls)),
                Cell::from(format!(
                    "{:>13}",
                    r.bytes.map_or("-".into(), |n| n.to_string())
                )),
                Cell::from(format!(
                    "{:>6}",
                    r.failed.map_or("-".into(), |n| n.to_string())
                )),
                Cell::from(format!("{:>9}", lat(|p| p.p50))),
                Cell::from(format!("{:>9}", lat(|p| p.p99))),
            ];
            if wide {
                cells.push(Cell::from(format!("{:>9}", lat(|p| p.max))));
            }
            Row::new(cells)
        })
        .collect();
    let mut widths = vec![
        Constraint::Fill(1),
        Constraint::Length(11),
        Constraint::Length(13),
        Constraint::Length(6),
        Constraint::Length(9),
        Constraint::Length(9),
    ];
    let mut header = vec![
        "function",
        "      calls",
        "        bytes",
        "failed",
        "      p50",
        "      p99",
    ];
    if wide {
        widths.push(Constraint::Length(9));
        header.push("    max <");
    }
    let table = Table::new(body, widths)
        .header(Row::new(header).style(Style::new().bold().underlined()))
        .block(Block::bordered().title(format!(
            "Functions (sorted by {}; time per call, entry to return{})",
            app.func_sort.name(),
            crate::view::site_tables::latency_note(app.view())
        )))
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol(SELECTED);
    let mut state = TableState::default()
        .with_selected((!rows.is_empty()).then(|| app.selected(Screen::Functions)));
    f.render_stateful_widget(table, top, &mut state);
    let t = app.totals();
    let free_note = if app.view().calls {
        "free: bytes freed not known (calls mode keeps no live map)".to_string()
    } else if app.view().sample_bytes > 0 {
        format!(
            "free: {} of blocks not sampled or not seen allocated (bytes freed: not known)",
            t.untracked_frees
        )
    } else {
        format!(
            "free: {} untracked (blocks not seen allocated)",
            t.untracked_frees
        )
    };
    let mut notes = vec![
        Line::from(free_note),
        Line::from(format!(
            "realloc: {} moved, {} in place, {} realloc(p, 0) frees",
            t.realloc_moves, t.realloc_in_place, t.realloc_frees
        )),
        Line::from("times come from power-of-two buckets: good to a factor of 1.5".dim()),
    ];
    if app.info.run.mode <= Mode::Counts {
        notes.push(Line::from(
            format!("no times in {} mode", app.info.run.mode).dim(),
        ));
    }
    if app.focus().is_some() {
        notes.push(Line::from(
            "times are of all processes (the kernel keeps them per function)".dim(),
        ));
    }
    f.render_widget(Paragraph::new(notes), bottom);
}

fn draw_processes(f: &mut Frame, app: &App, area: Rect) {
    // Hundreds at most: every row is formatted.
    let rows = app.proc_rows();
    let wide = area.width >= 110;
    let mut body = vec![all_processes_row(app, wide)];
    body.extend(rows.iter().map(|r| process_row(app, r, wide)));
    let (widths, header) = process_columns(app, wide);
    // Without room for VIRT, rows keep their last cell: a table draws as many as it has columns.
    let table = Table::new(body, widths)
        .header(Row::new(header).style(Style::new().bold().underlined()))
        .block(Block::bordered().title(format!(
            "Processes: {} (sorted by {}; Enter: show only this one)",
            rows.len(),
            app.proc_sort_name()
        )))
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol(SELECTED);
    let mut state = TableState::default().with_selected(Some(app.selected(Screen::Processes)));
    f.render_stateful_widget(table, area, &mut state);
}

/// A count in the processes table, a column wider on a wide terminal.
fn count_cell(v: u64, wide: bool) -> String {
    if wide {
        format!("{v:>11}")
    } else {
        format!("{v:>10}")
    }
}

/// The processes table's first row: every process together, selected when none is in focus.
fn all_processes_row(app: &App, wide: bool) -> Row<'static> {
    let all = app.all_totals();
    Row::new(vec![
        Cell::from(if app.focus().is_none() { "*" } else { " " }),
        Cell::from(""),
        Cell::from("all processes"),
        Cell::from(count_cell(all.allocations(), wide)),
        Cell::from(count_cell(all.frees(), wide)),
        Cell::from(format!("{:>10}", bytes(all.bytes_allocated() as i64))),
        Cell::from(format!(
            "{:>10}",
            live_or_rate(app, all.live_bytes, app.all_rate())
        )),
        Cell::from(""),
        Cell::from(""),
    ])
}

fn process_row(app: &App, r: &ProcRow, wide: bool) -> Row<'static> {
    // Ended ones stay listed (their figures are final), dimmed.
    let style = if r.exited {
        Style::new().dim()
    } else {
        Style::new()
    };
    Row::new(vec![
        Cell::from(if app.focus() == Some(r.pid) { "*" } else { " " }),
        Cell::from(format!("{:>7}", crate::profile::incarnation::Pid(r.pid))),
        Cell::from(if r.exited {
            format!("{} (ended)", r.comm)
        } else {
            r.comm.clone()
        }),
        Cell::from(count_cell(r.totals.allocations(), wide)),
        Cell::from(count_cell(r.totals.frees(), wide)),
        Cell::from(format!("{:>10}", bytes(r.totals.bytes_allocated() as i64))),
        Cell::from(format!(
            "{:>10}",
            live_or_rate(app, r.totals.live_bytes, r.rate)
        )),
        Cell::from(format!("{:>10}", r.rss_kb.map_or("-".into(), kib))),
        Cell::from(format!("{:>10}", r.virt_kb.map_or("-".into(), kib))),
        Cell::from(format!(
            "{:>10}",
            r.reserved.map_or("-".into(), |b| bytes(b as i64))
        )),
    ])
    .style(style)
}

/// The processes table's widths and header: VIRT and reserved only on a wide terminal.
fn process_columns(app: &App, wide: bool) -> (Vec<Constraint>, Vec<String>) {
    let num = if wide { 11 } else { 10 };
    let mut widths = vec![
        Constraint::Length(1),
        Constraint::Length(7),
        if wide {
            Constraint::Length(20)
        } else {
            Constraint::Fill(1)
        },
        Constraint::Length(num),
        Constraint::Length(num),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(10),
    ];
    let mut header = vec![
        String::new(),
        format!("{:>7}", "pid"),
        "command".into(),
        format!("{:>w$}", "allocs", w = num as usize),
        format!("{:>w$}", "frees", w = num as usize),
        format!("{:>10}", "allocated"),
        format!("{:>10}", if app.view().calls { "allocs/s" } else { "live" }),
        format!("{:>10}", "RSS"),
    ];
    if wide {
        widths.push(Constraint::Length(10));
        header.push(format!("{:>10}", "VIRT"));
        // What the allocator holds from the kernel: why VIRT and RSS differ from "live".
        widths.push(Constraint::Length(10));
        header.push(format!("{:>10}", "reserved"));
    }
    (widths, header)
}

const HELP: &[(&str, &str)] = &[
    ("q  Ctrl-C", "quit: detach, then print the summary"),
    ("Esc", "close the stack or filter; quit"),
    ("?", "this help (any key closes it)"),
    ("Tab  S-Tab  1-5", "next, previous, n-th screen"),
    ("j k  arrows", "move; PgUp PgDn g G jump"),
    ("Enter", "site: open its stack; process: show only it"),
    ("s", "cycle the sort order of this screen"),
    ("/", "filter by function or module substring"),
    ("p  Space", "pause the view (the kernel keeps counting)"),
    ("r", "reset: count from what is on screen now"),
    ("R", "count from the start again"),
    ("w", "write what is on screen as JSON"),
];

fn draw_help(f: &mut Frame, area: Rect) {
    let w = 64.min(area.width);
    let h = (HELP.len() as u16 + 2).min(area.height);
    let r = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    let lines: Vec<Line> = HELP
        .iter()
        .map(|(k, what)| {
            Line::from(vec![
                Span::styled(
                    format!(" {k:<16}"),
                    Style::new().add_modifier(Modifier::BOLD),
                ),
                Span::raw(*what),
            ])
        })
        .collect();
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title("Keys")),
        r,
    );
}

#[cfg(test)]
mod tests;
