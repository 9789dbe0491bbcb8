//! How a process that is not our child ended (`-p`): its pidfd says when, not how, and its
//! parent reaps it at once, so /proc has nothing left to read. The kernel's process events
//! connector (netlink, `CONFIG_PROC_EVENTS`) reports each exiting thread's exit code from
//! `do_exit`, before the pidfd turns readable; a socket filter keeps only the target's.
//!
//! Needs CAP_NET_ADMIN; without it (or the connector) the end is told without a status.
use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use crate::exit_status::ExitStatus;

const NETLINK_CONNECTOR: i32 = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
const NLMSG_DONE: u16 = 3;

/// Where a message's fields sit: a netlink header (16 bytes), a connector header (20), then
/// `struct proc_event`: what, cpu, timestamp (8, aligned), then the exit event's pid, tgid,
/// exit_code.
const NLMSG_HDR: usize = 16;
const CN_MSG: usize = 20;
const EVENT: usize = NLMSG_HDR + CN_MSG;
const WHAT: usize = EVENT;
const PID: usize = EVENT + 16;
const TGID: usize = PID + 4;
const EXIT_CODE: usize = TGID + 4;
const MIN_LEN: usize = EXIT_CODE + 4;

/// Subscribed to the exits of one process's threads.
pub struct ExitWatch {
    fd: OwnedFd,
    tgid: u32,
    /// The code of the latest thread of the process to exit: the last one's is the process's.
    last: Option<i32>,
}

impl ExitWatch {
    pub fn open(tgid: u32) -> io::Result<ExitWatch> {
        // SAFETY: plain socket call; the descriptor is owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                NETLINK_CONNECTOR,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        attach_filter(&fd, tgid)?;
        // SAFETY: zeroed sockaddr_nl is valid; fields set below.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        addr.nl_groups = CN_IDX_PROC;
        // SAFETY: a valid sockaddr_nl of the size given.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        listen(&fd)?;
        Ok(ExitWatch {
            fd,
            tgid,
            last: None,
        })
    }

    /// Reads what arrived (never blocks) and returns the process's status as its latest
    /// exited thread reported it. Call once its pidfd is readable: all its threads are gone.
    pub fn status(&mut self) -> Option<ExitStatus> {
        self.drain();
        self.last.and_then(ExitStatus::from_wait)
    }

    /// Keeps the socket from filling up with a thread-heavy process's exits.
    pub fn drain(&mut self) {
        let mut buf = [0u8; 512];
        loop {
            // SAFETY: reading into a buffer of the size given.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                match io::Error::last_os_error().raw_os_error() {
                    Some(libc::EINTR) | Some(libc::ENOBUFS) => continue,
                    _ => return,
                }
            }
            if let Some((tgid, code)) = parse_exit(&buf[..n as usize])
                && tgid == self.tgid
            {
                self.last = Some(code);
            }
        }
    }
}

/// (tgid, exit code) of an exit event; None for anything else or a short message.
fn parse_exit(msg: &[u8]) -> Option<(u32, i32)> {
    if msg.len() < MIN_LEN {
        return None;
    }
    let word = |at: usize| u32::from_ne_bytes(msg[at..at + 4].try_into().expect("4 bytes"));
    if word(WHAT) != PROC_EVENT_EXIT {
        return None;
    }
    let _pid = word(PID);
    Some((word(TGID), word(EXIT_CODE) as i32))
}

/// Asks the connector for process events.
fn listen(fd: &OwnedFd) -> io::Result<()> {
    let len = NLMSG_HDR + CN_MSG + 4;
    let mut msg = vec![0u8; len];
    msg[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    msg[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
    // SAFETY: getpid has no preconditions.
    msg[12..16].copy_from_slice(&(unsafe { libc::getpid() } as u32).to_ne_bytes());
    let cn = NLMSG_HDR;
    msg[cn..cn + 4].copy_from_slice(&CN_IDX_PROC.to_ne_bytes());
    msg[cn + 4..cn + 8].copy_from_slice(&CN_VAL_PROC.to_ne_bytes());
    msg[cn + 16..cn + 18].copy_from_slice(&4u16.to_ne_bytes());
    msg[cn + CN_MSG..].copy_from_slice(&PROC_CN_MCAST_LISTEN.to_ne_bytes());
    // SAFETY: sending a buffer of the size given.
    let n = unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A classic socket filter: only exit events of `tgid` reach the socket, so the daemon is not
/// woken, nor its buffer filled, by the rest of the host. cBPF's absolute loads read words
/// big-endian; the fields are the host's (little-endian) order, hence the swaps.
fn attach_filter(fd: &OwnedFd, tgid: u32) -> io::Result<()> {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    let ins = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        ins(LD_W_ABS, 0, 0, WHAT as u32),
        ins(JEQ_K, 0, 3, PROC_EVENT_EXIT.swap_bytes()),
        ins(LD_W_ABS, 0, 0, TGID as u32),
        ins(JEQ_K, 0, 1, tgid.swap_bytes()),
        ins(RET_K, 0, 0, u32::MAX),
        ins(RET_K, 0, 0, 0),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut _,
    };
    // SAFETY: the program outlives the call; the kernel copies it.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_other_messages_are_no_exit() {
        assert_eq!(parse_exit(&[0u8; 10]), None);
        let mut m = vec![0u8; MIN_LEN];
        assert_eq!(parse_exit(&m), None);
        m[WHAT..WHAT + 4].copy_from_slice(&PROC_EVENT_EXIT.to_ne_bytes());
        m[TGID..TGID + 4].copy_from_slice(&42u32.to_ne_bytes());
        m[EXIT_CODE..EXIT_CODE + 4].copy_from_slice(&(libc::SIGKILL).to_ne_bytes());
        assert_eq!(parse_exit(&m), Some((42, libc::SIGKILL)));
    }

    /// Root only (CAP_NET_ADMIN), as the probing tests: a child killed by SIGKILL is reported
    /// so through the connector, though this test reaps it at once, as a parent of a `-p`
    /// target would.
    #[test]
    #[cfg_attr(heaptrace_no_bpf, ignore = "needs root")]
    fn a_killed_process_is_reported_with_its_signal() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut w = ExitWatch::open(child.id()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            w.status(),
            Some(ExitStatus::Signal {
                signal: libc::SIGKILL,
                core_dumped: false
            })
        );
        // Held on its stdin until the watch is open.
        let mut other = std::process::Command::new("sh")
            .args(["-c", "read x; exit 5"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut w = ExitWatch::open(other.id()).unwrap();
        drop(other.stdin.take());
        other.wait().unwrap();
        // Only its own: the killed sleep's event is not this one's.
        assert_eq!(w.status(), Some(ExitStatus::Code(5)));
    }
}
