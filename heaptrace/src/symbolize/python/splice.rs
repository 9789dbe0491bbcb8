//! Python frames put where they ran: each native frame of `_PyEval_EvalFrameDefault` runs the
//! Python frames from the innermost not yet placed down to the first of its evaluation (the
//! entry frame), so they go just inside it; the native frames above and below stay.

use crate::symbolize::Frame;

/// The interpreter loop's function: one native frame of it per C-level evaluation.
pub const EVAL_FUNCTION: &str = "_PyEval_EvalFrameDefault";

/// `native` (innermost first) with `python` ((frame, begins an evaluation), innermost
/// first) spliced in. Python frames past the last evaluation frame found (the native walk
/// was cut short) go at the end.
pub fn splice(native: Vec<Frame>, python: Vec<(Frame, bool)>) -> Vec<Frame> {
    if python.is_empty() {
        return native;
    }
    let mut out = Vec::with_capacity(native.len() + python.len());
    let mut py = python.into_iter().peekable();
    for f in native {
        if py.peek().is_some() && is_eval(&f) {
            for (p, entry) in py.by_ref() {
                out.push(p);
                if entry {
                    break;
                }
            }
        }
        out.push(f);
    }
    out.extend(py.map(|(p, _)| p));
    out
}

fn is_eval(f: &Frame) -> bool {
    // `.cold` parts of a PGO build's loop carry the name with a suffix.
    f.function
        .strip_prefix(EVAL_FUNCTION)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbolize::FrameInfo;

    fn names(v: &[Frame]) -> Vec<&str> {
        v.iter().map(|f| &*f.function).collect()
    }

    #[test]
    fn each_evaluation_takes_its_frames() {
        let n = |s: &str| Frame::from(FrameInfo::named(s));
        let native = vec![
            n("malloc"),
            n("list_resize"),
            n(EVAL_FUNCTION),
            n("_PyObject_Call"),
            n("builtin_call"),
            n("_PyEval_EvalFrameDefault.cold"),
            n("main"),
        ];
        let python = vec![
            (n("inner"), false),
            (n("outer"), true),
            (n("<module>"), true),
        ];
        let out = splice(native, python);
        assert_eq!(
            names(&out),
            [
                "malloc",
                "list_resize",
                "inner",
                "outer",
                EVAL_FUNCTION,
                "_PyObject_Call",
                "builtin_call",
                "<module>",
                "_PyEval_EvalFrameDefault.cold",
                "main"
            ]
        );
        // A walk cut before the last evaluation: the rest at the end.
        let out = splice(
            vec![n("malloc"), n(EVAL_FUNCTION)],
            vec![(n("a"), true), (n("b"), true)],
        );
        assert_eq!(names(&out), ["malloc", "a", EVAL_FUNCTION, "b"]);
        assert_eq!(names(&splice(vec![n("f")], vec![])), ["f"]);
    }
}
