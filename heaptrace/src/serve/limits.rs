//! What one client may take of the server: each bound here, so that a slow or hostile client
//! costs a connection slot for a few seconds at most, and never the daemon's rounds.
use std::time::Duration;

/// Connections served at once; one past them is answered 503 and closed.
pub const CONNECTIONS: usize = 32;
/// Delta profiles (`?seconds=N`) waiting at once: each holds a copy of the sites.
pub const DELTA_WAITERS: usize = 4;
/// The time a client has to send a request's headers, from its first byte or, on a kept-alive
/// connection, from the previous response.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The request line and headers, in bytes, and how many headers.
pub const HEADER_BYTES: usize = 16 * 1024;
pub const HEADERS: usize = 64;
/// A connection's whole life: long enough for the longest delta profile and its answer.
pub const CONNECTION_LIFE: Duration = Duration::from_secs(super::query::SECONDS_MAX + 60);
