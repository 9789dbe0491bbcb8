//! Recordings: the Round stream written as it is drained, and read back into the same Profile
//! every view reads. See `format` for the file layout.
pub mod format;
pub mod reader;
pub mod replay;
pub mod writer;

pub use format::{FormatError, Header};
pub use reader::Recording;
pub use replay::Replay;
pub use writer::Recorder;
