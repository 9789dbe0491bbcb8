//! The bpf(2) system call, for the few commands aya 0.14 does not issue itself (`multi`,
//! `batch`).
use aya_obj::generated::bpf_attr;

pub fn bpf(cmd: u32, attr: &mut bpf_attr) -> std::io::Result<i64> {
    // SAFETY: attr is a valid, initialized bpf_attr of the size passed; the kernel reads and
    // writes only within it and the buffers its fields point to, which the callers keep alive.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}
