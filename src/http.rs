//! `/metrics` (Prometheus text), `/healthz` (process alive), `/readyz`
//! (streaming from the slot, broker connected and not blocking us).

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

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

/// Binds `addr` and serves until `stop`; returns the bound address (useful
/// with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    stop: CancellationToken,
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
    tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(e) = server.await {
            tracing::warn!(error = %e, "HTTP endpoint stopped");
        }
    });
    Ok(bound)
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
