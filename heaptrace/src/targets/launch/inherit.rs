//! What a launched command inherits besides its arguments (`--in-process`: the library in
//! its environment, the region's descriptor).
use std::os::unix::ffi::OsStrExt as _;

/// What a launched command gets beyond its arguments: environment entries (replacing those
/// of the same name; LD_PRELOAD put first in front of any it has) and descriptors left open
/// across its exec (`--in-process`: the region, and the library when it is a memfd).
#[derive(Default)]
pub struct Inherit {
    pub env: Vec<(String, String)>,
    pub fds: Vec<i32>,
}

impl Inherit {
    /// This process's environment with `env` put in.
    pub(super) fn environment(&self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = Vec::new();
        for (k, v) in std::env::vars_os() {
            let k = k.as_bytes();
            let ours = self.env.iter().find(|(name, _)| name.as_bytes() == k);
            match ours {
                Some((name, val)) if name == "LD_PRELOAD" && !v.is_empty() => {
                    out.push([k, b"=", val.as_bytes(), b" ", v.as_bytes()].concat())
                }
                Some(_) => {}
                None => out.push([k, b"=", v.as_bytes()].concat()),
            }
        }
        for (k, v) in &self.env {
            let preload_kept =
                k == "LD_PRELOAD" && out.iter().any(|e| e.starts_with(b"LD_PRELOAD="));
            if !preload_kept {
                out.push(format!("{k}={v}").into_bytes());
            }
        }
        out
    }
}
