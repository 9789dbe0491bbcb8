//! The document's `processes[]`, one object a process, written as the list is.
use heaptrace_common::Func;
use serde_json::{Value, json};

use super::*;

/// The sites live at process `pid`'s peak, largest first (none where not kept), as many as
/// its leaks list (a fiftieth of `--json-max-stacks`), and what that leaves out.
fn peak_sites(
    profile: &Profile,
    pid: u32,
    held: Option<&crate::drain::round::PeakHeld>,
) -> (Value, Value) {
    let mut peak = crate::profile::Peak::default();
    if let Some(held) = held {
        peak.set_held(pid, held);
    }
    let cap = (stacks_cap(profile) / 50).max(1);
    let w = profile.wrappers();
    let sites = peak.sites.iter().take(cap).map(|(id, blocks, bytes)| {
        with(
            site(profile, &w, id),
            json!({ "live_blocks": blocks, "live_bytes": bytes }),
        )
    });
    let left_out = super::peak_left_out(&peak.sites, cap);
    (Value::Array(sites.collect()), left_out)
}

/// `processes[]`: each process's figures, sizes and leaks, written as they are listed.
pub(super) fn processes<'a>(profile: &'a Profile, aliases: Vec<(Func, Func)>) -> Node<'a> {
    Node::list(move || {
        let aliases = aliases.clone();
        profile.procs.iter().map(move |(pid, p)| {
            let leaks = if profile.calls {
                Value::Null.into()
            } else {
                leaks(profile, Some(*pid))
            };
            let (peak_by, peak_left_out) = peak_sites(profile, *pid, p.peak_held.as_ref());
            let fields = json!({
                "comm": p.comm,
                "cgroup": p.cgroup,
                "functions": functions(&p.totals, &aliases, profile),
                "totals": totals_summary(&p.totals),
                "live": live(profile, &p.totals),
                "rss_kb": p.mem.map(|m| m.rss_kb),
                "virt_kb": p.mem.map(|m| m.virt_kb),
                "peak_rss_kb": p.peak_rss_kb,
                "peak": p.peak.map(|k| json!({
                    "live_bytes": k.bytes,
                    "live_blocks": p.peak_held.as_ref().map(|h| h.blocks),
                    "lower_bound": crate::view::lower_bound::untracked(profile, Some(*pid)) > 0,
                    "reached_by": { "size": k.size, "stack_id": k.stack_id },
                    "by_stack": peak_by,
                    "by_stack_left_out": peak_left_out,
                })),
                "memory": memory(profile, p),
                "exited": p.exited,
                "leaks_at_exit": p.leaks_at_exit,
                "oom_killed": p.oom_killed,
            });
            let Value::Object(mut fields) = fields else {
                unreachable!("json! of an object")
            };
            pid_fields(&mut fields, *pid);
            let mut m: Vec<(String, Node<'a>)> =
                fields.into_iter().map(|(k, v)| (k, v.into())).collect();
            m.push(("sizes".into(), sizes(profile, Some(*pid))));
            m.push(("leaks".into(), leaks));
            Node::object(m)
        })
    })
}
