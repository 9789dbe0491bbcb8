//! `heaptrace report FILE [VIEW]`: a recording replayed through the same aggregation as a live
//! trace, then one view (text or JSON), an export, or a comparison with another recording.
mod diff;
#[cfg(test)]
mod golden;
mod render;

use std::{collections::HashSet, path::Path};

use crate::{
    cli::{Format, ReportArgs},
    drain::round::Round,
    error::{Error, Result},
    profile::Profile,
    record::{FormatError, Recording, Replay},
    symbolize::Symbolizer,
    symbolize::modules::Location,
};

use crate::view::names::NameStyle;
pub use crate::view::names::Names;

/// How frames are named: the text views and the HTML page shorten by default, JSON and the
/// other exports keep names whole unless asked.
fn names(args: &ReportArgs) -> Names {
    // The HTML page is read by people, as the text views.
    let whole_by_default = matches!(args.export, Some(e) if e != crate::cli::Export::Html)
        || (args.export.is_none() && args.format == Format::Json);
    let style = if args.just_function_name {
        NameStyle::Function
    } else if args.full_names || (whole_by_default && !args.shorten_templates) {
        NameStyle::Full
    } else {
        NameStyle::Short
    };
    Names { style }
}

/// Exit code for a recording that cannot be read (bad input), as the issue asks.
pub const BAD_FILE: i32 = 2;

pub fn run(args: &ReportArgs) -> Result<i32> {
    // Before the replay, which can take a while: a bad -o, window or view is said at once.
    if let (Some(_), Some(out)) = (args.export, &args.output) {
        crate::output::check("-o", out, args.force)?;
    }
    check_window(args)?;
    if args.diff.is_some() {
        diff::check_view(args.view)?;
    }
    let (rec, profile) = match open(&args.file, args) {
        Ok(r) => r,
        Err(e) => {
            crate::say!("heaptrace: error: {}: {e}", args.file.display());
            return Ok(BAD_FILE);
        }
    };
    if (args.from.is_some() || args.to.is_some()) && profile.round_count() == 0 {
        return Err(Error::Usage(format!(
            "no round of {} ends between {} and {} (its last ends at {})",
            args.file.display(),
            args.from.map(secs).unwrap_or_else(|| "the start".into()),
            args.to.map(secs).unwrap_or_else(|| "the end".into()),
            rec.last_elapsed_ms
                .map(|ms| secs(std::time::Duration::from_millis(ms)))
                .unwrap_or_else(|| "none: it has no round".into()),
        )));
    }
    if rec.truncated {
        crate::say!(
            "heaptrace: warning: {} was cut short; read up to its last complete record",
            args.file.display()
        );
    }
    let names = names(args);
    if let Some(other) = &args.diff {
        let (_, pb) = match replayed(other, args) {
            Ok(r) => r,
            Err(e) => {
                crate::say!("heaptrace: error: {}: {e}", other.display());
                return Ok(BAD_FILE);
            }
        };
        super::out(&diff::render(
            &profile,
            &pb,
            args.view,
            &names,
            args.top,
            args.format,
        ))?;
        return Ok(0);
    }
    if let Some(kind) = args.export {
        let out = args
            .output
            .as_deref()
            .ok_or_else(|| Error::Usage("report --export needs -o FILE".into()))?;
        crate::view::export::write(kind, &rec, &profile, &names, args, out)?;
        crate::say!("heaptrace: wrote {}", out.display());
        return Ok(0);
    }
    match args.format {
        Format::Text => super::out(&render::text(args.view, &rec, &profile, &names, args)?)?,
        Format::Json => render::json(args.view, &rec, &profile, &names, args, &mut None)?
            .write_pretty(std::io::stdout().lock())?,
    }
    Ok(0)
}

/// `--from` after `--to` selects nothing: said before the file is read.
fn check_window(args: &ReportArgs) -> Result<()> {
    if let (Some(from), Some(to)) = (args.from, args.to)
        && from > to
    {
        return Err(Error::Usage(format!(
            "--from {} is after --to {}: no round can end in between",
            secs(from),
            secs(to)
        )));
    }
    Ok(())
}

/// A time since the start as the options take it: `250ms`, `4.0s`.
fn secs(d: std::time::Duration) -> String {
    if d < std::time::Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// Reads a recording, turning every way it can be wrong into one message, and replays it.
pub fn open(path: &Path, args: &ReportArgs) -> Result<(Recording, Profile), FormatError> {
    let (rec, mut p) = replayed(path, args)?;
    if args.resymbolize {
        resymbolize(&rec, &mut p);
    }
    Ok((rec, p))
}

/// The rounds in the --from/--to window, restricted to --pid, replayed as they are read: a
/// long recording is never held whole.
fn replayed(path: &Path, args: &ReportArgs) -> Result<(Recording, Profile), FormatError> {
    let from = args.from.map(|d| d.as_millis() as u64).unwrap_or(0);
    let to = args.to.map(|d| d.as_millis() as u64).unwrap_or(u64::MAX);
    let mut replay: Option<Replay> = None;
    let file = std::fs::File::open(path)?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let file = std::io::BufReader::new(crate::progress::Counted {
        inner: file,
        progress: crate::progress::Progress::new(len, &format!("reading {}", path.display()), true),
    });
    let rec = Recording::read_with(file, |rec, r| {
        if r.elapsed_ms < from || r.elapsed_ms > to {
            return;
        }
        let replay = replay.get_or_insert_with(|| Replay::new(rec));
        match args.pid {
            Some(pid) => replay.round(rec, &only_pid(r, pid), false),
            None => replay.round(rec, r, true),
        }
    })?;
    let replay = replay.unwrap_or_else(|| Replay::new(&rec));
    let mut p = replay.finish(&rec, |key| args.pid.is_none_or(|pid| pid == real(key.0)));
    // Leaks are the state at the end: shown when the window reaches the end.
    let reaches_end = args.to.is_none() || rec.last_elapsed_ms.is_some_and(|ms| ms <= to);
    if reaches_end && let Some(leaks) = &rec.leaks {
        p.set_leaks(
            leaks
                .iter()
                .filter(|(id, _)| args.pid.is_none_or(|pid| pid == real(id.0)))
                .copied()
                .collect(),
        );
    }
    if args.group_by == crate::cli::GroupBy::Command {
        p = p.by_command();
    }
    let rule = args.site_naming.rule(&rec.header.provider);
    Ok((rec, p.with_wrapper_rule(rule)))
}

/// The pid of a process key: `--pid` takes every process that had it.
fn real(key: u32) -> u32 {
    crate::profile::incarnation::Pid(key).real()
}

fn only_pid(r: &Round, pid: u32) -> Round {
    let mut out = Round {
        index: r.index,
        elapsed_ms: r.elapsed_ms,
        losses: r.losses,
        latency: r.latency,
        ..Default::default()
    };
    out.procs = r
        .procs
        .iter()
        .filter(|(p, _)| real(**p) == pid)
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    out.sizes = r
        .sizes
        .iter()
        .filter(|(k, _)| real(k.0) == pid)
        .map(|(k, v)| (*k, *v))
        .collect();
    out.sites = r
        .sites
        .iter()
        .filter(|(k, _)| real(k.0) == pid)
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    out.mem = r
        .mem
        .iter()
        .filter(|(p, _)| real(**p) == pid)
        .map(|(k, v)| (*k, *v))
        .collect();
    let its = |keys: &[u32]| keys.iter().copied().filter(|k| real(*k) == pid).collect();
    out.restarted = its(&r.restarted);
    out.ended = its(&r.ended);
    out
}

/// Symbolizes the stored (module, file offset) of every stack again, with the modules as they
/// are on this machine now (a module whose build id changed is reported and left alone).
fn resymbolize(rec: &Recording, p: &mut Profile) {
    let mut sym = Symbolizer::default();
    let mut changed: HashSet<String> = HashSet::new();
    let usable: Vec<bool> = rec
        .modules
        .iter()
        .map(|m| {
            let now = crate::record::writer::build_id(Path::new(&m.path));
            let ok = now.is_some() && now == m.build_id;
            // A module named only (`[python]`) is no file: its frames are kept as recorded.
            if !ok && !m.path.starts_with('[') {
                changed.insert(m.path.clone());
            }
            ok
        })
        .collect();
    for path in &changed {
        crate::say!(
            "heaptrace: warning: {path} is missing or its build id changed; its frames are kept as recorded"
        );
    }
    let paths: Vec<std::sync::Arc<Path>> = rec
        .modules
        .iter()
        .map(|m| Path::new(&m.path).into())
        .collect();
    // This host's files, opened as a trace opens them: without blocking, regular ones only.
    let files: Vec<Option<std::sync::Arc<crate::targets::target_file::TargetFile>>> = paths
        .iter()
        .map(|p| {
            crate::targets::target_file::TargetFile::host(p)
                .ok()
                .map(std::sync::Arc::new)
        })
        .collect();
    for (key, s) in &rec.stacks {
        // A folded stack holds frames only (its processes' addresses differed): kept.
        if !p.stacks.contains_key(key) || s.ips.is_empty() {
            continue;
        }
        if s.locations
            .iter()
            .flatten()
            .any(|(m, _)| !usable[*m as usize])
        {
            continue;
        }
        // Python frames are read from the process, not from a file: such a stack is kept.
        if s.frames.iter().any(|f| python_frame(rec, f)) {
            continue;
        }
        let locs: Vec<Option<Location>> = s
            .locations
            .iter()
            .map(|l| {
                l.map(|(m, offset)| Location {
                    path: paths[m as usize].clone(),
                    offset,
                    file: files[m as usize].clone(),
                })
            })
            .collect();
        p.stacks.insert(*key, sym.frames(&s.ips, &locs).into());
    }
}

/// A recorded Python frame: of module `[python]`, or (recordings before it was written) of no
/// module, with a file and line.
fn python_frame(rec: &Recording, f: &crate::record::format::FrameRec) -> bool {
    match f.module {
        Some(m) => rec
            .modules
            .get(m as usize)
            .is_some_and(|m| m.path == crate::unwind::python::PYTHON_MODULE),
        None => f.file.is_some() && f.line.is_some(),
    }
}

/// The function names a recording's header says were probed as another.
#[cfg(test)]
mod tests {
    use super::*;

    /// `--pid` keeps its process's restart and end (the other's go), every instance of it.
    #[test]
    fn one_pid_keeps_its_restarts_and_ends() {
        let second = 31395 | (1 << 22);
        let r = Round {
            restarted: vec![31395, 7],
            ended: vec![second, 7],
            folded: vec![7],
            ..Default::default()
        };
        let out = only_pid(&r, 31395);
        assert_eq!(out.restarted, [31395]);
        assert_eq!(out.ended, [second]);
        assert!(out.folded.is_empty());
    }

    /// `--resymbolize` names a stack's native frames again from this host's files, but a
    /// stack with Python frames (read from the process, no file to read them from) is kept
    /// as recorded, its Python frames marked as such.
    #[test]
    fn resymbolize_keeps_a_stack_with_python_frames() {
        use crate::{drain::round::NewStack, symbolize::FrameInfo};
        let exe = std::env::current_exe().unwrap();
        let dir = std::env::temp_dir().join(format!("heaptrace-resym-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.bin");
        let header = crate::record::format::Header {
            mode: crate::run_info::Mode::Stacks,
            ..Default::default()
        };
        let mut w = crate::record::Recorder::create_at(&path, &header).unwrap();
        let python = FrameInfo::named("fill")
            .at("/src/arenas.py", 12)
            .in_module(crate::unwind::python::PYTHON_MODULE, 0);
        let native = FrameInfo {
            function: "recorded_name".into(),
            file: None,
            line: None,
            module: exe.file_name().unwrap().to_string_lossy().into(),
            offset: 0x10,
            inlined: false,
        };
        let mut r = Round {
            index: 1,
            ..Default::default()
        };
        r.sites.insert((42, 7, 0), Default::default());
        let location = Location {
            path: exe.clone().into(),
            offset: 0x10,
            file: crate::targets::target_file::TargetFile::host(&exe)
                .ok()
                .map(Into::into),
        };
        let stack = NewStack {
            ips: vec![0x1000],
            locations: vec![Some(location)],
            frames: vec![native.into(), python.clone().into()].into(),
        };
        r.stacks.insert((42, 7), stack);
        w.round(&r).unwrap();
        w.finish(None, &Default::default()).unwrap();
        let rec = Recording::open(&path).unwrap();
        let mut p = rec.profile();
        resymbolize(&rec, &mut p);
        let frames = p.frames(&(42, 7, 0));
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(frames[0].function.as_ref(), "recorded_name");
        assert_eq!(*frames[1], python);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
