//! libpq's `require_auth`: which authentication requests a PostgreSQL
//! server may make of the relay. Whatever it says, the password is never
//! sent in the clear or as an MD5 hash to a server nobody verified.

/// An authentication method, by libpq's `require_auth` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMethod {
    /// `AuthenticationCleartextPassword`.
    Password,
    /// `AuthenticationMD5Password`.
    Md5,
    /// `AuthenticationGSS`.
    Gss,
    /// `AuthenticationSSPI`.
    Sspi,
    /// `AuthenticationSASL` (SCRAM-SHA-256).
    ScramSha256,
    /// `AuthenticationOk` before any request: the server authenticated
    /// nothing (`trust`, `peer`...).
    None,
}

impl AuthMethod {
    const ALL: [AuthMethod; 6] = [
        AuthMethod::Password,
        AuthMethod::Md5,
        AuthMethod::Gss,
        AuthMethod::Sspi,
        AuthMethod::ScramSha256,
        AuthMethod::None,
    ];

    /// libpq's name.
    pub fn name(self) -> &'static str {
        match self {
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::Gss => "gss",
            AuthMethod::Sspi => "sspi",
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::None => "none",
        }
    }

    /// The method of a libpq name.
    pub fn by_name(name: &str) -> Option<AuthMethod> {
        AuthMethod::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The method an authentication request (`R` message) with this code
    /// asks for; `None` for the steps inside one (SASL continue and final,
    /// GSS continue) and for `AuthenticationOk`.
    pub fn of_request(code: u32) -> Option<AuthMethod> {
        match code {
            3 => Some(AuthMethod::Password),
            5 => Some(AuthMethod::Md5),
            7 => Some(AuthMethod::Gss),
            9 => Some(AuthMethod::Sspi),
            10 => Some(AuthMethod::ScramSha256),
            _ => None,
        }
    }
}

/// The authentication requests both PostgreSQL connections answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthPolicy {
    allowed: Vec<AuthMethod>,
    /// `postgres.require_auth` as written, when set.
    written: Option<String>,
    /// The server proves who it is (`verify-ca`, `verify-full`, or a Unix
    /// socket only).
    verified: bool,
}

impl AuthPolicy {
    /// Reads `require_auth` as libpq does (`scram-sha-256`, a list
    /// `scram-sha-256,none`, or one that excludes: `!password,!md5`), for a
    /// server that is `verified` or not. Without a verified server,
    /// `password` and `md5` are never allowed, and naming them is an error.
    pub fn parse(written: Option<&str>, verified: bool) -> Result<AuthPolicy, String> {
        let Some(text) = written else {
            let allowed = (AuthMethod::ALL.into_iter())
                .filter(|m| verified || !matches!(m, AuthMethod::Password | AuthMethod::Md5))
                .collect();
            return Ok(AuthPolicy {
                allowed,
                written: None,
                verified,
            });
        };
        let names: Vec<&str> = text.split(',').map(str::trim).collect();
        let negated = names.iter().filter(|n| n.starts_with('!')).count();
        if negated != 0 && negated != names.len() {
            return Err("mixes methods with excluded (!) ones; list either kind".into());
        }
        let mut listed = Vec::new();
        for name in &names {
            let m = AuthMethod::by_name(name.trim_start_matches('!')).ok_or_else(|| {
                format!(
                    "{name:?} is not an authentication method (password, md5, gss, sspi, \
                     scram-sha-256, none)"
                )
            })?;
            if listed.contains(&m) {
                return Err(format!("names {} twice", m.name()));
            }
            listed.push(m);
        }
        let insecure = |m: &AuthMethod| matches!(m, AuthMethod::Password | AuthMethod::Md5);
        if negated == 0
            && !verified
            && let Some(m) = listed.iter().find(|m| insecure(m))
        {
            return Err(format!(
                "allows {}, which hands the password (or its MD5 hash) to whoever answers: \
                     allowed only when the server is verified (postgres.sslmode = \
                     \"verify-full\" or \"verify-ca\" with postgres.ca_file)",
                m.name()
            ));
        }
        let allowed = (AuthMethod::ALL.into_iter())
            .filter(|m| listed.contains(m) != (negated > 0))
            .filter(|m| verified || !insecure(m))
            .collect();
        Ok(AuthPolicy {
            allowed,
            written: Some(text.to_owned()),
            verified,
        })
    }

    /// Whether a request for `m` is answered.
    pub fn allows(&self, m: AuthMethod) -> bool {
        self.allowed.contains(&m)
    }

    /// The replication client's form of the same rules.
    pub fn for_replication(&self) -> pgwire_replication::AuthAllowed {
        pgwire_replication::AuthAllowed {
            password: self.allows(AuthMethod::Password),
            md5: self.allows(AuthMethod::Md5),
            scram_sha_256: self.allows(AuthMethod::ScramSha256),
            none: self.allows(AuthMethod::None),
        }
    }

    /// Why a request for `m` was refused (the password unsent), naming
    /// the setting to change.
    pub fn refusal(&self, m: AuthMethod) -> String {
        let what = match m {
            AuthMethod::Password => "the password in the clear".to_owned(),
            AuthMethod::Md5 => "an MD5 hash of the password".to_owned(),
            AuthMethod::None => "nothing: it let the relay in without authenticating".to_owned(),
            m => format!("{} authentication", m.name()),
        };
        let fix = match (&self.written, m) {
            (None, AuthMethod::Password | AuthMethod::Md5) if !self.verified => {
                "a server whose identity nobody verified must not get it: verify the server \
                 (postgres.sslmode = \"verify-full\" with postgres.ca_file), or have it use \
                 scram-sha-256 (password_encryption and pg_hba.conf)"
                    .to_owned()
            }
            (Some(w), _) => format!("postgres.require_auth = {w:?} does not allow it"),
            (None, _) => "the relay does not answer it".to_owned(),
        };
        format!("PostgreSQL asked for {what}; refused, nothing sent: {fix}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AuthMethod::*;

    #[test]
    fn require_auth_reads_as_libpq() {
        let p = |w: &str, v| AuthPolicy::parse(Some(w), v);
        let allowed = |p: &AuthPolicy| {
            (AuthMethod::ALL.into_iter())
                .filter(|m| p.allows(*m))
                .collect::<Vec<_>>()
        };
        let default = AuthPolicy::parse(Option::None, false).unwrap();
        assert_eq!(allowed(&default), [Gss, Sspi, ScramSha256, None]);
        let verified = AuthPolicy::parse(Option::None, true).unwrap();
        assert_eq!(allowed(&verified), AuthMethod::ALL);
        assert_eq!(allowed(&p("scram-sha-256", false).unwrap()), [ScramSha256]);
        assert_eq!(
            allowed(&p("scram-sha-256, none", false).unwrap()),
            [ScramSha256, None]
        );
        assert_eq!(
            allowed(&p("!none", false).unwrap()),
            [Gss, Sspi, ScramSha256]
        );
        assert_eq!(
            allowed(&p("!none", true).unwrap()),
            [Password, Md5, Gss, Sspi, ScramSha256]
        );
        assert_eq!(allowed(&p("md5", true).unwrap()), [Md5]);
        assert!(p("md5", false).unwrap_err().contains("verify-full"));
        assert!(p("password,scram-sha-256", false).is_err());
        assert!(
            p("scram-sha-256,!none", false)
                .unwrap_err()
                .contains("mixes")
        );
        assert!(
            p("scram", false)
                .unwrap_err()
                .contains("not an authentication method")
        );
        assert!(p("none,none", false).unwrap_err().contains("twice"));
        assert!(default.refusal(Password).contains("postgres.sslmode"));
        assert!(
            p("scram-sha-256", false)
                .unwrap()
                .refusal(None)
                .contains("postgres.require_auth")
        );
    }
}
