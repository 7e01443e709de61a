//! RabbitMQ TLS: `amqps://` for the relay's own client (`run`, `check`).

use super::{provider, root_store};
use rustls::client::ClientConfig;
use std::path::Path;
use std::sync::Arc;

/// The relay's own AMQP connection's TLS settings: the certificates of
/// `roots` (the CA file, or the system bundle) and nothing else.
pub fn rabbitmq_client_config(roots: &Path) -> Result<Arc<ClientConfig>, String> {
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(root_store(roots)?)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
