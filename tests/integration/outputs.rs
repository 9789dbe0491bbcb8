//! Output files, written as root: never through a planted symbolic link, mode 0600, an
//! existing file replaced only with --force, and every bad path refused before anything is
//! launched or attached, in one line naming it, with exit code 2.
use std::{
    os::unix::fs::{PermissionsExt as _, symlink},
    path::{Path, PathBuf},
    process::Output,
};

use crate::support::*;

/// A fresh directory for one test's files.
fn out_dir(tag: &str) -> PathBuf {
    let d = workspace()
        .join("target/test-out")
        .join(format!("outputs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A file only root may read, which no output may touch.
fn victim(dir: &Path) -> PathBuf {
    let v = dir.join("victim");
    std::fs::write(&v, "secret").unwrap();
    std::fs::set_permissions(&v, std::fs::Permissions::from_mode(0o600)).unwrap();
    v
}

fn assert_untouched(victim: &Path) {
    assert_eq!(std::fs::read_to_string(victim).unwrap(), "secret");
    let mode = std::fs::metadata(victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

/// A regular file (not a link), readable by its owner only.
fn assert_private_file(path: &Path) {
    let m = std::fs::symlink_metadata(path).unwrap();
    assert!(
        m.file_type().is_file(),
        "{} is not a regular file",
        path.display()
    );
    assert_eq!(m.permissions().mode() & 0o777, 0o600, "{}", path.display());
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `record -o REC --json DOC --command-output CMD_OUT [extra] -- sh -c ...`, the command
/// printing a line and touching `dir/marker`.
fn record_all(dir: &Path, extra: &[&str]) -> Output {
    heaptrace()
        .arg("record")
        .arg("-o")
        .arg(dir.join("rec.bin"))
        .arg("--json")
        .arg(dir.join("doc.json"))
        .arg("--command-output")
        .arg(dir.join("cmd.out"))
        .args(["--no-tui", "-q"])
        .args(extra)
        .args(["--", "sh", "-c", "echo from-the-command; touch \"$0\""])
        .arg(dir.join("marker"))
        .output()
        .unwrap()
}

/// Every output of a traced run, and an export: what was written went where it was asked, as
/// new files, and nothing went through the links planted there.
fn assert_outputs_written(dir: &Path) {
    assert_private_file(&dir.join("rec.bin"));
    assert_private_file(&dir.join("doc.json"));
    assert_private_file(&dir.join("cmd.out"));
    read_json(&dir.join("doc.json"));
    let cmd_out = std::fs::read_to_string(dir.join("cmd.out")).unwrap();
    assert_eq!(cmd_out, "from-the-command\n");
    let o = heaptrace()
        .arg("report")
        .arg(dir.join("rec.bin"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

fn export(dir: &Path, extra: &[&str]) -> Output {
    heaptrace()
        .arg("report")
        .arg(dir.join("rec.bin"))
        .args(["--export", "folded", "-o"])
        .arg(dir.join("out.folded"))
        .args(extra)
        .output()
        .unwrap()
}

bpf_test!(
    shared,
    fn a_link_planted_at_an_output_is_replaced_never_followed() {
        let dir = out_dir("links");
        let v = victim(&dir);
        for name in ["rec.bin", "doc.json", "cmd.out"] {
            symlink(&v, dir.join(name)).unwrap();
        }
        // Without --force a link is in the way: refused, the command never started.
        let o = record_all(&dir, &[]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("symbolic link"), "{}", stderr(&o));
        assert!(!dir.join("marker").exists());
        let o = record_all(&dir, &["--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(dir.join("marker").exists());
        assert_untouched(&v);
        assert_outputs_written(&dir);
        symlink(&v, dir.join("out.folded")).unwrap();
        let o = export(&dir, &[]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let o = export(&dir, &["--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_untouched(&v);
        assert_private_file(&dir.join("out.folded"));
        assert!(
            std::fs::read_to_string(dir.join("out.folded"))
                .unwrap()
                .contains("malloc")
        );
        // Nothing left under a temporary name.
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let want = [
            "cmd.out",
            "doc.json",
            "marker",
            "out.folded",
            "rec.bin",
            "victim",
        ];
        assert_eq!(names, want);
    }
);

bpf_test!(
    shared,
    fn force_replaces_existing_outputs() {
        let dir = out_dir("force");
        for name in ["rec.bin", "doc.json", "cmd.out", "out.folded"] {
            let p = dir.join(name);
            std::fs::write(&p, "old").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let o = record_all(&dir, &["--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_outputs_written(&dir);
        let o = export(&dir, &["--force"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_private_file(&dir.join("out.folded"));
        assert_ne!(
            std::fs::read_to_string(dir.join("out.folded")).unwrap(),
            "old"
        );
    }
);

/// A failed run's one line: exit code 2, the flag and the path named, the command never
/// started (no marker, nothing attached).
fn assert_refused_before_launch(o: &Output, dir: &Path, want: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("heaptrace: error: "), "{err}");
    assert!(err.contains(want), "want {want:?} in {err}");
    assert!(!err.contains("attached"), "{err}");
    assert!(
        !dir.join("marker").exists(),
        "the command was started: {err}"
    );
}

/// heaptrace with `args`, launching a command that would leave `dir/marker`.
fn launch(dir: &Path, args: &[&str]) -> Output {
    heaptrace()
        .args(args)
        .args(["--no-tui", "-q", "--", "touch"])
        .arg(dir.join("marker"))
        .output()
        .unwrap()
}

/// No probe is attached by these: each is refused first.
#[test]
fn an_existing_output_is_refused_before_launch() {
    let dir = out_dir("exists");
    let file = dir.join("old");
    std::fs::write(&file, "old").unwrap();
    let f = file.to_str().unwrap();
    for args in [
        &["record", "-o", f][..],
        &["--json", f],
        &["--command-output", f],
        &["record", "-o", "/dev/null", "--json", f],
    ] {
        let o = launch(&dir, args);
        assert_refused_before_launch(&o, &dir, &format!("{f}: exists; --force replaces it"));
    }
    // A report's export: before the recording is even read.
    let o = heaptrace()
        .args(["report", "/nonexistent/rec.bin", "--export", "svg", "-o", f])
        .output()
        .unwrap();
    assert_refused_before_launch(&o, &dir, &format!("-o {f}: exists; --force replaces it"));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "old");
}

#[test]
fn a_bad_output_path_is_refused_before_launch() {
    let dir = out_dir("bad");
    let d = dir.to_str().unwrap();
    let o = launch(&dir, &["record", "-o", d]);
    assert_refused_before_launch(&o, &dir, &format!("-o {d}: is a directory"));
    let o = launch(&dir, &["--json", "/nonexistent/x.json"]);
    assert_refused_before_launch(
        &o,
        &dir,
        "heaptrace: error: --json /nonexistent/x.json: no such directory /nonexistent",
    );
    let o = launch(&dir, &["--command-output", "/nonexistent/out"]);
    assert_refused_before_launch(
        &o,
        &dir,
        "--command-output /nonexistent/out: no such directory",
    );
    let o = heaptrace()
        .args(["report", "/nonexistent/rec.bin", "--export", "svg", "-o", d])
        .output()
        .unwrap();
    assert_refused_before_launch(&o, &dir, &format!("-o {d}: is a directory"));
}
