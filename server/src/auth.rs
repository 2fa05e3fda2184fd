//! Who is calling: `[server.auth]`.
//!
//! Mode `token`: a client sends `authorization: Bearer <token>`; Lattice
//! hashes it (SHA-256) and looks the digest up in the tokens file, whose
//! lines are `<principal> <sha256 hex of the token>` (a Kubernetes Secret,
//! mounted). The file holds no token, only digests; every entry is compared
//! in constant time; a token is never logged, and no error repeats it. The
//! file is re-read when its content changes (a revoked token stops working
//! within [`RELOAD_EVERY`]); a file that no longer parses keeps the previous
//! table and says why in the log; a deleted file revokes every token.
//!
//! Mode `mtls`: the principal is the client certificate's first URI
//! subject alternative name (a SPIFFE ID from a service mesh), else its
//! first DNS one; the listener must ask for client certificates
//! (`server.tls.client_ca_file`, see [`crate::tls`]). With a client CA set,
//! a request needs a valid certificate in every mode.
//!
//! Mode `none` (which a config must say: without `[server.auth]` Lattice
//! does not start): every caller is let in, as the principal [`ANONYMOUS`].

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use tonic::{Request, Status};
use tracing::{info, warn};

use crate::{
    config::{AuthMode, AuthSettings},
    tls::ServerTls,
};

/// How often the tokens file is checked for changes.
pub const RELOAD_EVERY: Duration = crate::reload::EVERY;

/// The principal of a caller when authentication is off.
pub const ANONYMOUS: &str = "anonymous";

/// A caller, as authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Its name (from the tokens file), or [`ANONYMOUS`].
    pub name: String,
    /// Whether it may use the admin RPCs.
    pub admin: bool,
}

/// The tokens file, parsed.
#[derive(Debug, Clone, Default)]
pub struct TokenTable {
    entries: Vec<(String, [u8; 32])>,
}

impl TokenTable {
    /// Reads and parses a tokens file. The error names the file and the
    /// line, never a token or digest.
    pub fn read(path: &Path) -> Result<TokenTable, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        TokenTable::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses `<principal> <sha256 hex>` lines (blank lines and `#`
    /// comments skipped).
    pub fn parse(text: &str) -> Result<TokenTable, String> {
        let mut entries = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(principal), Some(hex), None) = (words.next(), words.next(), words.next()) else {
                return Err(format!("line {}: expected `<principal> <sha256 hex of the token>`", n + 1));
            };
            let digest = decode_digest(hex)
                .ok_or_else(|| format!("line {}: the digest of {principal:?} is not 64 hex digits", n + 1))?;
            entries.push((principal.to_owned(), digest));
        }
        Ok(TokenTable { entries })
    }

    /// The principal whose digest matches `token`'s. Every entry is
    /// compared, each in constant time.
    fn principal(&self, token: &str) -> Option<&str> {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut found = None;
        for (principal, expected) in &self.entries {
            let diff = expected.iter().zip(digest.as_ref()).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 && found.is_none() {
                found = Some(principal.as_str());
            }
        }
        found
    }

    /// How many tokens it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn decode_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Decides who is calling (see the module docs).
#[derive(Debug)]
pub struct Authenticator {
    tokens: Option<Arc<RwLock<TokenTable>>>,
    /// Mode `mtls`: the client certificate names the principal.
    by_certificate: bool,
    /// The listener's TLS when it asks for client certificates: each
    /// request's chain is checked, whatever the mode.
    client_certs: Option<Arc<ServerTls>>,
    admins: Vec<String>,
}

impl Authenticator {
    /// The authenticator of `settings` over the listener's `tls`; in mode
    /// `token` it reads the file now and starts watching it (needs a Tokio
    /// runtime).
    pub fn new(settings: &AuthSettings, tls: Option<Arc<ServerTls>>) -> Result<Authenticator, String> {
        let client_certs = tls.filter(|t| t.mutual());
        let mut by_certificate = false;
        let tokens = match &settings.mode {
            AuthMode::None => {
                info!("auth: none (server.auth.mode): every client may run every agent");
                None
            }
            AuthMode::Mtls => {
                if client_certs.is_none() {
                    return Err("server.auth.mode \"mtls\" needs server.tls.client_ca_file".into());
                }
                info!("auth: mtls: a client is its certificate's first URI SAN, else its first DNS SAN");
                by_certificate = true;
                None
            }
            AuthMode::Token { tokens_file } => {
                let bytes =
                    std::fs::read(tokens_file).map_err(|e| format!("cannot read {}: {e}", tokens_file.display()))?;
                let table = TokenTable::parse(&String::from_utf8_lossy(&bytes))
                    .map_err(|e| format!("{}: {e}", tokens_file.display()))?;
                info!(path = %tokens_file.display(), tokens = table.len(), "auth: bearer tokens");
                let table = Arc::new(RwLock::new(table));
                tokio::spawn(watch(tokens_file.clone(), Arc::downgrade(&table), Some(bytes)));
                Some(table)
            }
        };
        Ok(Authenticator { tokens, by_certificate, client_certs, admins: settings.admins.clone() })
    }

    /// Whether callers must authenticate.
    pub fn enabled(&self) -> bool {
        self.tokens.is_some() || self.by_certificate
    }

    /// The caller of a request: UNAUTHENTICATED without a valid client
    /// certificate (when the listener asks for one) or token (mode `token`).
    pub fn authenticate<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        let certified = match &self.client_certs {
            Some(tls) => tls.client_identity(request.peer_certs().as_deref().map(Vec::as_slice))?,
            None => None,
        };
        let name = if self.by_certificate {
            certified.map(|c| c.to_string()).ok_or_else(|| Status::unauthenticated("present a client certificate"))?
        } else if let Some(tokens) = &self.tokens {
            let token = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .ok_or_else(|| Status::unauthenticated("send `authorization: Bearer <token>`"))?;
            let table = crate::sync::read(tokens);
            table.principal(token).ok_or_else(|| Status::unauthenticated("the token is not valid"))?.to_owned()
        } else {
            return Ok(Principal { name: ANONYMOUS.to_owned(), admin: true });
        };
        let admin = self.admins.contains(&name);
        Ok(Principal { name, admin })
    }
}

/// Follows the tokens file (see [`crate::reload`]): a changed file replaces
/// the table; one that doesn't parse (half written) leaves the previous
/// tokens in force until it changes again; a deleted file revokes every
/// token (removing the file is how an operator shuts everyone out).
async fn watch(path: PathBuf, table: std::sync::Weak<RwLock<TokenTable>>, seen: Option<Vec<u8>>) {
    let read = |_: &RwLock<TokenTable>| match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    };
    let apply = |table: &RwLock<TokenTable>, bytes: &Option<Vec<u8>>| {
        let new = match bytes {
            None => {
                warn!(path = %path.display(), "auth: the tokens file was deleted: every token is revoked");
                TokenTable::default()
            }
            Some(bytes) => match TokenTable::parse(&String::from_utf8_lossy(bytes)) {
                Ok(new) => {
                    info!(path = %path.display(), tokens = new.len(), "auth: tokens file reloaded");
                    new
                }
                Err(e) => {
                    warn!(error = %e, "auth: tokens file not reloaded; the previous tokens stay in force");
                    return;
                }
            },
        };
        *crate::sync::write(table) = new;
    };
    let unreadable = |e: &str| warn!(path = %path.display(), error = %e, "auth: tokens file not readable; retrying");
    crate::reload::follow(table, RELOAD_EVERY, seen, read, apply, unreadable).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(token: &str) -> String {
        ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn tokens_map_to_their_principals_and_nothing_else() {
        let text = format!("# who may call\nalice {}\n\nops {}\n", sha("a-secret"), sha("o-secret"));
        let table = TokenTable::parse(&text).unwrap();
        assert_eq!(table.principal("a-secret"), Some("alice"));
        assert_eq!(table.principal("o-secret"), Some("ops"));
        assert_eq!(table.principal("a-secreT"), None);
        assert_eq!(table.principal(""), None);
    }

    /// The file followed by content: a changed file replaces the table, a
    /// half-written one keeps the previous tokens, and a deleted one revokes
    /// every token (it kept them before).
    #[tokio::test(start_paused = true)]
    async fn the_tokens_file_is_followed_and_its_deletion_revokes_every_token() {
        let dir = std::env::temp_dir().join(format!("lattice-auth-{}", crate::session::new_id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens");
        let first = format!("alice {}\n", sha("a-secret"));
        std::fs::write(&path, &first).unwrap();
        let table = Arc::new(RwLock::new(TokenTable::parse(&first).unwrap()));
        tokio::spawn(watch(path.clone(), Arc::downgrade(&table), Some(first.into_bytes())));
        let who = |token: &str| table.read().unwrap().principal(token).map(str::to_owned);
        let settle = || tokio::time::sleep(RELOAD_EVERY * 2);

        std::fs::write(&path, "alice 12").unwrap();
        settle().await;
        assert_eq!(who("a-secret").as_deref(), Some("alice"), "a file that doesn't parse keeps the tokens");
        std::fs::write(&path, format!("bob {}\n", sha("b-secret"))).unwrap();
        settle().await;
        assert_eq!((who("a-secret"), who("b-secret").as_deref()), (None, Some("bob")));
        std::fs::remove_file(&path).unwrap();
        settle().await;
        assert_eq!(who("b-secret"), None, "a deleted tokens file revokes every token");
        std::fs::write(&path, format!("carol {}\n", sha("c-secret"))).unwrap();
        settle().await;
        assert_eq!(who("c-secret").as_deref(), Some("carol"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_line_is_named_without_its_digest() {
        let err = TokenTable::parse("alice 1234\n").unwrap_err();
        assert!(err.contains("line 1") && !err.contains("1234"), "{err}");
        assert!(TokenTable::parse("alice\n").unwrap_err().contains("line 1"));
    }
}
