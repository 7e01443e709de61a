//! `/metrics` (Prometheus text), `/healthz` (process alive), `/readyz`
//! (streaming from the slot, broker connected and not blocking us).
//!
//! Served with hyper directly so that slow or many clients are bounded: a
//! timeout on request headers, a lifetime per connection and a cap on
//! connections (see the constants). At the cap, a new connection takes the
//! place of the one idle longest ([`connections`]): a flood of idle
//! connections cannot keep the probes out.

mod connections {
    //! The connections the endpoint serves, at most a fixed number at once.
    //!
    //! When all places are taken, a new connection takes that of the
    //! connection that has waited longest without a request in progress (one
    //! that sent nothing yet, a half-sent request, an idle keep-alive), which is
    //! closed. A flood of idle or slow connections therefore cannot keep a probe
    //! out: each new connection, the probe's included, pushes out the oldest of
    //! them, and the probe's request is answered as soon as it has arrived.
    //! Only connections in the middle of a request keep their place; when every
    //! one is, the new connection is refused.

    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use tokio_util::sync::CancellationToken;

    /// The connections being served.
    pub(super) struct Connections {
        max: usize,
        open: Mutex<Open>,
    }

    #[derive(Default)]
    struct Open {
        next: u64,
        by_id: HashMap<u64, Entry>,
    }

    struct Entry {
        /// Since when it has had no request in progress; `None` while it has.
        idle_since: Option<Instant>,
        /// Cancelled when another connection takes its place.
        evicted: CancellationToken,
    }

    impl Connections {
        /// Room for `max` connections.
        pub(super) fn new(max: usize) -> Arc<Connections> {
            Arc::new(Connections {
                max,
                open: Mutex::new(Open::default()),
            })
        }

        /// A place for a new connection: a free one, else that of the
        /// connection idle longest, which is told to close (`evicted`). `None`
        /// when every connection has a request in progress.
        pub(super) fn admit(self: &Arc<Self>) -> Option<Place> {
            let mut open = self.open.lock().expect("connections lock");
            if open.by_id.len() >= self.max {
                let oldest = (open.by_id.iter())
                    .filter_map(|(id, e)| Some((e.idle_since?, *id)))
                    .min()?
                    .1;
                let gone = open.by_id.remove(&oldest).expect("listed");
                gone.evicted.cancel();
            }
            let id = open.next;
            open.next += 1;
            let evicted = CancellationToken::new();
            open.by_id.insert(
                id,
                Entry {
                    idle_since: Some(Instant::now()),
                    evicted: evicted.clone(),
                },
            );
            Some(Place {
                connections: Arc::clone(self),
                id,
                evicted,
            })
        }

        fn set_idle(&self, id: u64, idle: bool) {
            let mut open = self.open.lock().expect("connections lock");
            if let Some(e) = open.by_id.get_mut(&id) {
                e.idle_since = idle.then(Instant::now);
            }
        }
    }

    /// One connection's place; freed when dropped.
    pub(super) struct Place {
        connections: Arc<Connections>,
        id: u64,
        /// Cancelled when another connection took this place: close at once.
        pub(super) evicted: CancellationToken,
    }

    impl Place {
        /// A request is in progress until the guard is dropped: the connection
        /// keeps its place meanwhile.
        pub(super) fn busy(self: &Arc<Self>) -> Busy {
            self.connections.set_idle(self.id, false);
            Busy(Arc::clone(self))
        }
    }

    impl Drop for Place {
        fn drop(&mut self) {
            let mut open = self.connections.open.lock().expect("connections lock");
            open.by_id.remove(&self.id);
        }
    }

    /// See [`Place::busy`].
    pub(super) struct Busy(Arc<Place>);

    impl Drop for Busy {
        fn drop(&mut self) {
            self.0.connections.set_idle(self.0.id, true);
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_full_house_makes_room_by_closing_the_longest_idle() {
            let c = Connections::new(2);
            let first = Arc::new(c.admit().unwrap());
            let second = Arc::new(c.admit().unwrap());
            let busy_second = second.busy();
            let third = Arc::new(c.admit().expect("room made"));
            assert!(first.evicted.is_cancelled(), "the idle one goes");
            assert!(
                !second.evicted.is_cancelled(),
                "a request in progress stays"
            );
            drop(first);
            let busy_third = third.busy();
            assert!(c.admit().is_none(), "no idle connection left to close");
            drop(busy_second);
            let fourth = c.admit().expect("idle again");
            assert!(second.evicted.is_cancelled());
            assert!(!third.evicted.is_cancelled() && !fourth.evicted.is_cancelled());
            drop(busy_third);
        }
    }
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use connections::{Connections, Place};

use crate::metrics::Metrics;

/// The endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} (http.listen): {source}")]
pub struct HttpError {
    /// The address.
    pub addr: SocketAddr,
    /// Why.
    pub source: std::io::Error,
}

/// Longest wait for a request's headers, counted from when the connection
/// is ready for the next request (so it also bounds an idle keep-alive
/// connection). Prometheus and probes send a request in one packet; 10 s
/// tolerates a slow network yet cuts off a client that never finishes.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest life of one connection, whatever it is doing (e.g. sending a body
/// or reading the answer very slowly); it is then closed after the request
/// in progress, which gets `HEADER_READ_TIMEOUT` more to finish. A minute is
/// several scrapes: reconnecting that often costs nothing.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Most connections served at once. A scraper or two and the probes need a
/// handful; 64 bounds the tasks and buffers (each at most hyper's ~400 KB)
/// that clients can make us hold. Beyond it, a new connection closes the
/// one idle longest, or is closed when every one has a request in progress.
const MAX_CONNECTIONS: usize = 64;
/// Refused connections are logged at most this often, with a count.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Pause after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_secs(1);

/// What a client may hold; tests shorten the times.
#[derive(Clone, Copy, Debug)]
struct Limits {
    header_read: Duration,
    lifetime: Duration,
    max_connections: usize,
}

const LIMITS: Limits = Limits {
    header_read: HEADER_READ_TIMEOUT,
    lifetime: CONNECTION_LIFETIME,
    max_connections: MAX_CONNECTIONS,
};

/// Binds `addr` and serves until `stop`; returns the bound address (useful
/// with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    stop: CancellationToken,
) -> Result<SocketAddr, HttpError> {
    serve_with(addr, metrics, stop, LIMITS).await
}

async fn serve_with(
    addr: SocketAddr,
    metrics: Metrics,
    stop: CancellationToken,
    limits: Limits,
) -> Result<SocketAddr, HttpError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| HttpError { addr, source })?;
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(metrics);
    tokio::spawn(accept_loop(listener, app, stop, limits));
    Ok(bound)
}

async fn accept_loop(listener: TcpListener, app: Router, stop: CancellationToken, limits: Limits) {
    let connections = Connections::new(limits.max_connections);
    let (mut refused, mut last_log) = (0u64, None::<Instant>);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP endpoint cannot accept a connection");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                }
            }
        };
        let Some(place) = connections.admit() else {
            drop(stream);
            refused += 1;
            if last_log.is_none_or(|t: Instant| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
                tracing::warn!(
                    %peer, refused, limit = limits.max_connections,
                    "HTTP endpoint busy: closed connections beyond the limit"
                );
                (refused, last_log) = (0, Some(Instant::now()));
            }
            continue;
        };
        let (app, stop) = (app.clone(), stop.clone());
        tokio::spawn(serve_connection(stream, app, Arc::new(place), stop, limits));
    }
}

/// Serves one connection until the client closes it, it breaks a limit, or
/// `stop`; a request in progress then gets `header_read` to finish. Closed
/// at once when another connection takes its `place` (it had no request in
/// progress).
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    place: Arc<Place>,
    stop: CancellationToken,
    limits: Limits,
) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let app = TowerToHyperService::new(app);
    let evicted = place.evicted.clone();
    // Each request holds the connection's place until it is answered.
    let service = hyper::service::service_fn(move |req| {
        let busy = place.busy();
        let answer = hyper::service::Service::call(&app, req);
        async move {
            let r = answer.await;
            drop(busy);
            r
        }
    });
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => return log_end(r),
        () = evicted.cancelled() => return,
        () = tokio::time::sleep(limits.lifetime) => {}
        () = stop.cancelled() => {}
    }
    conn.as_mut().graceful_shutdown();
    if let Ok(r) = tokio::time::timeout(limits.header_read, conn).await {
        log_end(r);
    }
}

fn log_end(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "HTTP connection ended");
    }
}

async fn metrics_handler(State(m): State<Metrics>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

async fn ready_handler(State(m): State<Metrics>) -> impl IntoResponse {
    let streaming = m.streaming.get() == 1;
    let blocked = m.blocked.get() == 1;
    match (streaming, blocked) {
        (true, false) => (StatusCode::OK, "ready: streaming\n"),
        (true, true) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: broker blocked publishing\n",
        ),
        (false, _) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: not streaming (connecting or reconnecting)\n",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// How long a test waits for anything the server should do quickly.
    const PATIENCE: Duration = Duration::from_secs(3);

    async fn start(limits: Limits) -> SocketAddr {
        let addr = "127.0.0.1:0".parse().unwrap();
        let stop = CancellationToken::new();
        // Dropping the token does not cancel it: the server lives on.
        serve_with(addr, Metrics::new(), stop, limits)
            .await
            .unwrap()
    }

    /// Sends `request` on a new connection; everything the server sends
    /// back before it closes, or None if it has not closed within PATIENCE.
    async fn exchange(addr: SocketAddr, request: &str) -> Option<String> {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // A refused connection may be closed before (or while) we write.
        let _ = s.write_all(request.as_bytes()).await;
        let mut out = Vec::new();
        match tokio::time::timeout(PATIENCE, s.read_to_end(&mut out)).await {
            Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
            Err(_) => None,
        }
    }

    fn get(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
    }

    #[tokio::test]
    async fn metrics_are_served() {
        let addr = serve(
            "127.0.0.1:0".parse().unwrap(),
            Metrics::new(),
            CancellationToken::new(),
        )
        .await
        .unwrap();
        let response = exchange(addr, &get("/metrics")).await.expect("an answer");
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(
            response.contains("application/openmetrics-text"),
            "{response}"
        );
        assert!(response.trim_end().ends_with("# EOF"), "{response}");
        let response = exchange(addr, &get("/readyz")).await.expect("an answer");
        assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    }

    #[tokio::test]
    async fn unfinished_headers_are_cut_off() {
        let addr = start(Limits {
            header_read: Duration::from_millis(200),
            ..LIMITS
        })
        .await;
        let started = Instant::now();
        let response = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: rel")
            .await
            .expect("the server should close the connection");
        assert!(!response.contains("200 OK"), "{response}");
        assert!(started.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn beyond_the_cap_the_longest_idle_connection_makes_room() {
        let addr = start(Limits {
            max_connections: 2,
            ..LIMITS
        })
        .await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(TcpStream::connect(addr).await.unwrap());
            // Accepted in this order.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let response = exchange(addr, &get("/healthz")).await.expect("an answer");
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("\r\n\r\nok\n"), "{response}");
        // The first idle connection was closed to make room (long before
        // its header timeout); the second one keeps its place.
        let mut first = idle.remove(0);
        let read = tokio::time::timeout(PATIENCE, first.read(&mut [0; 64])).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "the oldest idle connection was kept"
        );
        let mut second = idle.remove(0);
        second.write_all(get("/healthz").as_bytes()).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(PATIENCE, second.read_to_end(&mut out))
            .await
            .expect("an answer")
            .unwrap();
        assert!(out.starts_with(b"HTTP/1.1 200 OK\r\n"));
    }

    #[tokio::test]
    async fn stop_closes_the_endpoint() {
        let stop = CancellationToken::new();
        let addr = serve("127.0.0.1:0".parse().unwrap(), Metrics::new(), stop.clone())
            .await
            .unwrap();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.cancel();
        let read = tokio::time::timeout(PATIENCE, idle.read(&mut [0; 64])).await;
        assert!(read.is_ok(), "an idle connection outlived stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(TcpStream::connect(addr).await.is_err(), "still listening");
    }

    #[tokio::test]
    async fn a_busy_keep_alive_connection_lives_at_most_its_lifetime() {
        let addr = start(Limits {
            lifetime: Duration::from_millis(300),
            ..LIMITS
        })
        .await;
        // A request every 50 ms never lets the header timeout fire.
        let mut s = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        let mut buf = [0; 1024];
        while started.elapsed() < PATIENCE {
            let request = b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n";
            if s.write_all(request).await.is_err()
                || matches!(s.read(&mut buf).await, Ok(0) | Err(_))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the connection was kept for {PATIENCE:?}");
    }
}
