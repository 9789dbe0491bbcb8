//! Where a launched command's standard streams go.
use std::path::Path;

use crate::error::{Error, Result};

/// Where a launched command's standard streams go.
pub struct Redirect {
    /// Receives stdout and stderr.
    pub output: std::fs::File,
    /// Becomes stdin.
    pub input: std::fs::File,
}

impl Redirect {
    /// stdout and stderr to `path` (created 0600, never through a link; an existing file
    /// replaced only with `force`), stdin from /dev/null.
    pub fn to(path: &Path, force: bool) -> Result<Redirect> {
        let output = crate::output::stream(path, force).map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        })?;
        let input = std::fs::File::open("/dev/null").map_err(|source| Error::Read {
            path: "/dev/null".into(),
            source,
        })?;
        Ok(Redirect { output, input })
    }
}
