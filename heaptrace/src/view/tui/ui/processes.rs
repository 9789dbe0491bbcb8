//! The processes screen (system-wide traces): a row per process.
use super::*;

pub(super) fn draw_processes(f: &mut Frame, app: &App, area: Rect) {
    // Hundreds at most: every row is formatted.
    let rows = app.proc_rows();
    let wide = area.width >= 110;
    let mut body = vec![all_processes_row(app, wide)];
    body.extend(rows.iter().map(|r| process_row(app, r, wide)));
    let (widths, header) = process_columns(app, wide);
    // Without room for VIRT, rows keep their last cell: a table draws as many as it has columns.
    let table = Table::new(body, widths)
        .header(Row::new(header).style(Style::new().bold().underlined()))
        .block(Block::bordered().title(if app.by_command {
            format!(
                "Commands: {} (sorted by {}; c: a row per process)",
                rows.len(),
                app.proc_sort_name()
            )
        } else {
            format!(
                "Processes: {} (sorted by {}; Enter: show only this one; c: by command)",
                rows.len(),
                app.proc_sort_name()
            )
        }))
        .row_highlight_style(Style::new().reversed())
        .highlight_symbol(SELECTED);
    let mut state = TableState::default().with_selected(Some(app.selected(Screen::Processes)));
    f.render_stateful_widget(table, area, &mut state);
}

/// A count in the processes table, a column wider on a wide terminal.
pub(super) fn count_cell(v: u64, wide: bool) -> String {
    if wide {
        format!("{v:>11}")
    } else {
        format!("{v:>10}")
    }
}

/// The processes table's first row: every process together, selected when none is in focus.
pub(super) fn all_processes_row(app: &App, wide: bool) -> Row<'static> {
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

pub(super) fn process_row(app: &App, r: &ProcRow, wide: bool) -> Row<'static> {
    // Ended ones stay listed (their figures are final), dimmed.
    let style = if r.oom_killed {
        Style::new().red()
    } else if r.exited {
        Style::new().dim()
    } else {
        Style::new()
    };
    Row::new(vec![
        Cell::from(if app.focus() == Some(r.pid) { "*" } else { " " }),
        Cell::from(format!("{:>7}", crate::profile::incarnation::Pid(r.pid))),
        Cell::from(match (r.oom_killed, r.exited) {
            // The status line says it whole ("killed by the OOM killer"); the column is narrow.
            (true, _) => format!("{} (OOM killed)", r.comm),
            (false, true) => format!("{} (ended)", r.comm),
            (false, false) => r.comm.clone(),
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
pub(super) fn process_columns(app: &App, wide: bool) -> (Vec<Constraint>, Vec<String>) {
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
