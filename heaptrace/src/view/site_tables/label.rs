//! A site in one line: the allocating function and the wrappers it was called through, then
//! the frame that names the site ([`Wrappers::site`]) and those outward. A list's lines never
//! read alike: sites whose lines would show more frames, then an address, then the stack id.
use std::{collections::HashMap, fmt::Write as _};

use heaptrace_common::Func;

use super::pid_prefix;
use crate::{
    drain::round::SiteId,
    profile::{
        Profile,
        wrappers::{SiteFrame, Wrappers},
    },
    symbolize::Frame,
    view::names::Names,
};

/// Frames a line shows from the site's outward.
const DEPTH: usize = 4;
/// The most frames a list shows to tell two of its sites apart.
const MAX_DEPTH: usize = 16;

/// How much of a site one line shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shown {
    /// Frames from the site's outward.
    depth: usize,
    /// The frame (counted from the site's) whose address is shown: sites whose frames read
    /// the same, that differ there in address only (no file:line to tell them apart).
    address: Option<usize>,
    /// The stack id is shown: sites whose frames are the same.
    id: bool,
}

impl Shown {
    const DEFAULT: Shown = Shown {
        depth: DEPTH,
        address: None,
        id: false,
    };
}

/// A site in one line, `depth` frames from the site's, names shortened.
pub fn site_label(profile: &Profile, site: &SiteId, depth: usize) -> String {
    site_label_with(profile, &profile.wrappers(), site, depth, &Names::SHORT)
}

pub fn site_label_with(
    profile: &Profile,
    wrappers: &Wrappers,
    site: &SiteId,
    depth: usize,
    names: &Names,
) -> String {
    let frames = profile.frames(site);
    let shown = Shown {
        depth,
        ..Shown::DEFAULT
    };
    line(site, &frames, wrappers.site(&frames), shown, names)
}

fn line(site: &SiteId, frames: &[Frame], at: SiteFrame, shown: Shown, names: &Names) -> String {
    if site.1 == heaptrace_common::BEFORE_ATTACH {
        return "allocated before attach".into();
    }
    let wrappers: Vec<String> = at
        .wrappers(frames)
        .iter()
        .map(|f| names.function(f))
        .collect();
    let func = match site.2 {
        heaptrace_common::mem::PYMALLOC => Some("pymalloc"),
        f => Func::from_u32(f).map(|f| f.name()),
    };
    let mut out = match func {
        Some(func) if wrappers.is_empty() => func.to_string(),
        Some(func) => format!("{func} via {}", wrappers.join(", ")),
        // The function not known (the allocation that reached the peak): wrappers as frames.
        None => std::iter::once("?".to_string())
            .chain(wrappers)
            .collect::<Vec<_>>()
            .join(" <- "),
    };
    for (i, f) in at.from_site(frames).iter().take(shown.depth).enumerate() {
        let _ = write!(out, " <- {}", names.label(f));
        if shown.address == Some(i) {
            let _ = write!(out, " ({}+{:#x})", f.module, f.offset);
        }
    }
    if shown.id {
        let _ = write!(out, " (stack {})", site.1);
    }
    out
}

/// The lines of one list's sites, the process first where there are several: no two alike.
/// Sites that would read the same show frames until their names part (up to MAX_DEPTH), or,
/// where they never do, the address of the first frame that differs, or their stack ids.
pub fn labels(profile: &Profile, ids: &[SiteId], names: &Names) -> Vec<String> {
    let wrappers = profile.wrappers();
    let stacks: Vec<Vec<Frame>> = ids.iter().map(|id| profile.frames(id)).collect();
    let at: Vec<SiteFrame> = stacks.iter().map(|f| wrappers.site(f)).collect();
    let mut shown = vec![Shown::DEFAULT; ids.len()];
    let text = |shown: &[Shown]| -> Vec<String> {
        (0..ids.len())
            .map(|i| {
                let l = line(&ids[i], &stacks[i], at[i], shown[i], names);
                format!("{}{l}", pid_prefix(profile, &ids[i]))
            })
            .collect()
    };
    let mut lines = text(&shown);
    // Each round shows a group more; a group that cannot be shown more ends it.
    for _ in 0..MAX_DEPTH + 2 {
        let mut alike: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, l) in lines.iter().enumerate() {
            alike.entry(l).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = alike.into_values().filter(|g| g.len() > 1).collect();
        if groups.is_empty() {
            break;
        }
        for g in groups {
            let tails: Vec<&[Frame]> = g.iter().map(|i| at[*i].from_site(&stacks[*i])).collect();
            let more = apart(&tails, shown[g[0]], names);
            g.iter().for_each(|i| shown[*i] = more);
        }
        let next = text(&shown);
        if next == lines {
            break;
        }
        lines = next;
    }
    lines
}

/// How sites whose lines read the same (their frames from the site's: `tails`) are shown
/// apart: with frames to where their names part, else with the address of the first frame
/// that differs, else with their stack ids.
fn apart(tails: &[&[Frame]], now: Shown, names: &Names) -> Shown {
    let longest = tails.iter().map(|t| t.len()).max().unwrap_or(0);
    let differ = |same: &dyn Fn(&Frame, &Frame) -> bool| {
        (0..longest.min(MAX_DEPTH)).find(|d| {
            tails.iter().any(|t| match (t.get(*d), tails[0].get(*d)) {
                (Some(a), Some(b)) => !same(a, b),
                (None, None) => false,
                _ => true,
            })
        })
    };
    if let Some(d) = differ(&|a, b| names.label(a) == names.label(b)) {
        Shown {
            depth: now.depth.max(d + 1),
            ..now
        }
    } else if let Some(d) = differ(&|a, b| a == b) {
        Shown {
            depth: now.depth.max(d + 1),
            address: Some(d),
            ..now
        }
    } else {
        Shown { id: true, ..now }
    }
}

/// The summary's line naming the wrappers its sites were named past, or None.
pub fn wrappers_note(profile: &Profile) -> Option<String> {
    let w = profile.wrappers();
    let skipped = w.passed_over(profile.stacks.values().map(|s| &s[..]));
    crate::profile::wrappers::note(&skipped, w.rule())
}
