//! The hub's request budget: its rate limits count *resolver* requests (the API and
//! `/resolve/...`, not the CDN a download is redirected to), per IP in 5-minute
//! windows (3,000 anonymous, 5,000 for a free account). Each file is resolved once and
//! its redirected location reused ([`super::http`]), so an install costs the resolver
//! a few requests per file; this budget makes sure that holds even where a server does
//! not redirect, and honours what the server says of its limit (`RateLimit`).

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The hub's rate-limit window.
pub const WINDOW: Duration = Duration::from_secs(300);
/// Resolver requests per window without a token.
pub const ANONYMOUS_LIMIT: usize = 3000;
/// Resolver requests per window with a (free account's) token.
pub const TOKEN_LIMIT: usize = 5000;

/// A sliding-window count of resolver requests, plus a stop the server may order.
#[derive(Debug)]
pub struct ResolverBudget {
    limit: usize,
    window: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When each request of the current window was sent, oldest first.
    sent: VecDeque<Instant>,
    /// What the server last said is left of its budget, less the requests sent since
    /// (`None`: it said nothing, or its window has reset since).
    left: Option<u64>,
    /// When the server's window resets (from its last `RateLimit`).
    reset_at: Option<Instant>,
    /// Requests sent and not yet answered.
    in_flight: u64,
    /// Requests counted in all.
    total: u64,
    /// Requests that had to wait for the budget.
    waits: u64,
}

impl ResolverBudget {
    /// `limit` requests per `window`.
    pub fn new(limit: usize, window: Duration) -> ResolverBudget {
        ResolverBudget {
            limit: limit.max(1),
            window,
            state: Mutex::default(),
        }
    }

    /// Count one request sent at `now` if the budget allows it; else how long to wait.
    pub fn try_take(&self, now: Instant) -> Result<(), Duration> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(reset) = s.reset_at {
            if reset <= now {
                // The server's window has reset: what it said no longer holds.
                (s.reset_at, s.left) = (None, None);
            } else if s.left == Some(0) {
                return Err(reset - now);
            }
        }
        while s
            .sent
            .front()
            .is_some_and(|&t| now.duration_since(t) >= self.window)
        {
            s.sent.pop_front();
        }
        if s.sent.len() >= self.limit {
            let oldest = s.sent.front().copied().unwrap_or(now);
            return Err(self.window.saturating_sub(now.duration_since(oldest)));
        }
        s.sent.push_back(now);
        s.total += 1;
        s.in_flight += 1;
        if let Some(left) = &mut s.left {
            *left = left.saturating_sub(1);
        }
        Ok(())
    }

    /// Wait until the budget allows a request, then count it. The ticket stands for
    /// the request until its answer: give the answer's `RateLimit` to
    /// [`Ticket::answered`], or drop it (no answer came).
    pub async fn take(&self) -> Ticket<'_> {
        let mut waited = false;
        loop {
            match self.try_take(Instant::now()) {
                Ok(()) => return Ticket { budget: self },
                Err(wait) => {
                    if !waited {
                        waited = true;
                        self.state
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .waits += 1;
                    }
                    tracing::debug!(
                        wait_ms = wait.as_millis() as u64,
                        "resolver budget spent; waiting"
                    );
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// What an answer said of the server's limit. The server counted every request
    /// sent before this answer's, and perhaps some still in flight: those are taken
    /// off what it says is left, so concurrent requests never overrun it. With nothing
    /// left, no request goes before the window resets.
    pub fn note(&self, limit: RateLimit, now: Instant) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let left = limit.remaining.saturating_sub(s.in_flight);
        s.left = Some(s.left.map_or(left, |l| l.min(left)));
        let reset = now + limit.reset.min(self.window);
        s.reset_at = Some(s.reset_at.map_or(reset, |r| r.max(reset)));
    }

    fn answered(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.in_flight = s.in_flight.saturating_sub(1);
    }

    /// Requests that had to wait for the budget so far.
    pub fn waits(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .waits
    }

    /// Resolver requests counted so far.
    pub fn total(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }
}

/// One counted request until its answer (see [`ResolverBudget::take`]).
#[derive(Debug)]
pub struct Ticket<'a> {
    budget: &'a ResolverBudget,
}

impl Ticket<'_> {
    /// The answer came, with what it said of the server's limit.
    pub fn answered(self, limit: Option<RateLimit>, now: Instant) {
        self.budget.answered();
        if let Some(l) = limit {
            self.budget.note(l, now);
        }
        std::mem::forget(self);
    }
}

impl Drop for Ticket<'_> {
    /// No answer (a transport error, a cancelled request): no longer in flight.
    fn drop(&mut self) {
        self.budget.answered();
    }
}

/// What a `RateLimit` header says: requests left and when the window resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Requests left in the window.
    pub remaining: u64,
    /// Until the window resets.
    pub reset: Duration,
}

/// Parse the IETF `RateLimit` field the hub sends (`"api";r=2999;t=270`), or the older
/// pair `RateLimit-Remaining` / `RateLimit-Reset` (given as `remaining`, `reset`).
pub fn parse_ratelimit(
    field: Option<&str>,
    remaining: Option<&str>,
    reset: Option<&str>,
) -> Option<RateLimit> {
    let num = |v: &str| v.trim().parse::<u64>().ok();
    if let Some(f) = field {
        let (mut r, mut t) = (None, None);
        for part in f.split([';', ',']) {
            if let Some((k, v)) = part.trim().split_once('=') {
                match k.trim() {
                    "r" | "remaining" => r = num(v),
                    "t" | "reset" => t = num(v),
                    _ => {}
                }
            }
        }
        if let (Some(remaining), Some(t)) = (r, t) {
            return Some(RateLimit {
                remaining,
                reset: Duration::from_secs(t),
            });
        }
    }
    Some(RateLimit {
        remaining: num(remaining?)?,
        reset: Duration::from_secs(num(reset?)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_allows_its_limit_then_waits_for_the_oldest() {
        let b = ResolverBudget::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(b.try_take(t0), Ok(()));
        assert_eq!(b.try_take(t0 + s(1)), Ok(()));
        assert_eq!(b.try_take(t0 + s(2)), Ok(()));
        assert_eq!(b.try_take(t0 + s(3)), Err(s(7)));
        assert_eq!(b.try_take(t0 + s(10)), Ok(()), "the first left the window");
        assert_eq!(b.total(), 4);
    }

    #[test]
    fn a_spent_server_budget_stops_requests_until_its_reset() {
        let b = ResolverBudget::new(100, WINDOW);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        b.note(
            RateLimit {
                remaining: 5,
                reset: s(30),
            },
            t0,
        );
        assert_eq!(b.try_take(t0), Ok(()));
        b.note(
            RateLimit {
                remaining: 0,
                reset: s(30),
            },
            t0,
        );
        assert_eq!(b.try_take(t0 + s(10)), Err(s(20)));
        assert_eq!(b.try_take(t0 + s(30)), Ok(()));
        // A reset beyond the window is held to the window.
        b.note(
            RateLimit {
                remaining: 0,
                reset: s(86_400),
            },
            t0,
        );
        assert_eq!(b.try_take(t0), Err(WINDOW));
    }

    #[test]
    fn requests_in_flight_are_taken_off_what_the_server_says_is_left() {
        let b = ResolverBudget::new(100, WINDOW);
        let t0 = Instant::now();
        // Three requests go out at once; the first answer says 3 are left, counted
        // before the other two reached the server (or not: the client cannot tell).
        for _ in 0..3 {
            b.try_take(t0).unwrap();
        }
        b.answered();
        b.note(
            RateLimit {
                remaining: 3,
                reset: Duration::from_secs(60),
            },
            t0,
        );
        // 3 − the 2 still in flight: one more request, then wait for the reset.
        assert_eq!(b.try_take(t0), Ok(()));
        assert_eq!(b.try_take(t0), Err(Duration::from_secs(60)));
        assert_eq!(b.try_take(t0 + Duration::from_secs(60)), Ok(()));
        assert_eq!(b.total(), 5);
    }

    #[test]
    fn ratelimit_fields_parse() {
        let s = Duration::from_secs;
        let cases = [
            (
                (Some(r#""api";r=2999;t=270"#), None, None),
                Some((2999, 270)),
            ),
            (
                (Some("limit=3000, remaining=0, reset=12"), None, None),
                Some((0, 12)),
            ),
            ((None, Some("7"), Some("60")), Some((7, 60))),
            ((Some("garbage"), Some("1"), Some("2")), Some((1, 2))),
            ((Some(r#""api";q=3000"#), None, None), None),
            ((None, Some("x"), Some("2")), None),
            ((None, None, None), None),
        ];
        for ((f, r, t), want) in cases {
            let got = parse_ratelimit(f, r, t).map(|l| (l.remaining, l.reset));
            assert_eq!(got, want.map(|(a, b)| (a, s(b))), "{f:?} {r:?} {t:?}");
        }
    }
}
