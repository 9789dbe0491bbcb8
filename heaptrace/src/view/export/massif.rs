//! Valgrind massif's text format, for `ms_print`: a snapshot per round, detailed at the peak
//! and at the end.
use super::*;

/// Massif's text format: a snapshot per round (live heap), detailed at the peak and at the end.
pub fn massif(rec: &Recording, p: &Profile, names: &Names) -> String {
    let mut s = String::new();
    s += &format!("desc: heaptrace --mode {}", rec.header.mode);
    if p.sample_bytes > 0 {
        s += &format!(
            " --sample-bytes {} (estimates from samples)",
            p.sample_bytes
        );
    }
    s += &peak_desc(p, names);
    s += "\n";
    let cmd = if rec.header.command.is_empty() {
        rec.header
            .cmdlines
            .first()
            .map(|c| c.1.clone())
            .unwrap_or_else(|| {
                let h = &rec.header;
                format!(
                    "({})",
                    crate::view::summary::all_processes(h.comm.as_deref(), h.cgroup.as_deref())
                )
            })
    } else {
        rec.header.command.join(" ")
    };
    s += &format!("cmd: {cmd}\ntime_unit: ms\n");
    let last = p.rounds.len().saturating_sub(1);
    let mut snap = 0;
    let mut emit = |s: &mut String, time: u64, heap: i64, tree: &str| {
        *s += &format!(
            "#-----------\nsnapshot={snap}\n#-----------\ntime={time}\nmem_heap_B={}\nmem_heap_extra_B=0\nmem_stacks_B=0\n{tree}",
            heap.max(0)
        );
        snap += 1;
    };
    emit(&mut s, 0, 0, "heap_tree=empty\n");
    for (i, r) in p.rounds.iter().enumerate() {
        // A row of a coarsened timeline covers several rounds: the peak's is shown as it was.
        if let Some(pk) = p.peak.as_ref().filter(|pk| r.covers(pk.round)) {
            let sites: Vec<(SiteId, u64)> = pk
                .sites
                .iter()
                .map(|(id, _, b)| (*id, (*b).max(0) as u64))
                .collect();
            let heap = pk.live_bytes.max(0) as u64;
            let tree = format!("heap_tree=peak\n{}", heap_tree(p, names, &sites, heap));
            emit(&mut s, pk.elapsed_ms, pk.live_bytes, &tree);
            continue;
        }
        let tree = if i == last {
            let sites: Vec<(SiteId, u64)> = p
                .leaks
                .iter()
                .flatten()
                .map(|(id, l)| (*id, l.bytes))
                .collect();
            format!(
                "heap_tree=detailed\n{}",
                heap_tree(p, names, &sites, r.live_bytes.max(0) as u64)
            )
        } else {
            "heap_tree=empty\n".to_string()
        };
        emit(&mut s, r.elapsed_ms, r.live_bytes, &tree);
    }
    s
}

/// The peak, for massif's description (its only free text ms_print shows): how high, how it
/// was taken, and the allocation that reached it when the kernel took it.
fn peak_desc(p: &Profile, names: &Names) -> String {
    let Some(pk) = p.peak.as_ref().filter(|pk| pk.live_bytes > 0) else {
        return String::new();
    };
    let b = crate::view::units::bytes;
    match pk.reached_by {
        Some((pid, stack_id, size)) => {
            let label = crate::view::site_tables::labels(p, &[(pid, stack_id, u32::MAX)], names);
            format!(
                "; peak {} (exact), reached by {} from {}",
                b(pk.live_bytes),
                b(size as i64),
                label.first().map_or("?", |l| l.trim_start_matches("? <- "))
            )
        }
        None => format!("; peak {} (at a round's end)", b(pk.live_bytes)),
    }
}

#[derive(Default)]
struct MNode {
    bytes: u64,
    children: std::collections::BTreeMap<String, MNode>,
}

/// Massif's heap tree: the allocation functions at the root, then each site's frames from the
/// innermost caller outwards.
fn heap_tree(p: &Profile, names: &Names, sites: &[(SiteId, u64)], total: u64) -> String {
    let mut root = MNode::default();
    for (id, b) in sites {
        let mut node = &mut root;
        for f in p.frames(id) {
            let label = format!("0x{:X}: {}", f.offset, names.label(&f));
            node = node.children.entry(label).or_default();
            node.bytes += b;
        }
    }
    let tracked: u64 = sites.iter().map(|(_, b)| b).sum();
    let mut s = format!(
        "n{}: {} (heap allocation functions) malloc/new/new[], --alloc-fns, etc.\n",
        root.children.len(),
        total.max(tracked)
    );
    fn walk(s: &mut String, n: &MNode, depth: usize) {
        let mut kids: Vec<_> = n.children.iter().collect();
        kids.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(a.0.cmp(b.0)));
        for (label, k) in kids {
            *s += &format!(
                "{}n{}: {} {label}\n",
                " ".repeat(depth),
                k.children.len(),
                k.bytes
            );
            walk(s, k, depth + 1);
        }
    }
    walk(&mut s, &root, 1);
    s
}
