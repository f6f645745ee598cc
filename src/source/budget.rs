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
    /// No request before this (the server said its budget is spent).
    until: Option<Instant>,
    /// Requests counted in all.
    total: u64,
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
        if let Some(until) = s.until {
            if until > now {
                return Err(until - now);
            }
            s.until = None;
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
        Ok(())
    }

    /// Wait until the budget allows a request, then count it.
    pub async fn take(&self) {
        loop {
            match self.try_take(Instant::now()) {
                Ok(()) => return,
                Err(wait) => {
                    tracing::debug!(
                        wait_ms = wait.as_millis() as u64,
                        "resolver budget spent; waiting"
                    );
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// What an answer said of the server's limit: with nothing left, no request goes
    /// before the window resets.
    pub fn note(&self, limit: RateLimit, now: Instant) {
        if limit.remaining == 0 {
            let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let until = now + limit.reset.min(self.window);
            s.until = Some(s.until.map_or(until, |u| u.max(until)));
        }
    }

    /// Resolver requests counted so far.
    pub fn total(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
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
