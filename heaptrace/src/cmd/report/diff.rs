//! `report a.bin --diff b.bin`: per site, what changed from a to b. Stack ids differ between
//! runs, so sites are matched by their symbolized frames. The views that are per site compare:
//! `overview` and `hotspots` order by the change in bytes allocated, `leaks` by the change in
//! bytes leaked; the others (a timeline, a histogram, a tree) are refused.
use std::{collections::BTreeMap, fmt::Write as _};

use heaptrace_common::Func;
use serde_json::json;

use crate::{
    cli::{Format, View},
    error::{Error, Result},
    profile::Profile,
    view::names::Names,
    view::units::bytes,
};

/// The views `--diff` can compare.
pub const VIEWS: [View; 3] = [View::Overview, View::Hotspots, View::Leaks];

pub fn check_view(view: View) -> Result<()> {
    if VIEWS.contains(&view) {
        return Ok(());
    }
    let name = |v: View| {
        use clap::ValueEnum as _;
        v.to_possible_value()
            .map(|p| p.get_name().to_string())
            .unwrap_or_default()
    };
    Err(Error::Usage(format!(
        "--diff compares sites: it works with the views {}, not {}",
        VIEWS.map(name).join(", "),
        name(view)
    )))
}

/// A change in bytes, signed, in human units: `+1.5 KiB`, `-12 B`, `0 B`.
fn delta(n: i64) -> String {
    if n > 0 {
        format!("+{}", bytes(n))
    } else {
        bytes(n)
    }
}

#[derive(Default, Clone, Copy)]
struct Figures {
    calls: i64,
    bytes: i64,
    leaked: i64,
}

fn by_label(p: &Profile, names: &Names) -> BTreeMap<String, Figures> {
    let mut out: BTreeMap<String, Figures> = BTreeMap::new();
    for (id, t) in &p.sites {
        let label = label(p, id, names);
        let e = out.entry(label).or_default();
        e.calls += t.calls as i64;
        e.bytes += t.bytes as i64;
    }
    for (id, l) in p.leaks.iter().flatten() {
        out.entry(label(p, id, names)).or_default().leaked += l.bytes as i64;
    }
    out
}

fn label(p: &Profile, id: &crate::drain::round::SiteId, names: &Names) -> String {
    let func = Func::from_u32(id.2).map(|f| f.name()).unwrap_or("?");
    let frames: Vec<String> = p.frames(id).iter().map(|f| names.function(f)).collect();
    format!("{func} <- {}", frames.join(" <- "))
}

pub fn render(
    a: &Profile,
    b: &Profile,
    view: View,
    names: &Names,
    top: usize,
    format: Format,
) -> String {
    let fa = by_label(a, names);
    let fb = by_label(b, names);
    let mut rows: Vec<(String, Figures, Figures)> = fa
        .keys()
        .chain(fb.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|k| {
            (
                k.clone(),
                fa.get(k).copied().unwrap_or_default(),
                fb.get(k).copied().unwrap_or_default(),
            )
        })
        .filter(|(_, x, y)| x.bytes != y.bytes || x.calls != y.calls || x.leaked != y.leaked)
        .collect();
    let by_leaks = view == View::Leaks;
    if by_leaks {
        rows.retain(|(_, x, y)| x.leaked != y.leaked);
    }
    rows.sort_by_key(|(k, x, y)| {
        let change = if by_leaks {
            y.leaked - x.leaked
        } else {
            y.bytes - x.bytes
        };
        (std::cmp::Reverse(change.abs()), k.clone())
    });
    rows.truncate(top);
    let (ta, tb) = (a.totals(), b.totals());
    match format {
        Format::Json => {
            let v: Vec<_> = rows
                .iter()
                .map(|(k, x, y)| {
                    json!({ "site": k, "calls": [x.calls, y.calls], "bytes": [x.bytes, y.bytes],
                            "leaked_bytes": [x.leaked, y.leaked] })
                })
                .collect();
            let doc = json!({
                "allocations": [ta.allocations(), tb.allocations()],
                "bytes_allocated": [ta.bytes_allocated(), tb.bytes_allocated()],
                "sites": v,
            });
            serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
        }
        Format::Text => {
            let mut s = format!(
                "allocations {} -> {} ({:+}), allocated {} -> {}\n",
                ta.allocations(),
                tb.allocations(),
                tb.allocations() as i64 - ta.allocations() as i64,
                bytes(ta.bytes_allocated() as i64),
                bytes(tb.bytes_allocated() as i64)
            );
            let _ = writeln!(s, "{:>12} {:>12} {:>12}  site", "bytes", "calls", "leaked");
            for (k, x, y) in rows {
                let _ = writeln!(
                    s,
                    "{:>12} {:>+12} {:>12}  {k}",
                    delta(y.bytes - x.bytes),
                    y.calls - x.calls,
                    delta(y.leaked - x.leaked)
                );
            }
            s
        }
    }
}
