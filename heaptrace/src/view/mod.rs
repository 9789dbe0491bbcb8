//! Everything a person or a tool reads: the round line and summary, the site tables, the JSON
//! document, the live view, the exports and the HTML report. Every view reads a Profile, never the kernel.
pub mod export;
pub mod html;
pub mod json;
pub mod lower_bound;
pub mod names;
pub mod site_tables;
pub mod summary;
pub mod tree;
pub mod tui;
pub mod units;
