//! How a process ended: an exit code, or the signal that killed it. A plain value, imported by
//! the stages that learn it (a launched command's tracer, the exit watch of `-p`) and those
//! that tell it (the summary, the JSON document, the recording).
use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// exit(code) or a return from main.
    Code(i32),
    /// Killed by this signal (its number), with a core dump or not.
    Signal { signal: i32, core_dumped: bool },
}

impl ExitStatus {
    /// From a wait status (`waitpid`'s, or a task's `exit_code` as the kernel reports it);
    /// None for a stop or anything else that is not an end.
    pub fn from_wait(status: i32) -> Option<ExitStatus> {
        if libc::WIFEXITED(status) {
            Some(ExitStatus::Code(libc::WEXITSTATUS(status)))
        } else if libc::WIFSIGNALED(status) {
            Some(ExitStatus::Signal {
                signal: libc::WTERMSIG(status),
                core_dumped: libc::WCOREDUMP(status),
            })
        } else {
            None
        }
    }

    /// The shell's convention: the code, or 128 + the signal.
    pub fn shell_code(&self) -> i32 {
        match *self {
            ExitStatus::Code(c) => c,
            ExitStatus::Signal { signal, .. } => 128 + signal,
        }
    }

    /// The signal's name when killed by one (`SIGSEGV`).
    pub fn signal_name(&self) -> Option<String> {
        match *self {
            ExitStatus::Code(_) => None,
            ExitStatus::Signal { signal, .. } => Some(signal_name(signal)),
        }
    }
}

/// "exited with status 3", "was killed by SIGSEGV (core dumped)".
impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitStatus::Code(c) => write!(f, "exited with status {c}"),
            ExitStatus::Signal {
                signal,
                core_dumped,
            } => {
                write!(f, "was killed by {}", signal_name(signal))?;
                if core_dumped {
                    write!(f, " (core dumped)")?;
                }
                Ok(())
            }
        }
    }
}

/// Linux x86-64's signal names; `SIG42` for the others (real-time signals).
pub fn signal_name(signal: i32) -> String {
    const NAMES: [&str; 32] = [
        "",
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match usize::try_from(signal).ok().and_then(|i| NAMES.get(i)) {
        Some(n) if !n.is_empty() => (*n).to_string(),
        _ => format!("SIG{signal}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_read_as_the_shell_does() {
        // exit(3): the code in the second byte.
        assert_eq!(ExitStatus::from_wait(3 << 8), Some(ExitStatus::Code(3)));
        assert_eq!(ExitStatus::Code(3).shell_code(), 3);
        // SIGSEGV with a core dump: the signal in the low 7 bits, 0x80 for the core.
        let segv = ExitStatus::from_wait(libc::SIGSEGV | 0x80).unwrap();
        assert_eq!(
            segv,
            ExitStatus::Signal {
                signal: libc::SIGSEGV,
                core_dumped: true
            }
        );
        assert_eq!(segv.shell_code(), 139);
        assert_eq!(segv.to_string(), "was killed by SIGSEGV (core dumped)");
        assert_eq!(
            ExitStatus::from_wait(libc::SIGTERM).unwrap().to_string(),
            "was killed by SIGTERM"
        );
        // A stop (0x7f in the low byte) is no end.
        assert_eq!(ExitStatus::from_wait((libc::SIGSTOP << 8) | 0x7f), None);
        assert_eq!(signal_name(40), "SIG40");
        assert_eq!(signal_name(-1), "SIG-1");
    }
}
