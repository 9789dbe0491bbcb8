//! A launched Python, or a seized tree's, held as it begins to finalize (`FinalizeHold`):
//! `Py_FinalizeEx` frees the code objects its stacks name, so a script that ends within a
//! round of its allocations would leave them unnamed. Held there, a round names them first.
use super::*;

impl Daemon {
    /// Once an image of the launched command or of a followed fork (`pid`) is started and
    /// its interpreter found: its `Py_FinalizeEx` probed and held (again for each new image).
    /// A seized tree's (`-p PID --follow-forks`) the same (its processes running at the start
    /// are held before the trace says it is attached: `hold_python_finalize`).
    pub(super) fn hold_finalize(&mut self, pid: u32) {
        let hold = match (&self.child, &self.tree) {
            (Some(child), _) if self.released.is_none() => child.finalize.clone(),
            (None, Some(tree)) => tree.finalize.clone(),
            _ => return,
        };
        if let Some(probes) = self.probes.as_mut() {
            hold_python_finalize(probes, self.modules.python.as_ref(), &hold, pid);
        }
    }

    /// `pid` exec'ed: the hold was for the image before (the new one is held again once
    /// started, where it is a Python too); or, `ended`, it is gone.
    pub(super) fn drop_finalize_hold(&mut self, pid: u32, ended: bool) {
        let hold = match (&self.child, &self.tree) {
            (Some(child), _) => &child.finalize,
            (None, Some(tree)) => &tree.finalize,
            _ => return,
        };
        hold.clear(pid);
        if let Some(p) = self.probes.as_mut() {
            p.unhold_python_finalize(pid, ended);
        }
    }
}

/// Process `pid`'s `Py_FinalizeEx` probed and held by `hold`'s tracer, where its interpreter
/// was found (`python`).
pub fn hold_python_finalize(
    probes: &mut crate::probe::Probes,
    python: Option<&crate::unwind::python::Interpreters>,
    hold: &launch::FinalizeHold,
    pid: u32,
) {
    if !python.is_some_and(|p| p.walks(pid)) {
        return;
    }
    let Some((file, offset, at)) = crate::symbolize::python::runtime::finalize_site(pid) else {
        log::debug!("pid {pid}: no Py_FinalizeEx: its finalization is not held");
        return;
    };
    let Some(sig) = launch::hold_signal(pid) else {
        log::debug!("pid {pid}: catches or blocks SIGURG and SIGWINCH: not held");
        return;
    };
    match probes.hold_python_finalize(&file, offset, pid, sig) {
        Ok(()) => hold.set(pid, at, sig),
        Err(e) => log::debug!("pid {pid}: Py_FinalizeEx not held: {e}"),
    }
}
