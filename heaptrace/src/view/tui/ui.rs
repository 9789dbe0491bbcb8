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
    profile::histogram::percentiles, run_info::Mode, symbolize::Frame as StackFrame,
    view::units::bytes, view::units::nanos,
};

const SELECTED: &str = "> ";
mod functions;
mod header;
mod processes;
mod sites;
mod sizes;
mod timeline;

use self::{functions::*, header::*, processes::*, sites::*, sizes::*, timeline::*};

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
        draw_help(f, f.area(), app.screen);
    }
}

fn kib(kb: u64) -> String {
    bytes(kb as i64 * 1024)
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
        Line::from(keys_line(area.width as usize))
    };
    f.render_widget(Paragraph::new(line).reversed(), area);
}

/// The keys line: as many of the keys as fit whole, in order of use (`?` lists them all).
fn keys_line(width: usize) -> String {
    const KEYS: [&str; 10] = [
        "q quit",
        "? help",
        "Tab screen",
        "j/k move",
        "Enter stack",
        "s sort",
        "/ filter",
        "p pause",
        "r reset",
        "w write",
    ];
    let mut out = String::new();
    for k in KEYS {
        let sep = if out.is_empty() { "" } else { "  " };
        if out.len() + sep.len() + k.len() > width {
            break;
        }
        out.push_str(sep);
        out.push_str(k);
    }
    out
}

/// (title, values, how to show one value).
type Series = (&'static str, Vec<u64>, fn(u64) -> String);

const HELP: &[(&str, &str)] = &[
    ("q  Ctrl-C", "quit: detach, then print the summary"),
    ("Esc", "close the stack or filter; quit"),
    ("?", "this help (any key closes it)"),
    ("Tab  S-Tab  1-5", "next, previous, n-th screen"),
    ("j k  arrows", "move; PgUp PgDn g G jump"),
    ("Enter", "site: open its stack; process: show only it"),
    ("s", "cycle the sort order of this screen"),
    ("c", "processes: a row per command, or per process"),
    ("/", "filter by function or module substring"),
    ("p  Space", "pause the view (the kernel keeps counting)"),
    ("r", "reset: count from what is on screen now"),
    ("R", "count from the start again"),
    ("w", "write what is on screen as JSON"),
];

/// What each column (or row) of a screen means, for the help overlay.
fn columns(screen: Screen) -> &'static [(&'static str, &'static str)] {
    match screen {
        Screen::Timeline => &[
            ("allocated/s", "bytes requested per second"),
            ("live heap", "requested bytes allocated, not yet freed"),
            ("RSS  VIRT", "resident and virtual memory (/proc)"),
            ("allocations/s", "allocating calls per second"),
            ("frees/s", "free calls per second"),
            ("now min max", "this round's value, the lowest, the highest"),
        ],
        Screen::Sites => &[
            ("bytes  calls", "requested here, and how often"),
            ("live", "bytes allocated here, not freed yet"),
            ("temporary", "blocks freed soon by their thread"),
            ("leaked", "blocks not freed when the process ended"),
            ("pid  func", "the process; the allocating function"),
            ("site", "first frame outside the allocator"),
        ],
        Screen::Sizes => &[
            ("size", "requested size in bytes, exact"),
            ("function", "the allocating function"),
            ("count  bytes", "calls of that size; size x count"),
        ],
        Screen::Functions => &[
            ("function", "the malloc-family function"),
            ("calls  bytes", "calls and bytes requested"),
            ("failed", "calls that returned NULL"),
            ("p50  p99", "time per call: median, 99th pct"),
            ("max <", "every timed call took less than this"),
        ],
        Screen::Processes => &[
            ("pid  command", "the process and its name"),
            ("allocs  frees", "allocating calls; free calls"),
            ("allocated", "bytes requested"),
            ("live  allocs/s", "live bytes (calls mode: calls/s)"),
            ("RSS  VIRT", "resident and virtual memory (/proc)"),
            ("reserved", "what its allocators hold (brk, mmap, pymalloc)"),
        ],
    }
}

fn draw_help(f: &mut Frame, area: Rect, screen: Screen) {
    let cols = columns(screen);
    let w = 64.min(area.width);
    let h = (HELP.len() as u16 + cols.len() as u16 + 3).min(area.height);
    let r = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    let line = |(k, what): &(&str, &str)| {
        Line::from(vec![
            Span::styled(
                format!(" {k:<16}"),
                Style::new().add_modifier(Modifier::BOLD),
            ),
            Span::raw(what.to_string()),
        ])
    };
    let mut lines: Vec<Line> = HELP.iter().map(line).collect();
    lines.push(Line::from(Span::styled(
        format!(" {} screen:", screen.title()),
        Style::new().add_modifier(Modifier::UNDERLINED),
    )));
    lines.extend(cols.iter().map(line));
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title("Keys")),
        r,
    );
}

#[cfg(test)]
mod tests;
