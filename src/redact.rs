//! Secrets out of what is printed: URLs with their passwords masked.

/// Masks the passwords of a `scheme://user:password@host/...?...` URL so
/// the URL can be logged.
///
/// The drivers disagree on where the credentials end: tokio-postgres reads
/// them to the first `@`, a URL parser to the last `@` before the path. So
/// everything from the first `:` to the last `@` is masked (an unencoded
/// `/`, `?`, `#` or `@` in the password stays hidden, at worst with some of
/// the host), and so is the value of every `password=` query parameter.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return mask_query_passwords(url);
    };
    let (scheme, rest) = (&url[..scheme_end], &url[scheme_end + 3..]);
    let masked = match rest.rfind('@') {
        Some(at) => match rest[..at].find(':') {
            Some(colon) => format!("{scheme}://{}:****{}", &rest[..colon], &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    mask_query_passwords(&masked)
}

/// `password=...` in a query string (or a key=value string), masked.
fn mask_query_passwords(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = find_password_key(rest) {
        let value = i + "password=".len();
        out.push_str(&rest[..value]);
        out.push_str("****");
        let end = rest[value..]
            .find(['&', ' ', '#'])
            .map_or(rest.len(), |e| value + e);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Where a `password=` parameter starts: at the start, or after `?`, `&`
/// or a space; any case.
fn find_password_key(s: &str) -> Option<usize> {
    let lower = s.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = lower[from..].find("password=") {
        let at = from + i;
        if at == 0 || matches!(s.as_bytes()[at - 1], b'?' | b'&' | b' ') {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// True when a `postgres://` URL's query sets `password=`.
pub fn query_has_password(url: &str) -> bool {
    url.split_once('?')
        .is_some_and(|(_, q)| find_password_key(q).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(
            redact_url("postgres://relay:s3cret@127.0.0.1:5432/app"),
            "postgres://relay:****@127.0.0.1:5432/app"
        );
        assert_eq!(redact_url("amqp://127.0.0.1/%2f"), "amqp://127.0.0.1/%2f");
        assert_eq!(redact_url("amqp://u:p@ss@h/v?x=1"), "amqp://u:****@h/v?x=1");
        assert_eq!(
            redact_url("postgres://relay@db/app?sslmode=require&Password=s3cret&x=1"),
            "postgres://relay@db/app?sslmode=require&Password=****&x=1"
        );
        assert_eq!(
            redact_url("host=db password=s3cret user=relay"),
            "host=db password=**** user=relay"
        );
        // Not a password parameter.
        assert_eq!(
            redact_url("postgres://db/app?old_password=x"),
            "postgres://db/app?old_password=x"
        );
        assert!(query_has_password("postgres://u@db/app?password=x"));
        assert!(!query_has_password("postgres://u:x@db/app?sslmode=require"));
    }

    /// Passwords made of the characters drivers treat specially.
    fn password() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9/?#@:%&= ._-]{1,24}".prop_map(|p| format!("Pw{p}"))
    }

    proptest! {
        #[test]
        fn no_url_shape_prints_its_password(
            pw in password(),
            scheme in prop::sample::select(vec!["postgres", "postgresql", "amqp", "amqps"]),
            shape in 0..4usize,
        ) {
            let url = match shape {
                0 => format!("{scheme}://relay:{pw}@db.example:5432/app"),
                1 => format!("{scheme}://relay:{pw}@db.example/app?sslmode=require"),
                2 => format!("{scheme}://relay@db.example/app?password={}", pw.replace(['&', ' ', '#'], "x")),
                _ => format!("{scheme}://relay:{pw}@[::1]:5432/app?application_name=a"),
            };
            let shown = redact_url(&url);
            let secret = if shape == 2 { pw.replace(['&', ' ', '#'], "x") } else { pw.clone() };
            prop_assert!(!shown.contains(&secret), "{url} -> {shown}");
            prop_assert!(shown.contains("****"), "{url} -> {shown}");
        }
    }
}
