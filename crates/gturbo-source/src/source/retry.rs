//! When to retry a request and how long to wait: pure functions, tested from tables.
//!
//! Transient faults are retried: statuses 408, 429, 500, 502, 503, 504, and transport
//! faults (connection refused or reset, timeouts, a body that ends early). Never
//! 401/403/404/416 or any other status: those are answers, and asking again costs the
//! user's rate limit for nothing. The delay is exponential backoff with jitter
//! ([`backoff`]), except that a server's `Retry-After` (RFC 9110 §10.2.3: delta-seconds or
//! an HTTP-date) replaces it ([`next_delay`]). A `Retry-After` over a limit (default
//! 300 s) is refused rather than slept on ([`parse_retry_after`]).

use std::time::{Duration, SystemTime};

use backon::ExponentialBuilder;

use super::SourceError;

/// The one retry budget: attempts per ranged read or API call, the first included.
///
/// A ranged read (`read_range` is `stream_range` collected) draws every request on it
/// from this budget: the first, each retry after a refusal, each resumption after a
/// body that broke. Nothing above the source retries a read again (the executor makes
/// one attempt), so a server that fails every request sees exactly this many requests
/// per read, `max_attempts - 1` waits apart, each the `Retry-After` it asked for.
pub const DEFAULT_MAX_ATTEMPTS: usize = 6;
/// The first backoff delay, before jitter.
pub const DEFAULT_BASE_DELAY: Duration = Duration::from_millis(250);
/// The longest computed backoff delay (a `Retry-After` may ask for more).
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(30);
/// The longest `Retry-After` we are willing to sleep.
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// How many times and how long to wait between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per request, the first included (at least 1).
    pub max_attempts: usize,
    /// The first backoff delay; each next one doubles, plus up to 100% jitter.
    pub base_delay: Duration,
    /// Cap on a computed delay.
    pub max_delay: Duration,
    /// Cap on a server's `Retry-After`; more is an error, not a wait.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            base_delay: DEFAULT_BASE_DELAY,
            max_delay: DEFAULT_MAX_DELAY,
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
        }
    }
}

/// Whether a response status is worth another attempt.
pub fn is_retryable_status(status: u16) -> bool {
    matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
}

/// A failure below HTTP, as far as retrying cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportFault {
    /// Could not connect (refused, DNS, TLS handshake).
    Connect,
    /// The connection was reset or closed before the answer was complete.
    Reset,
    /// Connect or read timeout.
    Timeout,
    /// The body ended before the announced or asked-for length.
    TruncatedBody,
    /// Anything else (a request we could not build, a redirect loop).
    Other,
}

/// Whether a transport fault is worth another attempt.
pub fn is_retryable_fault(fault: TransportFault) -> bool {
    !matches!(fault, TransportFault::Other)
}

/// A `Retry-After` value we will not act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryAfterError {
    /// Neither delta-seconds nor an HTTP-date; the caller falls back to its backoff.
    Unparsable,
    /// More than the limit.
    TooLong {
        /// Seconds asked for (saturated at `u64::MAX`).
        wait_s: u64,
        /// Seconds accepted.
        limit_s: u64,
    },
}

impl RetryAfterError {
    /// The user-facing error for a refused `Retry-After` of `header` from `url`.
    pub fn into_source_error(self, url: &str, header: &str) -> SourceError {
        match self {
            Self::TooLong { wait_s, limit_s } => SourceError::RetryAfterTooLong {
                url: url.to_string(),
                header: header.to_string(),
                wait_s,
                limit_s,
            },
            Self::Unparsable => SourceError::Malformed {
                url: url.to_string(),
                field: "Retry-After".into(),
                detail: format!("{header:?} is neither delta-seconds nor an HTTP-date"),
            },
        }
    }
}

/// How long a `Retry-After` value asks to wait, seen at `now` (RFC 9110 §10.2.3):
/// delta-seconds (`120`) or an HTTP-date (`Wed, 21 Oct 2015 07:28:00 GMT`; a date in
/// the past means "now"). Over `limit` → [`RetryAfterError::TooLong`].
pub fn parse_retry_after(
    value: &str,
    now: SystemTime,
    limit: Duration,
) -> Result<Duration, RetryAfterError> {
    let value = value.trim();
    let wait = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: too many of them is just a very long wait.
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).map_err(|_| RetryAfterError::Unparsable)?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    if wait > limit {
        // Round a fractional date wait up so the message never says "300 s over 300 s".
        let wait_s = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        return Err(RetryAfterError::TooLong {
            wait_s,
            limit_s: limit.as_secs(),
        });
    }
    Ok(wait)
}

/// The backoff schedule of `policy`: `max_attempts - 1` delays, exponential from
/// `base_delay` with factor 2, up to 100% jitter, capped at `max_delay` before jitter.
pub fn backoff(policy: &RetryPolicy) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(policy.base_delay)
        .with_max_delay(policy.max_delay)
        .with_factor(2.0)
        .with_max_times(policy.max_attempts.saturating_sub(1))
        .with_jitter()
}

/// The wait before the next attempt: none when the schedule is spent (`computed` is
/// `None`); the server's `Retry-After` when it sent one; else the computed delay, held
/// to `max_delay` (jitter may add up to 100% on top of the capped base).
pub fn next_delay(
    computed: Option<Duration>,
    retry_after: Option<Duration>,
    max_delay: Duration,
) -> Option<Duration> {
    let computed = computed?;
    Some(retry_after.unwrap_or(computed.min(max_delay)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use backon::BackoffBuilder;

    #[test]
    fn retryable_statuses() {
        for (status, retry) in [
            (408, true),
            (429, true),
            (500, true),
            (502, true),
            (503, true),
            (504, true),
            (200, false),
            (206, false),
            (400, false),
            (401, false),
            (403, false),
            (404, false),
            (410, false),
            (416, false),
            (501, false),
        ] {
            assert_eq!(is_retryable_status(status), retry, "{status}");
        }
    }

    #[test]
    fn retryable_faults() {
        for (fault, retry) in [
            (TransportFault::Connect, true),
            (TransportFault::Reset, true),
            (TransportFault::Timeout, true),
            (TransportFault::TruncatedBody, true),
            (TransportFault::Other, false),
        ] {
            assert_eq!(is_retryable_fault(fault), retry, "{fault:?}");
        }
    }

    #[test]
    fn retry_after_values() {
        // 2015-10-21T07:28:00Z
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let limit = DEFAULT_MAX_RETRY_AFTER;
        let s = Duration::from_secs;
        let cases: &[(&str, Result<Duration, RetryAfterError>)] = &[
            ("0", Ok(s(0))),
            ("1", Ok(s(1))),
            (" 120 ", Ok(s(120))),
            ("300", Ok(s(300))),
            (
                "301",
                Err(RetryAfterError::TooLong {
                    wait_s: 301,
                    limit_s: 300,
                }),
            ),
            (
                "99999999999999999999999",
                Err(RetryAfterError::TooLong {
                    wait_s: u64::MAX,
                    limit_s: 300,
                }),
            ),
            ("Wed, 21 Oct 2015 07:28:00 GMT", Ok(s(0))),
            ("Wed, 21 Oct 2015 07:28:30 GMT", Ok(s(30))),
            ("Wed, 21 Oct 2015 07:00:00 GMT", Ok(s(0))),
            (
                "Wed, 21 Oct 2015 08:28:00 GMT",
                Err(RetryAfterError::TooLong {
                    wait_s: 3600,
                    limit_s: 300,
                }),
            ),
            ("-1", Err(RetryAfterError::Unparsable)),
            ("1.5", Err(RetryAfterError::Unparsable)),
            ("", Err(RetryAfterError::Unparsable)),
            ("soon", Err(RetryAfterError::Unparsable)),
        ];
        for (value, want) in cases {
            assert_eq!(&parse_retry_after(value, now, limit), want, "{value:?}");
        }
        assert_eq!(
            parse_retry_after("20", now, s(10)),
            Err(RetryAfterError::TooLong {
                wait_s: 20,
                limit_s: 10
            })
        );
    }

    #[test]
    fn too_long_message_names_header_and_limit() {
        let e = RetryAfterError::TooLong {
            wait_s: 86400,
            limit_s: 300,
        }
        .into_source_error("http://h/x", "86400");
        assert_eq!(
            e.to_string(),
            "http://h/x: server asked to wait 86400 s (Retry-After: 86400), over the 300 s limit"
        );
    }

    #[test]
    fn backoff_schedule_grows_caps_and_stops() {
        let policy = RetryPolicy {
            max_attempts: 6,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(1),
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
        };
        let delays: Vec<Duration> = backoff(&policy).with_jitter_seed(7).build().collect();
        assert_eq!(delays.len(), 5, "6 attempts = 5 waits");
        // Base before jitter: 250, 500, 1000, 1000, 1000 ms; jitter adds [0, 100%).
        let bases = [250u64, 500, 1000, 1000, 1000];
        for (d, base) in delays.iter().zip(bases) {
            let base = Duration::from_millis(base);
            assert!(*d >= base && *d < base * 2, "{d:?} vs base {base:?}");
        }
    }

    #[test]
    fn retry_after_overrides_computed_delay() {
        let ms = Duration::from_millis;
        let cap = Duration::from_secs(30);
        let cases = [
            (Some(ms(300)), None, Some(ms(300))),
            (Some(ms(300)), Some(ms(1000)), Some(ms(1000))),
            (Some(ms(300)), Some(ms(0)), Some(ms(0))),
            (Some(Duration::from_secs(50)), None, Some(cap)),
            (
                Some(ms(300)),
                Some(Duration::from_secs(120)),
                Some(Duration::from_secs(120)),
            ),
            (None, Some(ms(1000)), None),
        ];
        for (computed, retry_after, want) in cases {
            assert_eq!(
                next_delay(computed, retry_after, cap),
                want,
                "{computed:?} {retry_after:?}"
            );
        }
    }
}
