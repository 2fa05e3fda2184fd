//! Busy polling (`server.busy_poll_us`): while a hook or tool call, or a
//! query's statement to the session store, is in flight, `lattice
//! serve`'s one worker thread keeps polling for readiness instead of
//! sleeping in the kernel, for at most the budget at a time.
//!
//! A thread that sleeps while it waits for a peer's answer pays for the
//! sleep when the answer comes: the kernel switches it back in, and on a
//! virtual machine a core that went idle waits for the hypervisor to
//! deliver the wake-up. For a call answered in ~100 µs that is a large
//! share of it, once per call. Polling keeps the thread on its core
//! (HAProxy's `busy-polling` does the same, for the same reason), and the
//! price is that core: up to all of it while calls are in flight. With no
//! call in flight nothing polls, so an idle server sleeps as before. Off
//! unless configured; it needs `server.worker_threads = 1`.
//!
//! The poller is a task on the runtime: while it runs, each turn of the
//! runtime runs the tasks that are ready, polls the I/O driver without
//! waiting, and comes back to the poller, which yields again: to the
//! runtime, and then its core to the kernel (`sched_yield`). A thread of
//! another process that is ready to run on that core (the hook the call
//! waits for, where processes outnumber cores) runs first, and the poller
//! takes only the time no one else wants. Without that yield, on 2 cores
//! shared with the peers, the polling cost throughput at 64 concurrent
//! queries and tail latency at one.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use tokio::{
    sync::Notify,
    time::{Duration, Instant},
};

pub use crate::config::BUSY_POLL_MAX_US as MAX_US;

/// Calls in flight, and the poller they wake.
#[derive(Debug, Default)]
pub struct Poller {
    in_flight: AtomicUsize,
    sent: Notify,
    /// Turns the poller has taken (`lattice_busy_poll_turns_total`).
    turns: Arc<AtomicUsize>,
}

/// The agent runtime's busy poller (see the module docs): it polls while
/// a call on one of its peers is in flight, and stops when dropped.
#[derive(Debug)]
pub struct BusyPoll {
    poller: Arc<Poller>,
    budget: Duration,
    task: tokio::task::AbortHandle,
}

impl BusyPoll {
    /// Starts polling on the current runtime, for at most `budget` at a
    /// time.
    pub fn start(budget: Duration) -> BusyPoll {
        let poller = Arc::new(Poller::default());
        let running = poller.clone();
        let task = tokio::spawn(async move { running.run(budget).await }).abort_handle();
        BusyPoll { poller, budget, task }
    }

    /// What calls mark themselves in flight on.
    pub fn poller(&self) -> Arc<Poller> {
        self.poller.clone()
    }

    /// How long it polls at a time.
    pub fn budget(&self) -> Duration {
        self.budget
    }
}

impl Drop for BusyPoll {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Poller {
    /// Marks a call in flight until the guard is dropped, and wakes the
    /// poller.
    pub fn call(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.sent.notify_one();
        InFlight(self)
    }

    /// Polls while a call is in flight, for at most `budget` after a call
    /// woke it; then waits for the next call.
    pub async fn run(&self, budget: Duration) {
        loop {
            self.sent.notified().await;
            let until = Instant::now() + budget;
            while self.in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < until {
                self.turns.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
                // The core goes to any other thread ready to run on it
                // first (see the module docs).
                std::thread::yield_now();
            }
        }
    }

    /// The turns taken so far, as the metric reads them.
    pub fn turns(&self) -> Arc<AtomicUsize> {
        self.turns.clone()
    }

    #[cfg(test)]
    fn polls(&self) -> usize {
        self.turns.load(Ordering::Relaxed)
    }
}

/// A call in flight (see [`Poller::call`]).
#[derive(Debug)]
pub struct InFlight<'a>(&'a Poller);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lets the other tasks of the runtime run `n` turns.
    async fn turns(n: usize) {
        for _ in 0..n {
            tokio::task::yield_now().await;
        }
    }

    /// The poller polls only while a call is in flight, and for at most its
    /// budget at a time; the next call starts a new budget. On the paused
    /// clock, time moves only when the test moves it.
    #[tokio::test(start_paused = true)]
    async fn it_polls_while_a_call_is_in_flight_for_the_budget_at_most() {
        let poller: &'static Poller = Box::leak(Box::default());
        tokio::spawn(poller.run(Duration::from_micros(200)));
        turns(10).await;
        assert_eq!(poller.polls(), 0, "nothing in flight: it waits");

        let call = poller.call();
        turns(10).await;
        let polled = poller.polls();
        assert!(polled >= 5, "a call in flight: it polls each turn ({polled})");

        tokio::time::advance(Duration::from_micros(199)).await;
        turns(10).await;
        assert!(poller.polls() > polled, "still within the budget");

        tokio::time::advance(Duration::from_micros(2)).await;
        turns(2).await;
        let at_budget = poller.polls();
        turns(10).await;
        assert_eq!(poller.polls(), at_budget, "past the budget it waits, though the call is in flight");

        let second = poller.call();
        turns(10).await;
        assert!(poller.polls() > at_budget, "the next call starts a new budget");

        drop((call, second));
        turns(2).await;
        let done = poller.polls();
        turns(10).await;
        assert_eq!(poller.polls(), done, "no call in flight: it stops within its budget");
    }

    /// A call dropped before it was answered (its deadline passed, its
    /// query was cancelled) is no longer in flight.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_call_is_no_longer_in_flight() {
        let poller: &'static Poller = Box::leak(Box::default());
        tokio::spawn(poller.run(Duration::from_millis(10)));
        let cancelled = tokio::spawn(async move {
            let _call = poller.call();
            std::future::pending::<()>().await;
        });
        turns(10).await;
        assert!(poller.polls() > 0);
        cancelled.abort();
        turns(2).await;
        let after = poller.polls();
        turns(10).await;
        assert_eq!(poller.polls(), after);
        assert_eq!(poller.in_flight.load(Ordering::Relaxed), 0);
    }
}
