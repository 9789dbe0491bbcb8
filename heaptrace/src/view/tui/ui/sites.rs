//! The sites screen and the stack of the selected site.
use super::*;

pub(super) fn site_label(fr: &StackFrame) -> String {
    let name = short_symbol(&fr.function);
    match (&fr.file, fr.line) {
        (Some(file), Some(line)) => {
            let base = file.rsplit('/').next().unwrap_or(file);
            format!("{name} ({base}:{line})")
        }
        _ => name,
    }
}

pub(super) fn draw_sites(f: &mut Frame, app: &App, area: Rect) {
    let rows = app.site_rows();
    // Stacks cut short for most calls: the sites are then callers of the allocator only.
    let cut = crate::view::site_tables::shallow(app.view())
        .map(|s| {
            format!(
                "; {:.0}% of stacks cut short, {}",
                s.percent,
                s.cause.brief()
            )
        })
        .unwrap_or_default();
    let block = Block::bordered().title(format!(
        "Sites: {} (sorted by {}; Enter: stack){}{cut}",
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
    let pid = app.many_processes();
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
    widths.push(Constraint::Length(7));
    // The site column's width: what the fixed ones, the gaps between columns, the borders
    // and the cursor leave. A longer name is cut at its start, keeping the function's name.
    let fixed: u16 = widths
        .iter()
        .map(|c| match c {
            Constraint::Length(n) => *n,
            _ => 0,
        })
        .sum();
    let site_width = area
        .width
        .saturating_sub(2 + SELECTED.len() as u16 + fixed + widths.len() as u16)
        as usize;
    widths.push(Constraint::Fill(1));
    let (shown, selected) = window(rows.len(), app.selected(Screen::Sites), area);
    let body: Vec<Row> = rows[shown]
        .iter()
        .map(|r| site_row(r, temp, leaks, pid, site_width))
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
pub(super) fn site_row(
    r: &SiteRow,
    temp: bool,
    leaks: bool,
    pid: bool,
    site_width: usize,
) -> Row<'static> {
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
    cells.push(Cell::from(crate::view::names::fit_end(
        &site_label(r.frame()),
        site_width,
    )));
    Row::new(cells)
}

/// Why the sites table is empty, under its header.
pub(super) fn draw_no_site(f: &mut Frame, app: &App, area: Rect) {
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
pub(super) fn draw_stack(f: &mut Frame, app: &App, area: Rect) {
    let Some(id) = app.detail else { return };
    let frames = app.site_frames(&id);
    let named = meaningful_frame(app.view(), &frames);
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
        l.push_str(&site_sizes(app.view(), &id, &t.sizes.dense()));
        if let Some(p) = percentiles(&t.lifetimes.dense(), 1024) {
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

/// The sizes a site requested, for its stack pane: exact from the size histogram where the
/// mode keeps one (`size 256.0 KiB`, or the median and the range), else an estimate from the
/// power-of-two buckets, marked `~` and kept within the buckets that were hit.
pub(super) fn site_sizes(
    p: &crate::profile::Profile,
    id: &crate::drain::round::SiteId,
    log2: &crate::drain::round::Log2,
) -> String {
    let exact = p.sizes_of_site(id);
    if p.sample_bytes == 0 && !exact.is_empty() {
        let total: u64 = exact.iter().map(|(_, n)| n).sum();
        let (min, max) = (exact[0].0, exact[exact.len() - 1].0);
        if min == max {
            return format!("; size {}", bytes(min as i64));
        }
        let mut seen = 0;
        let median = exact
            .iter()
            .find(|(_, n)| {
                seen += n;
                seen * 2 >= total
            })
            .map_or(min, |(s, _)| *s);
        return format!(
            "; size p50 {} ({} to {})",
            bytes(median as i64),
            bytes(min as i64),
            bytes(max as i64)
        );
    }
    let Some(est) = percentiles(log2, 1) else {
        return String::new();
    };
    // The buckets hit bound the estimate: [floor of the lowest, floor of the one past the top).
    let hit: Vec<usize> = log2
        .iter()
        .enumerate()
        .filter(|(_, n)| **n > 0)
        .map(|(b, _)| b)
        .collect();
    let (lo, hi) = match (hit.first(), hit.last()) {
        (Some(&lo), Some(&hi)) => (
            heaptrace_common::log2_bucket_floor(lo),
            heaptrace_common::log2_bucket_floor(hi + 1).saturating_sub(1),
        ),
        _ => (0, u64::MAX),
    };
    format!("; size p50 ~{}", bytes(est.p50.clamp(lo, hi) as i64))
}
