//! The library's typed errors. Each message is one line a user can act on.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("heaptrace must run as root (or with CAP_BPF and CAP_PERFMON) to load eBPF programs")]
    NotPermitted,
    #[error(
        "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing); heaptrace needs CONFIG_DEBUG_INFO_BTF"
    )]
    NoBtf,
    #[error("cannot find task_struct's {0} in the kernel's BTF (/sys/kernel/btf/vmlinux)")]
    Btf(String),
    #[error("this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing)")]
    NoUprobes,
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot look into process {pid}: {reason}")]
    NoAccess { pid: u32, reason: String },
    #[error(
        "process {0}'s main thread has ended (its other threads run on); the kernel matches a \
         process's probes by its main thread's memory, gone now, so -p would see nothing: use \
         --all --comm {1}"
    )]
    LeaderExited(u32, String),
    /// A signal came while the probes were being attached: nothing was traced.
    #[error("{0} while attaching; detached, nothing traced")]
    Signalled(String, i32),
    #[error("process {0} is heaptrace itself; it never traces itself")]
    SelfTarget(u32),
    #[error("no malloc found in process {pid} (looked in: {looked})")]
    NoMalloc { pid: u32, looked: String },
    #[error("--allocator-symbols {spec}: {missing} not found in {looked}")]
    SymbolsNotFound {
        spec: String,
        missing: String,
        looked: String,
    },
    #[error("no malloc found for {0}")]
    NoMallocFor(String),
    /// `found`: the command exists (a shell exits 126 when it cannot run it, 127 when there is
    /// no such command).
    #[error("cannot execute {cmd}: {reason}")]
    Exec {
        cmd: String,
        reason: String,
        found: bool,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse ELF file {path}: {reason}")]
    Elf { path: PathBuf, reason: String },
    #[error("cannot load the eBPF programs: {0}")]
    Load(String),
    #[error("cannot attach {func} in {path}: {reason}")]
    Attach {
        func: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot read eBPF map {map}: {reason}")]
    Map { map: &'static str, reason: String },
    #[error("{0}")]
    Usage(String),
    /// `-p PID --in-process`: the library could not be loaded into the process.
    #[error("--in-process -p {pid}: {reason}")]
    Inject { pid: u32, reason: String },
    /// An output path that cannot be written, found before anything is started.
    #[error("{flag} {path}: {reason}")]
    Output {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Heap(#[from] crate::heap::HeapError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The reader of our output went away (`heaptrace report F | head`): not worth a word.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Error::Io(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

impl Error {
    /// The process's exit code: 2 for a command line that cannot work (as clap's usage
    /// errors), 126/127 as a shell for a command it cannot run, 128 + a signal that stopped
    /// the start, 1 for the rest.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Output { .. } => 2,
            Error::Exec { found: true, .. } => 126,
            Error::Exec { found: false, .. } => 127,
            Error::Signalled(_, sig) => (128 + sig) as u8,
            _ => 1,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
