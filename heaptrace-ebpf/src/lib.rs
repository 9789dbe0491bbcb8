#![no_std]
// Exists so that heaptrace/build.rs can depend on this crate (rebuild triggers).
