//! `--serve ADDR`: an HTTP server beside the daemon that answers Prometheus (`/metrics`) and
//! continuous profilers (`/debug/pprof/heap`, `/debug/pprof/allocs`, in Go's layout), the way
//! a Go service does. It runs on a thread and a runtime of its own, and reads an immutable
//! snapshot the daemon publishes each round (`Publisher`): a slow or hostile client holds
//! nothing a round needs, and a round never waits for it.
pub mod auth;
mod demand;
mod limits;
pub mod metrics;
pub mod pprof;
pub mod query;
mod server;
pub mod snapshot;

pub use snapshot::Snapshot;
#[cfg(test)]
mod tests_support;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::sync::watch;

use crate::{
    cli::ServeArgs,
    error::{Error, Result},
};

/// The daemon's end: replaces the published snapshot, never waits for a reader.
#[derive(Clone)]
pub struct Publisher {
    tx: watch::Sender<Option<Arc<Snapshot>>>,
    demand: Arc<demand::Demand>,
}

impl Publisher {
    /// Whether a round should build a snapshot: only while clients read them (a snapshot
    /// copies the running processes' sites and stacks, which under `--all` is not free).
    pub fn wanted(&self) -> bool {
        self.demand.wanted()
    }

    pub fn publish(&self, s: Snapshot) {
        self.tx.send_replace(Some(Arc::new(s)));
    }
}

/// The server's settings, checked before anything is launched or attached.
pub struct Options {
    pub addr: SocketAddr,
    pub token: Option<auth::Token>,
    pub max_processes: usize,
    /// The time between rounds: how long a request after a quiet spell waits for a fresh
    /// snapshot.
    pub interval: Duration,
}

impl Options {
    /// None without --serve; an error (one line) for an address that needs a token it was
    /// not given, or a token file that cannot be read.
    pub fn from_cli(args: &ServeArgs, interval: Duration) -> Result<Option<Options>> {
        let Some(addr) = args.serve else {
            return Ok(None);
        };
        let token = auth::token_for(addr, args.serve_token_file.as_deref())?;
        if args.serve_max_processes == 0 {
            return Err(Error::Usage(
                "--serve-max-processes must be at least 1".into(),
            ));
        }
        Ok(Some(Options {
            addr,
            token,
            max_processes: args.serve_max_processes,
            interval,
        }))
    }
}

/// Binds the address now (a port in use is an error before the trace starts) and starts the
/// server's thread; the snapshot it serves comes from the returned Publisher.
pub fn start(opts: Options) -> Result<Publisher> {
    let listener = std::net::TcpListener::bind(opts.addr)
        .map_err(|e| Error::Usage(format!("--serve {}: cannot listen there: {e}", opts.addr)))?;
    listener.set_nonblocking(true)?;
    let (tx, rx) = watch::channel(None);
    let demand = Arc::new(demand::Demand::new());
    let state = server::State {
        snapshots: rx,
        demand: demand.clone(),
        fresh_wait: opts.interval * 2 + Duration::from_secs(1),
        token: opts.token,
        max_processes: opts.max_processes,
    };
    std::thread::Builder::new()
        .name("heaptrace-serve".into())
        .spawn(move || server::run(listener, state))?;
    Ok(Publisher { tx, demand })
}
