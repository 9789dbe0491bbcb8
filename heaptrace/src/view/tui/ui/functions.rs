//! The functions screen: calls, bytes, failures and latency per family function.
use super::*;

pub(super) fn draw_functions(f: &mut Frame, app: &App, area: Rect) {
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
