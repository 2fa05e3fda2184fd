//! The connection string as users copy it from their provider's console,
//! read with libpq's conventions for TLS.
//!
//! tokio-postgres parses the rest of the string (host, port, user, dbname,
//! timeouts…), but knows only three of libpq's six `sslmode`s and none of
//! `sslrootcert`, `sslcert` or `sslkey`: those are taken out here, in both
//! forms libpq takes (`postgres://…?sslmode=verify-full&sslrootcert=…` and
//! `host=… sslmode=verify-full`), and the remainder goes to tokio-postgres.
//! No message here ever quotes the string: it may hold a password.

use std::path::PathBuf;

/// libpq's `sslmode`: whether to use TLS and what to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// Plaintext first; TLS (unverified) if the server requires it.
    Allow,
    /// TLS (unverified) if the server offers it, else plaintext: libpq's
    /// default.
    Prefer,
    /// TLS only; the certificate is verified against `sslrootcert` when one
    /// is given (as libpq does), else not at all.
    Require,
    /// TLS only; the certificate must be signed by `sslrootcert`.
    VerifyCa,
    /// TLS only; signed by `sslrootcert` and naming the host (or its IP).
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode {:?} is not one of disable, allow, prefer, require, verify-ca, verify-full",
                    short(other)
                ));
            }
        })
    }

    /// The name libpq gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

/// Where the CAs that sign the server's certificate come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file (re-read for every new connection: rotation needs no
    /// restart).
    File(PathBuf),
    /// The system's trusted CAs (`sslrootcert=system`).
    System,
}

/// The TLS part of a connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    /// `sslmode` (libpq's default: `prefer`).
    pub mode: SslMode,
    /// `sslrootcert`.
    pub root: Option<RootCert>,
    /// `sslcert` and `sslkey`: a client certificate and its key (PEM).
    pub client: Option<(PathBuf, PathBuf)>,
}

impl TlsParams {
    /// Whether the server's certificate is checked against the roots (and,
    /// with `name`, its host name).
    pub fn verification(&self) -> Verification {
        match (self.mode, &self.root) {
            (SslMode::VerifyFull, _) => Verification::Full,
            (SslMode::VerifyCa, _) | (SslMode::Require, Some(_)) => Verification::Ca,
            _ => Verification::None,
        }
    }
}

/// What is checked of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Nothing (the connection is encrypted, not authenticated).
    None,
    /// Signed by a root.
    Ca,
    /// Signed by a root and naming the host.
    Full,
}

/// A connection string split in two: what tokio-postgres reads, and TLS.
#[derive(Debug)]
pub struct Target {
    /// Everything but the TLS parameters, parsed by tokio-postgres.
    pub config: tokio_postgres::Config,
    /// The TLS parameters.
    pub tls: TlsParams,
}

/// At most 32 characters of a value, for a message (never a whole string).
fn short(value: &str) -> String {
    value.chars().take(32).collect()
}

/// Reads a connection string (URL or key=value form).
pub fn parse(text: &str) -> Result<Target, String> {
    let text = text.trim();
    let (rest, pairs) = if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        split_url(text)?
    } else {
        split_key_values(text)?
    };
    let mut mode = None;
    let mut root = None;
    let (mut cert, mut key) = (None, None);
    for (k, v) in pairs {
        match k.as_str() {
            "sslmode" => mode = Some(SslMode::parse(&v)?),
            "sslrootcert" => root = Some(if v == "system" { RootCert::System } else { RootCert::File(v.into()) }),
            "sslcert" => cert = Some(PathBuf::from(v)),
            "sslkey" => key = Some(PathBuf::from(v)),
            _ => {} // (only TLS_KEYS are taken out)
        }
    }
    let mode = mode.unwrap_or(SslMode::Prefer);
    let client = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("set both sslcert and sslkey, or neither".into()),
    };
    if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) && root.is_none() {
        return Err(format!(
            "sslmode={} needs sslrootcert: the CA file that signs the server's certificate, or sslrootcert=system",
            mode.as_str()
        ));
    }
    if mode == SslMode::Disable && (root.is_some() || client.is_some()) {
        return Err("sslmode=disable with sslrootcert, sslcert or sslkey: drop them, or choose a mode with TLS".into());
    }
    let config: tokio_postgres::Config = rest.parse().map_err(|e: tokio_postgres::Error| {
        // Its message names a bad option or value kind, never the string.
        format!("it does not parse ({e})")
    })?;
    // TLS at once leaves no plaintext to fall back to (libpq refuses it too).
    if config.get_ssl_negotiation() == tokio_postgres::config::SslNegotiation::Direct
        && !matches!(mode, SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull)
    {
        return Err(format!(
            "sslnegotiation=direct needs sslmode=require, verify-ca or verify-full, not {}",
            mode.as_str()
        ));
    }
    Ok(Target { config, tls: TlsParams { mode, root, client } })
}

/// Keys handled here (only these are taken out of the string).
const TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// `postgres://…?a=b&sslmode=x` → (`postgres://…?a=b`, [(sslmode, x)]).
fn split_url(url: &str) -> Result<(String, Vec<(String, String)>), String> {
    let Some((base, query)) = url.split_once('?') else { return Ok((url.to_owned(), Vec::new())) };
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(k)?;
        if TLS_KEYS.contains(&key.as_str()) {
            taken.push((key, percent_decode(v)?));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rest, taken))
}

/// `host=a sslmode='x'` → (`host=a`, [(sslmode, x)]): libpq's key=value
/// form, values optionally single-quoted with `\'` and `\\` escapes.
fn split_key_values(text: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut raw = String::new();
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err("it does not parse (expected key=value pairs)".into());
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        raw.push_str(&key);
        raw.push('=');
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            raw.push('\'');
            loop {
                match chars.next() {
                    None => return Err("it does not parse (an unclosed quote)".into()),
                    Some('\'') => break,
                    Some('\\') => {
                        let escaped = chars.next().ok_or("it does not parse (a trailing backslash)")?;
                        raw.push('\\');
                        raw.push(escaped);
                        value.push(escaped);
                    }
                    Some(c) => {
                        raw.push(c);
                        value.push(c);
                    }
                }
            }
            raw.push('\'');
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                raw.push(c);
                value.push(c);
            }
        }
        if TLS_KEYS.contains(&key.as_str()) {
            taken.push((key, value));
        } else {
            kept.push(raw);
        }
    }
    Ok((kept.join(" "), taken))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or("it does not parse (a bad %-escape in its parameters)")?;
                out.push(hex);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| "it does not parse (a parameter is not UTF-8)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_its_tls_parameters_and_keeps_the_rest() {
        let t = parse(
            "postgres://lattice:s3cret@db.example.com:5433/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem\
             &connect_timeout=7&sslcert=/c.pem&sslkey=/k.pem",
        )
        .unwrap();
        assert_eq!(t.tls.mode, SslMode::VerifyFull);
        assert_eq!(t.tls.root, Some(RootCert::File("/etc/ca.pem".into())));
        assert_eq!(t.tls.client, Some(("/c.pem".into(), "/k.pem".into())));
        assert_eq!(t.tls.verification(), Verification::Full);
        assert_eq!(t.config.get_dbname(), Some("app"));
        assert_eq!(t.config.get_ports(), &[5433]);
        assert_eq!(t.config.get_connect_timeout(), Some(&std::time::Duration::from_secs(7)));
    }

    #[test]
    fn the_key_value_form_and_libpq_defaults() {
        let t = parse("host=db user=me password='a b\\'c' sslmode=require sslrootcert=system").unwrap();
        assert_eq!((t.tls.mode, t.tls.root.clone()), (SslMode::Require, Some(RootCert::System)));
        // require with a root checks the chain, as libpq does.
        assert_eq!(t.tls.verification(), Verification::Ca);
        assert_eq!(t.config.get_password(), Some(&b"a b'c"[..]));
        let plain = parse("postgres://db/app").unwrap();
        assert_eq!((plain.tls.mode, plain.tls.verification()), (SslMode::Prefer, Verification::None));
        assert_eq!(parse("host=db sslmode=require").unwrap().tls.verification(), Verification::None);
    }

    #[test]
    fn mistakes_are_said_without_the_string() {
        for (url, expected) in [
            ("postgres://u:hunter2@db/app?sslmode=verify", "sslmode \"verify\""),
            ("postgres://u:hunter2@db/app?sslmode=verify-full", "needs sslrootcert"),
            ("postgres://u:hunter2@db/app?sslcert=/c.pem", "both sslcert and sslkey"),
            ("postgres://u:hunter2@db/app?sslmode=disable&sslrootcert=/ca.pem", "sslmode=disable"),
            ("postgres://u:hunter2@db/app?nonsense=1", "does not parse"),
            ("host=db password='hunter2", "unclosed quote"),
            ("postgres://u:hunter2@db/app?sslnegotiation=direct", "needs sslmode=require"),
            ("host=db password=hunter2 sslmode=allow sslnegotiation=direct", "not allow"),
        ] {
            let e = parse(url).unwrap_err();
            assert!(e.contains(expected), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
    }
}
