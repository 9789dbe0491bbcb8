//! `--allocator-symbols`: an allocator whose functions have other names than the malloc
//! family's (a prefixed jemalloc, a program's own allocator, Rust's global allocator shims).
//! Each custom function is counted as the family function it stands for.
use heaptrace_common::Func;

/// How a custom function takes its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abi {
    /// The C family's own signatures.
    C,
    /// Rust's `__rust_alloc(size, align)`, `__rust_dealloc(ptr, size, align)`,
    /// `__rust_realloc(ptr, old_size, align, new_size)`, `__rust_alloc_zeroed(size, align)`.
    Rust,
}

/// A parsed `--allocator-symbols SPEC`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Custom {
    /// The spec as given, for messages.
    pub spec: String,
    pub abi: Abi,
    /// (counted as, symbol, must be found).
    pub names: Vec<(Func, String, bool)>,
}

const RUST: [(Func, &str); 4] = [
    (Func::Malloc, "__rust_alloc"),
    (Func::Free, "__rust_dealloc"),
    (Func::Realloc, "__rust_realloc"),
    (Func::Calloc, "__rust_alloc_zeroed"),
];

/// `prefix:PFX`, `rust`, or `FUNC=SYMBOL[,FUNC=SYMBOL...]`. Every spec needs malloc and free:
/// without them no block could be followed from its allocation to its release.
pub fn parse(spec: &str) -> Result<Custom, String> {
    let spec = spec.trim();
    let (abi, names) = if spec == "rust" {
        let names = RUST
            .iter()
            .map(|(f, s)| (*f, s.to_string(), matches!(f, Func::Malloc | Func::Free)))
            .collect();
        (Abi::Rust, names)
    } else if let Some(prefix) = spec.strip_prefix("prefix:") {
        if prefix.is_empty() || prefix.contains(char::is_whitespace) {
            return Err(format!("bad prefix {prefix:?}"));
        }
        let names = Func::ALL
            .iter()
            .map(|f| {
                let required = matches!(f, Func::Malloc | Func::Free);
                (*f, format!("{prefix}{}", f.name()), required)
            })
            .collect();
        (Abi::C, names)
    } else {
        let mut names: Vec<(Func, String, bool)> = Vec::new();
        for pair in spec.split(',') {
            let (func, symbol) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not FUNC=SYMBOL (or use prefix:PFX, rust)"))?;
            let func = Func::ALL
                .iter()
                .find(|f| f.name() == func.trim())
                .ok_or_else(|| {
                    let all: Vec<&str> = Func::ALL.iter().map(|f| f.name()).collect();
                    format!(
                        "unknown function {:?} (one of {})",
                        func.trim(),
                        all.join(", ")
                    )
                })?;
            let symbol = symbol.trim();
            if symbol.is_empty() {
                return Err(format!("no symbol given for {}", func.name()));
            }
            if names.iter().any(|(f, _, _)| f == func) {
                return Err(format!("{} given twice", func.name()));
            }
            names.push((*func, symbol.to_string(), true));
        }
        (Abi::C, names)
    };
    for need in [Func::Malloc, Func::Free] {
        if !names.iter().any(|(f, _, _)| *f == need) {
            return Err(format!("{} must be given", need.name()));
        }
    }
    Ok(Custom {
        spec: spec.to_string(),
        abi,
        names,
    })
}

/// Whether an ELF symbol is `want`: the plain name, or a Rust v0-mangled one whose last path
/// element is `want` (rustc mangles its allocator shims, e.g.
/// `_RNvCsfLfy6EI15iL_7___rustc12___rust_alloc`).
pub fn matches(symbol: &str, want: &str) -> bool {
    // Called for every symbol of a file, with each name looked for: no allocation unless the
    // symbol is a v0 one ending in the name (under --all each would trap into heaptrace's own
    // probes, and a large binary's symbols would stall the daemon).
    symbol == want
        || (symbol.starts_with("_R")
            && symbol.strip_suffix(want).is_some_and(|head| {
                // v0 puts an `_` between an identifier's length and an identifier that starts
                // with `_` or a digit.
                head.strip_suffix('_')
                    .filter(|_| want.starts_with(|c: char| c == '_' || c.is_ascii_digit()))
                    .unwrap_or(head)
                    .ends_with(&want.len().to_string())
            }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms() {
        let c = parse("prefix:je_").unwrap();
        assert_eq!(c.abi, Abi::C);
        assert!(c.names.contains(&(Func::Malloc, "je_malloc".into(), true)));
        assert!(
            c.names
                .contains(&(Func::Pvalloc, "je_pvalloc".into(), false))
        );
        let c = parse("malloc=my_alloc, free=my_free").unwrap();
        assert_eq!(
            c.names,
            vec![
                (Func::Malloc, "my_alloc".into(), true),
                (Func::Free, "my_free".into(), true)
            ]
        );
        let c = parse("rust").unwrap();
        assert_eq!(c.abi, Abi::Rust);
        assert_eq!(c.names.len(), 4);
    }

    #[test]
    fn rejects_bad_specs_with_the_reason() {
        assert!(
            parse("mallocx=a,free=b")
                .unwrap_err()
                .contains("unknown function")
        );
        assert!(
            parse("malloc=a")
                .unwrap_err()
                .contains("free must be given")
        );
        assert!(
            parse("malloc=a,malloc=b,free=c")
                .unwrap_err()
                .contains("twice")
        );
        assert!(parse("prefix:").is_err());
        assert!(parse("jemalloc").unwrap_err().contains("FUNC=SYMBOL"));
        assert!(parse("malloc=,free=f").is_err());
    }

    #[test]
    fn matches_plain_and_v0_mangled_shims() {
        assert!(matches("__rust_alloc", "__rust_alloc"));
        assert!(matches(
            "_RNvCsfLfy6EI15iL_7___rustc12___rust_alloc",
            "__rust_alloc"
        ));
        assert!(!matches(
            "_RNvCsfLfy6EI15iL_7___rustc19___rust_alloc_zeroed",
            "__rust_alloc"
        ));
        assert!(!matches(
            "_RNvCsfLfy6EI15iL_7___rustc11___rdl_alloc",
            "__rust_alloc"
        ));
        assert!(!matches("xx_malloc2", "xx_malloc"));
    }
}
