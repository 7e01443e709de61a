//! TLS for the three connections: the SQL connection (tokio-postgres with
//! rustls), the replication connection (pgwire-replication's rustls) and the
//! broker connection (tokio-rustls, for `run` and `check` alike). All use the
//! ring provider.
//!
//! PostgreSQL follows libpq's `sslmode`, and refuses what libpq refuses:
//!
//! | sslmode | TLS | certificate checked | host name checked |
//! |---|---|---|---|
//! | `disable` | never | - | - |
//! | `prefer` (default) | if the server offers it, else plaintext | no | no |
//! | `require` | always | only if a CA file is set (as libpq) | no |
//! | `verify-ca` | always | yes, against the CA file only | no |
//! | `verify-full` | always | yes, against the CA file only | yes |
//!
//! The CA is `postgres.ca_file` (or `sslrootcert=` in the URL). There is no
//! fallback to public roots: `verify-ca` and `verify-full` without a CA file
//! are refused when the configuration is loaded, because "any certificate a
//! public CA signed" is something anyone can obtain for a domain of their
//! own. The one exception is libpq's `sslrootcert=system`: the system's CA
//! bundle ([`system_ca_bundle`]), allowed only with `verify-full` (and its
//! default then), so a public certificate must at least name the host.
//! Unix-socket connections never use TLS (libpq ignores `sslmode` there too).
//!
//! RabbitMQ: `amqps://` URLs use TLS and verify the broker's certificate and
//! host name against `rabbitmq.ca_file` alone when it is set (a private CA
//! pins the broker), else against the system's CA bundle.
//!
//! Handshake failures are turned into messages that name the setting to
//! change, see [`postgres_failure`] and [`rabbitmq_failure`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::smallfile;

/// libpq's `sslmode`, for both PostgreSQL connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it, without verifying the certificate.
    #[default]
    Prefer,
    /// TLS or fail; the certificate is verified only against a configured CA.
    Require,
    /// TLS, certificate chain verified; the host name is not checked.
    VerifyCa,
    /// TLS, certificate chain and host name verified.
    VerifyFull,
}

impl SslMode {
    /// The accepted spellings, for error messages.
    pub const CHOICES: &'static str = "disable, prefer, require, verify-ca, verify-full";

    /// Parses libpq's spelling (`allow` is read as `prefer`, its closest
    /// equivalent here).
    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" | "verify_ca" => SslMode::VerifyCa,
            "verify-full" | "verify_full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// libpq's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the server's certificate is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    /// Nothing: encryption without authentication.
    Nothing,
    /// The chain up to a trusted root, any host name.
    Chain,
    /// Chain and host name.
    Full,
}

fn verification(mode: SslMode, has_ca: bool) -> Verify {
    match mode {
        SslMode::Disable | SslMode::Prefer => Verify::Nothing,
        // libpq: "if a root CA file exists, sslmode=require behaves like verify-ca".
        SslMode::Require if has_ca => Verify::Chain,
        SslMode::Require => Verify::Nothing,
        SslMode::VerifyCa => Verify::Chain,
        SslMode::VerifyFull => Verify::Full,
    }
}

// ------------------------------------------------------------ certificates

/// Reads a PEM file of CA certificates; the message says what is wrong with
/// the file (the caller names the setting).
pub fn load_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    Ok(read_ca_file(path)?.1)
}

/// The file's text and its certificates.
fn read_ca_file(path: &Path) -> Result<(String, Vec<CertificateDer<'static>>), String> {
    let pem = smallfile::read_text(path, smallfile::PEM_LIMIT)?;
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{} is not a PEM file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certs.iter().cloned());
    if added == 0 {
        return Err(format!("{} holds no usable CA certificate", path.display()));
    }
    Ok((pem, certs))
}

/// Where OpenSSL (and so libpq's `sslrootcert=system`) finds the system's
/// CA bundle on the common distributions: Debian and Ubuntu, Fedora and
/// RHEL, openSUSE, Alpine.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The system's CA bundle: `SSL_CERT_FILE` when set (as OpenSSL reads it),
/// else the first of the distributions' bundle files that exists.
pub fn system_ca_bundle(ssl_cert_file: Option<&str>) -> Option<PathBuf> {
    if let Some(f) = ssl_cert_file.filter(|f| !f.is_empty()) {
        return Some(PathBuf::from(f));
    }
    SYSTEM_BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// The roots to verify against: the CA file's certificates, and nothing
/// else.
fn root_store(ca_file: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(load_ca_file(ca_file)?);
    Ok(roots)
}

fn provider() -> Arc<CryptoProvider> {
    // pgwire-replication uses the process default;
    // make it ring everywhere (aws-lc-rs may be compiled in as well, and then
    // rustls would refuse to pick one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A client certificate (its chain, PEM) and its private key (PEM: PKCS#8,
/// PKCS#1 or SEC1), presented to a server that asks for one: PostgreSQL's
/// `cert` authentication (`postgres.cert_file`/`key_file`, or `sslcert=`
/// and `sslkey=` in the URL).
#[derive(Clone)]
pub struct ClientCert {
    /// The certificate chain, the client's own first.
    pub cert_file: PathBuf,
    /// Its private key.
    pub key_file: PathBuf,
    /// The pair read last that made a usable certificate: used when the
    /// files cannot be (a certificate and its key replaced one after the
    /// other, read in between).
    last_good: Arc<std::sync::Mutex<Option<CertAndKey>>>,
}

/// A certificate chain and its private key.
pub type CertAndKey = (
    Vec<CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
);

impl PartialEq for ClientCert {
    fn eq(&self, other: &Self) -> bool {
        (&self.cert_file, &self.key_file) == (&other.cert_file, &other.key_file)
    }
}
impl Eq for ClientCert {}

impl fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientCert")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

impl ClientCert {
    /// The pair of files (nothing read yet).
    pub fn new(cert_file: PathBuf, key_file: PathBuf) -> ClientCert {
        ClientCert {
            cert_file,
            key_file,
            last_good: Arc::default(),
        }
    }

    /// Reads both files; the message says what is wrong with which file
    /// (the caller names the setting).
    pub fn load(
        &self,
    ) -> Result<
        (
            Vec<CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        ),
        String,
    > {
        let (cert, key) = (&self.cert_file, &self.key_file);
        let pem = smallfile::read(cert, smallfile::PEM_LIMIT)?;
        let chain = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{} is not a PEM file: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                cert.display()
            ));
        }
        let pem = smallfile::read(key, smallfile::PEM_LIMIT)?;
        let key_der = rustls::pki_types::PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
            format!(
                "{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}",
                key.display()
            )
        })?;
        Ok((chain, key_der))
    }

    /// What the files hold now, checked to be a usable pair (the key the
    /// certificate's).
    pub fn fresh(&self) -> Result<CertAndKey, String> {
        let (chain, key) = self.load()?;
        // Checked on a throwaway builder, so that a failure leaves the
        // caller's for the pair read before.
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(RootCertStore::empty())
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(|e| {
                format!(
                    "{} and {} do not make a usable client certificate: {e}",
                    self.cert_file.display(),
                    self.key_file.display()
                )
            })?;
        Ok((chain, key))
    }

    /// Loads both and checks the key is the certificate's (as the
    /// handshake would, at the first connect).
    pub fn check(&self) -> Result<(), String> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(RootCertStore::empty());
        with_client_cert(builder, Some(self)).map(drop)
    }
}

/// `builder` finished with `client`'s certificate, or with none.
fn with_client_cert(
    builder: rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>,
    client: Option<&ClientCert>,
) -> Result<ClientConfig, String> {
    let Some(client) = client else {
        return Ok(builder.with_no_client_auth());
    };
    let fresh = client.fresh();
    let mut last = client.last_good.lock().expect("not poisoned");
    let (chain, key) = match fresh {
        Ok(pair) => {
            *last = Some((pair.0.clone(), pair.1.clone_key()));
            pair
        }
        Err(e) => match last.as_ref() {
            Some((chain, key)) => {
                tracing::warn!("{e}; presenting the client certificate read before");
                (chain.clone(), key.clone_key())
            }
            None => return Err(e),
        },
    };
    builder
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("the client certificate: {e}"))
}

fn client_config(
    verify: Verify,
    ca_file: Option<&Path>,
    client: Option<&ClientCert>,
) -> Result<ClientConfig, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    // Refused when the configuration was loaded; never fall back to public
    // roots here.
    let ca = || {
        ca_file.ok_or_else(|| {
            "verifying the server certificate needs a CA file (postgres.ca_file)".to_owned()
        })
    };
    let config = match verify {
        Verify::Full => builder.with_root_certificates(root_store(ca()?)?),
        Verify::Chain => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(chain_only(ca()?, provider)?)),
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider))),
    };
    with_client_cert(config, client)
}

fn chain_only(ca_file: &Path, provider: Arc<CryptoProvider>) -> Result<ChainOnly, String> {
    let inner = WebPkiServerVerifier::builder_with_provider(
        Arc::new(root_store(ca_file)?),
        Arc::clone(&provider),
    )
    .build()
    .map_err(|e| e.to_string())?;
    Ok(ChainOnly(inner, provider))
}

/// The handshake-signature half of our verifiers, the same for all: the
/// provider's algorithms, as [`WebPkiServerVerifier`] checks them. The
/// verifier's type has a `provider(&self) -> &CryptoProvider`.
macro_rules! signatures_by_provider {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algs = &self.provider().signature_verification_algorithms;
            rustls::crypto::verify_tls12_signature(message, cert, dss, algs)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algs = &self.provider().signature_verification_algorithms;
            rustls::crypto::verify_tls13_signature(message, cert, dss, algs)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            (self.provider().signature_verification_algorithms).supported_schemes()
        }
    };
}

/// verify-ca: the chain must lead to a trusted root; the names in the
/// certificate are not compared with the host.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>, Arc<CryptoProvider>);

impl ChainOnly {
    fn provider(&self) -> &CryptoProvider {
        &self.1
    }
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    signatures_by_provider!();
}

/// prefer/require without a CA: encrypt, authenticate nothing (as libpq).
/// The handshake signature is still checked, so the connection is bound to
/// the key in whatever certificate the server sent.
#[derive(Debug)]
struct NoVerification(Arc<CryptoProvider>);

impl NoVerification {
    fn provider(&self) -> &CryptoProvider {
        &self.0
    }
}

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    signatures_by_provider!();
}

mod failures;
mod postgres;
mod rabbitmq;
pub use failures::*;
pub use postgres::*;
pub use rabbitmq::*;

#[cfg(test)]
mod tests;
