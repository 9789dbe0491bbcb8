//! A launched Python held as it begins to finalize (`targets::launch::FinalizeHold`):
//! `Py_FinalizeEx` frees the code objects its stacks name, so a script that ends within a
//! round of its allocations would leave them unnamed. Held there, a round names them first.
use super::*;

impl Daemon {
    /// Once an image of the launched command or of a followed fork (`pid`) is started and
    /// its interpreter found: its `Py_FinalizeEx` probed and held (again for each new image).
    pub(super) fn hold_finalize(&mut self, pid: u32) {
        let (Some(child), Some(probes)) = (&self.child, self.probes.as_mut()) else {
            return;
        };
        let python = self.modules.python.as_ref();
        if self.released.is_some() || !python.is_some_and(|p| p.walks(pid)) {
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
            Ok(()) => child.finalize.set(pid, at, sig),
            Err(e) => log::debug!("pid {pid}: Py_FinalizeEx not held: {e}"),
        }
    }

    /// `pid` exec'ed: the hold was for the image before (the new one is held again once
    /// started, where it is a Python too); or, `ended`, it is gone.
    pub(super) fn drop_finalize_hold(&mut self, pid: u32, ended: bool) {
        if let Some(child) = &self.child {
            child.finalize.clear(pid);
            if let Some(p) = self.probes.as_mut() {
                p.unhold_python_finalize(pid, ended);
            }
        }
    }
}
