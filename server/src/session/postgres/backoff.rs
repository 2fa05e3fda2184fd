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
        self.pause_or(std::future::pending()).await
    }

    /// [`Backoff::pause`], cut short if `sooner` resolves first (a sign
    /// that asking now may succeed).
    pub(super) async fn pause_or(&mut self, sooner: impl Future<Output = ()>) -> bool {
        if Instant::now() + self.pause >= self.until {
            return false;
        }
        tokio::select! {
            () = tokio::time::sleep(self.pause) => {}
            () = sooner => {}
        }
        self.pause = (self.pause * 2).min(self.most);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pauses double up to the most, none ends past the end, and a sign
    /// that asking may succeed cuts the pause short (the next is doubled
    /// all the same).
    #[tokio::test(start_paused = true)]
    async fn pauses_double_and_a_sign_cuts_one_short() {
        let ms = |n: u64| Duration::from_millis(n);
        let start = Instant::now();
        let mut again = Backoff::new(start + ms(1000), ms(100), ms(300));
        assert!(again.pause().await);
        assert_eq!(start.elapsed(), ms(100));
        let sign = tokio::time::sleep(ms(30));
        assert!(again.pause_or(sign).await);
        assert_eq!(start.elapsed(), ms(130), "the sign came after 30 ms of a 200 ms pause");
        assert!(again.pause().await);
        assert!(again.pause().await);
        assert_eq!(start.elapsed(), ms(730));
        assert!(!again.pause().await, "a pause past the end");
        assert_eq!(start.elapsed(), ms(730), "gave up without waiting");
    }
}
