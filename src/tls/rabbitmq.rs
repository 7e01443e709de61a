//! RabbitMQ TLS: `amqps://` for the relay's own client and for lapin (`check`).

use super::{provider, read_ca_file, root_store};
use rustls::client::ClientConfig;
use rustls::pki_types::ServerName;
use std::path::Path;
use std::sync::Arc;

// lapin opens amqps:// URLs in plaintext when its TLS is not compiled in
// (no root-set feature, no `rustls-common`): this name exists only with it,
// so dropping the feature from Cargo.toml is a compile error, not a silent
// downgrade.
#[allow(unused_imports)]
use amq_protocol_tcp::RustlsConnectorConfig as _;

/// lapin's TLS settings, for `check`: the certificates of `roots` (the CA
/// file, or the system bundle) and nothing else. lapin is built without a
/// bundled root set, so these are all it trusts.
pub fn rabbitmq_tls(roots: &Path) -> Result<lapin::tcp::OwnedTLSConfig, String> {
    provider();
    Ok(lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain: Some(read_ca_file(roots)?.0),
    })
}

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

/// A TLS handshake with the broker at `host:port`, trusting `roots` as the
/// relay's own client does. `check` runs it before lapin, whose TLS errors
/// do not say why the broker was refused.
pub async fn rabbitmq_handshake(host: &str, port: u16, roots: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let config =
        rabbitmq_client_config(roots).map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| Error::new(ErrorKind::InvalidInput, e))?;
    let tcp = tokio::net::TcpStream::connect((host, port)).await?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map(drop)
}
