//! Unwind tables for code built without frame pointers: a file's `.eh_frame` turned into the
//! compact rows the return program searches (`table`), and the rows of the files traced
//! processes map, loaded once per file (`loaded`) into the kernel or an in-process region
//! (`region`). docs/unwinding.md has the design.
pub mod chunks;
pub mod loaded;
mod plt;
pub mod python;
pub mod region;
pub mod space;
pub mod table;

#[cfg(test)]
mod tests;
