//! Unwind tables for code built without frame pointers: a file's `.eh_frame` turned into the
//! compact rows the return program searches (`table`), and the rows of the files traced
//! processes map, loaded into the kernel once per file (`loaded`). docs/unwinding.md has the
//! design.
pub mod loaded;
pub mod space;
pub mod table;

#[cfg(test)]
mod tests;
