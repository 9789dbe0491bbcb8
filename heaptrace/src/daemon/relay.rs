//! A signal to heaptrace while it traces a launched command (SIGINT, SIGTERM, SIGHUP).
//!
//! The command gets it once: from heaptrace, unless it got it by itself. A terminal's Ctrl-C
//! goes to the whole foreground process group; `timeout` sends to its child (heaptrace), then
//! to its group; `kill -- -PGID` to the group. The command's tracer sees the signals it is
//! delivered (`launch::Delivered`), so heaptrace waits up to `GROUP_WAIT` for the command's
//! own copy before it sends one. The same signal reaching heaptrace twice from one sending
//! (to it, then to its group) is one signal; a later one ends the trace at once.
use super::*;
use signals::Received;

/// How long the command's copy of a signal sent to its group may come before or after
/// heaptrace's: both are sent together, so this is only scheduling on a busy host.
const GROUP_WAIT: Duration = Duration::from_millis(200);
/// The same signal again this soon after the first is the same sending: `timeout` sends two
/// within microseconds. A person sending it again takes longer.
const SAME_SENDING_NS: u64 = 250_000_000;

/// How the command got the signal heaptrace got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// heaptrace sent it.
    Passed,
    /// It was sent to the command's process group too.
    Group,
    /// The terminal sent it to the foreground process group, the command's.
    Terminal,
}

/// The first signal heaptrace got while its launched command runs.
pub struct Relay {
    pub got: Received,
    /// How the command got it; None while heaptrace waits for its own copy.
    pub route: Option<Route>,
    /// When heaptrace sends it, unless the command got its own copy by then.
    due: tokio::time::Instant,
}

impl Relay {
    /// What the end's reason says after the command's status.
    pub fn after(&self) -> String {
        match self.route {
            Some(Route::Passed) => format!(" after {}, passed on by heaptrace", self.got.sig),
            Some(Route::Group) => format!(" after {}, sent to its process group", self.got.sig),
            Some(Route::Terminal) => format!(" after {}, from its terminal", self.got.sig),
            None => format!(" after {}", self.got.sig),
        }
    }
}

impl Daemon {
    /// A signal while tracing: the end of a trace of `-p` or `--all`. A launched command gets
    /// the first one once (`Relay`) and is waited for; a second one ends the trace at once.
    pub(super) fn on_signal(&mut self, got: Received) -> Option<End> {
        if got.sig == Sig::Hup {
            signals::leave_hung_up_terminal();
        }
        if let Some(first) = &self.relay {
            let same = first.got.sig == got.sig
                && got.at_ns.saturating_sub(first.got.at_ns) < SAME_SENDING_NS;
            return (!same).then_some(End::Signal(got.sig));
        }
        let Some(child) = self.child.as_ref().filter(|_| !self.root_ended) else {
            return Some(End::Signal(got.sig));
        };
        // SAFETY: getpgid and getpgrp have no preconditions.
        let same_group = unsafe { libc::getpgid(child.pid as i32) == libc::getpgrp() };
        self.relay = Some(Relay {
            got,
            route: None,
            due: tokio::time::Instant::now() + GROUP_WAIT,
        });
        if got.from_terminal && same_group {
            self.routed(Route::Terminal);
        } else if self.command_got(got) {
            self.routed(Route::Group);
        }
        None
    }

    /// The wait for the command's own copy is over: sent now if it has none.
    pub(super) fn relay_due(&mut self) {
        let (Some(relay), Some(child)) = (&self.relay, &self.child) else {
            return;
        };
        let got = relay.got;
        if self.command_got(got) {
            self.routed(Route::Group);
            return;
        }
        // SAFETY: signalling our own child, which its tracer has not reaped.
        unsafe { libc::kill(child.pid as i32, got.sig.number()) };
        self.routed(Route::Passed);
    }

    /// Whether the command was delivered `got`'s signal about when heaptrace got it.
    fn command_got(&self, got: Received) -> bool {
        let since = got.at_ns.saturating_sub(GROUP_WAIT.as_nanos() as u64);
        self.child
            .as_ref()
            .is_some_and(|c| c.delivered.since(got.sig.number(), since))
    }

    /// Says how the command got the signal, which it is now waited for after.
    fn routed(&mut self, route: Route) {
        let (Some(relay), Some(pid)) = (self.relay.as_mut(), self.pid) else {
            return;
        };
        relay.route = Some(route);
        let sig = relay.got.sig;
        let how = match route {
            Route::Passed => format!("{sig} passed on to pid {pid}"),
            Route::Group => format!("{sig} reached pid {pid} too (sent to its process group)"),
            Route::Terminal => format!("{sig} reached pid {pid} too (from its terminal)"),
        };
        let msg = format!("{how}; waiting for it to end (send it again to stop at once)");
        if tui::active() {
            self.notice = Some(msg);
        } else {
            crate::say!("heaptrace: {msg}");
        }
    }
}

/// When an undecided signal is due to be sent; never without one.
pub(super) async fn due(relay: Option<&Relay>) {
    match relay.filter(|r| r.route.is_none()) {
        Some(r) => tokio::time::sleep_until(r.due).await,
        None => std::future::pending().await,
    }
}
