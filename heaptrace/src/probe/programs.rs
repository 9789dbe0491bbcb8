//! Programs of the loaded object: found by name and kind, loaded on first use, and the load
//! errors said in a line.
use aya::{Ebpf, programs::UProbe};

use crate::error::{Error, Result};

/// The first line of a load error and the verifier's last words, not its whole log.
fn short(e: &dyn std::fmt::Display) -> String {
    let full = format!("{e:#}");
    let lines: Vec<&str> = full.lines().collect();
    if lines.len() <= 4 {
        return lines.join(" ");
    }
    let tail: Vec<&str> = lines
        .iter()
        .rev()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.starts_with("verification time")
                && !l.starts_with("processed")
        })
        .take(2)
        .copied()
        .collect();
    format!(
        "{} ... {}",
        lines[0],
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )
}

/// aya's copy of uprobe program `name`, loaded (and verified) on first use: where uprobe_multi
/// links work, aya's copies serve only as the fallback, and are never loaded.
pub(super) fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    let prog: &mut UProbe = program(ebpf, name)?;
    if prog.fd().is_err() {
        prog.load()
            .map_err(|e| Error::Load(format!("{name}: {}", short(&e))))?;
    }
    Ok(prog)
}

/// A program of the object, as its kind (uprobe, tracepoint...).
pub fn program<'a, P>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| Error::Load(format!("program {name} missing from the object")))?
        .try_into()
        .map_err(|e| Error::Load(format!("{name}: {e}")))
}

/// Attaches the thread-exit cleanup of in-flight records (heaptrace-ebpf's threads.rs) before
/// any uprobe can make one. Without it, the daemon's purge of records of threads that are gone
/// still bounds the map, a round later: a warning, not an error.
pub(super) fn thread_exits(ebpf: &mut Ebpf) {
    let (prog, tp) = ("on_thread_exit", "sched_process_exit");
    let attached = program(ebpf, prog).map_err(|e| e.to_string()).and_then(
        |p: &mut aya::programs::RawTracePoint| {
            p.load().map_err(|e| format!("{prog}: {e}"))?;
            p.attach(tp).map_err(|e| format!("{prog} on {tp}: {e}"))
        },
    );
    if let Err(e) = attached {
        crate::say!("heaptrace: warning: no in-flight cleanup at thread exit ({e})");
    }
}
