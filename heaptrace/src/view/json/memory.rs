//! The memory behind malloc in the document: per process, and the reservations by site.
use serde_json::{Map, Value, json};

use super::{Node, pid_fields, site};
use crate::profile::Profile;

/// Three different numbers side by side: what the program asked for and still holds, what its
/// allocator holds from the kernel, and what the kernel counts (RSS, VIRT).
pub(super) fn memory(profile: &Profile, p: &crate::profile::ProcProfile) -> Value {
    json!({
        "requested_live_bytes": if profile.calls { Value::Null } else { p.totals.live_bytes.into() },
        "reserved_bytes": p.reserved.map(|r| r.total()),
        "reserved": p.reserved.map(|r| json!({
            "heap": r.heap, "arenas": r.arenas, "mmapped": r.mmapped, "pymalloc": r.pymalloc,
        })),
        // Estimated from smaps at the end: the brk heap and anonymous mappings, less stacks.
        "resident": p.resident,
        "rss_bytes": p.mem.map(|m| m.rss_kb * 1024),
        "virt_bytes": p.mem.map(|m| m.virt_kb * 1024),
    })
}

pub(crate) fn memory_by_process(profile: &Profile) -> Value {
    profile
        .procs
        .iter()
        .map(|(pid, p)| {
            let mut m = Map::new();
            pid_fields(&mut m, *pid);
            m.insert("comm".into(), p.comm.clone().into());
            m.insert("memory".into(), memory(profile, p));
            Value::Object(m)
        })
        .collect()
}

/// The allocators' reservations and releases by site, most bytes first.
pub(crate) fn reservations(profile: &Profile) -> Node<'_> {
    Node::list(move || {
        let w = profile.wrappers();
        let mut v: Vec<_> = profile.reservations.iter().collect();
        v.sort_by_key(|(k, t)| (std::cmp::Reverse(t.bytes), **k));
        v.into_iter().map(move |((pid, kind, stack_id, func), t)| {
            let mut m = site(profile, &w, &(*pid, *stack_id, *func));
            if *func == heaptrace_common::mem::NO_FUNC || *func == heaptrace_common::mem::PYMALLOC {
                m.insert("function".into(), Value::Null);
            }
            if *stack_id == heaptrace_common::NO_SITE {
                m.insert("frames".into(), Value::Array(Vec::new())); // no site known
            }
            m.insert("kind".into(), kind.name().into());
            if let Some(of) = kind.of() {
                m.insert("of".into(), of.into());
            }
            m.insert("calls".into(), t.calls.into());
            m.insert("bytes".into(), t.bytes.into());
            // The shape, beside the keys every per-stack entry has.
            let stack = json!({ "id": m["stack_id"].clone(), "frames": m["frames"].clone() });
            m.insert("stack".into(), stack);
            Value::Object(m)
        })
    })
}
