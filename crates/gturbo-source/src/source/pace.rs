//! Progress deadlines for one attempt at a transfer, as pure bookkeeping tested from
//! tables; [`super::http`] measures the waits and turns a [`Slow`] into a retry.
//!
//! Two rules, each failing the attempt (which then counts against the one retry budget
//! of the request, like a reset would):
//! - **low-speed limit**: fewer than `low_speed_bytes` arrive in the last
//!   `low_speed_time` of waiting (curl's `--speed-limit`/`--speed-time`). A server that
//!   stalls, or sends one byte every few seconds, fails here: a per-read timeout alone
//!   never fires on a trickle. The window *slides*: it is always the last
//!   `low_speed_time`, so the attempt fails at the first moment (once it has waited
//!   `low_speed_time`) that window holds too few bytes. The exact bound: an attempt
//!   fails `low_speed_time` after the arrival that last kept its window at the limit
//!   (the oldest of the newest bytes that make up `low_speed_bytes`), and at
//!   `low_speed_time` when no window ever held the limit. So a stall fails it at most
//!   `low_speed_time` after its last byte, and a burst as the answer comes, then a
//!   stall, fails it `low_speed_time` after the burst (issue 22: a window that
//!   restarted whenever it closed with enough bytes gave that case a second window,
//!   2 × `low_speed_time` per attempt). Arrivals are grouped to `low_speed_time / 64`
//!   (`ARRIVAL_SLOTS`), counted as early as the group's first, so a verdict may come
//!   up to that much sooner than the exact rule's, never later.
//! - **range timeout**: one attempt at a range (its request and its whole body) may wait
//!   `range_timeout` in all. It bounds a drip just fast enough to pass the low-speed limit.
//!
//! Only time spent waiting on the server counts: a consumer that is slow to ask for the
//! next chunk (a busy disk, a slow transform) is never blamed on the server.
//!
//! Worst case with the defaults, for a server that stalls every read, or sends a burst
//! (of any size) as it answers each read and then stalls: each attempt fails
//! [`DEFAULT_LOW_SPEED_TIME`] (30 s) after the answer (its time to first byte counts
//! as waiting too, with no bytes); [`super::retry::DEFAULT_MAX_ATTEMPTS`] (6) attempts
//! with the backoff between them (at most 2 × (0.25 + 0.5 + 1 + 2 + 4) = 15.5 s with
//! jitter) end the install within 6 × 30 + 15.5 = 195.5 s, under 3.5 minutes
//! ([`stall_bound`]), plus the answers' times to first byte and a timer's lateness
//! (milliseconds). docs/INSTALL.md states the same figure. A server that keeps an attempt
//! at the limit for a while (`low_speed_bytes` in every `low_speed_time`: a late
//! burst is one such window) holds it that long plus `low_speed_time`: no rule that
//! asks for `low_speed_bytes` in every `low_speed_time` may fail it sooner, and the
//! range timeout bounds the whole attempt.

use std::fmt;
use std::time::Duration;

/// Low-speed limit: an attempt must receive at least this many bytes…
pub const DEFAULT_LOW_SPEED_BYTES: u64 = 64 * 1024;
/// …in every this long of waiting (64 KiB in 30 s is about 2 KiB/s).
pub const DEFAULT_LOW_SPEED_TIME: Duration = Duration::from_secs(30);
/// Longest wait for one attempt at a range, its body included. A 64 MiB range (the
/// default `--range-mib`) needs about 110 KiB/s to arrive in one attempt; a slower link
/// still progresses, since the next attempt resumes from the byte reached.
pub const DEFAULT_RANGE_TIMEOUT: Duration = Duration::from_secs(600);

/// The limits of every attempt. A zero disables a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressLimits {
    /// Fewer bytes than this in `low_speed_time` fails the attempt (0: no limit).
    pub low_speed_bytes: u64,
    /// The low-speed window (zero: no limit).
    pub low_speed_time: Duration,
    /// Most waiting for one attempt in all (zero: no limit).
    pub range_timeout: Duration,
}

impl Default for ProgressLimits {
    fn default() -> Self {
        Self {
            low_speed_bytes: DEFAULT_LOW_SPEED_BYTES,
            low_speed_time: DEFAULT_LOW_SPEED_TIME,
            range_timeout: DEFAULT_RANGE_TIMEOUT,
        }
    }
}

impl ProgressLimits {
    fn low_speed_on(&self) -> bool {
        self.low_speed_bytes > 0 && !self.low_speed_time.is_zero()
    }
}

/// The longest a server that stalls every read can hold an install with these
/// `limits`, `attempts` per request and a backoff capped at `max_delay` (jitter
/// included, which may double a delay), when the first request already stalls.
/// `None` when no rule bounds a stall.
pub fn stall_bound(
    limits: &ProgressLimits,
    attempts: usize,
    base_delay: Duration,
    max_delay: Duration,
) -> Option<Duration> {
    let per_attempt = match (limits.low_speed_on(), limits.range_timeout.is_zero()) {
        (true, true) => limits.low_speed_time,
        (true, false) => limits.low_speed_time.min(limits.range_timeout),
        (false, false) => limits.range_timeout,
        (false, true) => return None,
    };
    let attempts = attempts.max(1);
    let mut total = per_attempt * attempts as u32;
    let mut delay = base_delay;
    for _ in 1..attempts {
        total += delay.min(max_delay) * 2;
        delay *= 2;
    }
    Some(total)
}

/// Why an attempt was given up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Slow {
    /// The low-speed window passed with too few bytes.
    LowSpeed {
        /// The limit in force.
        limits: ProgressLimits,
        /// Bytes received in the window.
        bytes: u64,
        /// The window's waiting time.
        waited: Duration,
    },
    /// The attempt waited longer than the range timeout.
    Deadline {
        /// The limit in force.
        limits: ProgressLimits,
        /// Bytes received by the attempt.
        bytes: u64,
        /// Its waiting time.
        waited: Duration,
    },
}

/// A byte rate for messages: `0.5 B/s`, `12.3 KiB/s`, `4.0 MiB/s`.
pub fn fmt_rate(bytes: u64, waited: Duration) -> String {
    let rate = bytes as f64 / waited.as_secs_f64().max(1e-3);
    if rate < 1024.0 {
        format!("{rate:.1} B/s")
    } else if rate < 1024.0 * 1024.0 {
        format!("{:.1} KiB/s", rate / 1024.0)
    } else {
        format!("{:.1} MiB/s", rate / (1024.0 * 1024.0))
    }
}

impl fmt::Display for Slow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LowSpeed {
                limits,
                bytes,
                waited,
            } => write!(
                f,
                "fewer than {} bytes in {} s (the low-speed limit): {bytes} bytes in {:.1} s, {}",
                limits.low_speed_bytes,
                limits.low_speed_time.as_secs_f64(),
                waited.as_secs_f64(),
                fmt_rate(*bytes, *waited)
            ),
            Self::Deadline {
                limits,
                bytes,
                waited,
            } => write!(
                f,
                "the range timeout of {} s passed: {bytes} bytes in {:.1} s, {}",
                limits.range_timeout.as_secs_f64(),
                waited.as_secs_f64(),
                fmt_rate(*bytes, *waited)
            ),
        }
    }
}

/// Arrivals closer together than `low_speed_time / ARRIVAL_SLOTS` share one record in
/// [`Pace`]'s window, stamped with the earlier time: the window then holds at most this
/// many records (plus one) however many chunks a server sends, and a byte is only ever
/// counted as older than it is, so the attempt fails no later than the exact rule says
/// (at most `low_speed_time / ARRIVAL_SLOTS` sooner, for a rate right at the limit).
const ARRIVAL_SLOTS: u32 = 64;

/// The progress of one attempt: record each wait with [`Pace::record`], and ask
/// [`Pace::check`] before the next one. A chunk that arrived is always kept; the rules
/// are judged before waiting again, so bytes already on hand are never thrown away.
#[derive(Debug, Clone)]
pub struct Pace {
    limits: ProgressLimits,
    /// Waiting so far, and bytes so far, in all.
    waited: Duration,
    bytes: u64,
    /// The arrivals of the sliding low-speed window, oldest first: (waiting time at
    /// which they came, bytes). Only the newest arrivals that reach
    /// `low_speed_bytes` together are kept: an older one cannot change when the window
    /// falls under the limit, since it leaves the window first.
    recent: std::collections::VecDeque<(Duration, u64)>,
    /// The bytes of `recent`.
    recent_bytes: u64,
}

impl Pace {
    /// A fresh attempt.
    pub fn new(limits: ProgressLimits) -> Self {
        Self {
            limits,
            waited: Duration::ZERO,
            bytes: 0,
            recent: std::collections::VecDeque::new(),
            recent_bytes: 0,
        }
    }

    /// Drop the arrivals that have left the window (came `low_speed_time` or more ago).
    fn slide(&mut self) {
        while let Some(&(at, n)) = self.recent.front() {
            if at + self.limits.low_speed_time > self.waited {
                break;
            }
            self.recent.pop_front();
            self.recent_bytes -= n;
        }
    }

    /// The waiting time at which the low-speed rule fails the attempt if no byte comes
    /// before: once the oldest arrival that keeps the window at the limit leaves it,
    /// and never before one whole window of waiting.
    fn low_speed_deadline(&self) -> Duration {
        let t = self.limits.low_speed_time;
        match self.recent.front() {
            Some(&(at, _)) if self.recent_bytes >= self.limits.low_speed_bytes => at + t,
            // Too few bytes in the window: it fails once a whole window has passed.
            _ => t,
        }
    }

    /// How long the next wait may last before [`Pace::check`] must judge it: until the
    /// sliding window would hold too few bytes, or what is left of the range timeout,
    /// whichever ends first. `None` when no rule is on.
    pub fn budget(&self) -> Option<Duration> {
        let window = self
            .limits
            .low_speed_on()
            .then(|| self.low_speed_deadline().saturating_sub(self.waited));
        let deadline = (!self.limits.range_timeout.is_zero())
            .then(|| self.limits.range_timeout.saturating_sub(self.waited));
        match (window, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A wait of `waited` that brought `bytes` (0 when it ran out of budget).
    pub fn record(&mut self, waited: Duration, bytes: u64) {
        self.waited += waited;
        self.bytes += bytes;
        if !self.limits.low_speed_on() {
            return;
        }
        self.slide();
        if bytes > 0 {
            let grain = self.limits.low_speed_time / ARRIVAL_SLOTS;
            match self.recent.back_mut() {
                Some((at, n)) if self.waited.saturating_sub(*at) < grain => *n += bytes,
                _ => self.recent.push_back((self.waited, bytes)),
            }
            self.recent_bytes += bytes;
            // Keep only the newest arrivals that reach the limit together.
            while let Some(&(_, n)) = self.recent.front() {
                if self.recent_bytes - n < self.limits.low_speed_bytes {
                    break;
                }
                self.recent.pop_front();
                self.recent_bytes -= n;
            }
        }
    }

    /// Whether the attempt may wait again: `Err` once the range timeout is used up, or
    /// when, after one whole low-speed window of waiting, the last `low_speed_time` of
    /// it brought fewer than `low_speed_bytes`.
    pub fn check(&mut self) -> Result<(), Slow> {
        if !self.limits.range_timeout.is_zero() && self.waited >= self.limits.range_timeout {
            return Err(Slow::Deadline {
                limits: self.limits,
                bytes: self.bytes,
                waited: self.waited,
            });
        }
        if self.limits.low_speed_on() && self.waited >= self.limits.low_speed_time {
            self.slide();
            if self.recent_bytes < self.limits.low_speed_bytes {
                return Err(Slow::LowSpeed {
                    limits: self.limits,
                    bytes: self.recent_bytes,
                    waited: self.limits.low_speed_time,
                });
            }
        }
        Ok(())
    }

    /// The verdict after a wait that ran its whole budget: what [`Pace::check`] says,
    /// which is always an `Err` then.
    pub fn expired(&mut self) -> Slow {
        match self.check() {
            Err(slow) => slow,
            // Unreachable when the wait lasted its budget; say the deadline passed.
            Ok(()) => Slow::Deadline {
                limits: self.limits,
                bytes: self.bytes,
                waited: self.waited,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;
    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_defaults_are_64_kib_in_30_s_and_600_s_per_range() {
        let d = ProgressLimits::default();
        assert_eq!(d.low_speed_bytes, 65_536);
        assert_eq!(d.low_speed_time, S(30));
        assert_eq!(d.range_timeout, S(600));
        // A server that stalls every read: 6 attempts × 30 s plus at most 15.5 s of
        // backoff (0.25, 0.5, 1, 2, 4 s, each up to doubled by jitter).
        let bound = stall_bound(
            &d,
            crate::source::retry::DEFAULT_MAX_ATTEMPTS,
            crate::source::retry::DEFAULT_BASE_DELAY,
            crate::source::retry::DEFAULT_MAX_DELAY,
        );
        assert_eq!(bound, Some(MS(195_500)));
        assert!(bound.unwrap() < S(210), "under 3.5 minutes");
    }

    #[test]
    fn stall_bounds_follow_the_rules_in_force() {
        let l = |b, t, r| ProgressLimits {
            low_speed_bytes: b,
            low_speed_time: S(t),
            range_timeout: S(r),
        };
        let cases = [
            (l(1, 10, 0), 1, Some(S(10))),
            (l(1, 10, 5), 1, Some(S(5))),
            (l(0, 10, 7), 2, Some(S(14) + MS(500))),
            (l(0, 0, 0), 3, None),
            (l(1, 0, 0), 3, None),
        ];
        for (limits, attempts, want) in cases {
            let got = stall_bound(&limits, attempts, MS(250), S(30));
            assert_eq!(got, want, "{limits:?} × {attempts}");
        }
    }

    #[test]
    fn budgets_and_verdicts() {
        let limits = ProgressLimits {
            low_speed_bytes: 100,
            low_speed_time: S(10),
            range_timeout: S(25),
        };
        let mut p = Pace::new(limits);
        assert_eq!(p.budget(), Some(S(10)));
        p.record(S(4), 60);
        p.check().unwrap();
        assert_eq!(p.budget(), Some(S(6)));
        // 110 bytes by 10 s: the window holds the limit until the 60 bytes of 4 s
        // leave it, at 14 s.
        p.record(S(6), 50);
        p.check().unwrap();
        assert_eq!(p.budget(), Some(S(4)));
        p.record(S(3), 100);
        p.check().unwrap();
        // 13 s waited; the 100 bytes of 13 s alone hold the limit until 23 s, and the
        // range timeout ends at 25 s.
        assert_eq!(p.budget(), Some(S(10)));
        p.record(S(10), 0);
        let e = p.check().unwrap_err();
        assert_eq!(
            e,
            Slow::LowSpeed {
                limits,
                bytes: 0,
                waited: S(10)
            }
        );

        let mut p = Pace::new(limits);
        p.record(S(9), 100);
        p.record(S(9), 1000);
        p.check().unwrap();
        assert_eq!(p.budget(), Some(S(7)), "the range timeout ends first");
        p.record(S(7), 1000);
        let e = p.check().unwrap_err();
        assert_eq!(
            e,
            Slow::Deadline {
                limits,
                bytes: 2100,
                waited: S(25)
            }
        );
        assert_eq!(
            e.to_string(),
            "the range timeout of 25 s passed: 2100 bytes in 25.0 s, 84.0 B/s"
        );

        let mut p = Pace::new(limits);
        p.record(S(10), 99);
        let e = p.expired();
        assert_eq!(
            e.to_string(),
            "fewer than 100 bytes in 10 s (the low-speed limit): 99 bytes in 10.0 s, 9.9 B/s"
        );

        let off = ProgressLimits {
            low_speed_bytes: 0,
            low_speed_time: S(10),
            range_timeout: Duration::ZERO,
        };
        let mut p = Pace::new(off);
        assert_eq!(p.budget(), None);
        p.record(S(1000), 0);
        p.check().unwrap();
    }

    /// Feed `arrivals` (waiting time, bytes) to a fresh attempt as a server would, each
    /// wait cut at the budget as [`super::super::http`] cuts it, then wait on with no
    /// byte: the waiting time at which the attempt fails.
    fn fails_at(limits: ProgressLimits, arrivals: &[(Duration, u64)]) -> Duration {
        let mut p = Pace::new(limits);
        let mut now = Duration::ZERO;
        for &(at, n) in arrivals {
            p.check()
                .unwrap_or_else(|e| panic!("failed at {now:?} before {at:?}: {e}"));
            let budget = p.budget().unwrap();
            assert!(
                at - now <= budget,
                "the attempt would have failed at {:?}, before the bytes of {at:?}",
                now + budget
            );
            p.record(at - now, n);
            now = at;
        }
        loop {
            if p.check().is_err() {
                return now;
            }
            let budget = p.budget().unwrap();
            assert!(!budget.is_zero(), "a budget of 0 that check passes");
            p.record(budget, 0);
            now += budget;
        }
    }

    /// Issue 22, defect 5: the window slides. A burst and then a stall used to pass one
    /// window (it held the burst), then fail a second one: 2 × `low_speed_time` per
    /// attempt. Now an attempt fails `low_speed_time` after the arrival that last kept
    /// its window at the limit, and exactly at `low_speed_time` when nothing came.
    #[test]
    fn the_low_speed_window_slides() {
        let limits = ProgressLimits {
            low_speed_bytes: 64 * 1024,
            low_speed_time: S(30),
            range_timeout: Duration::ZERO,
        };
        // The case: a burst as the answer comes, then nothing.
        assert_eq!(fails_at(limits, &[(MS(20), 10 << 20)]), S(30) + MS(20));
        // Nothing at all; too little in a burst.
        assert_eq!(fails_at(limits, &[]), S(30));
        assert_eq!(fails_at(limits, &[(MS(20), 1000)]), S(30));
        // A burst late in the first window holds the attempt until it leaves it.
        assert_eq!(fails_at(limits, &[(S(29), 1 << 20)]), S(59));
        // A good transfer that stops: fails 30 s after the arrivals that last made
        // up 64 KiB, whatever came before.
        let mut steady: Vec<(Duration, u64)> = (1..=100).map(|i| (S(i), 16 * 1024)).collect();
        assert_eq!(fails_at(limits, &steady), S(97 + 30));
        // ... and a trickle after it does not extend that.
        steady.push((S(101), 100));
        steady.push((S(120), 100));
        assert_eq!(fails_at(limits, &steady), S(97 + 30));
        // Exactly the limit in every window (64 KiB every 30 s) is never failed by
        // this rule (the range timeout bounds it).
        let at_limit: Vec<(Duration, u64)> = (1..=20).map(|i| (S(30 * i), 64 * 1024)).collect();
        assert_eq!(fails_at(limits, &at_limit), S(600 + 30));
        // Many small chunks (10 bytes a millisecond): the window keeps a bounded number
        // of records, and its verdict comes no later than the exact rule's: the oldest of
        // the last 64 KiB came 6.553 s ago, so it leaves the window in 23.447 s.
        let mut p = Pace::new(limits);
        for _ in 0..100_000 {
            p.record(MS(1), 10);
        }
        assert!(
            p.recent.len() <= ARRIVAL_SLOTS as usize + 1,
            "{}",
            p.recent.len()
        );
        assert!(p.recent_bytes >= 65_536, "{}", p.recent_bytes);
        p.check().unwrap();
        let left = p.budget().unwrap();
        let grain = limits.low_speed_time / ARRIVAL_SLOTS;
        assert!(left <= MS(23_447) && left + grain > MS(23_447), "{left:?}");
    }

    #[test]
    fn rates_read_in_human_units() {
        assert_eq!(fmt_rate(1, S(2)), "0.5 B/s");
        assert_eq!(fmt_rate(10 * 1024 * 1024, S(2)), "5.0 MiB/s");
        assert_eq!(fmt_rate(3 * 1024, S(1)), "3.0 KiB/s");
        // A zero wait counts as 1 ms, never a division by zero.
        assert_eq!(fmt_rate(5, Duration::ZERO), "4.9 KiB/s");
    }
}
