//! The timeline screen: a row per round (or per group of rounds).
use super::*;

pub(super) fn draw_timeline(f: &mut Frame, app: &App, area: Rect) {
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
