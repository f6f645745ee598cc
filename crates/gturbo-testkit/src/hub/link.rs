//! A realistic link for the test hub: a per-connection rate (as every CDN caps one
//! response), a time to first byte, and an aggregate cap shared by every answer.
//!
//! Each body chunk is scheduled on a virtual clock: a response may send its next chunk
//! no earlier than `start + bytes_so_far / conn_rate`, and the aggregate bucket hands
//! out send times one chunk after another at `aggregate_rate`; the chunk goes when both
//! allow. The latency is slept before the answer's headers, once per request.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

/// How the hub's link behaves. The default is an unshaped loopback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkShape {
    /// Bytes per second of one answer's body (`None`: unlimited).
    pub conn_rate: Option<u64>,
    /// Time to first byte: the wait before each answer's headers.
    pub latency: Duration,
    /// Bytes per second of all answers together (`None`: unlimited).
    pub aggregate_rate: Option<u64>,
}

impl LinkShape {
    /// Whether the link is shaped at all.
    pub fn is_shaped(&self) -> bool {
        self.conn_rate.is_some() || self.aggregate_rate.is_some() || !self.latency.is_zero()
    }
}

/// The running shaper: the shape and the aggregate bucket's clock.
#[derive(Debug)]
pub(super) struct Shaper {
    pub shape: LinkShape,
    /// When the aggregate link is free again.
    free_at: Mutex<Option<Instant>>,
}

fn secs_for(bytes: u64, rate: u64) -> Duration {
    Duration::from_secs_f64(bytes as f64 / rate.max(1) as f64)
}

impl Shaper {
    pub fn new(shape: LinkShape) -> Arc<Shaper> {
        Arc::new(Shaper {
            shape,
            free_at: Mutex::new(None),
        })
    }

    /// The time to first byte.
    pub async fn first_byte(&self) {
        if !self.shape.latency.is_zero() {
            tokio::time::sleep(self.shape.latency).await;
        }
    }

    /// Reserve `len` bytes on the aggregate link; returns when they may be sent.
    fn reserve(&self, len: u64) -> Option<Instant> {
        let rate = self.shape.aggregate_rate?;
        let mut free = self.free_at.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        // An idle link does not bank credit beyond one chunk's worth.
        let start = free.map_or(now, |f| f.max(now));
        let done = start + secs_for(len, rate);
        *free = Some(done);
        Some(done)
    }

    /// `body` at the shape's rates.
    pub fn shape<S>(
        self: Arc<Self>,
        body: S,
    ) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> + Send + use<S>
    where
        S: futures_util::Stream<Item = std::io::Result<Bytes>> + Send + Unpin,
    {
        let start = Instant::now();
        futures_util::stream::unfold(
            (body, self, 0u64, start),
            |(mut body, shaper, sent, start)| async move {
                let item = futures_util::StreamExt::next(&mut body).await?;
                let Ok(chunk) = &item else {
                    return Some((item, (body, shaper, sent, start)));
                };
                let sent = sent + chunk.len() as u64;
                let mut at = shaper.shape.conn_rate.map(|r| start + secs_for(sent, r));
                if let Some(agg) = shaper.reserve(chunk.len() as u64) {
                    at = Some(at.map_or(agg, |a| a.max(agg)));
                }
                if let Some(at) = at {
                    tokio::time::sleep_until(at).await;
                }
                Some((item, (body, shaper, sent, start)))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn time_to_send(shaper: Arc<Shaper>, bytes: usize, chunk: usize) -> Duration {
        let chunks: Vec<std::io::Result<Bytes>> = (0..bytes / chunk)
            .map(|_| Ok(Bytes::from(vec![0u8; chunk])))
            .collect();
        let t = Instant::now();
        let s = shaper.shape(futures_util::stream::iter(chunks));
        let n: usize =
            futures_util::StreamExt::fold(s, 0, |n, c| async move { n + c.unwrap().len() }).await;
        assert_eq!(n, bytes);
        t.elapsed()
    }

    fn near(t: Duration, ms: u64) -> bool {
        t >= Duration::from_millis(ms) && t < Duration::from_millis(ms * 2)
    }

    #[tokio::test]
    async fn a_connection_is_held_to_its_rate_and_the_aggregate_to_the_cap() {
        // 1 MB at 10 MB/s: 100 ms.
        let one = Shaper::new(LinkShape {
            conn_rate: Some(10_000_000),
            ..LinkShape::default()
        });
        let t = time_to_send(one, 1_000_000, 100_000).await;
        assert!(near(t, 100), "{t:?}");
        // Two answers at once, 10 MB/s each, under a 10 MB/s aggregate: 200 ms for both.
        let shared = Shaper::new(LinkShape {
            conn_rate: Some(10_000_000),
            aggregate_rate: Some(10_000_000),
            ..LinkShape::default()
        });
        // Timed from one instant: each answer's own clock starts when it is first polled,
        // which on a loaded machine can be after the other's first chunk was reserved.
        let t = Instant::now();
        let (a, b) = tokio::join!(
            time_to_send(shared.clone(), 1_000_000, 100_000),
            time_to_send(shared, 1_000_000, 100_000)
        );
        assert!(near(t.elapsed(), 200), "{:?} ({a:?} {b:?})", t.elapsed());
        // The latency is slept once, before the headers.
        let slow = Shaper::new(LinkShape {
            latency: Duration::from_millis(40),
            ..LinkShape::default()
        });
        let t = Instant::now();
        slow.first_byte().await;
        assert!(near(t.elapsed(), 40), "{:?}", t.elapsed());
    }
}
