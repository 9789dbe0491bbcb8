//! Starting a command stopped before its first instruction, so the probes are in place before
//! it runs: fork, the child stops itself, the parent attaches, then lets it exec.
//!
//! std's `Command::pre_exec` cannot do this (spawn waits for the exec), hence the raw fork.
use std::{
    ffi::CString,
    io::{self, Read as _},
    os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use crate::error::{Error, Result};

/// A child stopped before exec.
pub struct Stopped {
    pub pid: u32,
    /// Read end of a close-on-exec pipe: EOF once exec succeeded, an errno if it failed.
    status_pipe: OwnedFd,
    cmd: String,
}

pub fn spawn_stopped(exe: &Path, argv: &[String]) -> Result<Stopped> {
    let cmd = argv.first().cloned().unwrap_or_default();
    let exec_err = |reason: String| Error::Exec {
        cmd: cmd.clone(),
        reason,
    };
    let c_exe = CString::new(exe.as_os_str().as_bytes()).map_err(|e| exec_err(e.to_string()))?;
    let c_args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| exec_err(e.to_string()))?;
    let mut c_argv: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    c_argv.push(std::ptr::null());

    let mut fds = [0i32; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error().into());
    }
    // SAFETY: the child only calls async-signal-safe functions before exec or _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error().into());
    }
    if pid == 0 {
        // SAFETY: async-signal-safe calls only; arguments were prepared before fork.
        unsafe {
            libc::close(fds[0]);
            libc::raise(libc::SIGSTOP);
            libc::execv(c_exe.as_ptr(), c_argv.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(fds[1], (&errno as *const i32).cast(), 4);
            libc::_exit(127);
        }
    }
    // SAFETY: fds[1] is ours; the child holds its own copy.
    unsafe { libc::close(fds[1]) };
    // SAFETY: fds[0] is a fresh descriptor we own.
    let status_pipe = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    if r != pid || !libc::WIFSTOPPED(status) {
        return Err(exec_err("the child did not stop before exec".into()));
    }
    Ok(Stopped {
        pid: pid as u32,
        status_pipe,
        cmd,
    })
}

impl Stopped {
    /// Lets the child exec; fails if exec failed.
    pub fn resume(self) -> Result<u32> {
        // SAFETY: signalling our own stopped child.
        unsafe { libc::kill(self.pid as i32, libc::SIGCONT) };
        let mut buf = [0u8; 4];
        let mut f = std::fs::File::from(self.status_pipe);
        match f.read(&mut buf) {
            Ok(4) => {
                let errno = i32::from_ne_bytes(buf);
                reap(self.pid);
                Err(Error::Exec {
                    cmd: self.cmd,
                    reason: io::Error::from_raw_os_error(errno).to_string(),
                })
            }
            _ => Ok(self.pid),
        }
    }

    /// Kills and reaps the child (attach failed).
    pub fn abort(self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        reap(self.pid);
    }
}

fn reap(pid: u32) -> Option<i32> {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
    (r == pid as i32).then(|| exit_code(status))
}

/// The exit status of a child that has exited, without blocking; None while it runs.
pub fn try_wait(pid: u32) -> Option<i32> {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
    (r == pid as i32).then(|| exit_code(status))
}

/// Shell convention: the exit code, or 128 + the signal that killed it.
fn exit_code(status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_a_command_after_resume_and_reports_its_exit_code() {
        let argv = vec!["sh".to_string(), "-c".into(), "exit 7".into()];
        let child = spawn_stopped(Path::new("/bin/sh"), &argv).unwrap();
        let pid = child.resume().unwrap();
        assert_eq!(reap(pid), Some(7));
    }

    #[test]
    fn exec_failure_is_an_error_naming_the_command() {
        let argv = vec!["nope".to_string()];
        let child = spawn_stopped(Path::new("/nonexistent/nope"), &argv).unwrap();
        let err = child.resume().unwrap_err().to_string();
        assert!(err.contains("cannot execute nope"), "{err}");
    }
}
