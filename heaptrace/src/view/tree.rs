//! The call tree of allocation sites, like a massif detailed snapshot: from the allocating
//! function up through its callers (or, reversed, from main down).
use std::{collections::BTreeMap, fmt::Write as _};

use heaptrace_common::Func;
use serde_json::json;

use crate::{profile::Profile, view::json as doc, view::names::Names, view::units::bytes};

#[derive(Default, Debug)]
pub struct Node {
    pub calls: u64,
    pub bytes: u64,
    pub children: BTreeMap<String, Node>,
}

pub fn build(p: &Profile, names: &Names, reverse: bool) -> Node {
    let mut root = Node::default();
    for (id, t) in &p.sites {
        let mut path: Vec<String> =
            vec![Func::from_u32(id.2).map(|f| f.name()).unwrap_or("?").into()];
        path.extend(p.frames(id).iter().map(|f| names.label(f)));
        if reverse {
            path.reverse();
        }
        root.calls += t.calls;
        root.bytes += t.bytes;
        let mut node = &mut root;
        for label in path {
            node = node.children.entry(label).or_default();
            node.calls += t.calls;
            node.bytes += t.bytes;
        }
    }
    root
}

fn sorted(n: &Node) -> Vec<(&String, &Node)> {
    let mut v: Vec<_> = n.children.iter().collect();
    v.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(a.0.cmp(b.0)));
    v
}

pub fn render(root: &Node, top: usize) -> String {
    let mut s = format!(
        "{} in {} calls (100%)\n",
        bytes(root.bytes as i64),
        root.calls
    );
    fn walk(s: &mut String, n: &Node, total: u64, prefix: &str, top: usize) {
        let kids = sorted(n);
        let shown = kids.len().min(top);
        for (i, (label, child)) in kids.iter().take(shown).enumerate() {
            let last = i + 1 == shown && kids.len() <= top;
            let pct = if total > 0 {
                child.bytes as f64 * 100.0 / total as f64
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "{prefix}{}{:.2}% ({}, {} calls) {label}",
                if last { "└─ " } else { "├─ " },
                pct,
                bytes(child.bytes as i64),
                child.calls
            );
            let next = format!("{prefix}{}", if last { "   " } else { "│  " });
            walk(s, child, total, &next, top);
        }
        if kids.len() > top {
            let rest: u64 = kids.iter().skip(top).map(|(_, c)| c.bytes).sum();
            let _ = writeln!(
                s,
                "{prefix}└─ ... {} more ({})",
                kids.len() - top,
                bytes(rest as i64)
            );
        }
    }
    walk(&mut s, root, root.bytes, "", top);
    s
}

/// The tree as JSON, each node made as the writer reaches it (a tree of 16,000 deep stacks is
/// hundreds of megabytes as one `Value`).
pub fn json(root: &Node) -> doc::Node<'_> {
    fn node<'a>(label: &'a str, n: &'a Node) -> doc::Node<'a> {
        doc::Node::object([
            ("label", doc::Node::from(json!(label))),
            ("calls", json!(n.calls).into()),
            ("bytes", json!(n.bytes).into()),
            (
                "children",
                doc::Node::list(move || sorted(n).into_iter().map(|(l, c)| node(l, c))),
            ),
        ])
    }
    node("all", root)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{drain::round::SiteTotals, symbolize::Frame};

    fn f(name: &str) -> Frame {
        crate::symbolize::FrameInfo::named(name).into()
    }

    #[test]
    fn callers_merge_into_one_tree() {
        let mut p = Profile::default();
        p.stacks.insert((1, 1), vec![f("a"), f("main")].into());
        p.stacks.insert((1, 2), vec![f("b"), f("main")].into());
        let site = |calls, bytes| SiteTotals {
            calls,
            bytes,
            ..Default::default()
        };
        p.sites.insert((1, 1, 0), site(1, 100));
        p.sites.insert((1, 2, 0), site(3, 300));
        let up = build(&p, &Names::default(), false);
        assert_eq!(up.children["malloc"].bytes, 400);
        assert_eq!(
            up.children["malloc"].children["b"].children["main"].calls,
            3
        );
        let down = build(&p, &Names::default(), true);
        assert_eq!(down.children["main"].bytes, 400);
        assert_eq!(
            down.children["main"].children["a"].children["malloc"].bytes,
            100
        );
        let text = render(&down, 10);
        assert!(
            text.find("(300 B, 3 calls) b").unwrap() < text.find("(100 B, 1 calls) a").unwrap(),
            "{text}"
        );
        let leaf = |label: &str, calls, bytes| json!({ "label": label, "calls": calls, "bytes": bytes, "children": [] });
        let node = |label: &str, calls, bytes, children| json!({ "label": label, "calls": calls, "bytes": bytes, "children": children });
        let main_b = node("b", 3, 300, json!([leaf("malloc", 3, 300)]));
        let main_a = node("a", 1, 100, json!([leaf("malloc", 1, 100)]));
        assert_eq!(
            json(&down).to_value(),
            node(
                "all",
                4,
                400,
                json!([node("main", 4, 400, json!([main_b, main_a]))])
            )
        );
    }
}
