//! Pauses between attempts to ask the database again.

use std::time::Duration;

use tokio::time::Instant;

/// Pauses from a first one, doubling up to a most, until a moment past
/// which asking is pointless.
#[derive(Debug)]
pub(super) struct Backoff {
    until: Instant,
    pause: Duration,
    most: Duration,
}

impl Backoff {
    pub(super) fn new(until: Instant, first: Duration, most: Duration) -> Self {
        Self { until, pause: first, most }
    }

    /// When asking stops.
    pub(super) fn until(&self) -> Instant {
        self.until
    }

    /// Waits before asking again; false, at once, when that would end past
    /// [`Backoff::until`].
    pub(super) async fn pause(&mut self) -> bool {
        if Instant::now() + self.pause >= self.until {
            return false;
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(self.most);
        true
    }
}
