//! The HTTP server: its own thread and runtime, hyper's HTTP/1 with the bounds of `limits`,
//! read-only routes over the latest snapshot.
use std::{convert::Infallible, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, watch};

use super::{Snapshot, auth::Token, demand::Demand, limits, metrics, pprof, query::Query};

/// What every request reads.
pub struct State {
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    /// Told of each request, so that rounds build snapshots only while someone reads them.
    pub demand: Arc<Demand>,
    /// How long a request after a quiet spell waits for the next round's snapshot.
    pub fresh_wait: Duration,
    pub token: Option<Token>,
    pub max_processes: usize,
}

type Reply = Response<Full<Bytes>>;

/// The server's thread: accepts until the process ends.
pub fn run(listener: std::net::TcpListener, state: State) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            crate::say!("heaptrace: warning: --serve stopped: {e}");
            return;
        }
    };
    rt.block_on(accept(listener, Arc::new(state)));
}

async fn accept(listener: std::net::TcpListener, state: Arc<State>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            crate::say!("heaptrace: warning: --serve stopped: {e}");
            return;
        }
    };
    let slots = Arc::new(Semaphore::new(limits::CONNECTIONS));
    let deltas = Arc::new(Semaphore::new(limits::DELTA_WAITERS));
    loop {
        // Errors of one connection (reset before accepted, no file descriptors left for a
        // moment) end that connection, not the server.
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Full: told so without waiting on the client, then closed.
            let _ = stream.try_write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (state, deltas) = (state.clone(), deltas.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (state, deltas) = (state.clone(), deltas.clone());
                async move { Ok::<_, Infallible>(respond(&state, &deltas, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits::HEADER_TIMEOUT)
                .max_header_size(limits::HEADER_BYTES)
                .max_buf_size(limits::HEADER_BYTES.max(8192))
                .max_headers(limits::HEADERS)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(limits::CONNECTION_LIFE, conn).await;
            drop(slot);
        });
    }
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    r
}

fn text(status: StatusCode, msg: &str) -> Reply {
    reply(status, "text/plain; charset=utf-8", format!("{msg}\n"))
}

/// One request: method, token, body and route checked, in that order.
async fn respond(state: &State, deltas: &Semaphore, req: Request<Incoming>) -> Reply {
    let head = req.method() == Method::HEAD;
    let mut r = route(state, deltas, &req).await;
    if head {
        // The length a GET would have, as HTTP asks of a HEAD answer (hyper leaves an explicit
        // Content-Length alone).
        let len = hyper::body::Body::size_hint(r.body()).exact().unwrap_or(0);
        r.headers_mut()
            .insert(header::CONTENT_LENGTH, header::HeaderValue::from(len));
        *r.body_mut() = Full::new(Bytes::new());
    }
    r
}

async fn route(state: &State, deltas: &Semaphore, req: &Request<Incoming>) -> Reply {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "read-only: GET or HEAD");
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if let Some(token) = &state.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        if !token.admits(given) {
            let mut r = text(StatusCode::UNAUTHORIZED, "a bearer token is needed");
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    let has_body = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() != b"0")
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    if has_body {
        return text(StatusCode::PAYLOAD_TOO_LARGE, "requests have no body");
    }
    let path = req.uri().path();
    if path == "/" || path == "/debug/pprof/" {
        return reply(StatusCode::OK, "text/html; charset=utf-8", INDEX);
    }
    let query = match Query::parse(req.uri().query()) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, &e),
    };
    let kind = match path {
        "/metrics" => return metrics_reply(state, req).await,
        "/debug/pprof/heap" => pprof::Kind::Heap,
        "/debug/pprof/allocs" => pprof::Kind::Allocs,
        _ => return text(StatusCode::NOT_FOUND, "no such page: / lists them"),
    };
    profile_reply(state, deltas, &query, kind).await
}

/// The latest snapshot, if a round was taken.
fn latest(state: &State) -> Option<Arc<Snapshot>> {
    state.snapshots.borrow().clone()
}

/// A snapshot no older than a round: after a quiet spell the rounds built none, so the
/// request waits (at most `fresh_wait`) for the next. `extra`: how long the request will go
/// on reading snapshots (a delta profile's seconds).
async fn fresh(state: &State, extra: Duration) -> Option<Arc<Snapshot>> {
    let mut rx = state.snapshots.clone();
    let now = rx.borrow_and_update().clone();
    if state.demand.ask(extra) || now.as_ref().is_some_and(|s| s.ended) {
        return now;
    }
    let _ = tokio::time::timeout(state.fresh_wait, rx.changed()).await;
    latest(state).or(now)
}

fn no_round_yet() -> Reply {
    text(
        StatusCode::SERVICE_UNAVAILABLE,
        "no round taken yet: try again after the first",
    )
}

async fn metrics_reply(state: &State, req: &Request<Incoming>) -> Reply {
    let s = match fresh(state, Duration::ZERO).await {
        Some(s) => s,
        None => return no_round_yet(),
    };
    let openmetrics = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let body = metrics::render(&s, state.max_processes, openmetrics);
    let ct = if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    reply(StatusCode::OK, ct, body)
}

async fn profile_reply(state: &State, deltas: &Semaphore, q: &Query, kind: pprof::Kind) -> Reply {
    let extra = Duration::from_secs(q.seconds.unwrap_or(0));
    let s = match fresh(state, extra).await {
        Some(s) => s,
        None => return no_round_yet(),
    };
    let profile = match q.seconds {
        None => pprof::build(&s, q, kind, None),
        Some(secs) => {
            let Ok(_waiting) = deltas.try_acquire() else {
                return text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many delta profiles under way: try again later",
                );
            };
            let base = pprof::sites(&s.profile, q);
            drop(s);
            tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
            let now = match latest(state) {
                Some(s) => s,
                None => return no_round_yet(),
            };
            pprof::build(&now, q, kind, Some(&base))
        }
    };
    let mut r = reply(
        StatusCode::OK,
        "application/octet-stream",
        pprof::encode(&profile),
    );
    let name = match kind {
        pprof::Kind::Heap => "attachment; filename=\"heap\"",
        pprof::Kind::Allocs => "attachment; filename=\"allocs\"",
    };
    r.headers_mut().insert(
        header::CONTENT_DISPOSITION,
        header::HeaderValue::from_static(name),
    );
    r
}

const INDEX: &str = "<!doctype html><html><head><title>heaptrace</title></head><body>
<h1>heaptrace</h1>
<ul>
<li><a href=\"/metrics\">/metrics</a>: Prometheus series per process (OpenMetrics when asked)</li>
<li><a href=\"/debug/pprof/heap\">/debug/pprof/heap</a>: heap profile, Go's layout (inuse_space by default)</li>
<li><a href=\"/debug/pprof/allocs\">/debug/pprof/allocs</a>: the same, alloc_space by default</li>
</ul>
<p>Profiles take <code>?pid=</code>, <code>?comm=</code>, <code>?cgroup=</code> to narrow and
<code>?seconds=N</code> for the allocations of the next N seconds (at most 300).</p>
</body></html>
";
