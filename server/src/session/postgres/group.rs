//! Group commit: the commits of queries on different sessions that wait
//! at the same time go to the database as one statement.
//!
//! PostgreSQL spends more on a statement (its round trip, its transaction,
//! its WAL record of the commit) than on the rows it writes: one statement
//! carrying eight sessions' commits costs it about a quarter of what eight
//! statements do. Nothing waits to gather a group: a commit goes at once
//! when no commit statement is on its way, and those that arrive meanwhile
//! go together in the next one. With one query at a time, every commit
//! goes alone, as before.
//!
//! One statement on its way at a time makes the groups largest. So that a
//! statement stuck on the database (a lock, a silent connection) does not
//! hold up every other commit of the replica until its deadline, a second
//! one leaves when the first has been on its way for [`RESCUE`] with
//! commits waiting behind it.
//!
//! Each session's row keeps its own checks (the lease's token and the
//! version it read), so in one statement some commits may land and others
//! find their lease gone, each answered as if sent alone, and each keeps
//! its own token for the read-back of a lost reply. A statement the
//! database refuses writes nothing (its transaction rolls back); its
//! commits are then sent again one by one, so that one session's row can
//! fail only its own query.
//!
//! A commit still waiting for its turn when its query's deadline comes is
//! taken back: nothing was sent, so the query knows nothing was written.

use std::{
    future::Future,
    mem,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use futures_util::future::join_all;
use tokio::sync::oneshot;

use super::{
    PostgresStore,
    commit::{Commit, Sent},
};

/// Commit statements on their way at once, at most.
const IN_FLIGHT: usize = 2;
/// How long a commit statement is on its way, with commits waiting, before
/// another one leaves beside it.
const RESCUE: std::time::Duration = std::time::Duration::from_millis(5);
/// Commits in one statement, at most.
const MAX_COMMITS: usize = 64;
/// The stored text of one statement's commits, at most (a larger commit
/// goes alone).
const MAX_BYTES: usize = 1 << 20;

/// A commit waiting for its statement, and where its answer goes.
#[derive(Debug)]
struct Waiting {
    commit: Commit,
    answer: oneshot::Sender<Sent>,
}

/// The commits waiting, and the statements on their way.
#[derive(Debug, Default)]
struct Queue {
    waiting: Vec<Waiting>,
    flying: usize,
    /// Statements started so far.
    started: u64,
    /// Whether a second statement is to leave if the one on its way
    /// takes [`RESCUE`].
    rescue_armed: bool,
}

/// What a commit handed to the group starts.
#[derive(Debug, PartialEq, Eq)]
enum Start {
    /// A statement now.
    Statement,
    /// A second statement after [`RESCUE`], unless a statement started
    /// after the `started`-th meanwhile.
    Rescue { started: u64 },
    /// Nothing: it goes with the next statement.
    Nothing,
}

impl Queue {
    /// Adds `w`; what it starts.
    fn push(&mut self, w: Waiting) -> Start {
        self.waiting.push(w);
        if self.flying == 0 {
            self.flying = 1;
            Start::Statement
        } else if self.flying < IN_FLIGHT && !self.rescue_armed {
            self.rescue_armed = true;
            Start::Rescue { started: self.started }
        } else {
            Start::Nothing
        }
    }

    /// After [`RESCUE`]: whether a second statement is to leave (no
    /// statement started since the `started`-th, and commits wait).
    fn rescue(&mut self, started: u64) -> bool {
        self.rescue_armed = false;
        let stuck = self.started == started && !self.waiting.is_empty() && self.flying < IN_FLIGHT;
        if stuck {
            self.flying += 1;
        }
        stuck
    }

    /// The next statement's commits, or None (and one statement fewer on
    /// its way) when none wait.
    fn next(&mut self) -> Option<Vec<Waiting>> {
        if self.waiting.is_empty() {
            self.flying -= 1;
            return None;
        }
        self.started += 1;
        Some(self.take())
    }

    /// The next statement's commits: those waiting, in order, up to
    /// [`MAX_COMMITS`] and [`MAX_BYTES`] (the first always).
    fn take(&mut self) -> Vec<Waiting> {
        let (mut n, mut bytes) = (0, 0);
        for w in &self.waiting {
            bytes += w.commit.bytes();
            if n == MAX_COMMITS || (n > 0 && bytes > MAX_BYTES) {
                break;
            }
            n += 1;
        }
        let rest = self.waiting.split_off(n);
        mem::replace(&mut self.waiting, rest)
    }

    /// Takes back the commit under `token`, if it is still waiting.
    fn withdraw(&mut self, token: uuid::Uuid) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.commit.token != token);
        self.waiting.len() < before
    }
}

/// The store's commits on their way to the database.
#[derive(Debug, Default)]
pub(super) struct Group {
    queue: Mutex<Queue>,
    /// Commit statements sent with one commit, and with several; and the
    /// commits those carried.
    pub(super) alone: Arc<AtomicUsize>,
    pub(super) grouped: Arc<AtomicUsize>,
    pub(super) grouped_commits: Arc<AtomicUsize>,
}

/// A commit handed to the group: its answer comes when its statement's
/// does. Dropped before its commit was sent (its query ended), it takes
/// the commit back.
pub(super) struct Ticket {
    pub(super) answer: oneshot::Receiver<Sent>,
    token: uuid::Uuid,
    group: Arc<Group>,
}

impl Ticket {
    /// Takes the commit back if it has not been sent: true when nothing
    /// was (or will be) sent.
    pub(super) fn withdraw(&self) -> bool {
        crate::sync::lock(&self.group.queue).withdraw(self.token)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.withdraw();
    }
}

impl Group {
    /// Sends statements with `send` until no commit waits.
    async fn fly<F: Future<Output = ()>>(&self, send: impl Fn(Vec<Waiting>) -> F) {
        loop {
            let next = crate::sync::lock(&self.queue).next();
            let Some(batch) = next else { return };
            send(batch).await;
        }
    }

    /// Hands `w` to the group: a statement leaves with `send` at once if
    /// none is on its way, or a second after [`RESCUE`] if the one on its
    /// way is stuck.
    fn hand<F, Fut>(self: &Arc<Self>, w: Waiting, send: F)
    where
        F: Fn(Vec<Waiting>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let start = crate::sync::lock(&self.queue).push(w);
        let group = self.clone();
        match start {
            Start::Statement => {
                tokio::spawn(async move { group.fly(send).await });
            }
            Start::Rescue { started } => {
                tokio::spawn(async move {
                    tokio::time::sleep(RESCUE).await;
                    let rescue = crate::sync::lock(&group.queue).rescue(started);
                    if rescue {
                        group.fly(send).await;
                    }
                });
            }
            Start::Nothing => {}
        }
    }
}

impl PostgresStore {
    /// Hands `commit` to the group (see [`Group::hand`]).
    pub(super) fn send_commit(&self, commit: Commit) -> Ticket {
        let (tx, answer) = oneshot::channel();
        let token = commit.token;
        let store = self.clone();
        let send = move |batch| {
            let store = store.clone();
            async move { store.send_batch(batch).await }
        };
        self.group.hand(Waiting { commit, answer: tx }, send);
        Ticket { answer, token, group: self.group.clone() }
    }

    /// One statement for `batch`, each commit answered: past the last of
    /// their deadlines nobody waits, and the statement, cut off, is
    /// answered as sent without an answer.
    async fn send_batch(&self, batch: Vec<Waiting>) {
        let Some(until) = batch.iter().map(|w| w.commit.until).max() else { return };
        let _polling = self.polling();
        if let [one] = &batch[..] {
            self.group.alone.fetch_add(1, Ordering::Relaxed);
            // Cut off: sent, and no answer.
            let sent = tokio::time::timeout_at(until, self.commit_one(&one.commit)).await.unwrap_or(Sent::Unknown);
            for w in batch {
                let _ = w.answer.send(sent);
            }
            return;
        }
        self.group.grouped.fetch_add(1, Ordering::Relaxed);
        self.group.grouped_commits.fetch_add(batch.len(), Ordering::Relaxed);
        let commits: Vec<&Commit> = batch.iter().map(|w| &w.commit).collect();
        let answers = match tokio::time::timeout_at(until, self.commit_many(&commits)).await {
            // Cut off: sent, and no answer.
            Err(_) => vec![Sent::Unknown; batch.len()],
            Ok(Ok(answers)) => answers,
            Ok(Err(Sent::NotWritten)) => {
                // Refused, so nothing written: each again on its own.
                let alone = commits.iter().map(|c| async move {
                    self.group.alone.fetch_add(1, Ordering::Relaxed);
                    tokio::time::timeout_at(c.until, self.commit_one(c)).await.unwrap_or(Sent::Unknown)
                });
                join_all(alone).await
            }
            Ok(Err(other)) => vec![other; batch.len()],
        };
        for (w, sent) in batch.into_iter().zip(answers) {
            let _ = w.answer.send(sent);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;

    fn waiting(bytes: usize) -> (Waiting, uuid::Uuid) {
        let token = uuid::Uuid::new_v4();
        let commit = Commit {
            id: "s".into(),
            token,
            version: 0,
            rows: vec!["x".repeat(bytes)],
            keep: None,
            until: Instant::now() + Duration::from_secs(1),
        };
        (Waiting { commit, answer: oneshot::channel().0 }, token)
    }

    /// A statement takes the commits waiting, in order, up to its limits:
    /// the first always, however large.
    #[tokio::test(start_paused = true)]
    async fn a_statement_takes_the_commits_waiting_up_to_its_limits() {
        let mut queue = Queue::default();
        let tokens: Vec<uuid::Uuid> = (0..MAX_COMMITS + 3)
            .map(|_| {
                let (w, token) = waiting(10);
                queue.waiting.push(w);
                token
            })
            .collect();
        let first: Vec<uuid::Uuid> = queue.take().iter().map(|w| w.commit.token).collect();
        assert_eq!(first, tokens[..MAX_COMMITS]);
        assert_eq!(queue.take().len(), 3);
        assert!(queue.take().is_empty());

        for bytes in [MAX_BYTES + 1, 10, MAX_BYTES / 2, MAX_BYTES / 2] {
            queue.waiting.push(waiting(bytes).0);
        }
        assert_eq!(queue.take().len(), 1, "a commit over the limit goes alone");
        assert_eq!(queue.take().len(), 2, "up to the limit");
        assert_eq!(queue.take().len(), 1);
    }

    /// A commit can be taken back while it waits, not once it is taken for
    /// a statement.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_commit_can_be_taken_back_until_it_is_sent() {
        let mut queue = Queue::default();
        let (a, a_token) = waiting(1);
        queue.waiting.push(a);
        let sent = queue.take();
        let (b, b_token) = waiting(1);
        queue.waiting.push(b);
        assert!(!queue.withdraw(a_token), "a is on its way");
        assert!(queue.withdraw(b_token));
        assert!(!queue.withdraw(b_token));
        assert!(queue.take().is_empty());
        assert_eq!(sent.len(), 1);
    }

    /// The statements a test's sender was given: when, and how many
    /// commits each; and how many were on their way at most.
    #[derive(Default)]
    struct Sent {
        batches: Mutex<Vec<(Duration, usize)>>,
        flying: AtomicUsize,
        most: AtomicUsize,
    }

    /// A sender that records each statement and answers it after
    /// `answer_in`; the first one only when `first` is notified.
    fn sender(
        sent: &Arc<Sent>,
        start: Instant,
        answer_in: Duration,
        first: Arc<tokio::sync::Notify>,
    ) -> impl Fn(Vec<Waiting>) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + 'static {
        let sent = sent.clone();
        move |batch| {
            let sent = sent.clone();
            let first = first.clone();
            Box::pin(async move {
                let n = {
                    let mut batches = crate::sync::lock(&sent.batches);
                    batches.push((start.elapsed(), batch.len()));
                    batches.len()
                };
                let flying = sent.flying.fetch_add(1, Ordering::SeqCst) + 1;
                sent.most.fetch_max(flying, Ordering::SeqCst);
                if n == 1 {
                    first.notified().await;
                } else {
                    tokio::time::sleep(answer_in).await;
                }
                sent.flying.fetch_sub(1, Ordering::SeqCst);
            })
        }
    }

    /// A statement stuck on the database holds up the commits behind it
    /// for [`RESCUE`] only: then a second statement takes them.
    #[tokio::test(start_paused = true)]
    async fn a_second_statement_leaves_when_the_first_is_stuck() {
        let (group, sent, start) = (Arc::new(Group::default()), Arc::new(Sent::default()), Instant::now());
        let stuck = Arc::new(tokio::sync::Notify::new());
        for i in 0..3 {
            group.hand(waiting(1).0, sender(&sent, start, Duration::from_millis(1), stuck.clone()));
            if i == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let batches = crate::sync::lock(&sent.batches).clone();
        assert_eq!(batches, [(Duration::ZERO, 1), (Duration::from_millis(1) + RESCUE, 2)]);
        // Unstuck, both end: nothing on its way, nothing waiting.
        stuck.notify_one();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queue = crate::sync::lock(&group.queue);
        assert_eq!((queue.flying, queue.waiting.len(), queue.rescue_armed), (0, 0, false));
    }

    /// While statements keep coming back, one at a time goes: commits
    /// arriving meanwhile wait for the next, and go together.
    #[tokio::test(start_paused = true)]
    async fn statements_that_keep_coming_back_go_one_at_a_time() {
        let (group, sent, start) = (Arc::new(Group::default()), Arc::new(Sent::default()), Instant::now());
        let first = Arc::new(tokio::sync::Notify::new());
        // The first statement comes back after 5 ms; each later one after 3.
        let release = first.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            release.notify_one();
        });
        for _ in 0..20 {
            group.hand(waiting(1).0, sender(&sent, start, Duration::from_millis(3), first.clone()));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let batches = crate::sync::lock(&sent.batches).clone();
        assert_eq!(sent.most.load(Ordering::SeqCst), 1, "{batches:?}");
        assert_eq!(batches.iter().map(|b| b.1).sum::<usize>(), 20);
        // The second when the first came back, with the commits of the
        // meantime (one every 2 ms).
        assert_eq!(batches[..2], [(Duration::ZERO, 1), (Duration::from_millis(5), 2)]);
        assert!(batches.len() < 20, "{batches:?}");
    }

    /// A query that ends while its commit waits for a statement (its
    /// ticket dropped) takes the commit back: it is never sent.
    #[tokio::test(start_paused = true)]
    async fn a_commit_whose_query_ended_before_its_statement_is_never_sent() {
        let (group, sent, start) = (Arc::new(Group::default()), Arc::new(Sent::default()), Instant::now());
        let stuck = Arc::new(tokio::sync::Notify::new());
        group.hand(waiting(1).0, sender(&sent, start, Duration::from_millis(1), stuck.clone()));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let (w, token) = waiting(1);
        let (tx, answer) = oneshot::channel();
        group.hand(Waiting { answer: tx, ..w }, sender(&sent, start, Duration::from_millis(1), stuck.clone()));
        drop(Ticket { answer, token, group: group.clone() });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(*crate::sync::lock(&sent.batches), [(Duration::ZERO, 1)], "only the first was sent");
        stuck.notify_one();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let queue = crate::sync::lock(&group.queue);
        assert_eq!((queue.flying, queue.waiting.len()), (0, 0));
    }
}
