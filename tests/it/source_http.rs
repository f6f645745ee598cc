//! `HttpSource` against the in-process hub: resolve once, exact ranges, redirect reuse,
//! and every scripted network fault (retried or refused, with the exact error text).

use std::time::{Duration, Instant};

use gturbo::source::http::{HttpConfig, HttpSource, STREAM_CHUNK};
use gturbo::source::token::HfToken;
use gturbo::source::{RangeSource, SourceError};
use gturbo_testkit::hub::{Fault, FaultKind, Hub, HubConfig, HubRepo, RouteKind};

use crate::support;

const REPO: &str = "gturbo-test/tiny";
const BIN: &str = "weights/blob.bin";

struct Fixture {
    _tmp: tempfile::TempDir,
    hub: Hub,
    repo: HubRepo,
    files: Vec<(String, Vec<u8>)>,
}

impl Fixture {
    async fn new(config: HubConfig) -> Self {
        let tmp = support::temp_dir();
        let files = support::write_small_snapshot(tmp.path());
        let (hub, repo) = support::start_hub(
            REPO,
            tmp.path(),
            HubConfig {
                lfs_threshold: 1024 * 1024,
                ..config
            },
        )
        .await;
        Self {
            _tmp: tmp,
            hub,
            repo,
            files,
        }
    }

    fn bytes(&self, path: &str) -> &[u8] {
        &self
            .files
            .iter()
            .find(|(p, _)| p == path)
            .expect("fixture file")
            .1
    }

    /// Short delays so retry tests stay fast.
    fn config(&self) -> HttpConfig {
        let mut c = HttpConfig::new(self.hub.url(), REPO, "main");
        c.base_delay = Duration::from_millis(5);
        c.max_delay = Duration::from_millis(50);
        c
    }

    fn source(&self) -> HttpSource {
        HttpSource::new(self.config()).expect("http source")
    }

    fn resolve_url(&self, path: &str) -> String {
        format!(
            "{}/{REPO}/resolve/{}/{path}",
            self.hub.url(),
            self.repo.commit
        )
    }
}

#[tokio::test]
async fn resolve_pins_the_commit_lists_sha256_and_follows_pagination() {
    let fx = Fixture::new(HubConfig {
        tree_page_size: 2,
        ..HubConfig::default()
    })
    .await;
    let src = fx.source();
    let resolved = src.resolve().await.unwrap();
    assert_eq!(resolved.commit.as_deref(), Some(fx.repo.commit.as_str()));
    assert_eq!(resolved.revision, "main");
    let listed: Vec<(&str, u64)> = resolved
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    let want: Vec<(&str, u64)> = fx
        .files
        .iter()
        .map(|(p, b)| (p.as_str(), b.len() as u64))
        .collect();
    assert_eq!(listed, want);
    for f in &resolved.files {
        let lfs = f.path == BIN || f.path == "model.safetensors";
        let want = lfs.then(|| support::sha256_hex(fx.bytes(&f.path)));
        assert_eq!(f.sha256, want, "{}", f.path);
    }
    // A second resolve is served from the cache.
    let again = src.resolve().await.unwrap();
    assert_eq!(again, resolved);
    let stats = fx.hub.stats();
    assert_eq!(stats.revision, 1);
    // 4 files + 3 directories, 2 per page.
    assert_eq!(stats.tree, 4);
    assert_eq!(src.stats().requests, 5);
    assert_eq!(src.stats().retries, 0);
}

#[tokio::test]
async fn a_commit_revision_skips_the_revision_api() {
    let fx = Fixture::new(HubConfig::default()).await;
    let mut c = fx.config();
    c.revision = fx.repo.commit.clone();
    let src = HttpSource::new(c).unwrap();
    let resolved = src.resolve().await.unwrap();
    assert_eq!(resolved.commit.as_deref(), Some(fx.repo.commit.as_str()));
    assert_eq!(fx.hub.stats().revision, 0);
    assert_eq!(fx.hub.stats().tree, 1);
}

#[tokio::test]
async fn ranged_reads_return_exactly_the_bytes_asked() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    let data = fx.bytes(BIN);
    let n = data.len() as u64;
    for r in [0..1, 0..8, 1000..5000, n - 1..n, 0..n, 1_234_567..2_345_678] {
        let got = src.read_range(BIN, r.clone()).await.unwrap();
        assert!(got == data[r.start as usize..r.end as usize], "{r:?}");
    }
    assert!(src.read_range(BIN, 5..5).await.unwrap().is_empty());
    let cfg = src.read_file("config.json", 1 << 20).await.unwrap();
    assert_eq!(&cfg[..], fx.bytes("config.json"));
    let ranges = fx.hub.stats().file(REPO, BIN).ranges;
    assert_eq!(ranges[2].as_deref(), Some("bytes=1000-4999"));

    let e = src.read_range(BIN, n - 1..n + 1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{BIN} bytes {}-{}: bad ranged answer: outside the file's {n} bytes",
            n - 1,
            n
        )
    );
    let e = src.read_file(BIN, 1000).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{BIN}: {n} bytes, more than the 1000 bytes accepted for this file")
    );
    let e = src.read_range("nope.bin", 0..1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("nope.bin: not in the snapshot of {REPO}")
    );
}

#[tokio::test]
async fn the_redirected_location_is_reused_and_re_resolved_when_it_expires() {
    let fx = Fixture::new(HubConfig {
        redirect_to_cdn: true,
        ..HubConfig::default()
    })
    .await;
    let src = fx.source();
    let data = fx.bytes(BIN);
    for r in [0..100u64, 100..200, 5000..9000] {
        let got = src.read_range(BIN, r.clone()).await.unwrap();
        assert!(got == data[r.start as usize..r.end as usize], "{r:?}");
    }
    let f = fx.hub.stats().file(REPO, BIN);
    assert_eq!(
        (f.resolve, f.cdn),
        (1, 3),
        "one resolve, then the CDN: {f:?}"
    );

    // The signed URL expires: the next read resolves once more and carries on.
    fx.hub
        .faults()
        .push(Fault::status(403).route(RouteKind::Cdn).path(BIN));
    let got = src.read_range(BIN, 10..20).await.unwrap();
    assert_eq!(&got[..], &data[10..20]);
    let f = fx.hub.stats().file(REPO, BIN);
    assert_eq!((f.resolve, f.cdn), (2, 5), "{f:?}");
    assert_eq!(src.stats().retries, 0);
}

#[tokio::test]
async fn the_token_goes_to_the_endpoint_only_never_to_another_host() {
    let fx = Fixture::new(HubConfig {
        redirect_to_cdn: true,
        gated: vec![REPO.into()],
        token: Some("hf_right_token".into()),
        ..HubConfig::default()
    })
    .await;
    // The CDN listens on another port: another origin.
    assert_ne!(fx.hub.cdn_url(), Some(fx.hub.url()));
    let mut c = fx.config();
    c.token = HfToken::new("hf_right_token");
    let src = HttpSource::new(c).unwrap();
    for r in [0..10u64, 10..20] {
        src.read_range(BIN, r).await.unwrap();
    }
    let f = fx.hub.stats().file(REPO, BIN);
    assert_eq!((f.resolve, f.cdn, f.with_auth), (1, 2, 1), "{f:?}");
}

#[tokio::test]
async fn retry_after_seconds_is_waited_for() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::too_many_requests("1").path(BIN));
    let t = Instant::now();
    let got = src.read_range(BIN, 0..64).await.unwrap();
    let waited = t.elapsed();
    assert_eq!(&got[..], &fx.bytes(BIN)[..64]);
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
    assert_eq!(src.stats().retries, 1);
    assert_eq!(fx.hub.stats().file(REPO, BIN).ranges.len(), 2);
}

#[tokio::test]
async fn retry_after_http_date_is_waited_for() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    src.resolve().await.unwrap();
    // HTTP-dates have one-second resolution: now + 2 s is at least 1 s away.
    let at = std::time::SystemTime::now() + Duration::from_secs(2);
    fx.hub
        .faults()
        .push(Fault::too_many_requests(httpdate::fmt_http_date(at)).path(BIN));
    let t = Instant::now();
    src.read_range(BIN, 0..64).await.unwrap();
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
    assert_eq!(src.stats().retries, 1);
}

#[tokio::test]
async fn absurd_retry_after_is_refused_with_the_values() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::too_many_requests("86400").path(BIN));
    let e = src.read_range(BIN, 0..64).await.unwrap_err();
    assert!(matches!(e, SourceError::RetryAfterTooLong { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "{}: server asked to wait 86400 s (Retry-After: 86400), over the 300 s limit",
            fx.resolve_url(BIN)
        )
    );
    assert_eq!(fx.hub.stats().file(REPO, BIN).ranges.len(), 1);
}

#[tokio::test]
async fn transient_statuses_are_retried_to_success() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    // The revision API and the tree listing retry too.
    fx.hub
        .faults()
        .push(Fault::status(503).route(RouteKind::Revision));
    fx.hub
        .faults()
        .push(Fault::status(502).route(RouteKind::Tree));
    fx.hub.faults().push(Fault::status(503).times(2).path(BIN));
    let got = src.read_range(BIN, 100..200).await.unwrap();
    assert_eq!(&got[..], &fx.bytes(BIN)[100..200]);
    assert_eq!(src.stats().retries, 4);
    assert_eq!(fx.hub.faults().pending(), 0);
}

#[tokio::test]
async fn statuses_stop_after_max_attempts_with_the_range_in_the_error() {
    let fx = Fixture::new(HubConfig::default()).await;
    let mut c = fx.config();
    c.max_attempts = 3;
    let src = HttpSource::new(c).unwrap();
    src.resolve().await.unwrap();
    fx.hub.faults().push(Fault::status(503).times(10).path(BIN));
    let e = src.read_range(BIN, 0..10).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: HTTP 503 (bytes 0-9): Service Unavailable (ScriptedFault)",
            fx.resolve_url(BIN)
        )
    );
    assert_eq!(fx.hub.stats().file(REPO, BIN).ranges.len(), 3);
}

#[tokio::test]
async fn reset_and_truncated_bodies_are_retried_to_success() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    let data = fx.bytes(BIN);
    src.resolve().await.unwrap();
    for kind in [FaultKind::ResetMidBody, FaultKind::TruncatedBody] {
        let before = src.stats().retries;
        fx.hub.faults().push(Fault::new(kind.clone()).path(BIN));
        let got = src.read_range(BIN, 0..2_000_000).await.unwrap();
        assert!(got == data[..2_000_000], "{kind:?}");
        assert_eq!(src.stats().retries, before + 1, "{kind:?}");
    }
}

#[tokio::test]
async fn network_errors_after_all_attempts_name_the_range_and_count() {
    let fx = Fixture::new(HubConfig::default()).await;
    let mut c = fx.config();
    c.max_attempts = 2;
    let src = HttpSource::new(c).unwrap();
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::ResetMidBody).times(2).path(BIN));
    let e = src.read_range(BIN, 0..1_000_000).await.unwrap_err();
    let text = e.to_string();
    let head = format!(
        "{} (bytes 0-999999): network error after 2 attempt(s): body failed after",
        fx.resolve_url(BIN)
    );
    assert!(text.starts_with(&head), "{text}");
}

#[tokio::test]
async fn a_200_for_a_range_is_a_bad_range_error() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::FullBodyFor206).path(BIN));
    let e = src.read_range(BIN, 10..20).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{BIN} bytes 10-19: bad ranged answer: HTTP 200 with the whole file instead of 206 Partial Content (Content-Length: 3000000); the server ignored Range"
        )
    );
    assert_eq!(src.stats().retries, 0);
}

#[tokio::test]
async fn a_wrong_content_range_is_a_bad_range_error() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::WrongContentRange).path(BIN));
    let e = src.read_range(BIN, 10..20).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{BIN} bytes 10-19: bad ranged answer: Content-Range: bytes 11-20/3000000, expected bytes 10-19/3000000"
        )
    );
}

#[tokio::test]
async fn not_found_fails_fast_with_one_request() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    src.resolve().await.unwrap();
    let before = src.stats().requests;
    fx.hub.faults().push(Fault::status(404).path(BIN));
    let e = src.read_range(BIN, 0..10).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}: HTTP 404: not found (file {BIN})", fx.resolve_url(BIN))
    );
    assert_eq!(src.stats().requests, before + 1);

    let mut c = fx.config();
    c.repo = "gturbo-test/missing".into();
    let src = HttpSource::new(c).unwrap();
    let e = src.resolve().await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}/api/models/gturbo-test/missing/revision/main: HTTP 404: not found (repo gturbo-test/missing)",
            fx.hub.url()
        )
    );
    assert_eq!(src.stats().requests, 1);

    let mut c = fx.config();
    c.revision = "v9".into();
    let src = HttpSource::new(c).unwrap();
    let e = src.resolve().await.unwrap_err();
    assert!(
        e.to_string()
            .ends_with("HTTP 404: not found (revision v9 of gturbo-test/tiny)"),
        "{e}"
    );
    assert_eq!(src.stats().requests, 1);
}

#[tokio::test]
async fn a_gated_repo_fails_fast_and_never_shows_the_token() {
    let secret = "hf_wrong_token_0123456789";
    let fx = Fixture::new(HubConfig {
        gated: vec![REPO.into()],
        token: Some("hf_the_right_one".into()),
        ..HubConfig::default()
    })
    .await;
    let mut c = fx.config();
    c.token = HfToken::new(secret);
    let src = HttpSource::new(c).unwrap();
    let e = src.resolve().await.unwrap_err();
    let text = e.to_string();
    assert_eq!(
        text,
        format!(
            "{}/api/models/{REPO}/revision/main: HTTP 401: access denied with the token given: it is invalid, expired or revoked (check HF_TOKEN, HF_TOKEN_PATH or the token file from `hf auth login`)",
            fx.hub.url()
        )
    );
    let debug = format!("{e:?} {src:?}");
    assert!(!text.contains(secret) && !debug.contains(secret), "{debug}");
    assert!(debug.contains("HfToken(***)"), "{debug}");
    assert_eq!(src.stats().requests, 1);

    let mut c = fx.config();
    c.token = HfToken::new("hf_the_right_one");
    let src = HttpSource::new(c).unwrap();
    let got = src.read_file("config.json", 4096).await.unwrap();
    assert_eq!(&got[..], fx.bytes("config.json"));
}

// ---- stream_range: bounded chunks, resumption after body faults ----

const BIG: &str = "weights/big.bin";
const BIG_LEN: usize = 5_000_000;

/// The small snapshot plus a 5 MB `weights/big.bin`.
async fn big_fixture(config: HubConfig) -> Fixture {
    let tmp = support::temp_dir();
    let mut files = support::write_small_snapshot(tmp.path());
    let big = support::pseudo_random(BIG_LEN, 11);
    support::write_file(tmp.path(), BIG, &big);
    files.push((BIG.to_string(), big));
    files.sort_by(|a, b| a.0.cmp(&b.0));
    let (hub, repo) = support::start_hub(
        REPO,
        tmp.path(),
        HubConfig {
            lfs_threshold: 1024 * 1024,
            ..config
        },
    )
    .await;
    Fixture {
        _tmp: tmp,
        hub,
        repo,
        files,
    }
}

/// Every chunk of a stream, or the first error (outer or in the stream).
async fn chunks(
    stream: Result<gturbo::source::ByteStream, SourceError>,
) -> Result<Vec<bytes::Bytes>, SourceError> {
    use futures_util::StreamExt as _;
    let mut stream = stream?;
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.push(chunk?);
    }
    Ok(out)
}

/// The chunks before the stream's error, and the error.
async fn chunks_until_error(stream: gturbo::source::ByteStream) -> (Vec<u8>, Option<SourceError>) {
    use futures_util::StreamExt as _;
    let mut stream = stream;
    let mut got = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => got.extend_from_slice(&c),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

fn concat(chunks: &[bytes::Bytes]) -> Vec<u8> {
    chunks.iter().flat_map(|c| c.iter().copied()).collect()
}

/// The first and last byte of each `Range: bytes=a-b` the hub was asked for.
fn asked_ranges(ranges: &[Option<String>]) -> Vec<(u64, u64)> {
    ranges
        .iter()
        .map(|r| {
            let (a, b) = r
                .as_deref()
                .and_then(|r| r.strip_prefix("bytes="))
                .and_then(|r| r.split_once('-'))
                .expect("a Range header");
            (
                a.parse().expect("first byte"),
                b.parse().expect("last byte"),
            )
        })
        .collect()
}

// The hub cuts a faulty body after half the bytes, but under load a reset may drop
// bytes still queued on the server's side, so a resumption can start before the half.
// What the tests pin down: the resumed request starts exactly where the bytes received
// ended (the bytes are exact and none was fetched twice), and no later than the half.

#[tokio::test]
async fn a_streamed_range_arrives_exact_in_chunks_of_at_most_one_mib() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = fx.source();
    let data = fx.bytes(BIG);
    src.resolve().await.unwrap();
    let before = src.stats();
    let got = chunks(src.stream_range(BIG, 0..BIG_LEN as u64).await)
        .await
        .unwrap();
    assert!(concat(&got) == data, "streamed bytes differ from the file");
    assert!(got.len() >= 5, "{} chunks", got.len());
    for c in &got {
        assert!(
            !c.is_empty() && c.len() <= STREAM_CHUNK,
            "chunk of {}",
            c.len()
        );
    }
    let after = src.stats();
    assert_eq!(after.bytes - before.bytes, BIG_LEN as u64);
    assert_eq!(after.requests - before.requests, 1);
    assert_eq!(after.retries, 0);

    // A range in the middle; an empty range sends nothing.
    let r = 1_234_567..4_567_890u64;
    let got = chunks(src.stream_range(BIG, r.clone()).await)
        .await
        .unwrap();
    assert!(concat(&got) == data[r.start as usize..r.end as usize]);
    assert!(
        chunks(src.stream_range(BIG, 7..7).await)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        fx.hub.stats().file(REPO, BIG).ranges,
        vec![
            Some("bytes=0-4999999".to_string()),
            Some("bytes=1234567-4567889".to_string()),
        ]
    );

    // Refusals before any byte are the outer error, as for read_range.
    let e = chunks(src.stream_range(BIG, 10..BIG_LEN as u64 + 1).await)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{BIG} bytes 10-{BIG_LEN}: bad ranged answer: outside the file's {BIG_LEN} bytes")
    );
    let e = chunks(src.stream_range("nope.bin", 0..1).await)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("nope.bin: not in the snapshot of {REPO}")
    );
}

#[tokio::test]
async fn a_reset_or_truncated_body_is_resumed_from_the_byte_reached() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = fx.source();
    let data = fx.bytes(BIG);
    src.resolve().await.unwrap();
    // 4_000_000 bytes from 1000: the hub cuts the first body after half of them.
    let r = 1000..4_001_000u64;
    for kind in [FaultKind::ResetMidBody, FaultKind::TruncatedBody] {
        fx.hub.reset_stats();
        let before = src.stats();
        fx.hub.faults().push(Fault::new(kind.clone()).path(BIG));
        let got = chunks(src.stream_range(BIG, r.clone()).await)
            .await
            .unwrap();
        assert!(concat(&got) == data[1000..4_001_000], "{kind:?}");
        assert!(got.iter().all(|c| c.len() <= STREAM_CHUNK), "{kind:?}");
        let asked = asked_ranges(&fx.hub.stats().file(REPO, BIG).ranges);
        assert_eq!(asked.len(), 2, "{kind:?}: {asked:?}");
        assert_eq!(asked[0], (1000, 4_000_999), "{kind:?}");
        assert_eq!(asked[1].1, 4_000_999, "{kind:?}");
        let resume = asked[1].0;
        assert!(resume > 1000 && resume <= 2_001_000, "{kind:?}: {asked:?}");
        let after = src.stats();
        assert_eq!(after.retries - before.retries, 1, "{kind:?}");
        assert_eq!(after.requests - before.requests, 2, "{kind:?}");
        // Every body byte was used once: the resumption asked only for what was missing.
        assert_eq!(after.bytes - before.bytes, 4_000_000, "{kind:?}");
        assert_eq!(fx.hub.faults().pending(), 0);
    }
}

#[tokio::test]
async fn a_resumed_request_is_retried_on_a_transient_status() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = fx.source();
    let data = fx.bytes(BIG);
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::ResetMidBody).path(BIG));
    fx.hub.faults().push(Fault::status(503).path(BIG));
    let got = chunks(src.stream_range(BIG, 0..2_000_000).await)
        .await
        .unwrap();
    assert!(concat(&got) == data[..2_000_000]);
    let asked = asked_ranges(&fx.hub.stats().file(REPO, BIG).ranges);
    let resume = asked[1].0;
    assert!(resume > 0 && resume <= 1_000_000, "{asked:?}");
    assert_eq!(
        asked,
        [(0, 1_999_999), (resume, 1_999_999), (resume, 1_999_999)]
    );
    assert_eq!(src.stats().retries, 2);
}

#[tokio::test]
async fn a_resumed_request_goes_to_the_cached_cdn_location() {
    let fx = big_fixture(HubConfig {
        redirect_to_cdn: true,
        ..HubConfig::default()
    })
    .await;
    let src = fx.source();
    let data = fx.bytes(BIG);
    fx.hub.faults().push(
        Fault::new(FaultKind::ResetMidBody)
            .route(RouteKind::Cdn)
            .path(BIG),
    );
    let got = chunks(src.stream_range(BIG, 0..BIG_LEN as u64).await)
        .await
        .unwrap();
    assert!(concat(&got) == data);
    let f = fx.hub.stats().file(REPO, BIG);
    assert_eq!(
        (f.resolve, f.cdn),
        (1, 2),
        "one resolve, then the CDN twice: {f:?}"
    );
    let asked = asked_ranges(&f.ranges);
    let resume = asked[2].0;
    assert!(resume > 0 && resume <= 2_500_000, "{asked:?}");
    assert_eq!(
        asked,
        [(0, 4_999_999), (0, 4_999_999), (resume, 4_999_999)],
        "resolve, CDN, then the CDN again for the rest"
    );
    assert_eq!(src.stats().retries, 1);

    // The signed URL expires between the break and the resumption: the file is
    // resolved once more and the stream carries on from the byte reached.
    fx.hub.reset_stats();
    fx.hub.faults().push(
        Fault::new(FaultKind::ResetMidBody)
            .route(RouteKind::Cdn)
            .path(BIG),
    );
    fx.hub
        .faults()
        .push(Fault::status(403).route(RouteKind::Cdn).path(BIG));
    let got = chunks(src.stream_range(BIG, 0..2_000_000).await)
        .await
        .unwrap();
    assert!(concat(&got) == data[..2_000_000]);
    let f = fx.hub.stats().file(REPO, BIG);
    assert_eq!((f.resolve, f.cdn), (1, 3), "{f:?}");
    let asked = asked_ranges(&f.ranges);
    let resume = asked[1].0;
    assert!(resume > 0 && resume <= 1_000_000, "{asked:?}");
    assert_eq!(
        asked,
        [
            (0, 1_999_999),
            (resume, 1_999_999),
            (resume, 1_999_999),
            (resume, 1_999_999),
        ],
        "CDN (reset), CDN (expired), resolve, CDN"
    );
    assert_eq!(src.stats().retries, 2);
}

#[tokio::test]
async fn a_200_or_a_wrong_content_range_ends_a_stream_with_bad_range() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = fx.source();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::FullBodyFor206).path(BIG));
    let e = chunks(src.stream_range(BIG, 10..20).await)
        .await
        .unwrap_err();
    assert!(matches!(e, SourceError::BadRange { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "{BIG} bytes 10-19: bad ranged answer: HTTP 200 with the whole file instead of 206 Partial Content (Content-Length: {BIG_LEN}); the server ignored Range"
        )
    );
    assert_eq!(src.stats().retries, 0);

    // The resumed request is checked like the first: its wrong Content-Range ends the
    // stream after the bytes already delivered, naming the caller's range.
    let data = fx.bytes(BIG);
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::ResetMidBody).path(BIG));
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::WrongContentRange).path(BIG));
    let stream = src.stream_range(BIG, 0..2_000_000).await.unwrap();
    let (got, e) = chunks_until_error(stream).await;
    let k = got.len();
    assert!(
        k <= 1_000_000 && got == data[..k],
        "{k} bytes before the error"
    );
    let e = e.expect("the stream ends with an error");
    assert!(matches!(e, SourceError::BadRange { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "{BIG} bytes 0-1999999: bad ranged answer: Content-Range: bytes {}-2000000/{BIG_LEN}, expected bytes {k}-1999999/{BIG_LEN}",
            k + 1
        )
    );
}

#[tokio::test]
async fn a_stream_gives_up_when_attempts_run_out_with_the_range_and_count() {
    let fx = big_fixture(HubConfig::default()).await;
    let mut c = fx.config();
    c.max_attempts = 2;
    let src = HttpSource::new(c).unwrap();
    let data = fx.bytes(BIG);
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::ResetMidBody).times(2).path(BIG));
    let stream = src.stream_range(BIG, 0..1_000_000).await.unwrap();
    let (got, e) = chunks_until_error(stream).await;
    // Half, then half of the rest (750_000 bytes unless a reset dropped some), before
    // the budget of 2 attempts is spent; what arrived was handed on.
    let k = got.len();
    assert!(
        k <= 750_000 && got == data[..k],
        "{k} bytes before the error"
    );
    let e = e.expect("the stream ends with an error");
    assert!(
        matches!(e, SourceError::Network { attempts: 2, .. }),
        "{e:?}"
    );
    let text = e.to_string();
    let head = format!(
        "{} (bytes 0-999999): network error after 2 attempt(s): body failed after {k} of 1000000 bytes: ",
        fx.resolve_url(BIG)
    );
    assert!(text.starts_with(&head), "{text}");
    let asked = asked_ranges(&fx.hub.stats().file(REPO, BIG).ranges);
    let resume = asked[1].0;
    assert!(resume <= 500_000 && resume <= k as u64, "{asked:?}");
    assert_eq!(asked, [(0, 999_999), (resume, 999_999)]);
    assert_eq!(src.stats().retries, 1);
}

// ---- issue 13: progress deadlines, published hashes, token hints, Retry-After ----

use gturbo::source::pace::ProgressLimits;
use gturbo_testkit::hub::PublishedHashes;

/// A source whose progress rules fire in fractions of a second.
fn paced(fx: &Fixture, limits: ProgressLimits, attempts: usize) -> HttpSource {
    let mut c = fx.config();
    c.progress = limits;
    c.max_attempts = attempts;
    HttpSource::new(c).unwrap()
}

fn low_speed(bytes: u64, ms: u64) -> ProgressLimits {
    ProgressLimits {
        low_speed_bytes: bytes,
        low_speed_time: Duration::from_millis(ms),
        range_timeout: Duration::ZERO,
    }
}

#[tokio::test]
async fn a_server_that_stalls_every_read_fails_each_attempt_at_the_low_speed_limit() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = paced(&fx, low_speed(1000, 300), 3);
    src.resolve().await.unwrap();
    for kind in [FaultKind::Stall, FaultKind::StallBeforeHeaders] {
        fx.hub.reset_stats();
        fx.hub.faults().clear();
        fx.hub
            .faults()
            .push(Fault::new(kind.clone()).path(BIG).always());
        let before = src.stats().retries;
        let t = Instant::now();
        // A whole read and a stream: both give up after 3 attempts of 0.3 s.
        let e = src.read_range(BIG, 0..100_000).await.unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(e, SourceError::TooSlow { attempts: 3, .. }),
            "{kind:?}: {e:?}"
        );
        // The wait shown is the one measured (0.3 s, more on a loaded machine).
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "{BIG} (bytes 0-99999): too slow, gave up after 3 attempt(s): fewer than 1000 bytes in 0.3 s (the low-speed limit): 0 bytes in 0."
            )) && text.ends_with(&format!(" s, 0.0 B/s (from {})", fx.resolve_url(BIG))),
            "{kind:?}: {text}"
        );
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(5),
            "{kind:?}: {took:?}"
        );
        assert_eq!(src.stats().retries - before, 2, "{kind:?}");
        assert_eq!(fx.hub.stats().file(REPO, BIG).ranges.len(), 3, "{kind:?}");

        let stream = src.stream_range(BIG, 0..100_000).await;
        let e = match stream {
            Err(e) => e,
            Ok(s) => chunks_until_error(s).await.1.expect("an error"),
        };
        assert!(
            matches!(e, SourceError::TooSlow { attempts: 3, .. }),
            "{kind:?}: {e:?}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("{BIG} (bytes 0-99999): too slow")),
            "{e}"
        );
    }
}

#[tokio::test]
async fn a_slow_drip_fails_at_the_low_speed_limit_naming_the_rate() {
    let fx = big_fixture(HubConfig::default()).await;
    let src = paced(&fx, low_speed(10_000, 400), 2);
    src.resolve().await.unwrap();
    // 10 bytes every 50 ms: 200 B/s, a per-read timeout would never fire.
    fx.hub.faults().push(
        Fault::new(FaultKind::SlowDrip {
            bytes: 10,
            every_ms: 50,
        })
        .path(BIG)
        .always(),
    );
    let stream = src.stream_range(BIG, 0..1_000_000).await.unwrap();
    let (got, e) = chunks_until_error(stream).await;
    let e = e.expect("an error");
    assert!(
        matches!(e, SourceError::TooSlow { attempts: 2, .. }),
        "{e:?}"
    );
    let text = e.to_string();
    let head = format!(
        "{BIG} (bytes 0-999999): too slow, gave up after 2 attempt(s): fewer than 10000 bytes in 0.4 s (the low-speed limit): "
    );
    assert!(text.starts_with(&head), "{text}");
    assert!(text.contains(" B/s (from "), "{text}");
    // What dripped in was kept, and the second attempt resumed after it.
    assert!(!got.is_empty() && got == fx.bytes(BIG)[..got.len()]);
    let asked = asked_ranges(&fx.hub.stats().file(REPO, BIG).ranges);
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(asked[1].0 > 0, "{asked:?}");

    // A steady server well above the limit is not refused.
    fx.hub.faults().clear();
    fx.hub.faults().push(
        Fault::new(FaultKind::SlowDrip {
            bytes: 8192,
            every_ms: 20,
        })
        .path(BIG)
        .always(),
    );
    let got = chunks(src.stream_range(BIG, 0..100_000).await)
        .await
        .unwrap();
    assert!(concat(&got) == fx.bytes(BIG)[..100_000]);
}

#[tokio::test]
async fn the_range_timeout_ends_an_attempt_and_the_next_resumes_from_the_byte_reached() {
    let fx = big_fixture(HubConfig::default()).await;
    let limits = ProgressLimits {
        low_speed_bytes: 0,
        low_speed_time: Duration::ZERO,
        range_timeout: Duration::from_millis(300),
    };
    let src = paced(&fx, limits, 3);
    src.resolve().await.unwrap();
    // 4 KiB every 20 ms (about 200 KiB/s): passes any low-speed limit, but 1 MB takes
    // 5 s, far over three attempts of 0.3 s.
    fx.hub.faults().push(
        Fault::new(FaultKind::SlowDrip {
            bytes: 4096,
            every_ms: 20,
        })
        .path(BIG)
        .always(),
    );
    let stream = src.stream_range(BIG, 0..1_000_000).await.unwrap();
    let (got, e) = chunks_until_error(stream).await;
    let e = e.expect("an error");
    assert!(
        matches!(e, SourceError::TooSlow { attempts: 3, .. }),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with(&format!(
            "{BIG} (bytes 0-999999): too slow, gave up after 3 attempt(s): the range timeout of 0.3 s passed: "
        )) && text.contains("KiB/s"),
        "{text}"
    );
    assert!(got == fx.bytes(BIG)[..got.len()]);
    let asked = asked_ranges(&fx.hub.stats().file(REPO, BIG).ranges);
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(
        asked[0].0 < asked[1].0 && asked[1].0 < asked[2].0,
        "each attempt resumes where the last stopped: {asked:?}"
    );
    assert!(asked[2].0 <= got.len() as u64, "{asked:?} {}", got.len());
}

#[tokio::test]
async fn published_sha256_comes_from_the_listing_x_linked_etag_or_a_sha256_etag() {
    for (mode, cdn, want) in [
        (PublishedHashes::Everywhere, false, true),
        (PublishedHashes::LinkedEtag, false, true),
        (PublishedHashes::LinkedEtag, true, true),
        (PublishedHashes::Etag, false, true),
        (PublishedHashes::Etag, true, true),
        (PublishedHashes::Nowhere, false, false),
        (PublishedHashes::Nowhere, true, false),
    ] {
        let fx = Fixture::new(HubConfig {
            published_hashes: mode,
            redirect_to_cdn: cdn,
            ..HubConfig::default()
        })
        .await;
        let src = fx.source();
        let listed = src.resolve().await.unwrap();
        let in_listing = listed.file(BIN).unwrap().sha256.is_some();
        assert_eq!(in_listing, mode == PublishedHashes::Everywhere, "{mode:?}");
        let sha = support::sha256_hex(fx.bytes(BIN));
        src.read_range(BIN, 0..10).await.unwrap();
        assert_eq!(
            src.published_sha256(BIN),
            want.then(|| sha.clone()),
            "{mode:?} cdn={cdn}"
        );
        // Small (non-LFS) files publish a git SHA-1, never taken for a SHA-256.
        src.read_file("config.json", 4096).await.unwrap();
        assert_eq!(src.published_sha256("config.json"), None, "{mode:?}");
    }
}

#[tokio::test]
async fn an_x_linked_etag_that_contradicts_the_listing_refuses_the_read() {
    let fx = Fixture::new(HubConfig::default()).await;
    let src = fx.source();
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::new(FaultKind::ChangedEtag).path(BIN));
    let e = src.read_range(BIN, 0..10).await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(&format!(
            "{}: malformed answer: field `{BIN}: X-Linked-Etag`: SHA-256 ",
            fx.resolve_url(BIN)
        )) && text.contains(&format!(
            "differs from the tree listing's lfs.oid {}",
            support::sha256_hex(fx.bytes(BIN))
        )),
        "{text}"
    );
    assert_eq!(src.stats().retries, 0);
}

#[tokio::test]
async fn a_refused_token_gets_another_hint_than_a_missing_one() {
    let fx = Fixture::new(HubConfig {
        gated: vec![REPO.into()],
        token: Some("hf_the_right_one".into()),
        ..HubConfig::default()
    })
    .await;
    let revision_url = format!("{}/api/models/{REPO}/revision/main", fx.hub.url());
    let src = fx.source();
    assert_eq!(
        src.resolve().await.unwrap_err().to_string(),
        format!(
            "{revision_url}: HTTP 401: access denied; the repo may be gated or private (set HF_TOKEN or log in with `hf auth login`, and accept the repo's terms on the hub)"
        )
    );
    let mut c = fx.config();
    c.token = HfToken::new("hf_wrong");
    let src = HttpSource::new(c).unwrap();
    assert_eq!(
        src.resolve().await.unwrap_err().to_string(),
        format!(
            "{revision_url}: HTTP 401: access denied with the token given: it is invalid, expired or revoked (check HF_TOKEN, HF_TOKEN_PATH or the token file from `hf auth login`)"
        )
    );
    // A valid token without access to the repo (the hub answers 403).
    let mut c = fx.config();
    c.token = HfToken::new("hf_the_right_one");
    let src = HttpSource::new(c).unwrap();
    fx.hub
        .faults()
        .push(Fault::status(403).route(RouteKind::Revision));
    let e = src.resolve().await.unwrap_err();
    assert!(
        matches!(
            e,
            SourceError::Unauthorized {
                status: 403,
                token_sent: true,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().ends_with(
            "HTTP 403: access denied with the token given: it is valid but has no access to this repo (accept the repo's terms on the hub, or use a token with read access to it)"
        ),
        "{e}"
    );
}

#[tokio::test]
async fn a_retry_after_over_the_limit_on_a_stream_is_not_followed_by_another_request() {
    let fx = big_fixture(HubConfig::default()).await;
    let mut c = fx.config();
    c.max_retry_after = Duration::from_secs(10);
    let src = HttpSource::new(c).unwrap();
    src.resolve().await.unwrap();
    fx.hub
        .faults()
        .push(Fault::too_many_requests("86400").path(BIG));
    let e = chunks(src.stream_range(BIG, 0..1_000_000).await)
        .await
        .unwrap_err();
    assert!(matches!(e, SourceError::RetryAfterTooLong { .. }), "{e:?}");
    assert_eq!(fx.hub.stats().file(REPO, BIG).ranges.len(), 1);
    assert_eq!(src.stats().retries, 0);
}
