//! How a frame's function is named on one line. C++ names run to a thousand characters (every
//! template argument spelled out, parameters, return types): text views shorten them by
//! default, JSON and the exports keep them whole, and a name cut to a width keeps its end, where
//! the function's own name is.
use crate::symbolize::Frame;

/// How much of a name to show.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NameStyle {
    /// As the symbol demangles: return type, template arguments, parameters.
    #[default]
    Full,
    /// Template arguments and parameter lists elided: `Pool<…>::make(…)`.
    Short,
    /// The qualified function name only: `Pool::make`, no file:line.
    Function,
}

/// How frames are named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub style: NameStyle,
}

impl Names {
    pub const FULL: Names = Names {
        style: NameStyle::Full,
    };
    pub const SHORT: Names = Names {
        style: NameStyle::Short,
    };

    /// The function's name in this style.
    pub fn function(&self, f: &Frame) -> String {
        match self.style {
            NameStyle::Full => f.function.to_string(),
            NameStyle::Short => short_symbol(&f.function),
            NameStyle::Function => qualified_name(&f.function),
        }
    }

    /// "function (file:line)", with the file's base name, or just the function.
    pub fn label(&self, f: &Frame) -> String {
        let name = self.function(f);
        match (&f.file, f.line, self.style) {
            (_, _, NameStyle::Function) => name,
            (Some(file), Some(line), _) => {
                let base = file.rsplit('/').next().unwrap_or(file);
                format!("{name} ({base}:{line})")
            }
            _ => name,
        }
    }
}

/// `f(int, char)` -> `f`: cuts at the first '(' outside template brackets.
pub fn strip_parameters(name: &str) -> String {
    let mut depth = 0i32;
    for (i, c) in name.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            '(' if depth == 0 && i > 0 && !name[..i].ends_with("operator") => {
                return name[..i].to_string();
            }
            _ => {}
        }
    }
    name.to_string()
}

/// `Pool<Widget<int>>::make` -> `Pool<…>::make`: template and generic arguments elided. A '<'
/// right after an identifier opens arguments; a leading `<T as Trait>` path is kept.
pub fn shorten_templates(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut depth = 0usize;
    let mut prev: Option<char> = None;
    for c in name.chars() {
        match c {
            '<' if depth > 0 => depth += 1,
            '<' if prev.is_some_and(|p| p.is_alphanumeric() || p == '_') => {
                depth = 1;
                out.push_str("<…");
            }
            '>' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    out.push('>');
                }
            }
            _ if depth > 0 => {}
            _ => out.push(c),
        }
        prev = Some(c);
    }
    out
}

/// Whether a name has an operator made of brackets, which the bracket counting would cut.
fn has_bracket_operator(name: &str) -> bool {
    ["operator<", "operator>", "operator()", "operator-"]
        .iter()
        .any(|o| name.contains(o))
}

/// One line for a long C++ name: template arguments and parameter lists become `<…>` and
/// `(…)`. Names with operators made of those brackets are left alone.
pub fn short_symbol(name: &str) -> String {
    if has_bracket_operator(name) {
        return name.to_string();
    }
    let mut out = String::with_capacity(name.len());
    let mut depth = 0usize;
    // Whether the brackets opened at depth 0 hold anything: `next()` stays `next()`.
    let mut empty = true;
    for c in name.chars() {
        match c {
            '<' | '(' => {
                if depth == 0 {
                    out.push(c);
                    empty = true;
                } else {
                    empty = false;
                }
                depth += 1;
            }
            '>' | ')' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    if !empty {
                        out.push('…');
                    }
                    out.push(c);
                }
            }
            _ if depth == 0 => out.push(c),
            _ => empty = false,
        }
    }
    out
}

/// The qualified function name alone: the return type, template arguments and parameters
/// go. `std::string& std::string::_M_append<char>(char const*, unsigned long)` ->
/// `std::string::_M_append`; `operator new(unsigned long)` -> `operator new`.
pub fn qualified_name(name: &str) -> String {
    if has_bracket_operator(name) {
        return operator_name(name);
    }
    let bare = strip_parameters(name);
    // Template arguments out (a '<' right after an identifier), a leading `<T as Trait>` kept;
    // words split at spaces outside both.
    let mut words = vec![String::new()];
    let (mut args, mut kept) = (0usize, 0usize);
    let mut prev: Option<char> = None;
    for c in bare.chars() {
        match c {
            '<' if args > 0 => args += 1,
            '<' if prev.is_some_and(|p| p.is_alphanumeric() || p == '_') => args = 1,
            '>' if args > 0 => args -= 1,
            _ if args > 0 => {}
            '<' => {
                kept += 1;
                words.last_mut().expect("a word").push(c);
            }
            '>' if kept > 0 => {
                kept -= 1;
                words.last_mut().expect("a word").push(c);
            }
            ' ' if kept == 0 => words.push(String::new()),
            _ => words.last_mut().expect("a word").push(c),
        }
        prev = Some(c);
    }
    words.retain(|w| !w.is_empty());
    // The last word, with `operator` before it (`operator new`, `Foo::operator bool`).
    let n = words.len();
    let out = match n {
        0 => return bare,
        1 => words[0].clone(),
        _ if words[n - 2].ends_with("operator") => format!("{} {}", words[n - 2], words[n - 1]),
        _ => words[n - 1].clone(),
    };
    let out = out.trim_start_matches(['*', '&']).to_string();
    if out.is_empty() { bare } else { out }
}

/// `A::operator<<(std::ostream&, int)` -> `A::operator<<`: the operator's own brackets kept.
fn operator_name(name: &str) -> String {
    let Some(at) = name.find("operator") else {
        return name.to_string();
    };
    let after = &name[at + "operator".len()..];
    let symbol = if after.starts_with("()") {
        2
    } else {
        after
            .find(|c: char| !"<>=-+*/!&|^%~[],".contains(c))
            .unwrap_or(after.len())
    };
    let end = at + "operator".len() + symbol;
    let cut = name[end..].find('(').map_or(name.len(), |p| end + p);
    name[..cut].to_string()
}

/// `text` in at most `width` characters, cut at its start (`…basic_string<…>::_M_construct`):
/// a function's own name, and its file:line, are at the end.
pub fn fit_end(text: &str, width: usize) -> String {
    let n = text.chars().count();
    if n <= width {
        return text.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let keep: String = text.chars().skip(n - (width - 1)).collect();
    format!("…{keep}")
}

/// Where a whole stack ends: a process's or a thread's start, or `main` (a frame-pointer walk
/// stops in libc's caller of it). glibc's start frames as its debug file names them
/// (`__libc_start_main_impl`) and as its dynamic symbols do (`__libc_start_main`): a stripped
/// executable's `main` and `_start` have no name.
const STACK_BOTTOMS: [&str; 10] = [
    "_start",
    "__libc_start_main",
    "__libc_start_main_impl",
    "__libc_start_call_main",
    "main",
    "clone3",
    "__clone3",
    "clone",
    "__clone",
    "start_thread",
];

/// Whether a frame of this function is where a whole stack ends (see [`STACK_BOTTOMS`]).
pub fn is_stack_bottom(function: &str) -> bool {
    STACK_BOTTOMS.contains(&qualified_name(function).as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, file: Option<&str>, line: Option<u32>) -> Frame {
        let mut f = crate::symbolize::FrameInfo::named(function);
        f.file = file.map(Into::into);
        f.line = line;
        f.into()
    }

    #[test]
    fn names_shorten_as_asked() {
        assert_eq!(
            strip_parameters("Pool<Widget>::make_raw(unsigned long)"),
            "Pool<Widget>::make_raw"
        );
        assert_eq!(strip_parameters("operator()(int)"), "operator()");
        assert_eq!(
            shorten_templates("Pool<Widget<int>>::make_raw"),
            "Pool<…>::make_raw"
        );
        assert_eq!(
            shorten_templates("<alloc::vec::Vec<u8> as Clone>::clone"),
            "<alloc::vec::Vec<…> as Clone>::clone"
        );
        let f = frame("Pool<Widget>::make(int)", Some("/src/p.cc"), Some(3));
        assert_eq!(Names::SHORT.label(&f), "Pool<…>::make(…) (p.cc:3)");
        assert_eq!(Names::FULL.label(&f), "Pool<Widget>::make(int) (p.cc:3)");
        assert_eq!(short_symbol("Parser<Json>::next()"), "Parser<…>::next()");
        let just = Names {
            style: NameStyle::Function,
        };
        assert_eq!(just.label(&f), "Pool::make");
    }

    #[test]
    fn the_qualified_name_drops_return_types_templates_and_parameters() {
        let long = "std::__cxx11::basic_string<char, std::char_traits<char>, \
                    std::allocator<char> >& std::__cxx11::basic_string<char, \
                    std::char_traits<char>, std::allocator<char> >::_M_append<char>(char \
                    const*, unsigned long)";
        assert_eq!(
            qualified_name(long),
            "std::__cxx11::basic_string::_M_append"
        );
        assert_eq!(
            qualified_name("operator new(unsigned long)"),
            "operator new"
        );
        assert_eq!(
            qualified_name(
                "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int> >, int const&)"
            ),
            "std::vector::_M_realloc_insert"
        );
        assert_eq!(qualified_name("main"), "main");
        assert_eq!(
            qualified_name("operator<<(std::ostream&, int)"),
            "operator<<"
        );
        assert_eq!(
            qualified_name("<alloc::vec::Vec<u8> as Clone>::clone"),
            "<alloc::vec::Vec as Clone>::clone"
        );
        assert_eq!(
            qualified_name("Foo<int>::operator bool() const"),
            "Foo::operator bool"
        );
    }

    #[test]
    fn a_cut_name_keeps_its_end() {
        assert_eq!(fit_end("short", 10), "short");
        assert_eq!(
            fit_end("std::__cxx11::basic_string<…>::_M_construct", 30),
            "…basic_string<…>::_M_construct"
        );
        assert_eq!(fit_end("abc", 0), "");
        assert_eq!(fit_end("abcdef", 1), "…");
    }
}
