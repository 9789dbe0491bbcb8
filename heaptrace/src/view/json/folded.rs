//! What the document folded or left out (`--keep-exited`, `--json-max-processes`,
//! `--json-max-stacks`), and how many entries its lists by stack hold.
use serde_json::{Value, json};

use crate::profile::Profile;

/// How many entries a list by stack holds (`--json-max-stacks`).
pub(super) fn stacks_cap(profile: &Profile) -> usize {
    profile.folded.document_stacks.unwrap_or(usize::MAX)
}

/// How many processes `[N ... processes]` stands for, how many stacks the lists by stack
/// left out (and their figures), and the flags that would have kept them.
pub(super) fn folded(profile: &Profile, max_processes: Option<usize>) -> Value {
    let f = &profile.folded;
    let cap = stacks_cap(profile);
    let out = |n: usize| n.saturating_sub(cap);
    // Those the `stacks` list leaves out: its sites past the cap, largest first.
    let sites = profile.top_sites(usize::MAX, |t| t.bytes as i64);
    let (calls, bytes) = sites
        .iter()
        .skip(cap)
        .fold((0, 0), |(c, b), (_, t)| (c + t.calls, b + t.bytes));
    let temporary = profile.sites.values().filter(|t| t.temp_blocks > 0).count();
    // As `leaks.by_stack` lists them: blocks of no known site are not among them.
    let leaks = profile
        .leaks
        .iter()
        .flatten()
        .filter(|(id, _)| id.1 != heaptrace_common::NO_SITE)
        .count();
    json!({
        "processes": f.processes,
        "by_keep_exited": f.processes - f.document,
        "by_json_max_processes": f.document,
        "json_max_processes": max_processes,
        "json_max_stacks": f.document_stacks,
        "stacks_left_out": {
            "stacks": out(sites.len()),
            "calls": calls,
            "bytes": bytes,
            "temporary": out(temporary),
            "leaks": out(leaks),
        },
        "keep_with": "--keep-exited N (in the trace), --json-max-processes N and \
                      --json-max-stacks N (in this document)",
    })
}
