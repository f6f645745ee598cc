//! Byte ranges from a Hugging Face-compatible endpoint (the hub, a mirror, the test hub).
//!
//! # Flow
//!
//! 1. **Resolve the revision once.** `GET {endpoint}/api/models/{repo}/revision/{rev}`
//!    gives the commit (`sha`); skipped when the revision already is a 40-hex commit.
//!    Everything after is pinned to that commit, so a push to `main` mid-install cannot
//!    mix two snapshots.
//! 2. **List the tree once.** `GET {endpoint}/api/models/{repo}/tree/{commit}?recursive=true`,
//!    following `Link: <…>; rel="next"` pagination (RFC 8288). Every path is checked with
//!    [`check_repo_path`] (a hostile listing cannot name `../x`); `lfs.oid` is the file's
//!    SHA-256.
//! 3. **Resolve each file once.** The first ranged `GET` of a file goes to
//!    `{endpoint}/{repo}/resolve/{commit}/{path}`. Redirects are followed by hand
//!    (`redirect::Policy::none()`) so that `Authorization` is sent only to the endpoint's
//!    own origin, never to a CDN on another host, and so the final location can be cached:
//!    later ranges of the file go straight there, because the hub's rate limits count
//!    resolver requests. If a cached location answers 403/404/410 (an expired signed URL),
//!    the file is resolved again, once. The hops' headers also publish the file's
//!    SHA-256 where the listing has no `lfs.oid` ([`RangeSource::published_sha256`]):
//!    `X-Linked-Etag` (the hub's LFS SHA-256, on every LFS answer), else a strong `ETag`
//!    of 64 hex digits from the endpoint itself (a CDN's ETag is its own business). An
//!    `X-Linked-Etag` that contradicts the listing refuses the read. A file not in LFS
//!    has its git blob id as the listing's `oid` and as the `ETag` of its answers
//!    ([`RangeSource::published_git_oid`]; the `ETag` counts only where the listing has
//!    none, and only from the endpoint itself).
//! 4. **Check every ranged answer** (RFC 9110 §14): it must be `206 Partial Content` with
//!    `Content-Range: bytes a-b/total` naming exactly the bytes asked for and the listed
//!    size, a `Content-Length` (when sent) of exactly that length, and a body of exactly
//!    that length. A `200` (the server ignored `Range`) or any mismatch is
//!    [`SourceError::BadRange`] with the header values seen; we never slice a full body.
//! 5. **Retry transient faults only** ([`super::retry`]): 408/429/5xx, resets, timeouts and
//!    bodies that end early, with exponential backoff and jitter; a `Retry-After`
//!    (RFC 9110 §10.2.3, seconds or HTTP-date) replaces the computed delay, and one over
//!    `max_retry_after` is refused with [`SourceError::RetryAfterTooLong`]. 401/403 is
//!    [`SourceError::Unauthorized`] and 404 [`SourceError::NotFound`] at once: one request,
//!    no retries. Every attempt also obeys the progress rules of [`super::pace`] (a
//!    low-speed limit and a range timeout, measured on the time spent waiting on the
//!    server): an attempt that breaks one is a transient failure drawing on the same
//!    budget, and the last one is [`SourceError::TooSlow`], naming the file and the rate.
//! 6. **Stream big ranges** ([`RangeSource::stream_range`]): the same request and checks,
//!    then the body is handed on in chunks of at most [`STREAM_CHUNK`] bytes as they
//!    arrive. A body that breaks or ends short is resumed with a ranged `GET` for only the
//!    bytes not yet received (same checks, same cached location, counted as a retry and
//!    drawing on the same attempt budget), so the consumer sees one exact stream; a body
//!    longer than asked ends it with [`SourceError::BadRange`].
//!
//! The token ([`HfToken`]) is only ever written into the `Authorization` header (marked
//! sensitive); URLs in errors lose their query string, which may hold a CDN signature.
//! Every request (redirect hops and retries included), every retry and every body byte
//! is counted in [`SourceStats`].

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use backon::{BackoffBuilder as _, Retryable as _};
use bytes::{Bytes, BytesMut};
use reqwest::header::{self, HeaderMap};
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use super::budget::{self, ResolverBudget};
use super::pace::{Pace, ProgressLimits, Slow};
use super::retry::{self, RetryPolicy, TransportFault};
use super::token::HfToken;
use super::{
    ByteStream, RangeSource, RepoFile, ResolvedRepo, SourceError, SourceStats, check_repo_path,
};
use crate::format::digest;

/// Redirect hops followed per request.
const MAX_REDIRECTS: usize = 10;
/// Largest revision or tree-page JSON accepted.
const MAX_API_BODY: usize = 64 * 1024 * 1024;
/// Tree pages followed before the listing is declared endless.
const MAX_TREE_PAGES: usize = 100_000;
/// Largest chunk [`RangeSource::stream_range`] yields: what one read holds in flight.
pub const STREAM_CHUNK: usize = 1024 * 1024;

/// Where to read from and how patiently.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Base URL: `https://huggingface.co`, a mirror, or the test hub.
    pub endpoint: String,
    /// `org/name`.
    pub repo: String,
    /// Branch, tag or 40-hex commit.
    pub revision: String,
    /// Sent as `Authorization: Bearer` to the endpoint's own origin only.
    pub token: Option<HfToken>,
    /// Longest `Retry-After` slept on; more is an error.
    pub max_retry_after: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: usize,
    /// First backoff delay (doubles per retry, plus jitter).
    pub base_delay: Duration,
    /// Cap on a computed backoff delay.
    pub max_delay: Duration,
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
    /// Limit on the wait for each read of an answer, a backstop under `progress`: a
    /// stalled transfer fails and is retried instead of hanging an install.
    pub read_timeout: Duration,
    /// The low-speed limit and range timeout of every attempt ([`super::pace`]).
    pub progress: ProgressLimits,
    /// `User-Agent` header.
    pub user_agent: String,
}

impl HttpConfig {
    /// Defaults: no token, 6 attempts, 250 ms base delay, 30 s cap, 300 s Retry-After
    /// limit, 64 KiB in 30 s low-speed limit, 600 s range timeout.
    pub fn new(
        endpoint: impl Into<String>,
        repo: impl Into<String>,
        revision: impl Into<String>,
    ) -> Self {
        let policy = RetryPolicy::default();
        Self {
            endpoint: endpoint.into(),
            repo: repo.into(),
            revision: revision.into(),
            token: None,
            max_retry_after: policy.max_retry_after,
            max_attempts: policy.max_attempts,
            base_delay: policy.base_delay,
            max_delay: policy.max_delay,
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
            progress: ProgressLimits::default(),
            user_agent: format!("gturbo/{}", env!("CARGO_PKG_VERSION")),
        }
    }

    fn policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.max_attempts.max(1),
            base_delay: self.base_delay,
            max_delay: self.max_delay,
            max_retry_after: self.max_retry_after,
        }
    }
}

/// A [`RangeSource`] over HTTP. See the module doc for the flow.
///
/// Cheap to share: the state lives behind an [`Arc`], so a stream from
/// [`RangeSource::stream_range`] can own what it needs and outlive the borrow.
pub struct HttpSource {
    inner: Arc<Inner>,
}

/// The source's state, shared by the source and its open streams.
struct Inner {
    config: HttpConfig,
    endpoint: Url,
    repo_segments: Vec<String>,
    client: reqwest::Client,
    policy: RetryPolicy,
    resolved: tokio::sync::OnceCell<ResolvedRepo>,
    /// Per file, the location a redirect led to, reused for later ranges.
    locations: Mutex<HashMap<String, Url>>,
    /// Per file not hashed in the listing, the SHA-256 its answers published.
    published: Mutex<HashMap<String, (String, HashOrigin)>>,
    /// Per file without a git blob id in the listing, the one an `ETag` of the
    /// endpoint published.
    git_oids: Mutex<HashMap<String, String>>,
    /// Files whose answers said they are in LFS (`X-Linked-Size`, `X-Linked-Etag`):
    /// a listing without their `lfs` block gives the blob id of their pointer file as
    /// `oid`, which names no content bytes.
    in_lfs: Mutex<BTreeSet<String>>,
    requests: AtomicU64,
    retries: AtomicU64,
    /// Retries after a `429` or `503`: the server asking for less.
    pushbacks: AtomicU64,
    /// Requests to the endpoint's own origin, against the hub's 5-minute budget.
    resolver: ResolverBudget,
    bytes: AtomicU64,
}

impl fmt::Debug for HttpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.inner;
        f.debug_struct("HttpSource")
            .field("endpoint", &display_url(&s.endpoint))
            .field("repo", &s.config.repo)
            .field("revision", &s.config.revision)
            .field("token", &s.config.token)
            .field("policy", &s.policy)
            .finish_non_exhaustive()
    }
}

/// One answer after its redirects.
struct Sent {
    resp: reqwest::Response,
    /// The URL that gave it.
    url: Url,
    /// The SHA-256 the hops published for the file, and where.
    published: Option<(String, HashOrigin)>,
    /// A git blob id the endpoint's own `ETag` published ([`git_oid_in`]).
    git_oid: Option<String>,
    /// A hop said the file is in LFS (`X-Linked-Size` or `X-Linked-Etag`).
    lfs: bool,
}

/// Why one attempt failed, as the retry loop sees it.
#[derive(Debug)]
enum Failure {
    /// Worth another attempt; `retry_after` replaces the backoff delay.
    Transient {
        error: SourceError,
        status: Option<u16>,
        retry_after: Option<Duration>,
    },
    /// An answer; asking again would not change it.
    Fatal(SourceError),
    /// A cached redirect location no longer works (403/404/410): resolve the file again.
    Stale(SourceError),
}

impl Failure {
    fn into_error(self) -> SourceError {
        match self {
            Self::Transient { error, .. } | Self::Fatal(error) | Self::Stale(error) => error,
        }
    }
}

/// A URL fit for messages and logs: no user info, no query (it may carry a signature).
fn display_url(url: &Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.set_fragment(None);
    u.to_string()
}

/// A commit id as a hub may write it (either case; kept lowercased).
fn is_commit(rev: &str) -> bool {
    digest::is_hex(rev, digest::COMMIT_HEX_LEN)
}

/// A SHA-256 as a hub may write it (either case; kept lowercased).
fn is_sha256(s: &str) -> bool {
    digest::is_hex(s, digest::SHA256_HEX_LEN)
}

/// Where a file's published SHA-256 came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HashOrigin {
    /// `lfs.oid` in the tree listing.
    Listing,
    /// `X-Linked-Etag` on a file answer: the hub's LFS SHA-256 of the content.
    LinkedEtag,
    /// A strong `ETag` that is 64 hex digits, on an answer from the endpoint itself.
    Etag,
}

impl HashOrigin {
    /// The listing and `X-Linked-Etag` state the content's SHA-256; a bare `ETag` only
    /// looks like one, so it never overrides or contradicts them.
    fn is_strong(self) -> bool {
        !matches!(self, Self::Etag)
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Listing => "tree listing's lfs.oid",
            Self::LinkedEtag => "X-Linked-Etag",
            Self::Etag => "ETag",
        }
    }
}

/// The SHA-256 an answer's headers publish for its file, if any: `X-Linked-Etag`, else
/// (only from the endpoint's own origin, not a CDN's, whose ETags are its own) a strong
/// `ETag` of 64 hex digits.
fn published_in(headers: &HeaderMap, from_endpoint: bool) -> Option<(String, HashOrigin)> {
    let hex = |name: &str| {
        let v = headers.get(name)?.to_str().ok()?.trim();
        // A weak validator (`W/"…"`) does not name the bytes.
        let v = v.strip_prefix('"')?.strip_suffix('"')?;
        is_sha256(v).then(|| v.to_ascii_lowercase())
    };
    if let Some(h) = hex("x-linked-etag") {
        return Some((h, HashOrigin::LinkedEtag));
    }
    if from_endpoint && let Some(h) = hex(header::ETAG.as_str()) {
        return Some((h, HashOrigin::Etag));
    }
    None
}

/// The git blob id a strong `ETag` of 40 hex digits publishes (the hub's `ETag` of a
/// file not in LFS), from the endpoint's own origin only.
fn git_oid_in(headers: &HeaderMap, from_endpoint: bool) -> Option<String> {
    if !from_endpoint {
        return None;
    }
    let v = headers.get(header::ETAG)?.to_str().ok()?.trim();
    let v = v.strip_prefix('"')?.strip_suffix('"')?;
    digest::is_hex(v, digest::GIT_OID_HEX_LEN).then(|| v.to_ascii_lowercase())
}

/// The reqwest read timeout: a backstop that should never fire before the low-speed
/// rule, whose message names the file and the rate.
fn backstop_read_timeout(config: &HttpConfig) -> Duration {
    let p = &config.progress;
    if p.low_speed_bytes > 0 && !p.low_speed_time.is_zero() {
        config
            .read_timeout
            .max(p.low_speed_time + Duration::from_secs(5))
    } else {
        config.read_timeout
    }
}

/// A transient failure for an attempt that broke a progress rule.
fn slow_failure(what: &str, url: &Url, range: Option<Range<u64>>, slow: Slow) -> Failure {
    Failure::Transient {
        error: SourceError::TooSlow {
            file: what.to_string(),
            url: display_url(url),
            range,
            attempts: 1,
            detail: slow.to_string(),
        },
        status: None,
        retry_after: None,
    }
}

/// The next chunk of `resp`'s body, waiting no longer than `pace` allows. A chunk that
/// arrives is always returned; the rules are judged before each wait.
async fn paced_chunk(
    resp: &mut reqwest::Response,
    pace: &mut Pace,
) -> Result<reqwest::Result<Option<Bytes>>, Slow> {
    loop {
        pace.check()?;
        let started = Instant::now();
        let Some(budget) = pace.budget() else {
            return Ok(resp.chunk().await);
        };
        // `chunk` is cancel-safe: a timed-out wait loses no bytes.
        match tokio::time::timeout(budget, resp.chunk()).await {
            Ok(got) => {
                let n = match &got {
                    Ok(Some(c)) => c.len() as u64,
                    _ => 0,
                };
                pace.record(started.elapsed(), n);
                return Ok(got);
            }
            Err(_) => pace.record(started.elapsed().max(budget), 0),
        }
    }
}

/// The `rel="next"` target of a `Link` header (RFC 8288), if any.
pub fn parse_link_next(value: &str) -> Option<&str> {
    let mut rest = value;
    while let Some(open) = rest.find('<') {
        let after = &rest[open + 1..];
        let close = after.find('>')?;
        let target = &after[..close];
        let params_all = &after[close + 1..];
        let params = params_all.split_once('<').map_or(params_all, |(p, _)| p);
        let is_next = params.split(';').any(|p| {
            let p = p.trim().trim_end_matches(',').trim();
            p.split_once('=').is_some_and(|(k, v)| {
                k.trim().eq_ignore_ascii_case("rel")
                    && v.trim()
                        .trim_matches('"')
                        .split_ascii_whitespace()
                        .any(|r| r.eq_ignore_ascii_case("next"))
            })
        });
        if is_next {
            return Some(target);
        }
        rest = &after[close + 1..];
    }
    None
}

/// How a transport error counts for retrying.
fn transport_fault(e: &reqwest::Error) -> TransportFault {
    if e.is_timeout() {
        TransportFault::Timeout
    } else if e.is_connect() {
        TransportFault::Connect
    } else if e.is_body() || e.is_decode() {
        TransportFault::TruncatedBody
    } else if e.is_request() {
        TransportFault::Reset
    } else {
        TransportFault::Other
    }
}

/// The error text with its causes, without the URL (the caller names a safe one).
fn error_text(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        text.push_str(": ");
        text.push_str(&s.to_string());
        src = s.source();
    }
    text
}

#[derive(Debug, Deserialize)]
struct RevisionInfo {
    sha: Option<String>,
}

#[derive(Debug, Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    size: Option<u64>,
    /// The git blob id: of the content for a file not in LFS, of the pointer for one in
    /// LFS.
    oid: Option<String>,
    lfs: Option<TreeLfs>,
}

#[derive(Debug, Deserialize)]
struct TreeLfs {
    oid: String,
}

/// One file entry of a tree listing page (answered at `final_url`) as a [`RepoFile`]:
/// a safe path listed once, a size, the LFS SHA-256 and the git blob id each well
/// formed where given.
fn listed_file(
    e: TreeEntry,
    origin: &str,
    final_url: &Url,
    seen_paths: &mut BTreeSet<String>,
) -> Result<RepoFile, SourceError> {
    check_repo_path(origin, &e.path)?;
    let malformed = |field: &str, detail: String| SourceError::Malformed {
        url: display_url(final_url),
        field: format!("{}: {field}", e.path),
        detail,
    };
    let Some(size) = e.size else {
        return Err(malformed("size", "missing".into()));
    };
    let sha256 = match &e.lfs {
        Some(lfs) if is_sha256(&lfs.oid) => Some(lfs.oid.to_ascii_lowercase()),
        Some(lfs) => {
            return Err(malformed(
                "lfs.oid",
                format!("{:?} is not a SHA-256 hex digest", lfs.oid),
            ));
        }
        None => None,
    };
    // An LFS file's `oid` names its pointer file, not the content.
    let git_oid = match &e.oid {
        Some(oid) if e.lfs.is_none() => {
            if !digest::is_hex(oid, digest::GIT_OID_HEX_LEN) {
                return Err(malformed(
                    "oid",
                    format!("{oid:?} is not a git blob id (40 hex digits)"),
                ));
            }
            Some(oid.to_ascii_lowercase())
        }
        _ => None,
    };
    if !seen_paths.insert(e.path.clone()) {
        return Err(malformed("path", "listed twice".into()));
    }
    Ok(RepoFile {
        path: e.path,
        size,
        sha256,
        git_oid,
    })
}

/// The next page of a tree listing answered at `final_url`, from its `Link` header;
/// `None` on the last page.
fn next_tree_page(headers: &HeaderMap, final_url: &Url) -> Result<Option<Url>, SourceError> {
    let next = headers
        .get(header::LINK)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_link_next)
        .map(|n| final_url.join(n));
    match next {
        None => Ok(None),
        Some(Ok(u)) => Ok(Some(u)),
        Some(Err(e)) => Err(SourceError::Malformed {
            url: display_url(final_url),
            field: "Link".into(),
            detail: format!("next page is not a URL: {e}"),
        }),
    }
}

impl HttpSource {
    /// Requests sent to the endpoint's own origin (API and `/resolve`), the ones the
    /// hub's 5-minute rate limit counts; redirected CDN requests are not among them.
    pub fn resolver_requests(&self) -> u64 {
        self.inner.resolver.total()
    }

    /// A source for `config`. Checks the endpoint URL and the repo name; sends nothing.
    pub fn new(config: HttpConfig) -> Result<Self, SourceError> {
        Ok(Self {
            inner: Arc::new(Inner::new(config)?),
        })
    }
}

impl Inner {
    fn new(config: HttpConfig) -> Result<Self, SourceError> {
        // reqwest is built with `rustls-no-provider`: a provider must be installed before
        // the first client. A second install fails harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let endpoint = Url::parse(config.endpoint.trim_end_matches('/')).map_err(|e| {
            SourceError::Config(format!("endpoint {:?} is not a URL: {e}", config.endpoint))
        })?;
        if !matches!(endpoint.scheme(), "http" | "https") || endpoint.cannot_be_a_base() {
            return Err(SourceError::Config(format!(
                "endpoint {:?}: expected an http:// or https:// URL",
                config.endpoint
            )));
        }
        let origin = format!("repo name {:?}", config.repo);
        check_repo_path(&origin, &config.repo)?;
        let repo_segments: Vec<String> = config.repo.split('/').map(str::to_string).collect();
        if repo_segments.len() > 2 {
            return Err(SourceError::Config(format!(
                "repo {:?}: expected ORG/NAME",
                config.repo
            )));
        }
        if config.revision.is_empty() {
            return Err(SourceError::Config("empty revision".into()));
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(config.user_agent.clone())
            .connect_timeout(config.connect_timeout)
            .read_timeout(backstop_read_timeout(&config))
            .build()
            .map_err(|e| SourceError::Config(format!("HTTP client: {}", error_text(e))))?;
        let resolver = ResolverBudget::new(
            if config.token.is_some() {
                budget::TOKEN_LIMIT
            } else {
                budget::ANONYMOUS_LIMIT
            },
            budget::WINDOW,
        );
        Ok(Self {
            resolver,
            policy: config.policy(),
            endpoint,
            repo_segments,
            client,
            config,
            resolved: tokio::sync::OnceCell::new(),
            locations: Mutex::new(HashMap::new()),
            published: Mutex::new(HashMap::new()),
            git_oids: Mutex::new(HashMap::new()),
            in_lfs: Mutex::new(BTreeSet::new()),
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            pushbacks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        })
    }

    /// The endpoint URL with `segments` appended (each percent-encoded).
    fn url_with<'a>(
        &self,
        segments: impl IntoIterator<Item = &'a str>,
    ) -> Result<Url, SourceError> {
        let mut url = self.endpoint.clone();
        {
            let mut path = url.path_segments_mut().map_err(|()| {
                SourceError::Config(format!("endpoint {}: cannot take a path", self.endpoint))
            })?;
            path.pop_if_empty();
            path.extend(segments);
        }
        Ok(url)
    }

    fn api_url(&self, kind: &str, rev: &str) -> Result<Url, SourceError> {
        let mut segs = vec!["api", "models"];
        segs.extend(self.repo_segments.iter().map(String::as_str));
        segs.extend([kind, rev]);
        self.url_with(segs)
    }

    fn resolve_url(&self, commit: &str, path: &str) -> Result<Url, SourceError> {
        let mut segs: Vec<&str> = self.repo_segments.iter().map(String::as_str).collect();
        segs.extend(["resolve", commit]);
        segs.extend(path.split('/'));
        self.url_with(segs)
    }

    /// A retry after `status`: a `429` or `503` is the server asking for less (a
    /// reset or a timeout is not, and says nothing of how many connections it takes).
    fn note_pushback(&self, status: Option<u16>) {
        if matches!(status, Some(429 | 503)) {
            self.pushbacks.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn lock_locations(&self) -> std::sync::MutexGuard<'_, HashMap<String, Url>> {
        self.locations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Run `attempt` until it succeeds, fails for good, or the retry policy is spent.
    async fn with_retries<T, F, Fut>(&self, mut attempt: F) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let mut attempts: u32 = 1;
        let max_delay = self.policy.max_delay;
        let result = (|| attempt())
            .retry(retry::backoff(&self.policy))
            .when(|f| matches!(f, Failure::Transient { .. }))
            .adjust(|f, computed| {
                let retry_after = match f {
                    Failure::Transient { retry_after, .. } => *retry_after,
                    _ => None,
                };
                retry::next_delay(computed, retry_after, max_delay)
            })
            .notify(|f, wait| {
                attempts += 1;
                self.retries.fetch_add(1, Ordering::Relaxed);
                let status = match f {
                    Failure::Transient { status, .. } => *status,
                    _ => None,
                };
                self.note_pushback(status);
                tracing::debug!(
                    status = status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                    attempt = attempts,
                    wait_ms = wait.as_millis() as u64,
                    error = %f.error_ref(),
                    "retrying"
                );
            })
            .await;
        result.map_err(|mut f| {
            if let Failure::Transient {
                error:
                    SourceError::Network { attempts: a, .. } | SourceError::TooSlow { attempts: a, .. },
                ..
            } = &mut f
            {
                *a = attempts;
            }
            f
        })
    }

    /// [`Inner::send`] within what `pace` allows for the wait before the answer.
    async fn send_paced(
        &self,
        start: &Url,
        range: Option<&Range<u64>>,
        pace: &mut Pace,
        what: &str,
    ) -> Result<Sent, Failure> {
        let slow = |slow| slow_failure(what, start, range.cloned(), slow);
        pace.check().map_err(slow)?;
        let started = Instant::now();
        let Some(budget) = pace.budget() else {
            return self.send(start, range).await;
        };
        let sent = tokio::time::timeout(budget, self.send(start, range)).await;
        pace.record(started.elapsed(), 0);
        match sent {
            Ok(sent) => sent,
            Err(_) => Err(slow(pace.expired())),
        }
    }

    /// One request, following redirects by hand. Returns the final answer, its URL,
    /// and the SHA-256 the hops published for the file ([`published_in`]; an
    /// `X-Linked-Etag` on any hop beats an `ETag`).
    async fn send(&self, start: &Url, range: Option<&Range<u64>>) -> Result<Sent, Failure> {
        let mut url = start.clone();
        let mut published: Option<(String, HashOrigin)> = None;
        let mut git_oid: Option<String> = None;
        let mut lfs = false;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.client.get(url.clone());
            if let Some(r) = range {
                req = req.header(header::RANGE, format!("bytes={}-{}", r.start, r.end - 1));
            }
            // Credentials go to the endpoint's own origin only, never to a CDN host.
            if let Some(token) = self
                .config
                .token
                .as_ref()
                .filter(|_| url.origin() == self.endpoint.origin())
            {
                req = req.bearer_auth(token.expose());
            }
            let from_endpoint = url.origin() == self.endpoint.origin();
            // The hub's rate limits count these; a CDN location does not. The ticket
            // keeps the request counted as in flight until its answer (or its drop).
            let ticket = if from_endpoint {
                Some(self.resolver.take().await)
            } else {
                None
            };
            self.requests.fetch_add(1, Ordering::Relaxed);
            let resp = req
                .send()
                .await
                .map_err(|e| self.transport_failure(&url, range.cloned(), e, "request failed"))?;
            if let Some(ticket) = ticket {
                let text = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
                let limit = budget::parse_ratelimit(
                    text("ratelimit"),
                    text("ratelimit-remaining"),
                    text("ratelimit-reset"),
                );
                ticket.answered(limit, Instant::now());
            }
            if let Some(found) = published_in(resp.headers(), from_endpoint)
                && published
                    .as_ref()
                    .is_none_or(|(_, o)| !o.is_strong() && found.1.is_strong())
            {
                published = Some(found);
            }
            if let Some(found) = git_oid_in(resp.headers(), from_endpoint) {
                git_oid = Some(found);
            }
            lfs |= ["x-linked-size", "x-linked-etag"]
                .iter()
                .any(|h| resp.headers().contains_key(*h));
            let location = resp
                .headers()
                .get(header::LOCATION)
                .filter(|_| resp.status().is_redirection());
            if let Some(loc) = location {
                let next = loc
                    .to_str()
                    .ok()
                    .and_then(|l| url.join(l).ok())
                    .filter(|u| matches!(u.scheme(), "http" | "https"));
                let Some(next) = next else {
                    return Err(Failure::Fatal(SourceError::Malformed {
                        url: display_url(&url),
                        field: "Location".into(),
                        detail: format!(
                            "{:?} is not an http(s) URL",
                            String::from_utf8_lossy(loc.as_bytes())
                        ),
                    }));
                };
                url = next;
                continue;
            }
            return Ok(Sent {
                resp,
                url,
                published,
                git_oid,
                lfs,
            });
        }
        Err(Failure::Fatal(SourceError::Status {
            url: display_url(start),
            status: 310,
            range: range.cloned(),
            detail: format!("more than {MAX_REDIRECTS} redirects"),
        }))
    }

    fn transport_failure(
        &self,
        url: &Url,
        range: Option<Range<u64>>,
        e: reqwest::Error,
        context: &str,
    ) -> Failure {
        let fault = transport_fault(&e);
        let error = SourceError::Network {
            url: display_url(url),
            range,
            attempts: 1,
            detail: format!("{context}: {}", error_text(e)),
        };
        if retry::is_retryable_fault(fault) {
            Failure::Transient {
                error,
                status: None,
                retry_after: None,
            }
        } else {
            Failure::Fatal(error)
        }
    }

    /// The failure for a non-success status. `what` says what was looked for.
    fn status_failure(
        &self,
        url: &Url,
        range: Option<Range<u64>>,
        status: StatusCode,
        headers: &HeaderMap,
        what: &str,
    ) -> Failure {
        let code = status.as_u16();
        let shown = display_url(url);
        let error_code = headers
            .get("x-error-code")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        match code {
            401 | 403 => {
                return Failure::Fatal(SourceError::Unauthorized {
                    url: shown,
                    status: code,
                    token_sent: self.config.token.is_some()
                        && url.origin() == self.endpoint.origin(),
                });
            }
            404 => {
                let what = match error_code {
                    "RepoNotFound" => format!("repo {}", self.config.repo),
                    "RevisionNotFound" => {
                        format!("revision {} of {}", self.config.revision, self.config.repo)
                    }
                    _ => what.to_string(),
                };
                return Failure::Fatal(SourceError::NotFound { url: shown, what });
            }
            _ => {}
        }
        let mut detail = status
            .canonical_reason()
            .unwrap_or("unexpected status")
            .to_string();
        if !error_code.is_empty() {
            detail.push_str(&format!(" ({error_code})"));
        }
        if !retry::is_retryable_status(code) {
            return Failure::Fatal(SourceError::Status {
                url: shown,
                status: code,
                range,
                detail,
            });
        }
        let mut retry_after = None;
        if let Some(v) = headers.get(header::RETRY_AFTER) {
            let text = String::from_utf8_lossy(v.as_bytes()).into_owned();
            match retry::parse_retry_after(&text, SystemTime::now(), self.policy.max_retry_after) {
                Ok(d) => {
                    retry_after = Some(d);
                    detail.push_str(&format!(" (Retry-After: {text})"));
                }
                Err(e @ retry::RetryAfterError::TooLong { .. }) => {
                    return Failure::Fatal(e.into_source_error(&shown, &text));
                }
                // An unreadable hint: fall back to our own backoff.
                Err(retry::RetryAfterError::Unparsable) => {}
            }
        }
        Failure::Transient {
            error: SourceError::Status {
                url: shown,
                status: code,
                range,
                detail,
            },
            status: Some(code),
            retry_after,
        }
    }

    /// One attempt at a JSON API answer. Returns it with its headers and final URL.
    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &Url,
        what: &str,
    ) -> Result<(T, HeaderMap, Url), Failure> {
        let mut pace = Pace::new(self.config.progress);
        let Sent {
            mut resp,
            url: final_url,
            ..
        } = self.send_paced(url, None, &mut pace, what).await?;
        if resp.status() != StatusCode::OK {
            return Err(self.status_failure(&final_url, None, resp.status(), resp.headers(), what));
        }
        let headers = resp.headers().clone();
        let mut body = BytesMut::new();
        loop {
            let chunk = paced_chunk(&mut resp, &mut pace)
                .await
                .map_err(|slow| slow_failure(what, &final_url, None, slow))?;
            match chunk {
                Ok(Some(chunk)) => {
                    self.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if body.len() + chunk.len() > MAX_API_BODY {
                        return Err(Failure::Fatal(SourceError::Malformed {
                            url: display_url(&final_url),
                            field: "body".into(),
                            detail: format!("more than {MAX_API_BODY} bytes"),
                        }));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(self.transport_failure(&final_url, None, e, "reading the answer"));
                }
            }
        }
        let value = serde_json::from_slice(&body).map_err(|e| {
            Failure::Fatal(SourceError::Malformed {
                url: display_url(&final_url),
                field: "body".into(),
                detail: format!("not the expected JSON: {e}"),
            })
        })?;
        Ok((value, headers, final_url))
    }

    async fn resolve_uncached(&self) -> Result<ResolvedRepo, SourceError> {
        let repo = &self.config.repo;
        let revision = &self.config.revision;
        let commit = self.resolve_commit().await?;
        let mut page_url = self.api_url("tree", &commit)?;
        page_url.query_pairs_mut().append_pair("recursive", "true");
        let origin = format!("tree listing of {repo}@{commit}");
        let mut files = Vec::new();
        let mut seen_paths = BTreeSet::new();
        let mut seen_pages = BTreeSet::new();
        let what = format!("tree of {repo}@{commit}");
        loop {
            if seen_pages.len() >= MAX_TREE_PAGES || !seen_pages.insert(page_url.to_string()) {
                return Err(SourceError::Malformed {
                    url: display_url(&page_url),
                    field: "Link".into(),
                    detail: "pagination loops or never ends".into(),
                });
            }
            let (entries, headers, final_url): (Vec<TreeEntry>, _, _) = self
                .with_retries(|| self.get_json(&page_url, &what))
                .await
                .map_err(Failure::into_error)?;
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                files.push(listed_file(e, &origin, &final_url, &mut seen_paths)?);
            }
            match next_tree_page(&headers, &final_url)? {
                None => break,
                Some(u) => page_url = u,
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(ResolvedRepo {
            repo: repo.clone(),
            revision: revision.clone(),
            commit: Some(commit),
            files,
        })
    }

    /// The commit the configured revision names: the revision itself when it is a
    /// commit, else the one the revision API answers.
    async fn resolve_commit(&self) -> Result<String, SourceError> {
        let repo = &self.config.repo;
        let revision = &self.config.revision;
        if is_commit(revision) {
            return Ok(revision.to_ascii_lowercase());
        }
        let url = self.api_url("revision", revision)?;
        let what = format!("revision {revision} of {repo}");
        let (info, _, final_url): (RevisionInfo, _, _) = self
            .with_retries(|| self.get_json(&url, &what))
            .await
            .map_err(Failure::into_error)?;
        match info.sha {
            Some(sha) if is_commit(&sha) => Ok(sha.to_ascii_lowercase()),
            other => Err(SourceError::Malformed {
                url: display_url(&final_url),
                field: "sha".into(),
                detail: format!("{other:?} is not a 40-hex commit"),
            }),
        }
    }

    /// Send the ranged `GET` for `range` of `file` to `url` and check the answer's
    /// status and headers (206, `Content-Range`, `Content-Length`); the body is left
    /// unread. Remembers where a redirect led. Returns the answer and its final URL.
    async fn open_range(
        &self,
        url: &Url,
        file: &RepoFile,
        range: &Range<u64>,
        from_cache: bool,
        pace: &mut Pace,
    ) -> Result<(reqwest::Response, Url), Failure> {
        let path = &file.path;
        let Sent {
            resp,
            url: final_url,
            published,
            git_oid,
            lfs,
        } = self.send_paced(url, Some(range), pace, path).await?;
        let status = resp.status();
        let bad = |detail: String| SourceError::BadRange {
            path: path.clone(),
            range: range.clone(),
            detail,
        };
        if from_cache && matches!(status.as_u16(), 403 | 404 | 410) {
            return Err(Failure::Stale(SourceError::Status {
                url: display_url(&final_url),
                status: status.as_u16(),
                range: Some(range.clone()),
                detail: "cached location no longer valid".into(),
            }));
        }
        if status == StatusCode::OK {
            return Err(Failure::Fatal(bad(format!(
                "HTTP 200 with the whole file instead of 206 Partial Content (Content-Length: {}); the server ignored Range",
                header_text(resp.headers(), header::CONTENT_LENGTH)
            ))));
        }
        if status != StatusCode::PARTIAL_CONTENT {
            let what = format!("file {path}");
            return Err(self.status_failure(
                &final_url,
                Some(range.clone()),
                status,
                resp.headers(),
                &what,
            ));
        }
        let len = range.end - range.start;
        let want = format!("bytes {}-{}/{}", range.start, range.end - 1, file.size);
        let got = header_text(resp.headers(), header::CONTENT_RANGE);
        if got != want {
            return Err(Failure::Fatal(bad(format!(
                "Content-Range: {got}, expected {want}"
            ))));
        }
        let content_length = resp.headers().get(header::CONTENT_LENGTH);
        if let Some(cl) = content_length
            .filter(|cl| cl.to_str().ok().and_then(|v| v.parse::<u64>().ok()) != Some(len))
        {
            return Err(Failure::Fatal(bad(format!(
                "Content-Length: {}, expected {len}",
                String::from_utf8_lossy(cl.as_bytes())
            ))));
        }
        self.learn_sha256(file, published, &final_url)?;
        if lfs {
            lock(&self.in_lfs).insert(path.clone());
        } else if let Some(oid) =
            git_oid.filter(|_| file.git_oid.is_none() && file.sha256.is_none())
        {
            lock(&self.git_oids).entry(path.clone()).or_insert(oid);
        }
        if final_url != *url {
            self.lock_locations()
                .insert(path.clone(), final_url.clone());
        }
        Ok((resp, final_url))
    }

    fn lock_published(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, HashOrigin)>> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Remember the SHA-256 an answer for `file` published. The listing's `lfs.oid` and
    /// an `X-Linked-Etag` both state the content's hash: two that disagree mean the file
    /// changed under the install or the server contradicts itself, and the read is
    /// refused. A bare `ETag` is used only where neither says anything.
    fn learn_sha256(
        &self,
        file: &RepoFile,
        found: Option<(String, HashOrigin)>,
        url: &Url,
    ) -> Result<(), Failure> {
        let Some((hash, origin)) = found else {
            return Ok(());
        };
        let mut learned = self.lock_published();
        let known = file
            .sha256
            .clone()
            .map(|h| (h, HashOrigin::Listing))
            .or_else(|| learned.get(&file.path).cloned());
        match known {
            Some((k, ko)) if k != hash && ko.is_strong() && origin.is_strong() => {
                Err(Failure::Fatal(SourceError::Malformed {
                    url: display_url(url),
                    field: format!("{}: {}", file.path, origin.describe()),
                    detail: format!(
                        "SHA-256 {hash} differs from the {} {k}; the file changed during the install or the server contradicts itself",
                        ko.describe()
                    ),
                }))
            }
            Some((_, ko)) if ko.is_strong() || !origin.is_strong() => Ok(()),
            _ => {
                learned.insert(file.path.clone(), (hash, origin));
                Ok(())
            }
        }
    }
}

impl Failure {
    fn error_ref(&self) -> &SourceError {
        match self {
            Self::Transient { error, .. } | Self::Fatal(error) | Self::Stale(error) => error,
        }
    }
}

/// A lock whose holder cannot leave the data inconsistent by panicking.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn header_text(headers: &HeaderMap, name: header::HeaderName) -> String {
    match headers.get(&name) {
        Some(v) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
        None => "(absent)".into(),
    }
}

impl Inner {
    fn describe(&self) -> String {
        format!("{} {}", display_url(&self.endpoint), self.config.repo)
    }

    async fn resolve(&self) -> Result<ResolvedRepo, SourceError> {
        self.resolved
            .get_or_try_init(|| self.resolve_uncached())
            .await
            .cloned()
    }

    /// The listed file at `path` and its resolve URL, after checking `range` against its
    /// size.
    async fn ranged_file(
        &self,
        path: &str,
        range: &Range<u64>,
    ) -> Result<(RepoFile, Url), SourceError> {
        let repo = self.resolve().await?;
        let Some(file) = repo.file(path) else {
            return Err(SourceError::MissingFile {
                repo: self.config.repo.clone(),
                path: path.to_string(),
            });
        };
        if range.start > range.end || range.end > file.size {
            return Err(SourceError::BadRange {
                path: path.to_string(),
                range: range.clone(),
                detail: format!("outside the file's {} bytes", file.size),
            });
        }
        let commit = repo.commit.as_deref().unwrap_or(&self.config.revision);
        let resolve_url = self.resolve_url(commit, path)?;
        Ok((file.clone(), resolve_url))
    }

    /// [`Inner::stream_range`] collected: one read path, so one retry budget, one set of
    /// answer checks and one redirect rule for small and large reads alike.
    async fn read_range(
        self: &Arc<Self>,
        path: &str,
        range: Range<u64>,
    ) -> Result<Bytes, SourceError> {
        let len = usize::try_from(range.end.saturating_sub(range.start)).map_err(|_| {
            SourceError::BadRange {
                path: path.to_string(),
                range: range.clone(),
                detail: "more bytes than fit in memory".into(),
            }
        })?;
        let mut body = self.stream_range(path, range).await?;
        let mut first: Option<Bytes> = None;
        let mut out = BytesMut::new();
        while let Some(chunk) = futures_util::StreamExt::next(&mut body).await {
            let chunk = chunk?;
            // A range that came in one chunk is handed on without a copy.
            match first.take() {
                None if out.is_empty() => first = Some(chunk),
                Some(f) => {
                    out.reserve(len);
                    out.extend_from_slice(&f);
                    out.extend_from_slice(&chunk);
                }
                None => out.extend_from_slice(&chunk),
            }
        }
        Ok(first.unwrap_or_else(|| out.freeze()))
    }

    async fn read_file(self: &Arc<Self>, path: &str, max_len: u64) -> Result<Bytes, SourceError> {
        let repo = self.resolve().await?;
        let Some(file) = repo.file(path) else {
            return Err(SourceError::MissingFile {
                repo: self.config.repo.clone(),
                path: path.to_string(),
            });
        };
        if file.size > max_len {
            return Err(SourceError::TooLarge {
                path: path.to_string(),
                size: file.size,
                max: max_len,
            });
        }
        self.read_range(path, 0..file.size).await
    }

    fn stats(&self) -> SourceStats {
        SourceStats {
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Open `range` of `path` as a stream: the first request is sent and its answer
    /// checked before this returns, so a refusal (401, 404, a 200 for a range) is the
    /// outer error; faults in the body are healed or end the stream with one `Err`.
    async fn stream_range(
        self: &Arc<Self>,
        path: &str,
        range: Range<u64>,
    ) -> Result<ByteStream, SourceError> {
        let (file, resolve_url) = self.ranged_file(path, &range).await?;
        if range.is_empty() {
            return Ok(Box::pin(futures_util::stream::empty()));
        }
        let mut state = RangeStream {
            inner: Arc::clone(self),
            file,
            resolve_url,
            range,
            received: 0,
            body: None,
            pending: Bytes::new(),
            backoff: retry::backoff(&self.policy).build(),
            attempts: 1,
            pace: Pace::new(self.config.progress),
            done: false,
            re_resolved: false,
        };
        state.open().await?;
        Ok(Box::pin(futures_util::stream::unfold(
            state,
            |mut s| async move {
                let item = s.next_item().await?;
                Some((item, s))
            },
        )))
    }
}

/// One streamed ranged read. The attempt budget (`max_attempts`, backoff and
/// `Retry-After` rules) covers the whole read: the first request and every resumption
/// after a body fault draw on the same schedule, as the retries of one `read_range` do.
struct RangeStream {
    inner: Arc<Inner>,
    file: RepoFile,
    resolve_url: Url,
    /// The range the caller asked for.
    range: Range<u64>,
    /// Bytes of `range` accepted from the server so far (yielded or in `pending`).
    received: u64,
    /// The answer being read and its final URL.
    body: Option<(reqwest::Response, Url)>,
    /// What is left of a chunk larger than [`STREAM_CHUNK`].
    pending: Bytes,
    /// The delays still allowed: one per retry; empty when the budget is spent.
    backoff: backon::ExponentialBackoff,
    /// Attempts made, the first included.
    attempts: u32,
    /// The progress rules of the current attempt (a new one per request).
    pace: Pace,
    /// Finished, by success or by a yielded error.
    done: bool,
    /// An expired cached location was dropped and the file resolved again.
    re_resolved: bool,
}

impl RangeStream {
    fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    fn bad(&self, detail: String) -> SourceError {
        SourceError::BadRange {
            path: self.file.path.clone(),
            range: self.range.clone(),
            detail,
        }
    }

    /// The next piece of `pending`, at most [`STREAM_CHUNK`] bytes (a cheap split).
    fn take_pending(&mut self) -> Bytes {
        if self.pending.len() > STREAM_CHUNK {
            self.pending.split_to(STREAM_CHUNK)
        } else {
            std::mem::take(&mut self.pending)
        }
    }

    /// Send the request for the bytes not yet received, retrying per the budget.
    /// The cached redirect location is used when there is one, so a resumption goes
    /// straight back to the CDN; an expired one is dropped and the file resolved again.
    async fn open(&mut self) -> Result<(), SourceError> {
        loop {
            let rest = self.range.start + self.received..self.range.end;
            let cached = self.inner.lock_locations().get(&self.file.path).cloned();
            let from_cache = cached.is_some();
            let url = cached.unwrap_or_else(|| self.resolve_url.clone());
            self.pace = Pace::new(self.inner.config.progress);
            let failure = match self
                .inner
                .open_range(&url, &self.file, &rest, from_cache, &mut self.pace)
                .await
            {
                Ok(answer) => {
                    self.body = Some(answer);
                    return Ok(());
                }
                // An expired location is resolved again once per read, outside the
                // attempt budget (it is no fault of the server); a second refusal is.
                Err(Failure::Stale(e)) if !self.re_resolved => {
                    tracing::debug!(path = %self.file.path, error = %e, "cached location refused; resolving again");
                    self.inner.lock_locations().remove(&self.file.path);
                    self.re_resolved = true;
                    continue;
                }
                Err(f) => f,
            };
            self.retry_or_fail(failure).await?;
        }
    }

    /// Wait before the next attempt, or give the final error when the failure is
    /// fatal or the budget is spent. Errors name the whole range asked for.
    async fn retry_or_fail(&mut self, failure: Failure) -> Result<(), SourceError> {
        let (error, status, retry_after) = match failure {
            Failure::Transient {
                error,
                status,
                retry_after,
            } => (error, status, retry_after),
            Failure::Fatal(e) | Failure::Stale(e) => return Err(self.name_range(e)),
        };
        let wait = retry::next_delay(
            self.backoff.next(),
            retry_after,
            self.inner.policy.max_delay,
        );
        let Some(wait) = wait else {
            return Err(self.name_range(error));
        };
        self.attempts += 1;
        self.inner.retries.fetch_add(1, Ordering::Relaxed);
        self.inner.note_pushback(status);
        tracing::debug!(
            status = status.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            attempt = self.attempts,
            resume_at = self.range.start + self.received,
            wait_ms = wait.as_millis() as u64,
            error = %error,
            "retrying the rest of a streamed range"
        );
        tokio::time::sleep(wait).await;
        Ok(())
    }

    /// `e` with the caller's range (a resumption asks for less) and the attempts made.
    fn name_range(&self, mut e: SourceError) -> SourceError {
        match &mut e {
            SourceError::BadRange { range, .. } => *range = self.range.clone(),
            SourceError::Status { range, .. } => *range = Some(self.range.clone()),
            SourceError::Network {
                range, attempts, ..
            }
            | SourceError::TooSlow {
                range, attempts, ..
            } => {
                *range = Some(self.range.clone());
                *attempts = self.attempts;
            }
            _ => {}
        }
        e
    }

    async fn next_item(&mut self) -> Option<Result<Bytes, SourceError>> {
        if self.done {
            return None;
        }
        if !self.pending.is_empty() {
            return Some(Ok(self.take_pending()));
        }
        let len = self.len();
        loop {
            let Some((resp, url)) = self.body.as_mut() else {
                if self.received == len {
                    self.done = true;
                    return None;
                }
                if let Err(e) = self.open().await {
                    self.done = true;
                    return Some(Err(e));
                }
                continue;
            };
            let chunk = match paced_chunk(resp, &mut self.pace).await {
                Ok(chunk) => chunk,
                Err(_) if self.received == len => {
                    // Every byte is in; only the end of the body was slow to come.
                    self.body = None;
                    self.done = true;
                    return None;
                }
                Err(slow) => {
                    let url = url.clone();
                    let failure =
                        slow_failure(&self.file.path, &url, Some(self.range.clone()), slow);
                    self.body = None;
                    if let Err(e) = self.retry_or_fail(failure).await {
                        self.done = true;
                        return Some(Err(e));
                    }
                    continue;
                }
            };
            let failure = match chunk {
                Ok(Some(chunk)) => {
                    self.inner
                        .bytes
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if chunk.len() as u64 > len - self.received {
                        self.done = true;
                        self.body = None;
                        return Some(Err(self.bad(format!(
                            "body longer than the {len} bytes asked for (at least {} bytes)",
                            self.received + chunk.len() as u64
                        ))));
                    }
                    if chunk.is_empty() {
                        continue;
                    }
                    self.received += chunk.len() as u64;
                    self.pending = chunk;
                    return Some(Ok(self.take_pending()));
                }
                Ok(None) if self.received == len => {
                    self.body = None;
                    self.done = true;
                    return None;
                }
                Ok(None) => Failure::Transient {
                    error: self.bad(format!("body ended after {} of {len} bytes", self.received)),
                    status: Some(StatusCode::PARTIAL_CONTENT.as_u16()),
                    retry_after: None,
                },
                Err(e) if self.received == len => {
                    // Every byte is in; a fault after the last one loses nothing.
                    tracing::debug!(path = %self.file.path, error = %error_text(e), "fault after a complete body");
                    self.body = None;
                    self.done = true;
                    return None;
                }
                Err(e) => {
                    let url = url.clone();
                    let context = format!("body failed after {} of {len} bytes", self.received);
                    self.inner
                        .transport_failure(&url, Some(self.range.clone()), e, &context)
                }
            };
            self.body = None;
            if let Err(e) = self.retry_or_fail(failure).await {
                self.done = true;
                return Some(Err(e));
            }
        }
    }
}

#[async_trait]
impl RangeSource for HttpSource {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn resolve(&self) -> Result<ResolvedRepo, SourceError> {
        self.inner.resolve().await
    }

    async fn read_range(&self, path: &str, range: Range<u64>) -> Result<Bytes, SourceError> {
        self.inner.read_range(path, range).await
    }

    /// Chunks of at most [`STREAM_CHUNK`] bytes as they arrive. A body that breaks or
    /// ends early is resumed with a request for the bytes not yet received, so the
    /// consumer sees one exact stream; a body longer than asked ends it with
    /// [`SourceError::BadRange`].
    async fn stream_range(&self, path: &str, range: Range<u64>) -> Result<ByteStream, SourceError> {
        self.inner.stream_range(path, range).await
    }

    async fn read_file(&self, path: &str, max_len: u64) -> Result<Bytes, SourceError> {
        self.inner.read_file(path, max_len).await
    }

    fn stats(&self) -> SourceStats {
        self.inner.stats()
    }

    fn pushbacks(&self) -> u64 {
        self.inner.pushbacks.load(Ordering::Relaxed) + self.inner.resolver.waits()
    }

    fn published_sha256(&self, path: &str) -> Option<String> {
        let listed = self
            .inner
            .resolved
            .get()
            .and_then(|r| r.file(path))
            .and_then(|f| f.sha256.clone());
        listed.or_else(|| {
            self.inner
                .lock_published()
                .get(path)
                .map(|(h, _)| h.clone())
        })
    }

    /// The listing's `oid` of a file without an `lfs` block, unless an answer for the
    /// file said it is in LFS after all (then the `oid` is its pointer's); else a git
    /// blob id an `ETag` of the endpoint published.
    fn published_git_oid(&self, path: &str) -> Option<String> {
        if lock(&self.inner.in_lfs).contains(path) {
            return None;
        }
        let listed = self
            .inner
            .resolved
            .get()
            .and_then(|r| r.file(path))
            .and_then(|f| f.git_oid.clone());
        listed.or_else(|| lock(&self.inner.git_oids).get(path).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_next_is_found() {
        let cases = [
            (
                r#"<https://h/api?cursor=abc>; rel="next""#,
                Some("https://h/api?cursor=abc"),
            ),
            (
                r#"<https://h/p1>; rel="prev", <https://h/p3>; rel="next""#,
                Some("https://h/p3"),
            ),
            (r#"<https://h/p3>; rel=next"#, Some("https://h/p3")),
            (
                r#"<https://h/p3>; title="x"; rel="last next""#,
                Some("https://h/p3"),
            ),
            (r#"<https://h/p1>; rel="prev""#, None),
            ("", None),
            ("<broken", None),
        ];
        for (value, want) in cases {
            assert_eq!(parse_link_next(value), want, "{value}");
        }
    }

    #[test]
    fn urls_in_messages_lose_query_and_credentials() {
        let u = Url::parse("https://user:pw@cdn.example/x/y?X-Amz-Signature=abc#f").unwrap();
        assert_eq!(display_url(&u), "https://cdn.example/x/y");
    }

    #[test]
    fn config_errors_name_the_value() {
        let e = HttpSource::new(HttpConfig::new("ftp://x", "a/b", "main")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "endpoint \"ftp://x\": expected an http:// or https:// URL"
        );
        let e = HttpSource::new(HttpConfig::new("http://x", "a/../b", "main")).unwrap_err();
        assert!(e.to_string().contains("unsafe file name"), "{e}");
    }

    /// A stream over `range` of a `size`-byte file whose answer is already open with
    /// `chunks` as its body (no server: the headers were checked elsewhere).
    fn injected(chunks: Vec<Vec<u8>>, range: Range<u64>, size: u64) -> RangeStream {
        let config = HttpConfig::new("http://127.0.0.1:9", "a/b", "main");
        let inner = Arc::new(Inner::new(config).unwrap());
        let url = Url::parse("http://127.0.0.1:9/a/b/resolve/main/w.bin").unwrap();
        let body = reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, std::io::Error>(Bytes::from(c))),
        ));
        let resp = reqwest::Response::from(axum::http::Response::new(body));
        RangeStream {
            backoff: retry::backoff(&inner.policy).build(),
            inner,
            file: RepoFile {
                path: "w.bin".into(),
                size,
                sha256: None,
                git_oid: None,
            },
            resolve_url: url.clone(),
            range,
            received: 0,
            body: Some((resp, url)),
            pending: Bytes::new(),
            attempts: 1,
            pace: Pace::new(ProgressLimits::default()),
            done: false,
            re_resolved: false,
        }
    }

    async fn drain(s: &mut RangeStream) -> (Vec<usize>, Vec<u8>, Option<SourceError>) {
        let (mut lens, mut bytes) = (Vec::new(), Vec::new());
        while let Some(item) = s.next_item().await {
            match item {
                Ok(c) => {
                    lens.push(c.len());
                    bytes.extend_from_slice(&c);
                }
                Err(e) => {
                    assert!(s.next_item().await.is_none(), "nothing after the error");
                    return (lens, bytes, Some(e));
                }
            }
        }
        (lens, bytes, None)
    }

    #[tokio::test]
    async fn a_chunk_over_one_mib_is_handed_on_in_pieces() {
        // 251 is prime: a piece out of order would not line up.
        let data: Vec<u8> = (0..3 * STREAM_CHUNK + 5).map(|i| (i % 251) as u8).collect();
        let n = data.len() as u64;
        let mut s = injected(vec![data[..10].to_vec(), data[10..].to_vec()], 0..n, n);
        let (lens, bytes, err) = drain(&mut s).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(lens, [10, STREAM_CHUNK, STREAM_CHUNK, STREAM_CHUNK - 5]);
        assert!(bytes == data);
        assert_eq!(s.inner.stats().bytes, n);
    }

    #[tokio::test]
    async fn a_body_longer_than_asked_ends_the_stream_with_bad_range() {
        // One chunk over the range: refused whole, nothing handed on.
        let mut s = injected(vec![vec![7; 100]], 0..60, 1000);
        let (lens, _, err) = drain(&mut s).await;
        assert!(lens.is_empty(), "{lens:?}");
        let err = err.expect("an error");
        assert!(matches!(err, SourceError::BadRange { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "w.bin bytes 0-59: bad ranged answer: body longer than the 60 bytes asked for (at least 100 bytes)"
        );

        // Exactly the range, then one byte more.
        let mut s = injected(vec![vec![7; 60], vec![8]], 100..160, 1000);
        let (lens, _, err) = drain(&mut s).await;
        assert_eq!(lens, [60]);
        assert_eq!(
            err.expect("an error").to_string(),
            "w.bin bytes 100-159: bad ranged answer: body longer than the 60 bytes asked for (at least 61 bytes)"
        );
    }

    #[test]
    fn debug_output_hides_the_token() {
        let mut c = HttpConfig::new("http://127.0.0.1:9", "a/b", "main");
        c.token = HfToken::new("hf_supersecret");
        let s = HttpSource::new(c.clone()).unwrap();
        let text = format!("{s:?} {c:?}");
        assert!(!text.contains("hf_supersecret"), "{text}");
        assert!(text.contains("HfToken(***)"), "{text}");
    }
}
