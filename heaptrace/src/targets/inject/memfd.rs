//! A memfd made in the target, filled from heaptrace through /proc/PID/fd/N: the way a file
//! reaches a process in any mount namespace without a path it could be swapped at.
use std::{ffi::CStr, io::Write as _};

use super::call::Arg;
use crate::error::Result;

/// A new memfd named `name` in the target (close-on-exec); its descriptor there.
pub fn create(
    pid: u32,
    call: &dyn Fn(u64, &[Arg]) -> Result<u64>,
    memfd_create: u64,
    name: &CStr,
) -> Result<u64> {
    let fd = call(
        memfd_create,
        &[
            Arg::Bytes(name.to_bytes_with_nul()),
            Arg::Num(libc::MFD_CLOEXEC as u64),
        ],
    )? as i64;
    if !(0..=i32::MAX as i64).contains(&fd) {
        return Err(crate::error::Error::Inject {
            pid,
            reason: format!("memfd_create failed in it ({fd})"),
        });
    }
    Ok(fd as u64)
}

/// Writes `bytes` into the target's descriptor `fd`.
pub fn fill(pid: u32, fd: u64, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))?;
    f.write_all(bytes)
}
