//! A JSON document whose long arrays are produced while it is written.
//!
//! The `--json` document of a program with many stacks lists every stack with its frames,
//! several times over (stacks, temporary, peak, leaks, per process). Built whole as one
//! `serde_json::Value` tree and then printed, such a document costs several times its own size
//! at exit. Here each element of a long list is made when the
//! writer reaches it and dropped after: the document costs what its largest element does.
use std::{collections::BTreeMap, io::Write};

use serde::{Serialize, Serializer, ser::SerializeMap};
use serde_json::Value;

type Items<'a> = Box<dyn Iterator<Item = Node<'a>> + 'a>;

pub enum Node<'a> {
    Value(Value),
    /// Keys in sorted order, as serde_json's `Map` writes them: the same bytes either way.
    Object(BTreeMap<String, Node<'a>>),
    /// An array whose elements are made as they are written (each time it is written).
    List(Box<dyn Fn() -> Items<'a> + 'a>),
}

impl<'a> Node<'a> {
    pub fn object<K: Into<String>>(entries: impl IntoIterator<Item = (K, Node<'a>)>) -> Self {
        Node::Object(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    pub fn list<I, F>(items: F) -> Self
    where
        F: Fn() -> I + 'a,
        I: Iterator + 'a,
        I::Item: Into<Node<'a>>,
    {
        Node::List(Box::new(move || Box::new(items().map(Into::into))))
    }

    /// The entry `key` of an object, where it is a plain value.
    pub fn value_mut(&mut self, key: &str) -> Option<&mut Value> {
        match self {
            Node::Object(m) => match m.get_mut(key)? {
                Node::Value(v) => Some(v),
                _ => None,
            },
            Node::Value(v) => v.get_mut(key),
            Node::List(_) => None,
        }
    }

    /// The whole tree, for tests and small documents.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Writes the document pretty-printed, with a final newline.
    pub fn write_pretty(&self, out: impl Write) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::with_capacity(1 << 16, out);
        serde_json::to_writer_pretty(&mut out, self).map_err(std::io::Error::from)?;
        out.write_all(b"\n")?;
        out.flush()
    }
}

impl From<Value> for Node<'_> {
    fn from(v: Value) -> Self {
        Node::Value(v)
    }
}

impl Serialize for Node<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Node::Value(v) => v.serialize(s),
            Node::Object(m) => {
                let mut map = s.serialize_map(Some(m.len()))?;
                for (k, v) in m {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
            Node::List(items) => s.collect_seq(items()),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn writes_the_bytes_a_value_tree_would() {
        let tree = json!({
            "b": [1, {"x": [], "y": null}],
            "a": {"list": [{"k": 1}, {"k": 2}], "empty": [], "n": 3},
            "c": [],
        });
        let items = [json!({"k": 1}), json!({"k": 2})];
        let node = Node::object([
            ("b", Node::from(json!([1, {"x": [], "y": null}]))),
            (
                "a",
                Node::object([
                    ("list", Node::list(|| items.iter().cloned())),
                    ("empty", Node::list(std::iter::empty::<Value>)),
                    ("n", json!(3).into()),
                ]),
            ),
            ("c", Node::list(std::iter::empty::<Value>)),
        ]);
        let mut out = Vec::new();
        node.write_pretty(&mut out).unwrap();
        let want = serde_json::to_string_pretty(&tree).unwrap() + "\n";
        assert_eq!(String::from_utf8(out).unwrap(), want);
        assert_eq!(node.to_value(), tree);
        // Written twice, a list makes its elements again.
        assert_eq!(node.to_value(), tree);
    }

    /// An element that counts how many of its kind exist at once.
    struct Counted<'c>(&'c std::cell::Cell<(u32, u32)>);

    impl<'c> Counted<'c> {
        fn new(c: &'c std::cell::Cell<(u32, u32)>) -> Self {
            let (now, max) = c.get();
            c.set((now + 1, max.max(now + 1)));
            Counted(c)
        }
    }

    impl Drop for Counted<'_> {
        fn drop(&mut self) {
            let (now, max) = self.0.get();
            self.0.set((now - 1, max));
        }
    }

    impl<'c> From<Counted<'c>> for Node<'c> {
        fn from(c: Counted<'c>) -> Self {
            Node::list(move || {
                let _held = &c;
                std::iter::once(json!({"n": 1}))
            })
        }
    }

    #[test]
    fn a_list_holds_one_element_at_a_time() {
        let alive = std::cell::Cell::new((0, 0));
        let node = Node::object([("l", Node::list(|| (0..1000).map(|_| Counted::new(&alive))))]);
        let mut out = Vec::new();
        node.write_pretty(&mut out).unwrap();
        assert_eq!(alive.get(), (0, 1));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["l"].as_array().map(Vec::len), Some(1000));
        assert_eq!(v["l"][999], json!([{"n": 1}]));
    }

    #[test]
    fn value_mut_reaches_plain_entries_only() {
        let mut node = Node::object([
            ("h", Node::from(json!({"v": 1}))),
            ("l", Node::list(std::iter::empty::<Value>)),
        ]);
        node.value_mut("h").unwrap()["rss"] = 5.into();
        assert!(node.value_mut("l").is_none());
        assert_eq!(node.to_value()["h"], json!({"v": 1, "rss": 5}));
    }
}
