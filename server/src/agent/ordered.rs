//! Concurrent calls whose outputs are released in order, and whose first
//! failure ends everything at once.
//!
//! A reply's tool calls run up to `parallel_tool_calls` at a time, but their
//! results must reach the trace, the client and the model in tool_use
//! order. Collecting them in order (`buffered`) would hide a failure behind
//! a slower earlier call: a hook failing on a fast call's result would wait
//! for a slow sibling to finish. [`InOrder`] polls every running call, keeps
//! early finishers until their turn, and returns the first error as soon as
//! it happens; dropping it drops (cancels) every call still running.

use std::{collections::BTreeMap, future::Future};

use futures_util::{StreamExt, stream::FuturesUnordered};

/// Runs futures that each resolve to `Ok((index, value))` or an error.
/// `index` is the future's position in the input, counted from 0.
pub(crate) struct InOrder<F, T> {
    /// Not started yet, in order.
    waiting: std::vec::IntoIter<F>,
    /// Started, at most `limit` at once.
    running: FuturesUnordered<F>,
    /// Finished before their turn, by index.
    finished: BTreeMap<usize, T>,
    /// The index released next.
    next: usize,
}

impl<F, T, E> InOrder<F, T>
where
    F: Future<Output = Result<(usize, T), E>>,
{
    /// Starts the first `limit` (at least one) of `calls`.
    pub(crate) fn new(calls: Vec<F>, limit: usize) -> Self {
        let mut waiting = calls.into_iter();
        let running = waiting.by_ref().take(limit.max(1)).collect();
        Self { waiting, running, finished: BTreeMap::new(), next: 0 }
    }

    /// The next value in index order once it and every earlier one have
    /// finished; the first error as soon as any call fails; `None` when all
    /// were released. A new call starts whenever one finishes.
    pub(crate) async fn next(&mut self) -> Option<Result<T, E>> {
        loop {
            if let Some(value) = self.finished.remove(&self.next) {
                self.next += 1;
                return Some(Ok(value));
            }
            match self.running.next().await? {
                Err(e) => return Some(Err(e)),
                Ok((index, value)) => {
                    self.finished.insert(index, value);
                    self.running.extend(self.waiting.next());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{Arc, Mutex},
        time::Duration,
    };

    use tokio::time::{Instant, sleep};

    use super::*;

    /// Records, on drop, that a call ended without finishing.
    struct Dropped(Arc<Mutex<Vec<usize>>>, usize, bool);

    impl Drop for Dropped {
        fn drop(&mut self) {
            if !self.2 {
                self.0.lock().unwrap().push(self.1);
            }
        }
    }

    /// A call that takes `ms` and then succeeds or fails, noting whether it
    /// was cancelled.
    fn call(
        index: usize,
        ms: u64,
        fails: bool,
        cancelled: &Arc<Mutex<Vec<usize>>>,
    ) -> impl Future<Output = Result<(usize, Instant), usize>> + use<> {
        let guard = Dropped(cancelled.clone(), index, false);
        async move {
            // The whole guard moves in (not just the field written below).
            let mut guard = guard;
            sleep(Duration::from_millis(ms)).await;
            guard.2 = true;
            if fails { Err(index) } else { Ok((index, Instant::now())) }
        }
    }

    /// Outputs come in index order, each as soon as it and all before it
    /// are done: the slow first call holds back the two that finished
    /// before it, and releases them at the moment it finishes.
    #[tokio::test(start_paused = true)]
    async fn values_are_released_in_order_as_soon_as_they_can_be() {
        let cancelled = Arc::default();
        let start = Instant::now();
        let calls = [(0, 30), (1, 10), (2, 20)].map(|(i, ms)| call(i, ms, false, &cancelled));
        let mut ordered = InOrder::new(calls.into(), 3);
        let mut released = Vec::new();
        while let Some(done) = ordered.next().await {
            let finished_at = done.unwrap();
            released.push((finished_at - start, Instant::now() - start));
        }
        let ms = Duration::from_millis;
        assert_eq!(released, vec![(ms(30), ms(30)), (ms(10), ms(30)), (ms(20), ms(30))]);
        assert!(cancelled.lock().unwrap().is_empty());
    }

    /// The first failure comes back the moment it happens, not after a
    /// slower earlier call; dropping the runner cancels that call.
    #[tokio::test(start_paused = true)]
    async fn the_first_failure_returns_at_once_and_cancels_the_rest() {
        let cancelled = Arc::default();
        let start = Instant::now();
        let calls = vec![call(0, 5_000, false, &cancelled), call(1, 10, true, &cancelled)];
        let mut ordered = InOrder::new(calls, 2);
        assert_eq!(ordered.next().await.map(|r| r.map(|_| ())), Some(Err(1)));
        assert_eq!(Instant::now() - start, Duration::from_millis(10));
        drop(ordered);
        assert_eq!(*cancelled.lock().unwrap(), vec![0]);
    }

    /// At most `limit` calls run at once: with one, they run one after the
    /// other and a later one is never started after a failure.
    #[tokio::test(start_paused = true)]
    async fn the_limit_bounds_what_runs_at_once() {
        let cancelled = Arc::default();
        let start = Instant::now();
        let calls = [(0, 10, false), (1, 10, true), (2, 10, false)].map(|(i, ms, f)| call(i, ms, f, &cancelled));
        let mut ordered = InOrder::new(calls.into(), 1);
        assert!(matches!(ordered.next().await, Some(Ok(_))));
        assert_eq!(ordered.next().await.map(|r| r.map(|_| ())), Some(Err(1)));
        assert_eq!(Instant::now() - start, Duration::from_millis(20));
        drop(ordered);
        // The third was never polled: its guard is dropped unfinished.
        assert_eq!(*cancelled.lock().unwrap(), vec![2]);
    }
}
