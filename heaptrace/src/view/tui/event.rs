//! The view's event loop: redraw when something changed, then wait for whichever comes first
//! of a key (read by a thread of its own, so keys are handled at once, between rounds too), a
//! new snapshot from the daemon, or the request to close.
use std::{
    io::{self, Stdout},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use ratatui::{
    Terminal,
    backend::CrosstermBackend,
    crossterm::event::{self, Event},
};
use tokio::sync::{mpsc, watch};

use super::{
    app::{Action, App, Published},
    ui,
};

/// Runs until the user quits (the daemon is told through `quit`) or `stop` closes.
pub fn run(
    mut terminal: Terminal<CrosstermBackend<Stdout>>,
    mut app: App,
    mut snapshots: watch::Receiver<Arc<Published>>,
    mut stop: watch::Receiver<()>,
    quit: mpsc::UnboundedSender<()>,
) -> io::Result<()> {
    let (key_tx, mut keys) = mpsc::unbounded_channel();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let done = done.clone();
        std::thread::Builder::new()
            .name("heaptrace-keys".into())
            .spawn(move || read_keys(&done, &key_tx))?
    };
    // For the test that a panic in the view restores the terminal (tests/integration/tui.rs).
    let panic_on_key = std::env::var_os("HEAPTRACE_TEST_VIEW_PANIC").is_some();
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let result = rt.block_on(async {
        let mut dirty = true;
        loop {
            if dirty {
                if !super::active() {
                    return Ok(()); // a panic elsewhere restored the terminal: draw no more
                }
                terminal.draw(|f| ui::draw(f, &app))?;
                dirty = false;
            }
            tokio::select! {
                ev = keys.recv() => match ev {
                    Some(Ok(Event::Key(key))) => {
                        assert!(!panic_on_key, "HEAPTRACE_TEST_VIEW_PANIC: a key was pressed");
                        match app.on_key(key) {
                            Action::Quit => {
                                let _ = quit.send(());
                                return Ok(());
                            }
                            Action::Write => {
                                app.status = match write_export(&app) {
                                    Ok(path) => format!("wrote {}", path.display()),
                                    Err(e) => format!("cannot write the view: {e}"),
                                };
                            }
                            Action::None => {}
                        }
                        dirty = true;
                    }
                    Some(Ok(Event::Resize(..))) => dirty = true,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e),
                    None => return Err(io::Error::other("the key reader stopped")),
                },
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return Ok(()); // the daemon is gone
                    }
                    let p = snapshots.borrow_and_update().clone();
                    app.update(p);
                    dirty = true;
                }
                _ = stop.changed() => return Ok(()),
            }
        }
    });
    done.store(true, Ordering::SeqCst);
    let _ = reader.join();
    result
}

/// Reads terminal events until told to stop (it looks every 100 ms) or nobody listens.
fn read_keys(done: &AtomicBool, tx: &mpsc::UnboundedSender<io::Result<Event>>) {
    while !done.load(Ordering::SeqCst) {
        match event::poll(Duration::from_millis(100)) {
            Ok(false) => {}
            Ok(true) => {
                let ev = event::read();
                let failed = ev.is_err();
                if tx.send(ev).is_err() || failed {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        }
    }
}

/// Writes `App::export` to `heaptrace-view-ROUND[-N].json` in the current directory (or in the
/// temporary directory if that one is not writable) and returns its absolute path.
fn write_export(app: &App) -> io::Result<PathBuf> {
    let doc = app.export();
    let round = app.shown().round();
    let mut last_err = None;
    for dir in [std::env::current_dir()?, std::env::temp_dir()] {
        for n in 0..1000 {
            let name = if n == 0 {
                format!("heaptrace-view-{round}.json")
            } else {
                format!("heaptrace-view-{round}-{n}.json")
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(f) => {
                    doc.write_pretty(f)?;
                    return Ok(path);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    last_err = Some(e);
                    break;
                }
            }
        }
    }
    Err(last_err.unwrap_or_else(|| io::Error::other("no free file name")))
}
