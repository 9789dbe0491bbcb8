//! Exports for the tools people already use: pprof (`go tool pprof`), folded stacks and SVG
//! flame graphs (inferno), and massif's text format (`ms_print`).
use std::{
    collections::BTreeMap,
    io::{BufWriter, Write},
    path::Path,
};

use prost::Message as _;

use crate::{
    cli::{Export, FlameBy, ReportArgs},
    drain::round::SiteId,
    error::{Error, Result},
    output::NewFile,
    profile::Profile,
    record::Recording,
    symbolize::Frame,
    view::names::Names,
};

pub fn write(
    kind: Export,
    rec: &Recording,
    p: &Profile,
    names: &Names,
    args: &ReportArgs,
    out: &Path,
) -> Result<()> {
    let write_err = |source| Error::Write {
        path: out.to_path_buf(),
        source,
    };
    let file = NewFile::create(out, args.force).map_err(write_err)?;
    let mut f = BufWriter::new(file.file());
    write_kind(kind, rec, p, names, args, &mut f)
        .and_then(|()| f.flush())
        .map_err(write_err)?;
    drop(f);
    file.persist().map_err(write_err)?;
    Ok(())
}

fn write_kind(
    kind: Export,
    rec: &Recording,
    p: &Profile,
    names: &Names,
    args: &ReportArgs,
    mut f: impl Write,
) -> std::io::Result<()> {
    match kind {
        Export::Html => f.write_all(crate::view::html::report(rec, p, names).as_bytes())?,
        Export::Folded => {
            for line in folded(p, names, args.by, flame_roots(p, args.merge_processes)) {
                writeln!(f, "{line}")?;
            }
        }
        Export::Svg => {
            let lines = folded(p, names, args.by, flame_roots(p, args.merge_processes));
            let mut opts = inferno::flamegraph::Options::default();
            opts.title = format!("heaptrace: {}", by_title(args.by));
            if p.sample_bytes > 0 {
                opts.title += &format!(" (estimated, sampled 1 per {} bytes)", p.sample_bytes);
            }
            opts.count_name = match args.by {
                FlameBy::Count => "calls".into(),
                _ => "bytes".into(),
            };
            inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut f)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Export::Pprof => {
            let bytes = pprof(rec, p, names).encode_to_vec();
            let mut z = flate2::write::GzEncoder::new(f, flate2::Compression::default());
            z.write_all(&bytes)?;
            z.finish()?;
        }
        Export::Massif => f.write_all(massif(rec, p, names).as_bytes())?,
    }
    Ok(())
}

fn by_title(by: FlameBy) -> &'static str {
    match by {
        FlameBy::Count => "allocations by call count",
        FlameBy::Bytes => "bytes allocated",
        FlameBy::Live => "bytes not freed at the end",
        FlameBy::Temporary => "bytes in temporary allocations",
    }
}

/// The frames of a stack grouped per return address: inlined frames, then the one they were
/// inlined into (the symbolizer emits each address's frames in that order).
fn per_address(frames: &[Frame]) -> Vec<&[Frame]> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, f) in frames.iter().enumerate() {
        if !f.inlined {
            out.push(&frames[start..=i]);
            start = i + 1;
        }
    }
    if start < frames.len() {
        out.push(&frames[start..]);
    }
    out
}

/// Whether a flame graph gives each process (or command, grouped) a root frame of its own:
/// when more than one was traced, unless told to merge them.
pub fn flame_roots(p: &Profile, merge: bool) -> bool {
    !merge && p.procs.len() > 1
}

/// The root frame of a process's stacks in a flame graph.
fn root_frame(p: &Profile, pid: u32) -> String {
    let comm = p.procs.get(&pid).map_or("", |pp| pp.comm.as_str());
    let real = crate::profile::incarnation::Pid(pid).real();
    format!("pid {real} {comm}").trim_end().replace(';', ":")
}

/// Folded stacks, outermost frame first, the allocating function last, then the value; under
/// a root frame per process when `roots`, else the processes' same stacks summed into one line.
pub fn folded(p: &Profile, names: &Names, by: FlameBy, roots: bool) -> Vec<String> {
    let value = |id: &crate::drain::round::SiteId| -> u64 {
        match by {
            FlameBy::Count => p.sites.get(id).map(|t| t.calls).unwrap_or(0),
            FlameBy::Bytes => p.sites.get(id).map(|t| t.bytes).unwrap_or(0),
            FlameBy::Live => p
                .leaks
                .as_ref()
                .and_then(|l| l.get(id))
                .map(|l| l.bytes)
                .unwrap_or(0),
            FlameBy::Temporary => p.sites.get(id).map(|t| t.temp_bytes).unwrap_or(0),
        }
    };
    let mut lines: BTreeMap<String, u64> = BTreeMap::new();
    let mut ids: Vec<crate::drain::round::SiteId> = p.sites.keys().copied().collect();
    if let Some(l) = &p.leaks {
        ids.extend(l.keys().copied().filter(|k| !p.sites.contains_key(k)));
    }
    for id in ids {
        let v = value(&id);
        if v == 0 {
            continue;
        }
        let mut frames: Vec<String> = roots.then(|| root_frame(p, id.0)).into_iter().collect();
        frames.extend(
            p.frames(&id)
                .iter()
                .rev()
                .map(|f| names.function(f).replace(';', ":")),
        );
        frames.push(
            heaptrace_common::Func::from_u32(id.2)
                .map(|f| f.name())
                .unwrap_or("?")
                .into(),
        );
        *lines.entry(frames.join(";")).or_default() += v;
    }
    lines.into_iter().map(|(s, v)| format!("{s} {v}")).collect()
}

mod massif;
pub mod pprof;
#[cfg(test)]
mod tests;

pub use massif::massif;
pub use pprof::{PProfile, pprof};
