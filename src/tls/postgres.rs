//! PostgreSQL TLS: the SQL connection's and the replication connection's, as libpq's `sslmode` says.

use super::{
    ChainOnly, ClientCert, SslMode, Verify, chain_only, client_config, provider, verification,
};
use crate::pgurl::PgTarget;
use rustls::DigitallySignedStruct;
use rustls::SignatureScheme;
use rustls::client::ClientConfig;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::client::danger::ServerCertVerified;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::ServerName;
use rustls::pki_types::UnixTime;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

/// True when every host of the URL is a Unix-socket directory: no TLS there.
pub(super) fn unix_only(pg: &tokio_postgres::Config) -> bool {
    let hosts = pg.get_hosts();
    !hosts.is_empty()
        && hosts
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)))
}

/// Sets tokio-postgres's `ssl_mode` for `mode` and returns the connector.
pub fn postgres_sql_tls(
    pg: &mut tokio_postgres::Config,
    mode: SslMode,
    ca_file: Option<&Path>,
    client: Option<&ClientCert>,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
    use tokio_postgres::config::SslMode as Tp;
    let tp = match mode {
        _ if unix_only(pg) => Tp::Disable,
        SslMode::Disable => Tp::Disable,
        SslMode::Prefer => Tp::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Tp::Require,
    };
    pg.ssl_mode(tp);
    // Without TLS there is nobody to present a certificate to.
    let client = client.filter(|_| tp != Tp::Disable);
    let verify = if tp == Tp::Disable {
        Verify::Nothing
    } else {
        verification(mode, ca_file.is_some())
    };
    let ca_file = if verify == Verify::Nothing {
        None
    } else {
        ca_file
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
        client_config(verify, ca_file, client)?,
    ))
}

/// pgwire-replication's TLS settings for `mode`, connecting to `target`.
///
/// pgwire-replication 0.5's verify-ca still compares the host name with the
/// certificate (it waits for rustls's `NotValidForName`, which rustls now
/// reports as `NotValidForNameContext`). So where only the chain is to be
/// verified, a short probe connection reads the server's certificate first,
/// verifying its chain against the CA file, and if the certificate does not
/// name the host, one of the names it does list is given to
/// pgwire-replication as the name to check: a certificate signed by the
/// configured CA passes, as verify-ca says, and no other does (the real
/// connection verifies the chain again, against the same CA file).
pub async fn postgres_replication_tls_for(
    mode: SslMode,
    ca_file: Option<&Path>,
    target: &PgTarget,
    client: Option<&ClientCert>,
) -> Result<pgwire_replication::TlsConfig, String> {
    let mut tls = postgres_replication_tls(mode, ca_file, target)?;
    if let Some(client) = client
        && tls.mode != pgwire_replication::SslMode::Disable
    {
        tls.client_cert_pem_path = Some(client.cert_file.clone());
        tls.client_key_pem_path = Some(client.key_file.clone());
    }
    match (target, ca_file) {
        (PgTarget::Tcp { name, addr, port }, Some(ca))
            if tls.mode == pgwire_replication::SslMode::VerifyCa =>
        {
            let probe = certificate_name_for(name, addr, *port, ca);
            Ok(
                match tokio::time::timeout(std::time::Duration::from_secs(10), probe).await {
                    Ok(Some(name)) => tls.with_sni_hostname(name),
                    // No TLS, an untrusted chain...: the real connection says so.
                    _ => tls,
                },
            )
        }
        _ => Ok(tls),
    }
}

/// A name the certificate of the server at `addr:port` lists, when it does
/// not list `name` and its chain leads to `ca_file`; `None` otherwise.
pub(super) async fn certificate_name_for(
    name: &str,
    addr: &str,
    port: u16,
    ca_file: &Path,
) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

    // Each address of the name, as the connection after it (see `dial`):
    // two of them within the caller's deadline.
    let mut tcp = crate::dial::connect(addr, port, std::time::Duration::from_secs(4))
        .await
        .ok()?;
    // SSLRequest: length 8, code 80877103.
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .ok()?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.ok()?;
    if answer[0] != b'S' {
        return None;
    }
    let provider = provider();
    let seen: Seen = Arc::new(std::sync::Mutex::new(None));
    let config = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Recording {
            inner: chain_only(ca_file, provider).ok()?,
            seen: Arc::clone(&seen),
        }))
        .with_no_client_auth();
    let mut make = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    let connect =
        MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut make, name).ok()?;
    let stream = connect.connect(tcp).await.ok()?;
    drop(stream);
    let (der, name_matched): (Vec<u8>, bool) = seen.lock().ok()?.take()?;
    if name_matched {
        return None;
    }
    certificate_names(&der).into_iter().next()
}

/// The DNS names and IP addresses of a certificate's subjectAltName, as
/// names rustls accepts (a wildcard `*.x` as `outbox-relay.x`).
pub(super) fn certificate_names(der: &[u8]) -> Vec<String> {
    use x509_cert::der::Decode;
    use x509_cert::ext::pkix::SubjectAltName;
    use x509_cert::ext::pkix::name::GeneralName;
    let Ok(cert) = x509_cert::Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some((_, san))) = cert.tbs_certificate.get::<SubjectAltName>() else {
        return Vec::new();
    };
    san.0
        .iter()
        .filter_map(|n| match n {
            GeneralName::DnsName(d) => {
                let d = d.as_str();
                Some(match d.strip_prefix("*.") {
                    Some(rest) => format!("outbox-relay.{rest}"),
                    None => d.to_owned(),
                })
            }
            GeneralName::IpAddress(ip) => match ip.as_bytes().len() {
                4 => {
                    let b: [u8; 4] = ip.as_bytes().try_into().ok()?;
                    Some(std::net::Ipv4Addr::from(b).to_string())
                }
                16 => {
                    let b: [u8; 16] = ip.as_bytes().try_into().ok()?;
                    Some(std::net::Ipv6Addr::from(b).to_string())
                }
                _ => None,
            },
            _ => None,
        })
        .filter(|n| ServerName::try_from(n.clone()).is_ok())
        .collect()
}

/// Verifies like `inner` and keeps the certificate, and whether it names
/// the host, for [`certificate_name_for`].
#[derive(Debug)]
pub(super) struct Recording {
    inner: ChainOnly,
    seen: Seen,
}

/// The certificate a probe saw, and whether it named the host.
type Seen = Arc<std::sync::Mutex<Option<(Vec<u8>, bool)>>>;

impl Recording {
    fn provider(&self) -> &CryptoProvider {
        self.inner.provider()
    }
}

impl ServerCertVerifier for Recording {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let full = self.inner.0.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        if let Ok(mut seen) = self.seen.lock() {
            *seen = Some((end_entity.to_vec(), full.is_ok()));
        }
        Ok(verified)
    }

    signatures_by_provider!();
}

/// pgwire-replication's TLS settings for `mode`, connecting to `target`;
/// see [`postgres_replication_tls_for`]. The name checked (and sent as SNI)
/// is always the URL's host name, also when `hostaddr` says where to
/// connect, exactly as for the SQL connection.
pub fn postgres_replication_tls(
    mode: SslMode,
    ca_file: Option<&Path>,
    target: &PgTarget,
) -> Result<pgwire_replication::TlsConfig, String> {
    use pgwire_replication::TlsConfig;
    let PgTarget::Tcp { name, .. } = target else {
        return Ok(TlsConfig::disabled());
    };
    let ca: Option<PathBuf> = ca_file.map(Path::to_path_buf);
    let tls = match (mode, verification(mode, ca.is_some())) {
        (SslMode::Disable, _) => return Ok(TlsConfig::disabled()),
        (SslMode::Prefer, _) => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        (_, Verify::Nothing) => TlsConfig::require(),
        // pgwire-replication would fall back to the Mozilla roots: never.
        (_, Verify::Chain | Verify::Full) if ca.is_none() => {
            return Err(format!(
                "sslmode={mode} needs a CA file to verify the server certificate \
                 (postgres.ca_file)"
            ));
        }
        (_, Verify::Chain) => TlsConfig::verify_ca(ca),
        (_, Verify::Full) => TlsConfig::verify_full(ca),
    };
    Ok(tls.with_sni_hostname(name.as_str()))
}
