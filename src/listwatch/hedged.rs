//! Hedged requests: when an attempt gets no answer for a while, another one goes out beside it,
//! and the first answer wins.
//!
//! etcd-client balances requests over its endpoints at random (tonic's balancer gives every
//! connection the same load), and a member that hangs without closing anything (SIGSTOP, a disk
//! stall, a half-open partition) keeps its connection "ready". A request routed to it waits for
//! its whole timeout. A second attempt picks a member at random again, so a few attempts a
//! fraction of a second apart reach a live member almost surely, while a healthy member, which
//! answers within milliseconds, never sees a second attempt.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long an attempt may go unanswered before another one is sent beside it, for requests
/// a live member answers at once (watch creation, count-only reads).
pub(crate) const HEDGE_AFTER: Duration = Duration::from_millis(250);

/// The most attempts in flight at once.
const MAX_IN_FLIGHT: usize = 4;

/// How many attempts may fail before the request fails: a member that is down refuses at once,
/// and the next attempt may reach a live one.
const MAX_FAILED: usize = 3;

/// How a hedged request ended.
#[derive(Debug)]
pub(crate) enum Hedged<R, E> {
    /// An attempt answered.
    Answered(R),
    /// Every attempt sent failed; the last error.
    Failed(E),
    /// No attempt answered before the deadline.
    TimedOut,
}

/// Runs `attempt`, and another one each time `hedge` passes without an answer (at most
/// [`MAX_IN_FLIGHT`] at once) or an attempt fails in a way another member might not
/// (`elsewhere`: a refused connection, say; at most [`MAX_FAILED`] times), until one answers or
/// `deadline`. The first success wins and the other attempts are dropped (a dropped etcd request
/// or watch stream is canceled). An error that is not `elsewhere` ends the request at once;
/// otherwise the last error ends it once no other attempt is waiting: the caller's retry policy
/// decides what comes next.
pub(crate) async fn hedged<R, E, F, Fut, G>(
    hedge: Duration,
    deadline: Instant,
    elsewhere: G,
    mut attempt: F,
) -> Hedged<R, E>
where
    G: Fn(&E) -> bool,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<R, E>> + Send + 'static,
    R: Send + 'static,
    E: Send + 'static,
{
    let mut running = JoinSet::new();
    let mut last_error = None;
    let mut failed = 0;
    loop {
        if running.len() < MAX_IN_FLIGHT {
            running.spawn(attempt());
        }
        let next = (Instant::now() + hedge).min(deadline);
        loop {
            tokio::select! {
                done = running.join_next(), if !running.is_empty() => match done {
                    Some(Ok(Ok(answer))) => return Hedged::Answered(answer),
                    Some(Ok(Err(e))) => {
                        if !elsewhere(&e) {
                            // Every member would answer the same (a compacted revision, say):
                            // waiting for the others would only turn it into a timeout.
                            return Hedged::Failed(e);
                        }
                        failed += 1;
                        let again = failed < MAX_FAILED;
                        last_error = Some(e);
                        if again {
                            // Another member may answer: try it now rather than at the hedge.
                            break;
                        }
                    }
                    // A panicking attempt is a bug in the attempt; the others may still answer.
                    Some(Err(join)) => tracing::warn!(error = %join, "a hedged attempt panicked"),
                    None => {}
                },
                _ = tokio::time::sleep_until(next) => break,
            }
            if running.is_empty() {
                return match last_error {
                    Some(e) => Hedged::Failed(e),
                    // Only panics: try again at the next hedge, within the deadline.
                    None if Instant::now() < deadline => break,
                    None => Hedged::TimedOut,
                };
            }
        }
        if Instant::now() >= deadline {
            return Hedged::TimedOut;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    type Attempt = std::pin::Pin<Box<dyn Future<Output = Result<usize, &'static str>> + Send>>;

    /// Attempt `n` answers after `delays[n]` (or never, past the list) with `n`.
    fn attempts(delays: &'static [Option<u64>]) -> (Arc<AtomicUsize>, impl FnMut() -> Attempt) {
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = sent.clone();
        (sent, move || {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let delay = delays.get(n).copied().flatten();
            Box::pin(async move {
                match delay {
                    Some(ms) => {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        Ok(n)
                    }
                    None => std::future::pending().await,
                }
            })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_prompt_answer_sends_nothing_more() {
        let (sent, attempt) = attempts(&[Some(10)]);
        let deadline = Instant::now() + Duration::from_secs(3);
        assert!(matches!(
            hedged(HEDGE_AFTER, deadline, |_| true, attempt).await,
            Hedged::Answered(0)
        ));
        assert_eq!(sent.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_attempt_is_overtaken_by_the_next() {
        // The first two hang (a stopped member), the third answers.
        let (sent, attempt) = attempts(&[None, None, Some(5)]);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(3);
        assert!(matches!(
            hedged(HEDGE_AFTER, deadline, |_| true, attempt).await,
            Hedged::Answered(2)
        ));
        assert_eq!(sent.load(Ordering::SeqCst), 3);
        assert!(
            start.elapsed() < Duration::from_millis(600),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_answers_before_the_deadline() {
        let (sent, attempt) = attempts(&[]);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(2);
        assert!(matches!(
            hedged::<usize, &str, _, _, _>(HEDGE_AFTER, deadline, |_| true, attempt).await,
            Hedged::TimedOut
        ));
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert!(sent.load(Ordering::SeqCst) >= MAX_IN_FLIGHT, "kept trying");
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_ends_it_only_when_nothing_else_waits() {
        let deadline = Instant::now() + Duration::from_secs(3);
        let tried = Arc::new(AtomicUsize::new(0));
        let failed = hedged(
            HEDGE_AFTER,
            deadline,
            |_| true,
            || {
                tried.fetch_add(1, Ordering::SeqCst);
                async { Err::<(), _>("refused") }
            },
        )
        .await;
        assert!(matches!(failed, Hedged::Failed("refused")));
        assert_eq!(
            tried.load(Ordering::SeqCst),
            MAX_FAILED,
            "a refusal is tried again at once"
        );
        // The first attempt hangs, the second is refused (another member may answer), the third
        // answers.
        let n = Arc::new(AtomicUsize::new(0));
        let answered = hedged(
            HEDGE_AFTER,
            deadline,
            |_| true,
            || {
                let n = n.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 => std::future::pending().await,
                        1 => Err("refused"),
                        _ => Ok(n),
                    }
                }
            },
        )
        .await;
        assert!(matches!(answered, Hedged::Answered(2)), "{answered:?}");
    }

    /// Issue 28, minor: one attempt hangs (a stopped member), another fails at once with an
    /// error every member would give (a compacted revision): the request ends with that error
    /// then, not at the deadline as "timed out".
    #[tokio::test(start_paused = true)]
    async fn an_error_no_other_member_would_fix_ends_it_at_once_beside_a_hung_attempt() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(3);
        let n = Arc::new(AtomicUsize::new(0));
        let result = hedged(
            HEDGE_AFTER,
            deadline,
            |e: &&str| *e != "compacted",
            || {
                let n = n.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 => std::future::pending().await,
                        _ => Err::<usize, _>("compacted"),
                    }
                }
            },
        )
        .await;
        assert!(
            matches!(result, Hedged::Failed("compacted")),
            "{result:?} after {:?}",
            start.elapsed()
        );
        assert_eq!(start.elapsed(), HEDGE_AFTER, "ended as the error came");
        assert_eq!(n.load(Ordering::SeqCst), 2, "nothing sent after it");
    }
}
