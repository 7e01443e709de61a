//! RabbitMQ TLS: `amqps://` for the relay's own client (`run`, `check`).

use super::{ClientCert, provider, root_store, with_client_cert};
use rustls::client::ClientConfig;
use std::path::Path;
use std::sync::Arc;

/// The relay's own AMQP connection's TLS settings: the certificates of
/// `roots` (the CA file, or the system bundle) and nothing else; `client`,
/// the certificate it presents when the broker asks (`rabbitmq.cert_file`).
pub fn rabbitmq_client_config(
    roots: &Path,
    client: Option<&ClientCert>,
) -> Result<Arc<ClientConfig>, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(root_store(roots)?);
    Ok(Arc::new(with_client_cert(builder, client)?))
}
