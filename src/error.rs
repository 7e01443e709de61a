//! Why the relay stopped, or why a session ended: one error type over the
//! source's, the sink's and the stream's, and the one place that decides
//! between retrying and stopping. Below `relay` and `recover`, which both
//! return it; above `source` and `sink`, which know nothing of it.

use crate::checkpoint::CheckpointError;
use crate::message::RenderError;
use crate::metrics::Target;
use crate::sink::SinkError;
use crate::sink::publisher::PublishError;
use crate::source::SourceError;

/// Why the relay stopped, or why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// PostgreSQL side.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Broker side.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// Publishing stopped for a reason of the events themselves (a row
    /// that cannot become a message, one the broker never takes) or of the
    /// stream's order; the broker's own failures are [`RelayError::Sink`].
    #[error(transparent)]
    Publish(PublishError),
    /// A command was stopped (SIGINT/SIGTERM) before it finished.
    #[error("{0}")]
    Interrupted(String),
}

impl RelayError {
    /// The one place that decides: retry with backoff, or stop and tell the
    /// operator.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Source(e) => e.is_transient(),
            RelayError::Sink(e) => e.is_transient(),
            // A broken stream is re-read from the slot by a new session.
            RelayError::Publish(e) => e.is_transient(),
            RelayError::Interrupted(_) => false,
        }
    }

    /// The side that failed, for the reconnect counter.
    pub(crate) fn target(&self) -> Target {
        match self {
            RelayError::Sink(_) => Target::rabbitmq,
            _ => Target::postgres,
        }
    }
}

impl From<CheckpointError> for RelayError {
    fn from(e: CheckpointError) -> Self {
        RelayError::Publish(PublishError::Order(e))
    }
}

impl From<RenderError> for RelayError {
    fn from(e: RenderError) -> Self {
        RelayError::Publish(PublishError::Render(e))
    }
}

impl From<PublishError> for RelayError {
    fn from(e: PublishError) -> Self {
        match e {
            PublishError::Sink(e) => RelayError::Sink(e),
            other => RelayError::Publish(other),
        }
    }
}
