//! The stream's links: the budget of connections and reorder-window places every
//! job draws on ([`Links`]), the sub-range size that budget allows, and the window
//! that fetches one job's sub-ranges concurrently and hands them on in order.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::source::{RangeSource, SourceError};

use super::autojobs;

/// The budget every job draws on: connections (requests in flight) and places in the
/// reorder window (sub-ranges fetched or being fetched and not yet consumed).
///
/// A sub-range holds a window place from before its request until its bytes have been
/// hashed and transformed, so the window's memory is at most `places × sub_range`
/// bytes, whatever the shard count: that is the memory the RSS budget counts
/// ([`Links::window_bytes`]). A connection is held only while the request runs, so a
/// job transforms one sub-range while the next ones arrive.
pub(super) struct Links {
    connections: Arc<Semaphore>,
    pub(super) places: Arc<Semaphore>,
    /// Connections allowed now (grows under `--jobs auto`).
    limit: AtomicU64,
    /// Bytes per sub-range request.
    pub(super) sub_range: u64,
    /// Requests in flight now, and the most seen at once.
    pub(super) busy: AtomicU64,
    /// Source bytes received so far (as they arrive, before the window hands them on).
    pub(super) received: AtomicU64,
    peak_busy: AtomicU64,
    /// Set by the first sub-range that fails for good. Every such failure ends the
    /// install, so no request may start after it: a sub-range queued behind the
    /// failed one would otherwise take its connection and ask the server again before
    /// the install's shutdown aborts it (after a refusal such as a `Retry-After` over
    /// the limit, issue 13, item 7).
    failed: std::sync::atomic::AtomicBool,
    /// The jobs the install runs, and the cores they run on.
    jobs: usize,
    pub(super) cores: u64,
    /// Whether `--jobs auto` has added connections (a fixed `--jobs N` starts so).
    pub(super) grown: std::sync::atomic::AtomicBool,
    /// Jobs still requesting once no job waits to start (0 while some wait): the
    /// install's last sub-ranges are then cut smaller ([`Links::sub_range_now`]).
    pub(super) last_jobs: AtomicU64,
    /// Piece buffers not in use, each of capacity `sub_range`. A buffer is made only
    /// when none is spare and comes back when its piece is consumed (or its request
    /// fails), so at most one exists per window place ever granted: the window's
    /// memory is at most `places × sub_range`, allocated once and reused.
    spare: std::sync::Mutex<Vec<Vec<u8>>>,
}

/// The reorder window's share of the install's memory budget ([`super::MEMORY_BUDGET`],
/// 256 MiB of RSS at any `--jobs`, issue 9): the rest is tiles, HTTP buffers and the
/// runtime (about 45 MiB at 16 connections, measured). 192 MiB so that at 4 connections (`--jobs 4`,
/// `--jobs auto`'s start) a 64 MiB read is two requests of 32 MiB, not three of 21.3:
/// each request waits its time to first byte, and at 40 ms and 50 MB/s per
/// connection that wait cost 8.6 % of the link at 21.3 MiB, 5.6 % at 32.
pub(super) const WINDOW_BUDGET: u64 = super::MEMORY_BUDGET - (64 << 20);

/// The sub-range size `--sub-range-kib auto` gives `connections`: the largest whole
/// MiB whose window ([`places_for`] the connections) fits [`WINDOW_BUDGET`], within 4
/// to 32 MiB.
///
/// Each request waits for its first byte (a CDN's or a far hub's latency) before
/// bytes flow, so a connection moves `size / (size + latency × rate)` of its rate:
/// at 50 MB/s and 40 ms, 0.67 with 4 MiB sub-ranges and 0.92 at 21 MiB. Few
/// connections can afford large sub-ranges within the budget, many need them less
/// (their sum outruns the consumer). Above 32 MiB a sub-range only adds to what a
/// kill re-fetches.
pub(super) fn auto_sub_range(connections: usize) -> u64 {
    sub_range_for(connections, cores())
}

fn sub_range_for(connections: usize, cores: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let places = places_for(connections, cores, usize::MAX) as u64;
    (WINDOW_BUDGET / places / MIB).clamp(4, 32) * MIB
}

/// Window places at `connections` on `cores`: one per connection fetching, and one
/// per shard job ([`autojobs::shard_jobs`] run at once, at most `jobs`, the jobs
/// there are) consuming a sub-range while its next ones arrive. Two consuming places in all (as before) left connections idle
/// whenever more than two jobs consumed at once: under `--jobs auto` at 8 connections
/// (4 jobs) 6 of 8 were busy, and growth stopped there as if the link were the bound.
fn places_for(connections: usize, cores: u64, jobs: usize) -> usize {
    let c = connections.max(1);
    c + (autojobs::shard_jobs(cores, c as u64) as usize).min(jobs.max(1))
}

/// The cores the install's jobs run on.
fn cores() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// The smallest sub-range [`Links::sub_range_now`] cuts: below it the time to first
/// byte costs more than the idle connections it fills.
const MIN_TAIL_SUB_RANGE: u64 = 4 << 20;

impl Links {
    /// `jobs`: the jobs the install runs (bounds the consuming places).
    /// `grown`: whether the connections are already the link's bound (a fixed count).
    pub(super) fn new(connections: usize, sub_range: u64, jobs: usize, grown: bool) -> Links {
        let (connections, cores) = (connections.max(1), cores());
        Links {
            connections: Arc::new(Semaphore::new(connections)),
            places: Arc::new(Semaphore::new(places_for(connections, cores, jobs))),
            jobs,
            cores,
            grown: std::sync::atomic::AtomicBool::new(grown),
            limit: AtomicU64::new(connections as u64),
            sub_range,
            busy: AtomicU64::new(0),
            received: AtomicU64::new(0),
            peak_busy: AtomicU64::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
            last_jobs: AtomicU64::new(0),
            spare: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// An empty piece buffer of capacity `sub_range`: a spare one, or a new one.
    fn take_buffer(&self) -> Vec<u8> {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        spare.unwrap_or_else(|| Vec::with_capacity(self.sub_range as usize))
    }

    fn give_back(&self, mut buf: Vec<u8>) {
        buf.clear();
        self.spare
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(buf);
    }

    /// The size of a job's next sub-range when `left` bytes of it are still to be
    /// requested: `sub_range`, or, once no job waits to start, the job's share of the
    /// connections over what it has left (at least [`MIN_TAIL_SUB_RANGE`]). Full-size
    /// sub-ranges to the end left connections idle while the install's last one or two
    /// arrived (at `--jobs 4` on the capped link: 1 or 2 of 4 busy for its last 0.5 s).
    fn sub_range_now(&self, left: u64) -> u64 {
        let jobs = self.last_jobs.load(Ordering::Relaxed);
        if jobs == 0 {
            return self.sub_range;
        }
        let share = (self.limit() / jobs).max(1);
        (left / share).clamp(MIN_TAIL_SUB_RANGE.min(self.sub_range), self.sub_range)
    }

    /// Allow one more connection (and the window places that come with it).
    pub(super) fn grow(&self) {
        let now = self.limit.fetch_add(1, Ordering::Relaxed) as usize;
        self.grown.store(true, Ordering::Relaxed);
        let (cores, jobs) = (self.cores, self.jobs);
        self.connections.add_permits(1);
        self.places
            .add_permits(places_for(now + 1, cores, jobs) - places_for(now, cores, jobs));
    }

    /// Connections allowed now.
    pub(super) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// The most requests that were in flight at once.
    pub(super) fn peak(&self) -> u64 {
        self.peak_busy.load(Ordering::Relaxed)
    }

    /// The most connections whose window fits [`WINDOW_BUDGET`] at `sub_range` bytes
    /// each (at least 1): `--jobs` above it is held to it.
    pub(super) fn max_connections(sub_range: u64) -> usize {
        max_connections_for(sub_range, cores())
    }
}

fn max_connections_for(sub_range: u64, cores: u64) -> usize {
    let places = (WINDOW_BUDGET / sub_range.max(1)) as usize;
    let mut c = 1;
    while places_for(c + 1, cores, usize::MAX) <= places {
        c += 1;
    }
    c
}

/// One fetched sub-range, in one buffer of the window's pool, and the window place it
/// holds until dropped.
///
/// The body's chunks are copied into the buffer as they arrive and dropped at once.
/// Keeping them instead (as before) kept alive the HTTP client's whole read buffer
/// behind each chunk: every socket read that returned less than the buffer size the
/// client had reserved for it leaves that allocation pinned by its chunk, and the
/// next read reserves a fresh one; measured at 16 connections, the window's 72 MiB
/// of data held ~240 MiB of RSS. One copy of each source byte (memcpy speed, a few
/// per cent of the hash's cost) buys a window whose memory is exactly its bound.
pub(super) struct Piece {
    pub(super) bytes: Vec<u8>,
    links: Arc<Links>,
    _place: OwnedSemaphorePermit,
}

impl Drop for Piece {
    fn drop(&mut self) {
        // Back to the pool before the place is released (the fields drop after this),
        // so the request that takes the place finds the buffer spare.
        self.links.give_back(std::mem::take(&mut self.bytes));
    }
}

/// The bounded reorder window of one read: its sub-ranges are fetched concurrently,
/// each on a task of its own, and handed on strictly in order. The tasks belong to a
/// [`tokio::task::JoinSet`], so none outlives the read (an error, a cancelled job).
pub(super) struct Window<'a> {
    source: &'a Arc<dyn RangeSource>,
    links: &'a Arc<Links>,
    path: String,
    /// The job's reads, in order; sub-ranges never cross a read's end, and the window
    /// runs on across reads so a job's connections stay busy at read boundaries.
    ranges: std::collections::VecDeque<std::ops::Range<u64>>,
    /// Index of the next sub-range to request and to hand on.
    spawned: u64,
    handed: u64,
    tasks: tokio::task::JoinSet<(u64, Result<Piece, SourceError>)>,
    /// Sub-ranges that arrived before their turn.
    early: std::collections::BTreeMap<u64, Result<Piece, SourceError>>,
    /// Called once the last sub-range is requested (the stream stage then starts the
    /// next job).
    all_requested: Option<Box<dyn FnOnce() + Send + 'a>>,
}

impl<'a> Window<'a> {
    pub(super) fn new(
        source: &'a Arc<dyn RangeSource>,
        links: &'a Arc<Links>,
        path: &str,
        ranges: impl IntoIterator<Item = std::ops::Range<u64>>,
        all_requested: Box<dyn FnOnce() + Send + 'a>,
    ) -> Window<'a> {
        Window {
            all_requested: Some(all_requested),
            source,
            links,
            path: path.to_string(),
            ranges: ranges.into_iter().filter(|r| !r.is_empty()).collect(),
            spawned: 0,
            handed: 0,
            tasks: tokio::task::JoinSet::new(),
            early: std::collections::BTreeMap::new(),
        }
    }

    /// Request more sub-ranges while window places are free; waits for one only when
    /// nothing of this read is in the window, so a job always makes progress and
    /// never holds places it cannot use.
    async fn top_up(&mut self) {
        let links = self.links.clone();
        while !self.ranges.is_empty() {
            let place = if self.spawned == self.handed {
                match links.places.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return,
                }
            } else {
                match links.places.clone().try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => return,
                }
            };
            self.request(place);
        }
    }

    /// Request the next sub-range under `place` (there is one).
    fn request(&mut self, place: OwnedSemaphorePermit) {
        let Some(front) = self.ranges.front().cloned() else {
            return;
        };
        let links = self.links.clone();
        let left: u64 = self.ranges.iter().map(|r| r.end - r.start).sum();
        let size = next_sub_range(front.end - front.start, links.sub_range_now(left));
        let range = front.start..front.start + size;
        if range.end == front.end {
            self.ranges.pop_front();
        } else if let Some(f) = self.ranges.front_mut() {
            f.start = range.end;
        }
        let (index, source, path) = (self.spawned, self.source.clone(), self.path.clone());
        self.tasks.spawn(async move {
            let got = fetch_piece(source.as_ref(), links, &path, range, place).await;
            (index, got)
        });
        self.spawned += 1;
        if self.ranges.is_empty()
            && let Some(all_requested) = self.all_requested.take()
        {
            all_requested();
        }
    }

    /// The next sub-range in order; `None` after the last.
    pub(super) async fn next(&mut self) -> Option<Result<Piece, SourceError>> {
        self.top_up().await;
        if self.handed == self.spawned {
            return None;
        }
        loop {
            if let Some(p) = self.early.remove(&self.handed) {
                self.handed += 1;
                return Some(p);
            }
            // While the head is on its way, a place given back by another job's
            // consumer is taken at once (topping up only between pieces left it
            // free for the rest of a sub-range: at the capped link's tail, 2 of 4
            // connections busy with 4 places free).
            let more = !self.ranges.is_empty();
            let joined = tokio::select! {
                j = self.tasks.join_next() => j,
                p = self.links.places.clone().acquire_owned(), if more => {
                    if let Ok(p) = p {
                        self.request(p);
                    }
                    continue;
                }
            };
            match joined? {
                // A sub-range that failed for good (its retry budget spent, or an
                // answer such as 404) fails the read at once, whatever its place: the
                // rest of the window is cancelled with it instead of spending budgets
                // of its own against a server that refuses.
                Ok((_, Err(e))) => return Some(Err(e)),
                Ok((i, got)) => {
                    self.early.insert(i, got);
                }
                Err(e) => {
                    return Some(Err(SourceError::Config(format!(
                        "sub-range task of {} failed: {e}",
                        self.path
                    ))));
                }
            }
        }
    }
}

/// The size of the next sub-range of a read with `rest` bytes left: the rest in equal
/// parts of at most `max` (a 64 MiB read at 24 MiB: three of 21.3, not 24 + 24 + 16),
/// since a short last part would pay a whole time to first byte for little.
fn next_sub_range(rest: u64, max: u64) -> u64 {
    rest.div_ceil(rest.div_ceil(max.max(1)))
}

/// When a request gives its connection to the next one: once the bytes it has left
/// would take no longer to arrive, at the rate this response runs, than its time to
/// first byte took. Each request waits that long for its first byte (40 ms on the
/// benchmark's capped link, a CDN's or a far hub's latency), and the HTTP client
/// cannot pipeline a second request on a connection, so without the handover every
/// connection stood idle for one time to first byte per sub-range: 5.6 % of the link
/// at 32 MiB sub-ranges, 50 MB/s and 40 ms (`--jobs 4`: 181 MB/s of 200 while
/// streaming). The next request then waits for its first byte while these last bytes
/// arrive: the two overlap only while it waits (a TCP connection more is open then),
/// and the connection count the summary reports stays at most `--jobs`. The lead is
/// capped at [`Handover::MAX_LEAD`]: a first byte that came after a retry's wait
/// (inside the source's budget) is no measure of the link, and would hand over most
/// of the response early. On loopback the time to first byte is well under a
/// millisecond and the handover comes with the last chunk or two.
struct Handover {
    asked: std::time::Instant,
    /// When the first chunk arrived, and the bytes since then (after it).
    first: Option<(std::time::Instant, u64)>,
}

impl Handover {
    /// Bytes of a response before its rate is trusted.
    const MEASURED: u64 = 1 << 20;
    /// The longest time to first byte the handover leads by (a far CDN's is tens to a
    /// couple of hundred milliseconds).
    const MAX_LEAD: f64 = 0.25;

    fn new(asked: std::time::Instant) -> Handover {
        Handover { asked, first: None }
    }

    /// Whether the connection goes to the next request now (`now`: when a chunk of `n`
    /// bytes arrived, with `left` bytes still to come).
    fn due(&mut self, now: std::time::Instant, n: u64, left: u64) -> bool {
        let Some((at, since)) = &mut self.first else {
            self.first = Some((now, 0));
            return left == 0;
        };
        *since += n;
        if left == 0 {
            return true;
        }
        if *since < Self::MEASURED {
            return false;
        }
        let rate = *since as f64 / now.duration_since(*at).as_secs_f64().max(1e-9);
        let lead = at
            .duration_since(self.asked)
            .as_secs_f64()
            .min(Self::MAX_LEAD);
        left as f64 <= rate * lead
    }
}

/// A connection a request holds: its permit, counted in [`Links::busy`] (and the peak)
/// from when it is taken until it is dropped, at the handover or the request's end.
struct Busy<'a> {
    links: &'a Links,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl<'a> Busy<'a> {
    fn new(links: &'a Links, permit: tokio::sync::SemaphorePermit<'a>) -> Busy<'a> {
        let busy = links.busy.fetch_add(1, Ordering::Relaxed) + 1;
        links.peak_busy.fetch_max(busy, Ordering::Relaxed);
        Busy {
            links,
            _permit: permit,
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        // Before the permit goes (the fields drop after this), as before the handover.
        self.links.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Fetch one sub-range under a connection permit into a piece buffer; the permit goes
/// to the next request a time to first byte before the last byte ([`Handover`]).
async fn fetch_piece(
    source: &dyn RangeSource,
    links: Arc<Links>,
    path: &str,
    range: std::ops::Range<u64>,
    place: OwnedSemaphorePermit,
) -> Result<Piece, SourceError> {
    let permit = links
        .connections
        .acquire()
        .await
        .map_err(|_| SourceError::Config("connection budget closed".into()))?;
    if links.failed.load(Ordering::Acquire) {
        // The install is ending with another sub-range's error; park until the
        // shutdown aborts this task rather than add an error or a request of its own.
        drop(permit);
        return std::future::pending().await;
    }
    let mut conn = Some(Busy::new(&links, permit));
    let mut buf = links.take_buffer();
    let want = range.end - range.start;
    let mut handover = Handover::new(std::time::Instant::now());
    let result = async {
        let mut body = source.stream_range(path, range.clone()).await?;
        while let Some(c) = body.next().await {
            let c = c?;
            links.received.fetch_add(c.len() as u64, Ordering::Relaxed);
            if (buf.len() + c.len()) as u64 > want {
                // The sources refuse a long body themselves; this keeps the buffer
                // within its capacity whatever a source does.
                return Err(SourceError::BadRange {
                    path: path.to_string(),
                    range: range.clone(),
                    detail: format!("more than the {want} bytes asked for"),
                });
            }
            buf.extend_from_slice(&c);
            let (n, left) = (c.len() as u64, want - buf.len() as u64);
            if conn.is_some() && handover.due(std::time::Instant::now(), n, left) {
                // The next request goes out now and waits for its first byte while
                // this one's last bytes arrive.
                conn = None;
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        // Before the connection is given back, so whoever takes it next sees it.
        links.failed.store(true, Ordering::Release);
        links.give_back(buf);
        return Err(e);
    }
    drop(conn);
    Ok(Piece {
        bytes: buf,
        links,
        _place: place,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_sub_ranges_fit_the_window_budget_at_every_connection_count() {
        // Two cores (this project's CI): 1 + 1, 4 + 2 and 16 + 8 places.
        assert_eq!(sub_range_for(1, 2), 32 * MIB);
        assert_eq!(sub_range_for(4, 2), 32 * MIB);
        assert_eq!(sub_range_for(16, 2), 8 * MIB);
        assert_eq!(sub_range_for(256, 2), 4 * MIB);
        // Sixteen: four jobs consume at 4 connections.
        assert_eq!(sub_range_for(4, 16), 24 * MIB);
        for cores in [1, 2, 8, 16, 64] {
            for c in 1..=256 {
                let size = sub_range_for(c, cores);
                assert!((4 * MIB..=32 * MIB).contains(&size), "{c}: {size}");
                // The connections the install opens at that size, and their window.
                let used = c.min(max_connections_for(size, cores));
                let window = places_for(used, cores, usize::MAX) as u64 * size;
                assert!(window <= WINDOW_BUDGET, "{cores} cores, {c}: {window}");
            }
        }
    }

    #[test]
    fn a_connection_is_handed_on_one_time_to_first_byte_before_the_last_byte() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let (size, chunk) = (32 * MIB, 64 << 10);
        // The bytes left when a 32 MiB response, in 64 KiB chunks, whose first byte
        // came `first` after its request and the rest at `rate` B/s, hands on.
        let handed_on_with = |first: Duration, rate: f64| {
            let mut h = Handover::new(t0);
            let mut got = 0;
            loop {
                got += chunk;
                let at = t0 + first + Duration::from_secs_f64((got - chunk) as f64 / rate);
                if h.due(at, chunk, size - got) {
                    return size - got;
                }
                assert!(got < size, "never handed on");
            }
        };
        // 50 MB/s after 40 ms: once what is left takes at most 40 ms, 2 MB.
        let left = handed_on_with(Duration::from_millis(40), 50e6);
        assert!((1_900_000..=2_000_000).contains(&left), "{left} bytes left");
        // Loopback: a first byte after 0.1 ms at 1 GB/s leaves 100 kB, the last chunks.
        let left = handed_on_with(Duration::from_micros(100), 1e9);
        assert!(left <= 100_000, "{left} bytes left");
        // A first byte after a retry's 3 s wait: the lead is capped at 0.25 s (12.5 MB
        // at 50 MB/s), not 3 s (the whole response).
        let left = handed_on_with(Duration::from_secs(3), 50e6);
        assert!(
            (12_000_000..=12_500_000).contains(&left),
            "{left} bytes left"
        );
        // A response shorter than the measuring stretch keeps its connection to the end.
        let first = t0 + Duration::from_millis(40);
        let mut h = Handover::new(t0);
        assert!(!h.due(first, chunk, MIB - chunk));
        assert!(!h.due(first + Duration::from_secs(1), chunk, 1));
        assert!(h.due(first + Duration::from_secs(2), 1, 0));
    }

    #[test]
    fn reads_split_into_equal_sub_ranges_of_at_most_the_size() {
        let split = |len: u64, max: u64| {
            let (mut rest, mut parts) = (len, Vec::new());
            while rest > 0 {
                let n = next_sub_range(rest, max);
                assert!(n >= 1 && n <= max && n <= rest, "{len} {max}: {n}");
                parts.push(n);
                rest -= n;
            }
            parts
        };
        assert_eq!(
            split(64 * MIB, 24 * MIB),
            vec![22369622, 22369621, 22369621]
        );
        assert_eq!(split(64 * MIB, 32 * MIB), vec![32 * MIB, 32 * MIB]);
        assert_eq!(split(5, 2), vec![2, 2, 1]);
        assert_eq!(split(1, 4 * MIB), vec![1]);
        for len in [1, 7, 4095, 64 * MIB - 1, 64 * MIB + 1, 1 << 33] {
            for max in [1, 3, 4 * MIB, 21 * MIB] {
                if len / max > 100_000 {
                    continue;
                }
                let parts = split(len, max);
                assert_eq!(parts.len() as u64, len.div_ceil(max), "{len} {max}");
                let (lo, hi) = (parts.iter().min().unwrap(), parts.iter().max().unwrap());
                assert!(hi - lo <= 1, "{len} {max}: {lo}..{hi}");
            }
        }
    }
}
