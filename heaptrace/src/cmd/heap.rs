//! `heaptrace heap`: the census of glibc's heap of a running process or a core file, as text
//! on stdout and, with --json, a JSON document.
use std::path::Path;

use crate::{
    cli::HeapArgs,
    error::{Error, Result},
    heap::{census::Census, walk::FreeKind},
    output::NewFile,
    view::units::bytes,
};

pub fn run(args: &HeapArgs) -> Result<i32> {
    if let Some(path) = args.json.as_deref().filter(|p| *p != "-") {
        crate::output::check("--json", Path::new(path), args.force)?;
    }
    let census = match (&args.pid, &args.core) {
        (Some(pid), _) => {
            crate::targets::access::Privileges::own().check_pid(*pid)?;
            crate::heap::of_process(*pid, args.stop, !args.without_symbols)?
        }
        (None, Some(core)) => crate::heap::of_core(core, !args.without_symbols)?,
        (None, None) => {
            return Err(Error::Usage(
                "heaptrace heap needs -p PID or --core FILE".into(),
            ));
        }
    };
    for w in &census.warnings {
        crate::say!("heaptrace: warning: {w}");
    }
    match args.json.as_deref() {
        Some("-") => {
            serde_json::to_writer_pretty(std::io::stdout().lock(), &census)
                .map_err(|e| Error::Io(e.into()))?;
            super::out("\n")?;
        }
        Some(path) => {
            write_json(Path::new(path), args.force, &census)?;
            super::out(&text(&census, args.top))?;
        }
        None => super::out(&text(&census, args.top))?,
    }
    Ok(0)
}

fn write_json(path: &Path, force: bool, census: &Census) -> Result<()> {
    let err = |source: std::io::Error| Error::Write {
        path: path.into(),
        source,
    };
    let out = NewFile::create(path, force).map_err(err)?;
    serde_json::to_writer_pretty(out.file(), census).map_err(|e| err(e.into()))?;
    out.persist().map_err(err)?;
    Ok(())
}

fn kind_name(k: FreeKind) -> &'static str {
    match k {
        FreeKind::Tcache => "tcache",
        FreeKind::Fastbin => "fastbins",
        FreeKind::Unsorted => "unsorted bin",
        FreeKind::Small => "small bins",
        FreeKind::Large => "large bins",
        FreeKind::Unbinned => "in no bin",
    }
}

/// The census for people: totals, free memory by kind, arenas, the most common sizes.
pub fn text(c: &Census, top: usize) -> String {
    let mut s = String::new();
    totals(&mut s, c);
    arenas(&mut s, c);
    sizes(&mut s, c, top);
    s
}

fn b(n: u64) -> String {
    bytes(n as i64)
}

/// Where the census came from, then in use, free by kind, top chunks and fragmentation.
fn totals(s: &mut String, c: &Census) {
    use std::fmt::Write as _;
    let how = match &c.found_by {
        crate::heap::locate::FoundBy::Symbols(p) => format!("symbols from {}", p.display()),
        crate::heap::locate::FoundBy::CodePatterns => "code patterns (no debug symbols)".into(),
    };
    let source = match &c.source {
        crate::heap::census::Source::Pid(p) => format!("process {p}"),
        crate::heap::census::Source::Core(p) => format!("core file {}", p.display()),
    };
    let exact = if c.exact {
        "exact"
    } else {
        "read while it ran"
    };
    let _ = writeln!(
        s,
        "glibc {} heap of {source} ({exact}; malloc's state found by {how})",
        c.glibc
    );
    let _ = writeln!(
        s,
        "in use      {:>10} blocks {:>12}  ({} of them mmapped, {})",
        c.in_use.blocks,
        b(c.in_use.bytes),
        c.mmapped.blocks,
        b(c.mmapped.bytes)
    );
    let _ = writeln!(
        s,
        "free        {:>10} blocks {:>12}",
        c.free.blocks,
        b(c.free.bytes)
    );
    for (k, t) in &c.free.by_kind {
        let _ = writeln!(
            s,
            "  {:<14}{:>8} blocks {:>12}",
            kind_name(*k),
            t.blocks,
            b(t.bytes)
        );
    }
    let _ = writeln!(
        s,
        "top chunks  {:>10}        {:>12}",
        c.top.blocks,
        b(c.top.bytes)
    );
    let _ = writeln!(
        s,
        "tcache structs {:>7}        {:>12}",
        c.internal.blocks,
        b(c.internal.bytes)
    );
    let _ = writeln!(
        s,
        "fragmentation {:.1}% (free bytes in arenas / free + in use); malloc_trim could return up to {}",
        c.fragmentation * 100.0,
        b(c.trimmable_bytes)
    );
    if c.unreadable_bytes > 0 {
        let _ = writeln!(
            s,
            "unreadable  {:>12} (see the warnings)",
            b(c.unreadable_bytes)
        );
    }
}

/// A line per arena, then a line per thread cache.
fn arenas(s: &mut String, c: &Census) {
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "\n{:<20} {:>6} {:>12} {:>10} {:>12} {:>10} {:>12}",
        "arena", "heaps", "system", "in use", "bytes", "free", "top"
    );
    for a in &c.arenas {
        let name = if a.main {
            format!("{:#x} main", a.address)
        } else {
            format!("{:#x}", a.address)
        };
        let _ = writeln!(
            s,
            "{name:<20} {:>6} {:>12} {:>10} {:>12} {:>10} {:>12}",
            a.heaps.len(),
            b(a.system_mem),
            a.in_use.blocks,
            b(a.in_use.bytes),
            a.free.blocks,
            b(a.top_bytes)
        );
    }
    if !c.tcaches.is_empty() {
        let _ = writeln!(s, "\n{:<20} {:>10} {:>12}", "tcache", "blocks", "bytes");
        for t in &c.tcaches {
            let _ = writeln!(
                s,
                "{:<20} {:>10} {:>12}",
                format!("{:#x}", t.address),
                t.blocks,
                b(t.bytes)
            );
        }
    }
}

/// The in-use blocks by usable size, most bytes first, `top` of them.
fn sizes(s: &mut String, c: &Census, top: usize) {
    use std::fmt::Write as _;
    let mut sizes: Vec<_> = c.sizes.iter().collect();
    sizes.sort_by_key(|x| std::cmp::Reverse(x.size * x.count));
    let _ = writeln!(
        s,
        "\n{:>12} {:>10} {:>12}   (in-use blocks by usable size, most bytes first)",
        "size", "blocks", "bytes"
    );
    for x in sizes.iter().take(top) {
        let _ = writeln!(
            s,
            "{:>12} {:>10} {:>12}",
            x.size,
            x.count,
            b(x.size * x.count)
        );
    }
    if sizes.len() > top {
        let _ = writeln!(s, "{:>12} more sizes (--top N)", sizes.len() - top);
    }
}
