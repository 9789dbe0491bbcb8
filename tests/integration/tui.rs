//! The live view, end to end: the real binary in a tmux pane, driven with send-keys and read
//! with capture-pane, against fixtures whose calls are known.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use crate::{
    faults::{INT3, code_byte, read_byte},
    support::*,
};

/// A tmux server of our own (its own socket), killed when dropped.
pub(crate) struct Tmux {
    socket: String,
}

const SESSION: &str = "t";

impl Tmux {
    /// Starts `shell_cmd` in a detached pane of `w` x `h` cells.
    pub(crate) fn start(tag: &str, w: u16, h: u16, shell_cmd: &str) -> Tmux {
        let t = Tmux {
            socket: format!("heaptrace-{tag}-{}", std::process::id()),
        };
        let out = t
            .cmd()
            .args(["new-session", "-d", "-s", SESSION])
            .args(["-x", &w.to_string(), "-y", &h.to_string()])
            .arg(shell_cmd)
            .output()
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        t
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket, "-f", "/dev/null"]);
        c
    }

    pub(crate) fn screen(&self) -> String {
        self.capture(&[])
    }

    /// The screen with the lines scrolled off its top.
    pub(crate) fn history(&self) -> String {
        self.capture(&["-S", "-500"])
    }

    fn capture(&self, extra: &[&str]) -> String {
        let out = self
            .cmd()
            .args(["capture-pane", "-p", "-t", SESSION])
            .args(extra)
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Sends keys as tmux names them ("q", "Enter", "Escape", "Tab"), one at a time.
    pub(crate) fn keys(&self, keys: &[&str]) {
        for k in keys {
            let ok = self
                .cmd()
                .args(["send-keys", "-t", SESSION, k])
                .status()
                .expect("tmux send-keys")
                .success();
            assert!(ok, "send-keys {k}");
            // Let the view take each key on its own (an Esc followed at once by a key reads
            // as Alt+key).
            std::thread::sleep(Duration::from_millis(150));
        }
    }

    /// Waits until the screen satisfies `ok`; panics with the last screen after `secs`.
    pub(crate) fn wait_for(&self, what: &str, secs: u64, ok: impl Fn(&str) -> bool) -> String {
        self.wait_on(what, secs, ok, false)
    }

    /// The same, with the lines scrolled off the screen.
    pub(crate) fn wait_history(&self, what: &str, secs: u64, ok: impl Fn(&str) -> bool) -> String {
        self.wait_on(what, secs, ok, true)
    }

    fn wait_on(&self, what: &str, secs: u64, ok: impl Fn(&str) -> bool, history: bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let s = if history {
                self.history()
            } else {
                self.screen()
            };
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").status();
    }
}

pub(crate) fn tmux_or_skip(test: &str) -> bool {
    if Command::new("tmux").arg("-V").output().is_ok() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{test}: tmux is missing (cargo xtask setup installs it)");
    }
    eprintln!("SKIPPED {test}: tmux is missing");
    false
}

/// The line of the screen that contains `needle`.
fn line_with<'a>(screen: &'a str, needle: &str) -> &'a str {
    screen
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{screen}"))
}

/// The selected row of the table on screen (the one the cursor `> ` is on).
fn selected_row(screen: &str) -> &str {
    line_with(screen, "│> ")
}

pub(crate) fn out_dir(tag: &str) -> PathBuf {
    let d = workspace()
        .join("target/test-out")
        .join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `cd DIR; heaptrace ARGS; echo exit=$? > DIR/status; sleep` (the pane stays to be read).
pub(crate) fn shell(dir: &Path, args: &[&str]) -> String {
    shell_env(dir, "", args)
}

/// The same with `VAR=value ` settings before heaptrace; the terminal's settings once it
/// exited go to DIR/stty.
pub(crate) fn shell_env(dir: &Path, env: &str, args: &[&str]) -> String {
    let mut cmd = format!(
        "cd {} && RUST_LOG=warn {env}{}",
        quote(&dir.display().to_string()),
        quote(env!("CARGO_BIN_EXE_heaptrace"))
    );
    for a in args {
        cmd.push(' ');
        cmd.push_str(&quote(a));
    }
    cmd.push_str(&format!(
        "; e=$?; stty -a > {}; echo exit=$e > {}; sleep 600",
        quote(&dir.join("stty").display().to_string()),
        quote(&dir.join("status").display().to_string())
    ));
    cmd
}

pub(crate) fn wait_status(dir: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join("status")) {
            return s.trim().to_string();
        }
        assert!(Instant::now() < deadline, "heaptrace did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

bpf_test!(
    shared,
    /// A launched fixture with known sites: the view shows its functions with their exact counts,
    /// keys sort, open a stack, filter and write the view, and what `w` wrote agrees with `--json`.
    fn live_view_shows_the_sites_of_a_command_and_answers_keys() {
        if !tmux_or_skip("live_view_shows_the_sites_of_a_command_and_answers_keys") {
            return;
        }
        let bin = fixture("sites", "", &[]);
        let dir = out_dir("tui-sites");
        let json = dir.join("run.json");
        let t = Tmux::start(
            "sites",
            120,
            40,
            &shell(
                &dir,
                &[
                    "--interval",
                    "200ms",
                    "--json",
                    &json.display().to_string(),
                    "--",
                    &bin.display().to_string(),
                    "1000",
                ],
            ),
        );

        // The fixture exits within a second; the view stays on the final figures.
        let s = t.wait_for("the end of the trace", 60, |s| {
            s.contains("exited with status 0")
        });
        assert!(s.contains("2 Sites"), "{s}");
        let c = line_with(&s, "helper_c (sites.c:31)");
        assert!(c.contains(" 1000 ") && c.contains("325.2 KiB"), "{c}");
        let a = line_with(&s, "alloc_a (sites.c:19)");
        assert!(a.contains(" 1000 ") && a.contains("108.4 KiB"), "{a}");
        let b = line_with(&s, "alloc_b (sites.c:27)");
        assert!(b.contains(" 1000 ") && b.contains("97.7 KiB"), "{b}");
        assert!(s.contains("leak_d (sites.c:"), "{s}");
        // Sorted by bytes: helper_c's 333-byte blocks first.
        assert!(selected_row(&s).contains("helper_c"), "{s}");

        // s s: sorted by live bytes, where only the leaked calloc blocks of alloc_b remain first.
        t.keys(&["s", "s"]);
        let s = t.wait_for("sort by live", 5, |s| s.contains("sort: live"));
        assert!(selected_row(&s).contains("alloc_b"), "{s}");
        // Sorted by leaks (s s), alloc_b's 1000 blocks are the biggest leak.
        t.keys(&["s", "s"]);
        let s = t.wait_for("sort by leaks", 5, |s| s.contains("sort: leaks"));
        assert!(selected_row(&s).contains("alloc_b"), "{s}");
        assert!(selected_row(&s).contains("97.7 KiB"), "{s}");

        // Enter: the whole stack, with file:line and main at the bottom.
        t.keys(&["Enter"]);
        let s = t.wait_for("the stack", 5, |s| s.contains("Stack of calloc"));
        assert!(s.contains("alloc_b"), "{s}");
        assert!(s.contains("sites.c:27"), "{s}");
        assert!(s.contains("main"), "{s}");
        assert!(s.contains("called 1000 times"), "{s}");

        // Esc closes the stack; / filters by function name.
        t.keys(&["Escape", "/", "h", "e", "l", "p", "Enter"]);
        let s = t.wait_for("the filter", 5, |s| s.contains("filter: help"));
        assert!(s.contains("Sites: 1 "), "{s}");
        assert!(s.contains("helper_c"), "{s}");
        assert!(!s.contains("alloc_a (sites"), "{s}");

        // Functions screen: malloc's exact calls (1000 + 1000 + 3 realloc(NULL) are realloc's).
        t.keys(&["4"]);
        let s = t.wait_for("the functions screen", 5, |s| {
            s.contains("Functions (sorted")
        });
        let calloc = line_with(&s, " calloc ");
        assert!(
            calloc.contains(" 1000 ") && calloc.contains(" 100000 "),
            "{calloc}"
        );

        // w: what is on screen, as JSON, where the status line says.
        t.keys(&["w"]);
        let s = t.wait_for("the written view", 5, |s| s.contains("wrote /"));
        let path = line_with(&s, "wrote /")
            .split("wrote ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        assert!(path.starts_with(&dir.display().to_string()), "{path}");
        let view = read_json(Path::new(&path));
        assert_eq!(view["view"]["screen"], "functions");

        t.keys(&["q"]);
        assert_eq!(wait_status(&dir), "exit=0");
        // Back on the normal screen: the summary.
        let s = t.wait_history("the summary", 10, |s| s.contains("not freed at the end"));
        assert!(s.contains("exited with status 0"), "{s}");

        // The view's figures are those of --json.
        let doc = read_json(&json);
        assert_eq!(view["document"]["functions"], doc["functions"]);
        assert_eq!(view["document"]["totals"], doc["totals"]);
        assert_eq!(view["document"]["leaks"], doc["leaks"]);
        assert_eq!(
            stacks_by_function(&view["document"]),
            stacks_by_function(&doc)
        );
        let malloc = view["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["function"] == "malloc")
            .unwrap();
        assert_eq!(malloc["calls"], doc["functions"]["malloc"]["calls"]);
    }
);

bpf_test!(
    exclusive,
    /// Attached to a running process: the view refreshes round after round, pauses, and quitting
    /// it detaches every probe (the target's code is byte for byte its file again) and leaves the
    /// target running.
    fn quitting_the_live_view_detaches_every_probe() {
        if !tmux_or_skip("quitting_the_live_view_detaches_every_probe") {
            return;
        }
        let mut spin = KillOnDrop(Command::new(fixture("spin", "", &[])).spawn().unwrap());
        let pid = spin.0.id();
        std::thread::sleep(Duration::from_millis(100));
        let placed = planned_probes(Some(pid)).1["free"].entry;
        let (malloc_at, malloc_byte) = code_byte(pid, "malloc", 0);
        let (free_at, free_byte) = code_byte(pid, "free", placed);
        assert_eq!(read_byte(pid, malloc_at), malloc_byte, "probed already");

        let dir = out_dir("tui-spin");
        let t = Tmux::start(
            "spin",
            80,
            24,
            &shell(&dir, &["--interval", "200ms", "-p", &pid.to_string()]),
        );
        let round = |s: &str| -> u64 {
            line_with(s, "round ")
                .split("round ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|r| r.parse().ok())
                .unwrap_or(0)
        };
        let s = t.wait_for("two rounds", 60, |s| {
            s.contains("pid ") && s.contains("round ") && round(s) >= 2
        });
        assert!(s.contains(&format!("pid {pid} (spin)")), "{s}");
        assert_eq!(read_byte(pid, malloc_at), INT3, "no uprobe on malloc");
        assert_eq!(read_byte(pid, free_at), INT3, "no uprobe on free");

        // The functions screen counts spin's mallocs, and the count grows from round to round.
        t.keys(&["4"]);
        let s = t.wait_for("the functions screen", 5, |s| {
            s.contains("Functions (sorted")
        });
        let calls = |s: &str| -> u64 {
            line_with(s, "│> malloc")
                .split_whitespace()
                .nth(2)
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        let first = calls(&s);
        let s = t.wait_for("more mallocs", 10, |s| calls(s) > first);
        assert!(calls(&s) > 0, "{s}");

        // p freezes the view while the kernel keeps counting; p again catches up.
        t.keys(&["p"]);
        // The header's "PAUSED" can be cut at 80 columns (its CPU figure varies in width); the
        // status line says it in full.
        let s = t.wait_for("pause", 5, |s| s.contains("paused: the figures stay"));
        let frozen = round(&s);
        std::thread::sleep(Duration::from_millis(700));
        let s = t.screen();
        assert_eq!(round(&s), frozen, "the view moved while paused:\n{s}");
        t.keys(&["p"]);
        t.wait_for("resume", 5, |s| !s.contains("PAUSE") && round(s) > frozen);

        // r: figures since now; Tab cycles screens; ? shows the keys.
        t.keys(&["r"]);
        t.wait_for("reset", 5, |s| s.contains("since round"));
        t.keys(&["Tab"]);
        t.wait_for("the timeline", 5, |s| s.contains("allocations/s"));
        t.keys(&["?"]);
        t.wait_for("help", 5, |s| {
            s.contains("Keys") && s.contains("pause the view")
        });
        t.keys(&["Escape"]);
        t.wait_for("help closed", 5, |s| !s.contains("pause the view"));

        t.keys(&["q"]);
        assert_eq!(wait_status(&dir), "exit=0");
        let s = t.wait_history("the summary", 10, |s| s.contains("quit; detached"));
        assert!(s.contains("malloc"), "{s}");
        assert_eq!(
            read_byte(pid, malloc_at),
            malloc_byte,
            "malloc still probed"
        );
        assert_eq!(read_byte(pid, free_at), free_byte, "free still probed");
        assert!(spin.0.try_wait().unwrap().is_none(), "the target died");
    }
);

bpf_test!(
    shared,
    /// A panic in the view's thread: the terminal is restored (cooked mode, the normal screen),
    /// the panic is told, the probes are detached, the summary is printed and heaptrace fails.
    fn a_panic_in_the_live_view_restores_the_terminal() {
        if !tmux_or_skip("a_panic_in_the_live_view_restores_the_terminal") {
            return;
        }
        let spin = KillOnDrop(Command::new(fixture("spin", "", &[])).spawn().unwrap());
        let pid = spin.0.id();
        let dir = out_dir("tui-panic");
        let t = Tmux::start(
            "panic",
            100,
            30,
            &shell_env(
                &dir,
                "HEAPTRACE_TEST_VIEW_PANIC=1 ",
                &["--interval", "200ms", "-p", &pid.to_string()],
            ),
        );
        t.wait_for("the view", 60, |s| s.contains("1 Timeline"));
        t.keys(&["j"]);
        assert_eq!(wait_status(&dir), "exit=1");
        let s = t.wait_history("the summary", 10, |s| s.contains("quit; detached"));
        assert!(
            s.contains("HEAPTRACE_TEST_VIEW_PANIC: a key was pressed"),
            "{s}"
        );
        assert!(s.contains("error: the live view panicked"), "{s}");
        assert!(
            !s.contains("1 Timeline"),
            "the view is still on screen:\n{s}"
        );
        let stty = std::fs::read_to_string(dir.join("stty")).unwrap();
        let modes: Vec<&str> = stty.split_whitespace().collect();
        for mode in ["icanon", "echo", "isig", "opost"] {
            assert!(
                modes.contains(&mode),
                "terminal not restored ({mode}): {stty}"
            );
        }
    }
);

/// A target that does not outlive its test, whatever the test's outcome.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
