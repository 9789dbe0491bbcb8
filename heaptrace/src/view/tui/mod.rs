//! The live view: a terminal UI over the same Profile every other view reads.
//!
//! The daemon (`daemon`) publishes a snapshot after each round into a `tokio::sync::watch`
//! channel and goes on draining; the view runs on a thread of its own and only ever clones the
//! newest snapshot's `Arc`, so it never holds anything the daemon waits for. Quitting the view
//! sends one message back, and the daemon detaches.
//!
//! - `app.rs`: the view's state (screens, sorting, filter, selection, pause, reset), pure;
//! - `event.rs`: the event loop (keys from a reader thread, snapshots from the daemon);
//! - `ui.rs`: drawing, one function per screen.
//!
//! The terminal is restored whatever happens: when the view closes, when the daemon fails
//! (dropping `Tui` closes it), and on a panic in any thread (a panic hook restores it before
//! the message is printed).
pub mod app;
pub mod event;
pub mod ui;

use std::{
    io::{self, IsTerminal as _},
    sync::{
        Arc, Once,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

pub use app::{Info, Published};
use ratatui::{
    Terminal,
    backend::CrosstermBackend,
    crossterm::{
        cursor::{Hide, Show},
        execute,
        terminal::{EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode},
    },
};
use tokio::sync::{mpsc, watch};

/// Whether the terminal is in the view's mode (raw, alternate screen).
static ACTIVE: AtomicBool = AtomicBool::new(false);
static HOOK: Once = Once::new();

/// Whether heaptrace should open the view: stdout is a terminal, and heaptrace is in its
/// foreground. A background process group (under `timeout` without `--foreground`, or `&`)
/// would be stopped by SIGTTOU at the view's first change of the terminal's mode: it prints
/// the rounds instead, and says so.
pub fn wanted() -> bool {
    if !io::stdout().is_terminal() {
        return false;
    }
    // SAFETY: tcgetpgrp and getpgrp have no preconditions.
    let (fg, own) = unsafe { (libc::tcgetpgrp(libc::STDOUT_FILENO), libc::getpgrp()) };
    if fg >= 0 && fg != own {
        crate::say!(
            "heaptrace: not in the terminal's foreground (process group {own}, the terminal's \
             is {fg}): no live view, the rounds are printed as with --no-tui"
        );
        return false;
    }
    true
}

/// Puts the terminal back as it was. Safe to call any number of times, from any thread.
pub fn restore() {
    if ACTIVE.swap(false, Ordering::SeqCst) {
        let _ = disable_raw_mode();
        let _ = execute!(io::stdout(), LeaveAlternateScreen, Show);
    }
}

pub(crate) fn active() -> bool {
    ACTIVE.load(Ordering::SeqCst)
}

fn install_panic_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
    });
}

/// The daemon's ends of the channels: publish snapshots, hear when the view quits.
pub struct Link {
    pub snapshots: watch::Sender<Arc<Published>>,
    /// Receives one message when the view quits (or None when its thread ended otherwise).
    pub quit: mpsc::UnboundedReceiver<()>,
}

impl Link {
    pub fn publish(&self, p: Published) {
        // Replaces the previous snapshot; never waits for the view.
        self.snapshots.send_replace(Arc::new(p));
    }
}

/// The running view. Dropping it closes the view and restores the terminal.
pub struct Tui {
    thread: Option<JoinHandle<io::Result<()>>>,
    /// Dropped to tell the view to close.
    stop: Option<watch::Sender<()>>,
}

impl Tui {
    /// Takes over the terminal and starts the view's thread.
    pub fn start(info: Info, first: Published) -> io::Result<(Tui, Link)> {
        install_panic_hook();
        enable_raw_mode()?;
        ACTIVE.store(true, Ordering::SeqCst);
        let terminal = execute!(io::stdout(), EnterAlternateScreen, Hide)
            .and_then(|()| Terminal::new(CrosstermBackend::new(io::stdout())));
        let terminal = match terminal {
            Ok(t) => t,
            Err(e) => {
                restore();
                return Err(e);
            }
        };
        let (snap_tx, snap_rx) = watch::channel(Arc::new(first));
        let (quit_tx, quit_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = watch::channel(());
        let app = app::App::new(info, snap_rx.borrow().clone());
        let thread = std::thread::Builder::new()
            .name("heaptrace-view".into())
            .spawn(move || {
                let r = event::run(terminal, app, snap_rx, stop_rx, quit_tx);
                restore();
                r
            });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                restore();
                return Err(e);
            }
        };
        Ok((
            Tui {
                thread: Some(thread),
                stop: Some(stop_tx),
            },
            Link {
                snapshots: snap_tx,
                quit: quit_rx,
            },
        ))
    }

    /// Closes the view if it is still open and waits until the terminal is restored.
    pub fn close(mut self) -> Result<(), String> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), String> {
        self.stop.take();
        let r = match self.thread.take().map(|t| t.join()) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(e))) => Err(format!("the live view failed: {e}")),
            Some(Err(_)) => Err("the live view panicked".to_string()),
        };
        restore();
        r
    }
}

impl Drop for Tui {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
