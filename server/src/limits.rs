//! Per-principal limits (`[server.limits]`): queries in flight at once and
//! queries started per minute, each principal on its own (with
//! `[server.auth] mode = "none"` every caller is the one principal
//! `anonymous`, so the limits are global). Over a limit a query is refused
//! with RESOURCE_EXHAUSTED and a `google.rpc.RetryInfo` saying when to try
//! again; nothing is started.

pub use crate::config::LimitSettings;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The limits' state, shared by all queries.
#[derive(Debug, Default)]
pub struct Limits {
    settings: LimitSettings,
    principals: Mutex<HashMap<String, Usage>>,
}

#[derive(Debug)]
struct Usage {
    in_flight: usize,
    /// Queries that may start now (a token bucket of `per_minute`, refilled
    /// continuously).
    tokens: f64,
    refilled: Instant,
}

/// Counts one query of a principal in flight while it lives.
#[derive(Debug)]
pub struct Admitted {
    limits: Arc<Limits>,
    principal: String,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Ok(mut all) = self.limits.principals.lock()
            && let Some(u) = all.get_mut(&self.principal)
        {
            u.in_flight = u.in_flight.saturating_sub(1);
        }
    }
}

impl Limits {
    /// Limits with `settings`.
    pub fn new(settings: LimitSettings) -> Arc<Limits> {
        Arc::new(Limits { settings, principals: Mutex::new(HashMap::new()) })
    }

    /// Admits one query of `principal`, or says why not and when to retry.
    pub fn admit(self: &Arc<Self>, principal: &str) -> Result<Option<Admitted>, Status> {
        if self.settings == LimitSettings::default() {
            return Ok(None);
        }
        let now = Instant::now();
        let mut all = self.principals.lock().map_err(|_| Status::internal("the limits are unavailable"))?;
        let per_minute = self.settings.queries_per_minute.map(f64::from);
        let usage = all.entry(principal.to_owned()).or_insert_with(|| Usage {
            in_flight: 0,
            tokens: per_minute.unwrap_or(0.0),
            refilled: now,
        });
        if let Some(most) = self.settings.queries_in_flight
            && usage.in_flight >= most
        {
            return Err(refused(
                format!("{principal:?} has {most} queries in flight, its limit (server.limits.queries_in_flight)"),
                Duration::from_secs(1),
            ));
        }
        if let Some(rate) = per_minute {
            let elapsed = now.saturating_duration_since(usage.refilled).as_secs_f64();
            usage.tokens = (usage.tokens + elapsed * rate / 60.0).min(rate);
            usage.refilled = now;
            if usage.tokens < 1.0 {
                let wait = Duration::from_secs_f64((1.0 - usage.tokens) * 60.0 / rate);
                return Err(refused(
                    format!(
                        "{principal:?} started {rate} queries in the last minute, its limit \
                         (server.limits.queries_per_minute)"
                    ),
                    wait,
                ));
            }
            usage.tokens -= 1.0;
        }
        usage.in_flight += 1;
        Ok(Some(Admitted { limits: self.clone(), principal: principal.to_owned() }))
    }
}

fn refused(message: String, retry_after: Duration) -> Status {
    let millis = retry_after.as_millis().max(1) as u64;
    let message = format!("{message}; retry in {millis} ms");
    Status::with_error_details(
        Code::ResourceExhausted,
        message,
        ErrorDetails::with_retry_info(Some(Duration::from_millis(millis))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rate refills with time: on tokio's paused clock, a principal
    /// at its limit may start one more query after 60 s / rate, and the
    /// refusal says so; another principal is not affected.
    #[tokio::test(start_paused = true)]
    async fn the_rate_refills_with_time_per_principal() {
        let limits = Limits::new(LimitSettings { queries_in_flight: None, queries_per_minute: Some(2) });
        drop(limits.admit("alice").unwrap());
        drop(limits.admit("alice").unwrap());
        let refused = limits.admit("alice").unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert_eq!(refused.get_details_retry_info().and_then(|r| r.retry_delay), Some(Duration::from_secs(30)));
        assert!(limits.admit("bob").is_ok(), "bob has his own budget");
        tokio::time::advance(Duration::from_secs(29)).await;
        assert!(limits.admit("alice").is_err(), "not yet");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(limits.admit("alice").is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn in_flight_queries_are_counted_until_they_end() {
        let limits = Limits::new(LimitSettings { queries_in_flight: Some(1), queries_per_minute: None });
        let first = limits.admit("alice").unwrap();
        assert_eq!(limits.admit("alice").unwrap_err().code(), Code::ResourceExhausted);
        assert!(limits.admit("bob").is_ok());
        drop(first);
        assert!(limits.admit("alice").is_ok());
    }
}
