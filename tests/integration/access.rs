//! `-p` of a process heaptrace may not look into: said in one line, before anything is
//! attached, naming what is missing.
use std::process::Command;

use crate::support::*;

bpf_test!(
    /// With CAP_BPF and CAP_PERFMON but not CAP_SYS_PTRACE, another user's maps are readable
    /// and the files they map are not: "no malloc found" used to be all it said.
    fn another_users_process_without_cap_sys_ptrace_is_refused_by_name() {
        if Command::new("setpriv").arg("--version").output().is_err() {
            eprintln!("skipped: no setpriv");
            return;
        }
        let mut root = Command::new("sleep").arg("30").spawn().unwrap();
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args(["--inh-caps=+bpf,+perfmon", "--ambient-caps=+bpf,+perfmon"])
            .arg(env!("CARGO_BIN_EXE_heaptrace"))
            .args(["--no-tui", "-q", "-p", &root.id().to_string()])
            .output()
            .unwrap();
        let _ = root.kill();
        let _ = root.wait();
        assert!(!out.status.success());
        let line = error_line(&out);
        assert!(
            line.contains("permission denied")
                && line.contains("/map_files")
                && line.contains("uid 0")
                && line.contains("CAP_SYS_PTRACE"),
            "{line}"
        );
    }
);
