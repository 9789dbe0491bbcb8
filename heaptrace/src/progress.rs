//! Progress of start-up work that can take a while (the `--all` scan of running processes,
//! reading a large recording): a bar on stderr when it is a terminal and the work has taken
//! more than a second, nothing otherwise (pipes, logs, CI). Callers use it before the live
//! view takes the screen.
use std::{
    io::IsTerminal as _,
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Shown only after this: most start-ups are quicker, and a flash of a bar is noise.
const AFTER: Duration = Duration::from_secs(1);

pub struct Progress {
    bar: Option<ProgressBar>,
    /// Where the bar goes once shown.
    target: Option<fn() -> ProgressDrawTarget>,
    after: Duration,
    started: Instant,
    shown: bool,
}

impl Progress {
    /// Work of `len` units (processes, bytes, as `bytes` says), described by `what`.
    pub fn new(len: u64, what: &str, bytes: bool) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress {
                bar: None,
                target: None,
                after: AFTER,
                started: Instant::now(),
                shown: false,
            };
        }
        Progress::drawn_on(len, what, bytes, ProgressDrawTarget::stderr, AFTER)
    }

    /// The same drawn on `target` once `after` has passed (tests draw on a fake terminal).
    fn drawn_on(
        len: u64,
        what: &str,
        bytes: bool,
        target: fn() -> ProgressDrawTarget,
        after: Duration,
    ) -> Progress {
        let template = if bytes {
            "{msg} [{bar:30}] {bytes}/{total_bytes} ({eta})"
        } else {
            "{msg} [{bar:30}] {pos}/{len} ({eta})"
        };
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(format!("heaptrace: {what}"));
        Progress {
            bar: Some(bar),
            target: Some(target),
            after,
            started: Instant::now(),
            shown: false,
        }
    }

    /// `n` more units done.
    pub fn inc(&mut self, n: u64) {
        let Some(bar) = &self.bar else { return };
        bar.inc(n);
        if !self.shown
            && self.started.elapsed() >= self.after
            && let Some(target) = self.target
        {
            bar.set_draw_target(target());
            self.shown = true;
            bar.tick();
        }
    }

    /// Whether a bar is on the terminal now.
    pub fn is_shown(&self) -> bool {
        self.shown
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// A reader that counts what was read into a progress bar.
pub struct Counted<R> {
    pub inner: R,
    pub progress: Progress,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.inc(n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, OnceLock};

    use indicatif::TermLike;

    use super::*;

    /// A terminal that keeps what is written to it.
    #[derive(Debug, Default)]
    struct Screen(Arc<Mutex<String>>);

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            100
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.0.lock().unwrap().push_str(s);
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    static SCREEN: OnceLock<Arc<Mutex<String>>> = OnceLock::new();

    fn screen() -> ProgressDrawTarget {
        let s = SCREEN.get_or_init(Default::default).clone();
        ProgressDrawTarget::term_like(Box::new(Screen(s)))
    }

    #[test]
    fn a_bar_shows_once_its_delay_passed_and_reading_is_unchanged() {
        let data = vec![7u8; 10_000];
        // Not yet: the delay has not passed.
        let mut r = Counted {
            inner: &data[..],
            progress: Progress::drawn_on(10_000, "reading t.bin", true, screen, AFTER),
        };
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut r, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(!r.progress.is_shown());
        // Past it: drawn, with what it is doing and how far it got.
        let mut p = Progress::drawn_on(10_000, "reading t.bin", true, screen, Duration::ZERO);
        p.inc(5_000);
        assert!(p.is_shown());
        let shown = SCREEN.get().unwrap().lock().unwrap().clone();
        assert!(shown.contains("heaptrace: reading t.bin"), "{shown:?}");
        assert!(shown.contains("4.88 KiB/9.77 KiB"), "{shown:?}");
    }
}
