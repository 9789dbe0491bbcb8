//! Python frames from outside the process: CPython's code objects read from the traced
//! process's memory and named `function (file.py:line)`. docs/python.md.
pub mod linetable;
pub mod objects;
pub mod offsets;
pub mod runtime;
pub mod splice;
pub mod threads;
