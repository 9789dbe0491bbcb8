//! The sizes screen: the exact size histogram.
use super::*;

pub(super) fn draw_sizes(f: &mut Frame, app: &App, area: Rect) {
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
