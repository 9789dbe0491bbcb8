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

/// Where a launched command's standard streams go.
pub struct Redirect {
    /// Receives stdout and stderr.
    pub output: std::fs::File,
    /// Becomes stdin.
    pub input: std::fs::File,
}

impl Redirect {
    /// stdout and stderr to `path` (created or truncated), stdin from /dev/null.
    pub fn to(path: &Path) -> Result<Redirect> {
        let output = std::fs::File::create(path).map_err(|e| {
            Error::Io(io::Error::new(
                e.kind(),
                format!("cannot write {}: {e}", path.display()),
            ))
        })?;
        let input = std::fs::File::open("/dev/null").map_err(|source| Error::Read {
            path: "/dev/null".into(),
            source,
        })?;
        Ok(Redirect { output, input })
    }
}

/// A child stopped before exec.
pub struct Stopped {
    pub pid: u32,
    /// Read end of a close-on-exec pipe: EOF once exec succeeded, an errno if it failed.
    status_pipe: OwnedFd,
    cmd: String,
}

pub fn spawn_stopped(exe: &Path, argv: &[String], redirect: Option<&Redirect>) -> Result<Stopped> {
    use std::os::fd::AsRawFd as _;
    let fds_in_child = redirect.map(|r| (r.output.as_raw_fd(), r.input.as_raw_fd()));
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
            if let Some((out, input)) = fds_in_child {
                // dup2 leaves the copies open across exec (the originals are close-on-exec).
                libc::dup2(out, 1);
                libc::dup2(out, 2);
                libc::dup2(input, 0);
            }
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
        let child = spawn_stopped(Path::new("/bin/sh"), &argv, None).unwrap();
        let pid = child.resume().unwrap();
        assert_eq!(reap(pid), Some(7));
    }

    #[test]
    fn redirects_output_to_a_file_and_input_from_dev_null() {
        let out = std::env::temp_dir().join(format!("heaptrace-launch-{}.out", std::process::id()));
        let argv = vec![
            "sh".to_string(),
            "-c".into(),
            "echo to-out; echo to-err >&2; cat; echo done".into(),
        ];
        let r = Redirect::to(&out).unwrap();
        let child = spawn_stopped(Path::new("/bin/sh"), &argv, Some(&r)).unwrap();
        drop(r);
        let pid = child.resume().unwrap();
        assert_eq!(reap(pid), Some(0));
        let text = std::fs::read_to_string(&out).unwrap();
        let _ = std::fs::remove_file(&out);
        assert_eq!(text, "to-out\nto-err\ndone\n");
    }

    #[test]
    fn exec_failure_is_an_error_naming_the_command() {
        let argv = vec!["nope".to_string()];
        let child = spawn_stopped(Path::new("/nonexistent/nope"), &argv, None).unwrap();
        let err = child.resume().unwrap_err().to_string();
        assert!(err.contains("cannot execute nope"), "{err}");
    }
}
