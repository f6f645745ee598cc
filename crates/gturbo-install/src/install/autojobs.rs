//! `--jobs auto`: how many connections the stream stage keeps open, decided from what
//! the link delivers. Pure bookkeeping fed one [`Sample`] per tick, so the rules are
//! tested against simulated links ([`tests`]) rather than timed runs; the stream stage
//! takes the samples and applies the [`Step`]s.
//!
//! The rules, per *level* (a number of connections):
//! - **Start at [`Jobs::AUTO_START`](super::options::Jobs::AUTO_START)**, not 1: a
//!   capped link needs several, and a few more than needed cost nothing on loopback.
//! - **Settle, then measure**: the first [`SETTLE_TICKS`] after a change are not
//!   judged (a new connection's first request pays the time to first byte), the next
//!   [`MEASURE_TICKS`] give the level's rate, from bytes *received* (not consumed, so
//!   a transform that is busy does not hide what the link delivers).
//! - **Grow only when the connections are the bound**: requests were in flight on
//!   at least 7 of 8 connections in most of the measured ticks. When they were not, the
//!   transforms, the hasher or the disk are the bound (a fast link, loopback) and more
//!   connections would only cost memory and the hub requests: growth stops.
//! - **Grow multiplicatively** (×[`GROWTH`]) while each step raised the rate by at
//!   least [`MIN_GAIN`]; the first step that gained less ends the growth (an
//!   aggregate cap, or the CPU, is the bound then).
//! - **Never past `max`** (the window budget and [`Jobs::AUTO_MAX`]), and never once
//!   the source pushed back: a request that waited on the hub's resolver budget or
//!   its `RateLimit`, or a retry after a `429` or `503` ends the growth (a reset or a
//!   timeout does not: it says nothing of how many connections the server takes).
//!
//! The shard jobs that run at once follow the connections ([`shard_jobs`]): one per
//! two cores until the connections have grown (a job hashes on one core while it
//! transforms on another; the stream stage's `jobs_at_once`), one per
//! [`CONNECTIONS_PER_JOB`] once they have.

use std::time::Duration;

/// How often the stream stage samples the link.
pub(super) const TICK: Duration = Duration::from_millis(250);
/// Ticks after a change that are not judged.
pub(super) const SETTLE_TICKS: u32 = 1;
/// Ticks a level is measured over.
pub(super) const MEASURE_TICKS: u32 = 2;
/// Each growth step multiplies the connections by this.
pub(super) const GROWTH: u64 = 2;
/// A step must raise the rate by this fraction to be worth the next one.
pub(super) const MIN_GAIN: f64 = 0.10;

/// Connections per shard job once the link is the bound.
pub(super) const CONNECTIONS_PER_JOB: u64 = 2;

/// Shard jobs to run at once at `connections`, on `cores` cores.
///
/// A job hashes and transforms its shard strictly in order, so its consumer stalls at
/// every read boundary (the fsync and the journal line) and whenever the sub-range at
/// the head of its window is still arriving. While the consumer is the bound
/// (loopback: the connections never grow) one job per core is best; more only
/// contend for the cores. Once the controller has grown the connections, the link is
/// the bound, and those stalls are idle time on the link: one job per
/// [`CONNECTIONS_PER_JOB`] connections keeps another job's bytes flowing through
/// them. On the benchmark's capped link (4 shards, a loaded 2-core host) one job per
/// core reached 0.79× the throughput of `--jobs 16` (4 jobs at once) at 16
/// connections, and 2 jobs at 8 connections 0.80×.
pub(super) fn shard_jobs(cores: u64, connections: u64) -> u64 {
    let connections = connections.max(1);
    cores
        .max(connections / CONNECTIONS_PER_JOB)
        .min(connections)
        .max(1)
}

/// What happened in one tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Sample {
    /// Source bytes received since the previous sample.
    pub bytes: u64,
    /// Time since the previous sample.
    pub elapsed: Duration,
    /// Requests in flight at the sample.
    pub busy: u64,
    /// The source pushed back since the previous sample (a wait on the resolver
    /// budget or its `RateLimit`, a retry after a `429` or `503`).
    pub pushed_back: bool,
}

/// What to do after a sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Step {
    /// Keep the connections as they are.
    Hold,
    /// Allow this many connections in all.
    Grow(u64),
    /// Growth ends here (said once; [`Step::Hold`] after).
    Stop(Why),
}

/// Why the growth ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Why {
    /// The connections were not all busy: something else is the bound.
    NotTheBound,
    /// The last step raised the rate by less than [`MIN_GAIN`].
    NoGain,
    /// At the most connections allowed.
    AtMax,
    /// The source pushed back.
    PushedBack,
}

/// The controller.
#[derive(Debug, Clone)]
pub(super) struct Controller {
    limit: u64,
    max: u64,
    done: bool,
    /// Ticks left to skip at this level.
    settle: u32,
    /// This level's measurement so far: bytes, seconds, ticks, ticks with every
    /// connection busy.
    bytes: u64,
    secs: f64,
    ticks: u32,
    saturated: u32,
    /// The rate of the level before this one.
    previous: Option<f64>,
}

impl Controller {
    /// Starting at `start` connections, growing to at most `max`.
    pub fn new(start: u64, max: u64) -> Controller {
        let max = max.max(1);
        Controller {
            limit: start.clamp(1, max),
            max,
            done: false,
            settle: SETTLE_TICKS,
            bytes: 0,
            secs: 0.0,
            ticks: 0,
            saturated: 0,
            previous: None,
        }
    }

    /// Connections allowed now.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The rate the last finished level measured, bytes per second.
    pub fn last_rate(&self) -> Option<f64> {
        self.previous
    }

    fn stop(&mut self, why: Why) -> Step {
        self.done = true;
        Step::Stop(why)
    }

    /// Judge one tick.
    pub fn sample(&mut self, s: Sample) -> Step {
        if self.done {
            return Step::Hold;
        }
        if s.pushed_back {
            return self.stop(Why::PushedBack);
        }
        if self.settle > 0 {
            self.settle -= 1;
            return Step::Hold;
        }
        self.bytes += s.bytes;
        self.secs += s.elapsed.as_secs_f64();
        self.ticks += 1;
        // 7 of 8 busy counts: `busy` is one instant's count, and a connection whose
        // sub-range has just arrived is idle until the next request starts; at 8
        // connections a sample of 7 busy stopped a capped link's growth 1 run in 5.
        if s.busy * 8 >= self.limit * 7 {
            self.saturated += 1;
        }
        if self.ticks < MEASURE_TICKS {
            return Step::Hold;
        }
        let rate = self.bytes as f64 / self.secs.max(1e-9);
        let saturated = self.saturated * 2 >= self.ticks;
        let previous = self.previous.replace(rate);
        (self.bytes, self.secs, self.ticks, self.saturated) = (0, 0.0, 0, 0);
        self.settle = SETTLE_TICKS;
        if previous.is_some_and(|p| rate < p * (1.0 + MIN_GAIN)) {
            return self.stop(Why::NoGain);
        }
        if !saturated {
            return self.stop(Why::NotTheBound);
        }
        if self.limit >= self.max {
            return self.stop(Why::AtMax);
        }
        self.limit = (self.limit * GROWTH).min(self.max);
        Step::Grow(self.limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated link: `per_conn` bytes/s per connection, `aggregate` for all of
    /// them, and a consumer (transforms, hash, disk) that takes at most `cpu` bytes/s.
    /// Requests stay in flight only while the consumer keeps up, as the reorder
    /// window makes them: when the consumer is the bound, connections idle in
    /// proportion.
    #[derive(Clone, Copy)]
    struct Link {
        per_conn: f64,
        aggregate: f64,
        cpu: f64,
    }

    impl Link {
        fn tick(&self, conns: u64) -> Sample {
            let offered = (conns as f64 * self.per_conn).min(self.aggregate);
            let rate = offered.min(self.cpu);
            let busy = if offered <= self.cpu {
                conns
            } else {
                (conns as f64 * self.cpu / offered).floor() as u64
            };
            Sample {
                bytes: (rate * TICK.as_secs_f64()) as u64,
                elapsed: TICK,
                busy,
                pushed_back: false,
            }
        }
    }

    /// Drive a controller over `link` until it stops; the connections it ends at, why,
    /// and the ticks it took.
    fn run(link: Link, start: u64, max: u64) -> (u64, Why, u32) {
        let mut c = Controller::new(start, max);
        for t in 1..1000 {
            if let Step::Stop(why) = c.sample(link.tick(c.limit())) {
                return (c.limit(), why, t);
            }
        }
        panic!("never stopped");
    }

    const MB: f64 = 1e6;

    #[test]
    fn a_link_that_caps_each_connection_grows_to_the_most_allowed() {
        // The benchmark's capped link: 50 MB/s per connection, a fast consumer.
        let link = Link {
            per_conn: 50.0 * MB,
            aggregate: f64::INFINITY,
            cpu: 2000.0 * MB,
        };
        let (conns, why, ticks) = run(link, 4, 16);
        assert_eq!((conns, why), (16, Why::AtMax));
        // 4 → 8 → 16: three levels of settle + measure, no more.
        assert_eq!(ticks, 3 * (SETTLE_TICKS + MEASURE_TICKS));
    }

    #[test]
    fn loopback_where_the_consumer_is_the_bound_never_grows() {
        // One connection alone outruns the transforms: the connections idle.
        let link = Link {
            per_conn: 2000.0 * MB,
            aggregate: f64::INFINITY,
            cpu: 300.0 * MB,
        };
        let (conns, why, _) = run(link, 4, 16);
        assert_eq!((conns, why), (4, Why::NotTheBound));
    }

    #[test]
    fn growth_stops_once_a_step_gains_under_ten_percent() {
        // An aggregate cap of 250 MB/s at 50 MB/s per connection: 4 give 200, 8 give
        // 250 (+25 %, worth it), 16 give 250 (+0 %): the growth ends there.
        let link = Link {
            per_conn: 50.0 * MB,
            aggregate: 250.0 * MB,
            cpu: 2000.0 * MB,
        };
        assert_eq!(run(link, 4, 64), (16, Why::NoGain, 9));
        // The consumer as the bound once the link is fast enough: 4 × 50 = 200 MB/s,
        // 8 would be 400 but the consumer takes 300, so requests idle: stop at 8.
        let link = Link {
            per_conn: 50.0 * MB,
            aggregate: f64::INFINITY,
            cpu: 300.0 * MB,
        };
        assert_eq!(run(link, 4, 64), (8, Why::NotTheBound, 6));
    }

    #[test]
    fn the_bound_is_never_passed() {
        let link = Link {
            per_conn: 10.0 * MB,
            aggregate: f64::INFINITY,
            cpu: f64::INFINITY,
        };
        for (start, max, want) in [(4, 6, 6), (4, 4, 4), (8, 3, 3), (0, 16, 16), (2, 1, 1)] {
            let mut c = Controller::new(start, max);
            let mut seen = c.limit();
            loop {
                match c.sample(link.tick(c.limit())) {
                    Step::Grow(n) => {
                        assert!(n <= max.max(1), "{start}→{max}: grew to {n}");
                        seen = seen.max(n);
                    }
                    Step::Stop(why) => {
                        assert_eq!(why, Why::AtMax);
                        break;
                    }
                    Step::Hold => {}
                }
            }
            assert_eq!(seen, want, "start {start}, max {max}");
        }
    }

    #[test]
    fn a_push_back_ends_growth_at_once_and_for_good() {
        let link = Link {
            per_conn: 50.0 * MB,
            aggregate: f64::INFINITY,
            cpu: f64::INFINITY,
        };
        let mut c = Controller::new(4, 16);
        // Settle, measure: 4 → 8.
        for _ in 0..SETTLE_TICKS + MEASURE_TICKS - 1 {
            assert_eq!(c.sample(link.tick(4)), Step::Hold);
        }
        assert_eq!(c.sample(link.tick(4)), Step::Grow(8));
        let pushed = Sample {
            pushed_back: true,
            ..link.tick(8)
        };
        assert_eq!(c.sample(pushed), Step::Stop(Why::PushedBack));
        for _ in 0..20 {
            assert_eq!(c.sample(link.tick(8)), Step::Hold);
        }
        assert_eq!(c.limit(), 8);
    }

    #[test]
    fn shard_jobs_follow_the_connections_once_they_grow() {
        // Two cores: the starting 4 connections run one job per core; grown to 8 or
        // more, one job per two connections (a 4-shard repo then runs all four, as
        // `--jobs 16` does).
        let two: Vec<u64> = [1, 2, 4, 8, 12, 16].map(|c| shard_jobs(2, c)).into();
        assert_eq!(two, [1, 2, 2, 4, 6, 8]);
        // Many cores: never more jobs than connections (a job needs one).
        assert_eq!(shard_jobs(16, 4), 4);
        assert_eq!(shard_jobs(16, 16), 16);
        assert_eq!(shard_jobs(0, 0), 1);
        // The controller's path on the simulated capped link ends at eight jobs (as
        // many as there are shards, at most), and on loopback (the consumer the
        // bound) stays at one per core.
        let capped = Link {
            per_conn: 50.0 * MB,
            aggregate: f64::INFINITY,
            cpu: 2000.0 * MB,
        };
        let loopback = Link {
            per_conn: 2000.0 * MB,
            aggregate: f64::INFINITY,
            cpu: 300.0 * MB,
        };
        assert_eq!(shard_jobs(2, run(capped, 4, 16).0), 8);
        assert_eq!(shard_jobs(2, run(loopback, 4, 16).0), 2);
    }

    #[test]
    fn a_settling_tick_is_not_judged() {
        // The tick right after a step sees nothing (new requests still waiting for
        // their first byte); it must not count as a level that gained nothing.
        let link = Link {
            per_conn: 50.0 * MB,
            aggregate: f64::INFINITY,
            cpu: f64::INFINITY,
        };
        let mut c = Controller::new(4, 16);
        let mut steps = Vec::new();
        for t in 0..30 {
            let mut s = link.tick(c.limit());
            if t % (SETTLE_TICKS + MEASURE_TICKS) as usize == 0 {
                s.bytes = 0;
                s.busy = 0;
            }
            match c.sample(s) {
                Step::Hold => {}
                step => steps.push(step),
            }
        }
        assert_eq!(
            steps,
            [Step::Grow(8), Step::Grow(16), Step::Stop(Why::AtMax)]
        );
    }
}
