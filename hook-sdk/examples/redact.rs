//! `redact`: a PII-redaction hook for tool results.
//!
//! Replaces, in every tool result's text:
//!
//! | what | marker |
//! |---|---|
//! | email addresses | `[REDACTED:email]` |
//! | card numbers (13-19 digits, spaces or dashes allowed, Luhn-checked) | `[REDACTED:card]` |
//! | phone numbers (7-15 digits written with a `+` or separators: spaces, dots, dashes, parentheses) | `[REDACTED:phone]` |
//! | API-key-like tokens (`sk_live_…`, `sk-…`, `ghp_…`, `AKIA…`, `xox…-`, long `key_`/`token_` values) | `[REDACTED:api_key]` |
//!
//! A bare run of digits is neither a phone number nor, unless it passes the
//! Luhn check, a card number, so order ids and amounts stay; and
//! a result with nothing to redact is kept as it is (an unset reply).
//!
//! Run: `cargo run -p lattice-hook-sdk --example redact -- --listen 127.0.0.1:50071`
//! and register it for the `tool_result` event. With `--tls-cert` and
//! `--tls-key` (PEM files) it serves TLS; `--tls-client-ca` also requires
//! Lattice to present a certificate signed by that CA (mutual TLS).

use std::{net::SocketAddr, path::PathBuf, sync::LazyLock};

use clap::Parser;
use lattice_hook_sdk::{Hook, Server, Status, ToolResultBlock, ToolResultCall, async_trait};
use regex::Regex;

static EMAIL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}").expect("valid regex"));
static API_KEY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(?:sk_(?:live|test)_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|xox[abpr]-[A-Za-z0-9-]{10,}|(?:key|token)_[A-Za-z0-9]{24,})\b")
        .expect("valid regex")
});
/// Digit groups separated by single spaces or dashes.
static DIGITS: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\d(?:[ -]?\d){12,18}").expect("valid regex"));
static PHONE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){1,4}").expect("valid regex")
});

/// The Luhn checksum of a digit string.
fn luhn(digits: &str) -> bool {
    let mut sum = 0;
    for (i, c) in digits.chars().rev().enumerate() {
        let Some(mut d) = c.to_digit(10) else { return false };
        if i % 2 == 1 {
            d *= 2;
            if d > 9 {
                d -= 9;
            }
        }
        sum += d;
    }
    sum % 10 == 0
}

/// Redacts `text`; returns the new text and how many values were replaced.
pub fn redact(text: &str) -> (String, usize) {
    let mut count = 0;
    let mut out = API_KEY
        .replace_all(text, |_: &regex::Captures| {
            count += 1;
            "[REDACTED:api_key]"
        })
        .into_owned();
    out = EMAIL
        .replace_all(&out, |_: &regex::Captures| {
            count += 1;
            "[REDACTED:email]"
        })
        .into_owned();
    out = DIGITS
        .replace_all(&out, |c: &regex::Captures| {
            let digits: String = c[0].chars().filter(char::is_ascii_digit).collect();
            if (13..=19).contains(&digits.len()) && luhn(&digits) {
                count += 1;
                "[REDACTED:card]".to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    out = PHONE
        .replace_all(&out, |c: &regex::Captures| {
            let digits = c[0].chars().filter(char::is_ascii_digit).count();
            let formatted = c[0].contains(['+', ' ', '.', '-', '(']);
            if (7..=15).contains(&digits) && formatted {
                count += 1;
                "[REDACTED:phone]".to_owned()
            } else {
                c[0].to_owned()
            }
        })
        .into_owned();
    (out, count)
}

/// The hook: redacts every text block of a tool result.
pub struct Redact;

#[async_trait]
impl Hook for Redact {
    async fn on_tool_result(&self, call: ToolResultCall) -> Result<Option<ToolResultBlock>, Status> {
        let mut total = 0;
        let mut out = call.result.clone();
        for block in &mut out.content {
            let (text, n) = redact(&block.text);
            total += n;
            block.text = text;
        }
        tracing::info!(tool_use_id = %call.tool_use_id, redactions = total, "tool result checked");
        Ok((total > 0).then_some(out))
    }
}

#[derive(Parser)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:50071")]
    listen: SocketAddr,
    /// Serve TLS with this certificate (chain), PEM.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key, PEM.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM): mutual TLS.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Log lines: text or json.
    #[arg(long, default_value = "text")]
    log_format: lattice_hook_sdk::LogFormat,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    lattice_hook_sdk::init_logs(args.log_format);
    let read = |path: &PathBuf| std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()));
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let mut tls = lattice_hook_sdk::Tls::new(read(cert)?, read(key)?);
            if let Some(ca) = &args.tls_client_ca {
                tls = tls.require_client_ca(read(ca)?);
            }
            Server::new(Redact).tls(tls).serve(args.listen).await?;
        }
        _ => Server::new(Redact).serve(args.listen).await?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_each_kind_and_keeps_the_rest() {
        let input = "Ada <ada.lovelace@example.com>, +44 20 7946 0958, card 4111 1111 1111 1111, \
                     key sk_live_51HxQ2eZvKYlo2CExampleKey9, order 1234567890123 (not Luhn), plan: team";
        let (out, n) = redact(input);
        assert!(out.contains("[REDACTED:email]"), "{out}");
        assert!(out.contains("[REDACTED:phone]"), "{out}");
        assert!(out.contains("[REDACTED:card]"), "{out}");
        assert!(out.contains("[REDACTED:api_key]"), "{out}");
        for secret in
            ["ada.lovelace@example.com", "7946 0958", "4111 1111 1111 1111", "sk_live_51HxQ2eZvKYlo2CExampleKey9"]
        {
            assert!(!out.contains(secret), "{secret} survived: {out}");
        }
        assert!(out.contains("plan: team"));
        assert_eq!(n, 4);
    }

    #[test]
    fn luhn_separates_cards_from_other_numbers() {
        assert!(luhn("4111111111111111"));
        assert!(luhn("5555555555554444"));
        assert!(!luhn("4111111111111112"));
        let (out, _) = redact("card 5555-5555-5555-4444");
        assert_eq!(out, "card [REDACTED:card]");
    }

    #[tokio::test]
    async fn clean_results_are_kept() {
        let call = ToolResultCall {
            tool_use_id: "t".into(),
            result: ToolResultBlock { tool_use_id: "t".into(), content: vec![], is_error: false },
            ..Default::default()
        };
        assert_eq!(Redact.on_tool_result(call).await.unwrap(), None);
    }
}
