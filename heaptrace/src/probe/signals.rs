//! The program that keeps a thread's call in flight apart from its signal handlers' calls
//! (heaptrace-ebpf's signals.rs), run at each delivery of a signal.
use aya::{Ebpf, programs::RawTracePoint};

/// Attached before any uprobe. Without it a handler's calls made while an allocator call is in
/// flight are taken as nested in that call, not counted: a warning says so.
pub fn attach(ebpf: &mut Ebpf) {
    let (prog, tp) = ("on_signal_deliver", "signal_deliver");
    let attached = crate::probe::program(ebpf, prog)
        .map_err(|e| e.to_string())
        .and_then(|p: &mut RawTracePoint| {
            p.load().map_err(|e| format!("{prog}: {e}"))?;
            p.attach(tp).map_err(|e| format!("{prog} on {tp}: {e}"))
        });
    if let Err(e) = attached {
        crate::say!(
            "heaptrace: warning: a signal handler's allocations made while an allocator call \
             is in flight will not be counted ({e})"
        );
    }
}
