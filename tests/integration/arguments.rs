//! What heaptrace passes on to a launched command: its arguments' bytes, as given.
use std::{ffi::OsString, os::unix::ffi::OsStringExt as _};

use crate::support::*;

bpf_test!(
    shared,
    /// An argument that is not UTF-8 (`$'\xff'` in a shell) made any command untraceable:
    /// it reaches the command byte for byte.
    fn a_non_utf8_argument_reaches_the_command_unchanged() {
        let out = json_path("argv-bytes").with_extension("out");
        let _ = std::fs::remove_file(&out);
        let odd = OsString::from_vec(vec![b'a', 0xff, 0xfe, b'\n', 0x80, b'z']);
        let mut cmd = heaptrace();
        cmd.args(["--no-tui", "-q", "--mode", "counts", "--"])
            .args(["/bin/sh", "-c", "printf '%s' \"$1\" > \"$2\"", "sh"])
            .arg(&odd)
            .arg(&out);
        run_ok(&mut cmd);
        assert_eq!(std::fs::read(&out).unwrap(), odd.into_vec());
    }
);
