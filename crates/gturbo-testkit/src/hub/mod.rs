//! A local Hugging Face-compatible hub: serves snapshot directories over HTTP the way the
//! hub does, with request counters and scripted faults, for tests, benchmarks and demos.
//!
//! It owns the server side of the protocol only; the client is gturbo-source's `source::http`.
//! The official Python client (`hf download`) must be able to download from it
//! (`tests/it/hub_protocol.rs` proves it), so the answers follow what the hub sends.
//!
//! # Routes
//!
//! | Route | Answer |
//! |---|---|
//! | `GET /api/models/{org}/{name}/revision/{rev}` | `{"id","modelId","sha","siblings":[{"rfilename"}],...}`; `rev` is `main` or the commit, else 404 `X-Error-Code: RevisionNotFound` |
//! | `GET /api/models/{org}/{name}/tree/{rev}[/{dir}][?recursive=true][&cursor=N]` | `[{"type":"file","oid","size","path","lfs":{"oid","size","pointerSize"}}, {"type":"directory","oid","size":0,"path"}]`, sorted by path, at most `tree_page_size` entries; `Link: <…&cursor=N>; rel="next"` when more follow |
//! | `HEAD`/`GET /{org}/{name}/resolve/{rev}/{path}` | the file (200, or 206 for `Range: bytes=a-b`, 416 when unsatisfiable) with `X-Repo-Commit`, `ETag`, `Accept-Ranges: bytes`, `Content-Length`, and for LFS files `X-Linked-Etag`, `X-Linked-Size`; in CDN mode, LFS files answer `302` to `/cdn/...` with those headers instead |
//! | `HEAD`/`GET /cdn/{org}/{name}/{commit}/{path}?sig=…` | on a second port ([`Hub::cdn_url`]), so another origin as a real CDN is: the file bytes, as above, without `X-Repo-Commit` (a CDN does not know commits) |
//!
//! Errors: unknown repo → 404 `X-Error-Code: RepoNotFound`; unknown file → 404
//! `X-Error-Code: EntryNotFound`; a gated repo without `Authorization: Bearer <token>` →
//! 401 `X-Error-Code: GatedRepo` (revision, tree and resolve routes; CDN URLs are signed).
//!
//! # Files and hashes
//!
//! A file is "LFS" when it is at least `lfs_threshold` bytes or ends in `.safetensors`.
//! Its ETag and `lfs.oid` are the SHA-256 of its content; other files get the git blob
//! SHA-1 (`sha1("blob {len}\0" + content)`), and an LFS file's tree `oid` is the blob SHA-1
//! of its LFS pointer file, as on the hub. Bodies are streamed from disk in 256 KiB
//! chunks, so sparse files of tens of GB cost no memory. SHA-256 is computed lazily, once
//! per file, only when a tree listing, a `HEAD`, or a `Range: bytes=0-0` metadata probe
//! needs it (other `GET`s send the ETag when it is already known). [`HubRepo::oids`] may
//! name a JSON file (`{"path": "sha256 hex"}`), kept outside the served directory, whose
//! hashes are served without hashing anything. The directory is scanned once at start;
//! symlinks are followed (a Hugging Face cache snapshot folder works); `.git` and
//! `.cache` are skipped, as gturbo's local source skips them.
//!
//! [`HubConfig::published_hashes`] makes the hub publish less than the hub does, as a
//! mirror may: only `X-Linked-Etag` (no `lfs` in the listing), only a SHA-256 `ETag`, or
//! nothing at all ([`PublishedHashes`]). Scripted [`Fault`]s cover statuses with
//! `Retry-After`, resets, truncations, wrong ranges and hashes, other bytes of the same
//! length under the file's own hashes, and slow servers: a drip of a few bytes at a
//! time, a stall after the headers, a stall before them.

mod faults;
mod link;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use sha1::Digest as _;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::OnceCell;

use faults::RequestShape;
pub use faults::{Fault, FaultKind, Faults, RouteKind};
pub use link::LinkShape;

/// Files at least this large are served as LFS files (the hub's own rule is 10 MiB).
pub const DEFAULT_LFS_THRESHOLD: u64 = 10 * 1024 * 1024;
/// Tree entries per page, as on the hub.
pub const DEFAULT_TREE_PAGE_SIZE: usize = 1000;
const CHUNK: usize = 256 * 1024;

/// One repository served from a snapshot directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRepo {
    /// `org/name`.
    pub repo: String,
    /// The snapshot directory whose files are the repo's files.
    pub dir: PathBuf,
    /// The commit `main` resolves to: 40 lowercase hex.
    pub commit: String,
    /// Known SHA-256s, `{"path": "sha256 hex"}`, served without hashing the files (for
    /// header-only replicas). Outside `dir`, so that the served repo is exactly `dir`.
    pub oids: Option<PathBuf>,
}

impl HubRepo {
    /// A repo whose commit is derived from its name (stable across runs).
    pub fn new(repo: impl Into<String>, dir: impl Into<PathBuf>) -> Self {
        let repo = repo.into();
        let commit = hex::encode(sha1::Sha1::digest(format!("gturbo-hub:{repo}")));
        Self {
            repo,
            dir: dir.into(),
            commit,
            oids: None,
        }
    }
}

/// What the hub serves and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubConfig {
    /// The repositories.
    pub repos: Vec<HubRepo>,
    /// Answer `/resolve` of LFS files with a 302 to `/cdn/...`, as the hub does.
    pub redirect_to_cdn: bool,
    /// Repos (`org/name`) that need `Authorization: Bearer <token>`.
    pub gated: Vec<String>,
    /// The token gated repos accept (`None`: no token opens them).
    pub token: Option<String>,
    /// Size from which a file is an LFS file (`*.safetensors` always are).
    pub lfs_threshold: u64,
    /// Tree entries per page; clients must follow `Link` to get the rest.
    pub tree_page_size: usize,
    /// TCP port on [`HubConfig::bind`] (0: any free port).
    pub port: u16,
    /// The address both listeners (hub and CDN) bind: 127.0.0.1 unless a benchmark
    /// serves from another network namespace (scripts/bench/bench_install.sh `AGG_CAP`).
    pub bind: std::net::IpAddr,
    /// Hash a file whose SHA-256 is not known yet when a tree listing needs it. Off
    /// for header-only replicas (hundreds of GB of holes): their listing then carries
    /// `lfs` only for files whose hash `oids.json` gives, like a server that has not
    /// indexed them yet; gturbo treats such files as having no published hash.
    pub hash_on_listing: bool,
    /// Where LFS files' SHA-256 is published (fault modes for mirrors that publish less).
    pub published_hashes: PublishedHashes,
    /// Per-connection rate, time to first byte and aggregate cap of file answers.
    pub link: LinkShape,
    /// A rate limit on resolver requests (API and `/resolve`, not `/cdn`), as the hub
    /// keeps per IP: every answer says what is left in a `RateLimit` field, and a
    /// request over the limit is answered `429` with `Retry-After`.
    pub resolver_limit: Option<ResolverLimit>,
}

/// `requests` resolver requests per fixed `window` (the hub: 3,000 per 5 minutes
/// anonymously).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolverLimit {
    /// Requests per window.
    pub requests: u64,
    /// The window; it starts at the first request and again at the first one after it ends.
    pub window: std::time::Duration,
}

/// Where the hub publishes an LFS file's SHA-256. The hub itself does all three; a
/// mirror or proxy may publish less, and a client must verify from whatever is there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PublishedHashes {
    /// The listing's `lfs.oid`, `X-Linked-Etag` and `ETag`, as the hub does.
    #[default]
    Everywhere,
    /// Only `X-Linked-Etag` on file answers: the listing has no `lfs` block and the
    /// `ETag` is the git blob SHA-1 of the LFS pointer.
    LinkedEtag,
    /// Only a SHA-256 `ETag` on file answers (no `lfs` block, no `X-Linked-Etag`).
    Etag,
    /// Nowhere: no `lfs` block, no `X-Linked-Etag`, and an `ETag` that is no SHA-256.
    Nowhere,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            repos: Vec::new(),
            redirect_to_cdn: false,
            gated: Vec::new(),
            token: None,
            lfs_threshold: DEFAULT_LFS_THRESHOLD,
            tree_page_size: DEFAULT_TREE_PAGE_SIZE,
            port: 0,
            bind: std::net::Ipv4Addr::LOCALHOST.into(),
            hash_on_listing: true,
            published_hashes: PublishedHashes::Everywhere,
            link: LinkShape::default(),
            resolver_limit: None,
        }
    }
}

/// Why the hub could not start.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Reading a snapshot directory or binding the port failed.
    #[error("{path}: {source}")]
    Io {
        /// The file, directory or address.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A bad repo name, commit, or oids file.
    #[error("{0}")]
    Config(String),
}

/// Request counters, per route kind and per file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Revision API requests.
    pub revision: u64,
    /// Tree API requests (each page counts).
    pub tree: u64,
    /// `/resolve` requests (HEAD and GET, redirected or not).
    pub resolve: u64,
    /// `/cdn` requests.
    pub cdn: u64,
    /// Resolver requests answered `429` for being over [`HubConfig::resolver_limit`].
    pub rate_limited: u64,
    /// The most resolver requests one window of [`HubConfig::resolver_limit`] let in.
    pub resolver_window_peak: u64,
    /// Per file, keyed `org/name/path`.
    pub files: BTreeMap<String, FileStats>,
}

impl HubStats {
    /// The counters of `repo`'s file `path` (zero when never asked).
    pub fn file(&self, repo: &str, path: &str) -> FileStats {
        self.files
            .get(&format!("{repo}/{path}"))
            .cloned()
            .unwrap_or_default()
    }
}

/// Request counters of one file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileStats {
    /// `/resolve` requests.
    pub resolve: u64,
    /// `/cdn` requests.
    pub cdn: u64,
    /// `HEAD` requests (either route).
    pub head: u64,
    /// Requests (either route) that carried an `Authorization` header.
    pub with_auth: u64,
    /// The `Range` header of each `GET` (either route), in arrival order; `None` = no Range.
    pub ranges: Vec<Option<String>>,
    /// When each `GET` of `ranges` arrived, so tests can check the waits between them.
    pub arrivals: Vec<std::time::Instant>,
}

/// A running hub; stops when dropped.
#[derive(Debug)]
pub struct Hub {
    url: String,
    shared: Arc<Shared>,
    /// Dropping it tells both servers to stop.
    shutdown: Option<tokio::sync::watch::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Hub {
    /// Base URL, `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Base URL of the CDN listener (another port, so another origin), in CDN mode.
    pub fn cdn_url(&self) -> Option<&str> {
        self.shared.cdn_base.as_deref()
    }

    /// Counters so far.
    pub fn stats(&self) -> HubStats {
        self.shared.stats().clone()
    }

    /// Zero every counter.
    pub fn reset_stats(&self) {
        *self.shared.stats() = HubStats::default();
    }

    /// The handle that scripts faults.
    pub fn faults(&self) -> Faults {
        self.shared.faults.clone()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        drop(self.shutdown.take());
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[derive(Debug)]
struct FileEntry {
    path: String,
    abs: PathBuf,
    size: u64,
    lfs: bool,
    sha256: OnceCell<String>,
    blob_sha1: OnceCell<String>,
}

#[derive(Debug)]
struct RepoState {
    repo: String,
    commit: String,
    gated: bool,
    /// Sorted by path.
    files: Vec<Arc<FileEntry>>,
    by_path: HashMap<String, usize>,
}

#[derive(Debug)]
struct Shared {
    base: String,
    cdn_base: Option<String>,
    repos: HashMap<String, RepoState>,
    redirect_to_cdn: bool,
    token: Option<String>,
    page_size: usize,
    hash_on_listing: bool,
    published_hashes: PublishedHashes,
    stats: Mutex<HubStats>,
    faults: Faults,
    link: Arc<link::Shaper>,
    resolver_limit: Option<ResolverLimit>,
    /// The current resolver window: when it started and the requests it let in.
    resolver_window: Mutex<Option<(std::time::Instant, u64)>>,
}

impl Shared {
    fn stats(&self) -> std::sync::MutexGuard<'_, HubStats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Start serving `config` on its bind address (127.0.0.1 by default) on a tokio task of the current runtime.
pub async fn start(config: HubConfig) -> Result<Hub, HubError> {
    let mut repos = HashMap::new();
    for r in &config.repos {
        check_repo_name(&r.repo)?;
        if r.commit.len() != 40
            || !r
                .commit
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(HubError::Config(format!(
                "{}: commit {:?} is not 40 lowercase hex digits",
                r.repo, r.commit
            )));
        }
        let (dir, oids) = (r.dir.clone(), r.oids.clone());
        let threshold = config.lfs_threshold;
        let files =
            tokio::task::spawn_blocking(move || scan_snapshot(&dir, oids.as_deref(), threshold))
                .await
                .map_err(|e| HubError::Config(format!("snapshot scan task failed: {e}")))??;
        let by_path = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.path.clone(), i))
            .collect();
        let state = RepoState {
            repo: r.repo.clone(),
            commit: r.commit.clone(),
            gated: config.gated.contains(&r.repo),
            files,
            by_path,
        };
        if repos.insert(r.repo.clone(), state).is_some() {
            return Err(HubError::Config(format!("repo {} given twice", r.repo)));
        }
    }
    let (listener, base) = bind(config.bind, config.port).await?;
    let cdn_listener = if config.redirect_to_cdn {
        Some(bind(config.bind, 0).await?)
    } else {
        None
    };
    let shared = Arc::new(Shared {
        base: base.clone(),
        cdn_base: cdn_listener.as_ref().map(|(_, b)| b.clone()),
        repos,
        redirect_to_cdn: config.redirect_to_cdn,
        token: config.token.clone(),
        page_size: config.tree_page_size.max(1),
        hash_on_listing: config.hash_on_listing,
        published_hashes: config.published_hashes,
        stats: Mutex::new(HubStats::default()),
        faults: Faults::default(),
        link: link::Shaper::new(config.link),
        resolver_limit: config.resolver_limit,
        resolver_window: Mutex::new(None),
    });
    let hub_router = Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(revision))
        .route("/api/models/{org}/{name}/tree/{rev}", get(tree_root))
        .route("/api/models/{org}/{name}/tree/{rev}/{*dir}", get(tree_dir))
        .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            rate_limit,
        ))
        .with_state(shared.clone());
    let (tx, rx) = tokio::sync::watch::channel(());
    let mut tasks = vec![serve(listener, hub_router, rx.clone())];
    if let Some((cdn_listener, _)) = cdn_listener {
        let cdn_router = Router::new()
            .route("/cdn/{org}/{name}/{commit}/{*path}", get(cdn))
            .with_state(shared.clone());
        tasks.push(serve(cdn_listener, cdn_router, rx));
    }
    Ok(Hub {
        url: base,
        shared,
        shutdown: Some(tx),
        tasks,
    })
}

/// [`HubConfig::resolver_limit`] on every resolver route: count the request in the
/// current window and say what is left (`RateLimit: "api";r=LEFT;t=SECONDS`), or answer
/// `429` with `Retry-After` when the window is spent.
async fn rate_limit(
    State(hub): State<Arc<Shared>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(limit) = hub.resolver_limit else {
        return next.run(req).await;
    };
    let now = std::time::Instant::now();
    let (left, reset) = {
        let mut w = hub
            .resolver_window
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (start, count) = match *w {
            Some((start, count)) if now.duration_since(start) < limit.window => (start, count),
            _ => (now, 0),
        };
        let reset = limit.window.saturating_sub(now.duration_since(start));
        if count >= limit.requests {
            *w = Some((start, count));
            drop(w);
            hub.stats().rate_limited += 1;
            let secs = reset.as_secs_f64().ceil().max(1.0) as u64;
            return Response::builder()
                .status(StatusCode::TOO_MANY_REQUESTS)
                .header(header::RETRY_AFTER, secs)
                .header("ratelimit", format!("\"api\";r=0;t={secs}"))
                .body(Body::from("rate limited"))
                .unwrap_or_default();
        }
        *w = Some((start, count + 1));
        let mut stats = hub.stats();
        stats.resolver_window_peak = stats.resolver_window_peak.max(count + 1);
        (limit.requests - count - 1, reset)
    };
    let mut resp = next.run(req).await;
    let secs = reset.as_secs_f64().ceil().max(1.0) as u64;
    if let Ok(v) = HeaderValue::from_str(&format!("\"api\";r={left};t={secs}")) {
        resp.headers_mut().insert("ratelimit", v);
    }
    resp
}

async fn bind(
    ip: std::net::IpAddr,
    port: u16,
) -> Result<(tokio::net::TcpListener, String), HubError> {
    let addr = SocketAddr::from((ip, port));
    let io = |source| HubError::Io {
        path: addr.to_string(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(io)?;
    let local = listener.local_addr().map_err(io)?;
    Ok((listener, format!("http://{local}")))
}

fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    mut stop: tokio::sync::watch::Receiver<()>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
            // Resolves when the `Hub` drops the sender.
            while stop.changed().await.is_ok() {}
        });
        if let Err(e) = serve.await {
            tracing::warn!("test hub stopped: {e}");
        }
    })
}

fn check_repo_name(repo: &str) -> Result<(), HubError> {
    let parts: Vec<&str> = repo.split('/').collect();
    let ok = parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(HubError::Config(format!(
            "repo {repo:?}: expected ORG/NAME of letters, digits, `-`, `_`, `.`"
        )))
    }
}

fn scan_snapshot(
    dir: &Path,
    oids_path: Option<&Path>,
    lfs_threshold: u64,
) -> Result<Vec<Arc<FileEntry>>, HubError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| HubError::Io { path, source }
    };
    let oids: HashMap<String, String> = match oids_path {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(io(p))?;
            serde_json::from_slice(&bytes).map_err(|e| {
                HubError::Config(format!("{}: not a {{path: sha256}} map: {e}", p.display()))
            })?
        }
        None => HashMap::new(),
    };
    let mut files = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((abs_dir, rel_dir)) = stack.pop() {
        for entry in std::fs::read_dir(&abs_dir).map_err(io(&abs_dir))? {
            let entry = entry.map_err(io(&abs_dir))?;
            let abs = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                return Err(HubError::Config(format!(
                    "{}: file name is not UTF-8",
                    abs.display()
                )));
            };
            if matches!(name.as_str(), ".git" | ".cache") {
                continue;
            }
            let rel = if rel_dir.is_empty() {
                name.clone()
            } else {
                format!("{rel_dir}/{name}")
            };
            // fs::metadata follows symlinks: an HF cache snapshot links into blobs/.
            let meta = std::fs::metadata(&abs).map_err(io(&abs))?;
            if meta.is_dir() {
                stack.push((abs, rel));
            } else if meta.is_file() {
                let size = meta.len();
                let sha256 = OnceCell::new();
                if let Some(oid) = oids.get(&rel) {
                    if oid.len() != 64 || !oid.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(HubError::Config(format!(
                            "{}: {rel}: {oid:?} is not a SHA-256 hex digest",
                            oids_path.unwrap_or(dir).display()
                        )));
                    }
                    let _ = sha256.set(oid.to_ascii_lowercase());
                }
                files.push(Arc::new(FileEntry {
                    lfs: size >= lfs_threshold || rel.ends_with(".safetensors"),
                    path: rel,
                    abs,
                    size,
                    sha256,
                    blob_sha1: OnceCell::new(),
                }));
            }
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

impl FileEntry {
    async fn sha256(&self) -> std::io::Result<String> {
        self.sha256
            .get_or_try_init(|| {
                let abs = self.abs.clone();
                async move {
                    tokio::task::spawn_blocking(move || hash_file(&abs, |_| sha2::Sha256::new()))
                        .await
                        .map_err(std::io::Error::other)?
                }
            })
            .await
            .cloned()
    }

    /// The git blob SHA-1 of the content (non-LFS) or of the LFS pointer file (LFS).
    async fn blob_sha1(&self) -> std::io::Result<String> {
        if self.lfs {
            let pointer = self.lfs_pointer().await?;
            return Ok(git_blob_sha1(pointer.as_bytes()));
        }
        self.blob_sha1
            .get_or_try_init(|| {
                let abs = self.abs.clone();
                async move {
                    tokio::task::spawn_blocking(move || {
                        hash_file(&abs, |len| {
                            let mut h = sha1::Sha1::new();
                            h.update(format!("blob {len}\0"));
                            h
                        })
                    })
                    .await
                    .map_err(std::io::Error::other)?
                }
            })
            .await
            .cloned()
    }

    async fn lfs_pointer(&self) -> std::io::Result<String> {
        let sha = self.sha256().await?;
        Ok(format!(
            "version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {}\n",
            self.size
        ))
    }

    /// The ETag value (without quotes), computing it only when `compute`.
    async fn etag(&self, compute: bool) -> std::io::Result<Option<String>> {
        if self.lfs {
            if compute {
                Ok(Some(self.sha256().await?))
            } else {
                Ok(self.sha256.get().cloned())
            }
        } else {
            // Non-LFS files are small: always hash.
            Ok(Some(self.blob_sha1().await?))
        }
    }
}

fn hash_file<D: sha2::Digest>(path: &Path, init: impl FnOnce(u64) -> D) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut h = init(len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

fn git_blob_sha1(content: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", content.len()));
    h.update(content);
    hex::encode(h.finalize())
}

// ---------------------------------------------------------------------------------------
// Handlers

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "error": message }).to_string();
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(code) {
        h.insert("x-error-code", v);
    }
    resp
}

fn fault_status(code: u16, retry_after: Option<&str>) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let mut resp = error(status, "ScriptedFault", "scripted fault");
    if let Some(v) = retry_after.and_then(|v| HeaderValue::from_str(v).ok()) {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

fn internal(what: &str, e: std::io::Error) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalError",
        &format!("{what}: {e}"),
    )
}

// The `Err` side is the answer a handler sends; boxing it would buy nothing.
#[allow(clippy::result_large_err)]
impl Shared {
    /// The repo, checking the gate. `Err` is the answer to send.
    /// What every API route does first: a scripted status fault, then the repo (with
    /// its gate), then the revision.
    fn api_repo(
        &self,
        route: RouteKind,
        org: &str,
        name: &str,
        rev: &str,
        headers: &HeaderMap,
    ) -> Result<&RepoState, Response> {
        let shape = RequestShape {
            route,
            path: None,
            file_body: false,
        };
        if let Some(FaultKind::Status { code, retry_after }) = self.faults.take(&shape) {
            return Err(fault_status(code, retry_after.as_deref()));
        }
        let repo = self.repo(org, name, headers)?;
        repo.check_rev(rev)?;
        Ok(repo)
    }

    fn repo(&self, org: &str, name: &str, headers: &HeaderMap) -> Result<&RepoState, Response> {
        let key = format!("{org}/{name}");
        let Some(repo) = self.repos.get(&key) else {
            return Err(error(
                StatusCode::NOT_FOUND,
                "RepoNotFound",
                &format!("Repository {key} not found"),
            ));
        };
        if repo.gated {
            let sent = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let ok = matches!((sent, &self.token), (Some(s), Some(t)) if s == t);
            if !ok {
                return Err(error(
                    StatusCode::UNAUTHORIZED,
                    "GatedRepo",
                    &format!(
                        "Access to model {key} is restricted. You must have access to it and be authenticated to access it."
                    ),
                ));
            }
        }
        Ok(repo)
    }
}

#[allow(clippy::result_large_err)]
impl RepoState {
    fn check_rev(&self, rev: &str) -> Result<(), Response> {
        if rev == "main" || rev == self.commit {
            Ok(())
        } else {
            Err(error(
                StatusCode::NOT_FOUND,
                "RevisionNotFound",
                &format!("Invalid rev id: {rev}"),
            ))
        }
    }

    fn file(&self, path: &str) -> Result<&Arc<FileEntry>, Response> {
        self.by_path
            .get(path)
            .map(|&i| &self.files[i])
            .ok_or_else(|| {
                error(
                    StatusCode::NOT_FOUND,
                    "EntryNotFound",
                    &format!("Entry not found: {path}"),
                )
            })
    }
}

async fn revision(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    hub.stats().revision += 1;
    let repo = match hub.api_repo(RouteKind::Revision, &org, &name, &rev, &headers) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|f| serde_json::json!({ "rfilename": f.path }))
        .collect();
    let body = serde_json::json!({
        "_id": &repo.commit[..24],
        "id": repo.repo,
        "modelId": repo.repo,
        "sha": repo.commit,
        "private": false,
        "gated": if repo.gated { serde_json::json!("manual") } else { serde_json::json!(false) },
        "disabled": false,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "lastModified": "2025-01-01T00:00:00.000Z",
        "createdAt": "2025-01-01T00:00:00.000Z",
        "siblings": siblings,
    });
    json_response(body.to_string())
}

fn json_response(body: String) -> Response {
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[derive(Debug, Deserialize)]
struct TreeQuery {
    recursive: Option<String>,
    cursor: Option<String>,
}

async fn tree_root(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    Query(q): Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    tree(hub, org, name, rev, String::new(), q, headers).await
}

async fn tree_dir(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, rev, dir)): UrlPath<(String, String, String, String)>,
    Query(q): Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    tree(hub, org, name, rev, dir, q, headers).await
}

async fn tree(
    hub: Arc<Shared>,
    org: String,
    name: String,
    rev: String,
    dir: String,
    q: TreeQuery,
    headers: HeaderMap,
) -> Response {
    hub.stats().tree += 1;
    let repo = match hub.api_repo(RouteKind::Tree, &org, &name, &rev, &headers) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let recursive = q
        .recursive
        .as_deref()
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let dir = dir.trim_end_matches('/');
    let prefix = if dir.is_empty() {
        String::new()
    } else {
        format!("{dir}/")
    };
    // Entries under `dir`: files, and the directories that lead to them.
    enum Entry<'a> {
        File(&'a Arc<FileEntry>),
        Dir(String),
    }
    let mut entries: BTreeMap<String, Entry<'_>> = BTreeMap::new();
    let mut dirs = BTreeSet::new();
    for f in &repo.files {
        let Some(rest) = f.path.strip_prefix(&prefix) else {
            continue;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        for i in 1..parts.len() {
            if !recursive && i > 1 {
                break;
            }
            dirs.insert(format!("{prefix}{}", parts[..i].join("/")));
        }
        if recursive || parts.len() == 1 {
            entries.insert(f.path.clone(), Entry::File(f));
        }
    }
    if !dir.is_empty() && entries.is_empty() && dirs.is_empty() {
        return error(
            StatusCode::NOT_FOUND,
            "EntryNotFound",
            &format!("{dir} does not exist on \"{rev}\""),
        );
    }
    for d in dirs {
        entries.insert(d.clone(), Entry::Dir(d));
    }
    let start: usize = match q.cursor.as_deref().map(str::parse) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return error(StatusCode::BAD_REQUEST, "BadRequest", "invalid cursor");
        }
    };
    let total = entries.len();
    let mut out = Vec::new();
    for (_, entry) in entries.into_iter().skip(start).take(hub.page_size) {
        match entry {
            Entry::Dir(path) => out.push(serde_json::json!({
                "type": "directory",
                "oid": git_blob_sha1(path.as_bytes()),
                "size": 0,
                "path": path,
            })),
            Entry::File(f) => {
                let unhashed = f.lfs && !hub.hash_on_listing && f.sha256.get().is_none();
                let oid = if unhashed {
                    // No content hash without reading the file: the oid stands for a
                    // pointer that names only the size (header-only replicas).
                    let pointer = format!(
                        "version https://git-lfs.github.com/spec/v1\nsize {}\n",
                        f.size
                    );
                    git_blob_sha1(pointer.as_bytes())
                } else {
                    match f.blob_sha1().await {
                        Ok(o) => o,
                        Err(e) => return internal(&f.path, e),
                    }
                };
                let mut v = serde_json::json!({
                    "type": "file",
                    "oid": oid,
                    "size": f.size,
                    "path": f.path,
                });
                if f.lfs
                    && hub.published_hashes == PublishedHashes::Everywhere
                    && (hub.hash_on_listing || f.sha256.get().is_some())
                {
                    let (sha, pointer) = match (f.sha256().await, f.lfs_pointer().await) {
                        (Ok(s), Ok(p)) => (s, p),
                        (Err(e), _) | (_, Err(e)) => return internal(&f.path, e),
                    };
                    v["lfs"] = serde_json::json!({
                        "oid": sha,
                        "size": f.size,
                        "pointerSize": pointer.len(),
                    });
                }
                out.push(v);
            }
        }
    }
    let mut resp = json_response(serde_json::Value::Array(out).to_string());
    let next = start.saturating_add(hub.page_size);
    if next < total {
        let dir_part = if dir.is_empty() {
            String::new()
        } else {
            format!("/{}", encode_path(dir))
        };
        let link = format!(
            "<{}/api/models/{org}/{name}/tree/{}{dir_part}?recursive={recursive}&cursor={next}>; rel=\"next\"",
            hub.base,
            encode_segment(&rev),
        );
        if let Ok(v) = HeaderValue::from_str(&link) {
            resp.headers_mut().insert(header::LINK, v);
        }
    }
    resp
}

async fn resolve(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, rev, path)): UrlPath<(String, String, String, String)>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    hub.stats().resolve += 1;
    let repo = match hub.repo(&org, &name, &headers) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    count_file(&hub, repo, &path, RouteKind::Resolve, &method, &headers);
    if let Err(resp) = repo.check_rev(&rev) {
        return resp;
    }
    let file = match repo.file(&path) {
        Ok(f) => f.clone(),
        Err(resp) => return resp,
    };
    let redirect = hub.redirect_to_cdn && file.lfs;
    let shape = RequestShape {
        route: RouteKind::Resolve,
        path: Some(&path),
        file_body: method == Method::GET && !redirect,
    };
    let fault = hub.faults.take(&shape);
    if let Some(FaultKind::Status { code, retry_after }) = &fault {
        return fault_status(*code, retry_after.as_deref());
    }
    if redirect {
        let compute = method == Method::HEAD || is_probe(&headers);
        let mut resp = Response::new(Body::empty());
        *resp.status_mut() = StatusCode::FOUND;
        let location = format!(
            "{}/cdn/{org}/{name}/{}/{}?sig=gturbo-test",
            hub.cdn_base.as_deref().unwrap_or(&hub.base),
            repo.commit,
            encode_path(&path)
        );
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&location) {
            h.insert(header::LOCATION, v);
        }
        let answer = FileAnswer {
            commit: Some(&repo.commit),
            fault: fault.as_ref(),
            compute,
            hashes: hub.published_hashes,
        };
        if let Err(e) = file_headers(h, &file, &answer).await {
            return internal(&path, e);
        }
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(0u64));
        return resp;
    }
    serve_file(
        &file,
        Some(&repo.commit),
        hub.published_hashes,
        &method,
        &headers,
        fault,
        &hub.link,
    )
    .await
}

async fn cdn(
    State(hub): State<Arc<Shared>>,
    UrlPath((org, name, commit, path)): UrlPath<(String, String, String, String)>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    hub.stats().cdn += 1;
    let key = format!("{org}/{name}");
    let Some(repo) = hub.repos.get(&key).filter(|r| r.commit == commit) else {
        return error(StatusCode::NOT_FOUND, "NoSuchKey", "no such object");
    };
    count_file(&hub, repo, &path, RouteKind::Cdn, &method, &headers);
    let file = match repo.file(&path) {
        Ok(f) => f.clone(),
        Err(resp) => return resp,
    };
    let shape = RequestShape {
        route: RouteKind::Cdn,
        path: Some(&path),
        file_body: method == Method::GET,
    };
    let fault = hub.faults.take(&shape);
    if let Some(FaultKind::Status { code, retry_after }) = &fault {
        return fault_status(*code, retry_after.as_deref());
    }
    serve_file(
        &file,
        None,
        hub.published_hashes,
        &method,
        &headers,
        fault,
        &hub.link,
    )
    .await
}

fn count_file(
    hub: &Shared,
    repo: &RepoState,
    path: &str,
    route: RouteKind,
    method: &Method,
    headers: &HeaderMap,
) {
    let mut stats = hub.stats();
    let f = stats
        .files
        .entry(format!("{}/{path}", repo.repo))
        .or_default();
    match route {
        RouteKind::Cdn => f.cdn += 1,
        _ => f.resolve += 1,
    }
    if headers.contains_key(header::AUTHORIZATION) {
        f.with_auth += 1;
    }
    if method == Method::HEAD {
        f.head += 1;
    } else {
        f.ranges.push(
            headers
                .get(header::RANGE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        );
        f.arrivals.push(std::time::Instant::now());
    }
}

/// `Range: bytes=0-0`: the metadata probe some clients (hf-hub 0.4) send instead of HEAD.
fn is_probe(headers: &HeaderMap) -> bool {
    headers
        .get(header::RANGE)
        .is_some_and(|v| v.as_bytes() == b"bytes=0-0")
}

/// What shapes the headers of one file answer.
struct FileAnswer<'a> {
    /// `X-Repo-Commit` (none from the CDN).
    commit: Option<&'a str>,
    fault: Option<&'a FaultKind>,
    /// Hash the file now if its SHA-256 is not known yet.
    compute: bool,
    hashes: PublishedHashes,
}

async fn file_headers(
    h: &mut HeaderMap,
    file: &FileEntry,
    answer: &FileAnswer<'_>,
) -> std::io::Result<()> {
    let FileAnswer {
        commit,
        fault,
        compute,
        hashes,
    } = *answer;
    if file.lfs && hashes != PublishedHashes::Everywhere {
        lfs_headers_publishing_less(h, file, answer).await?;
    } else if let Some(mut etag) = file.etag(compute).await? {
        if fault == Some(&FaultKind::ChangedEtag) {
            etag = if file.lfs {
                hex::encode(sha2::Sha256::digest(format!("changed:{etag}")))
            } else {
                git_blob_sha1(format!("changed:{etag}").as_bytes())
            };
        }
        if let Ok(v) = HeaderValue::from_str(&format!("\"{etag}\"")) {
            if file.lfs {
                h.insert("x-linked-etag", v.clone());
            }
            h.insert(header::ETAG, v);
        }
    }
    if let Some(commit) = commit {
        let commit = if fault == Some(&FaultKind::ChangedCommit) {
            hex::encode(sha1::Sha1::digest(format!("changed:{commit}")))
        } else {
            commit.to_string()
        };
        if let Ok(v) = HeaderValue::from_str(&commit) {
            h.insert("x-repo-commit", v);
        }
    }
    if file.lfs {
        h.insert("x-linked-size", HeaderValue::from(file.size));
    }
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    Ok(())
}

/// The hash headers of an LFS file in the modes that publish less than the hub
/// ([`PublishedHashes`]). Without a listing to have hashed the file, the hash is
/// computed for every answer that carries it.
async fn lfs_headers_publishing_less(
    h: &mut HeaderMap,
    file: &FileEntry,
    answer: &FileAnswer<'_>,
) -> std::io::Result<()> {
    let changed = answer.fault == Some(&FaultKind::ChangedEtag);
    let sha256 = || async {
        let sha = file.sha256().await?;
        Ok::<_, std::io::Error>(if changed {
            hex::encode(sha2::Sha256::digest(format!("changed:{sha}")))
        } else {
            sha
        })
    };
    let quoted = |v: &str| HeaderValue::from_str(&format!("\"{v}\"")).ok();
    let (linked, etag) = match answer.hashes {
        PublishedHashes::LinkedEtag => {
            let pointer = file.lfs_pointer().await?;
            (Some(sha256().await?), git_blob_sha1(pointer.as_bytes()))
        }
        PublishedHashes::Etag => (None, sha256().await?),
        PublishedHashes::Everywhere | PublishedHashes::Nowhere => {
            // The blob SHA-1 of a pointer that names only the size: says nothing of
            // the content.
            let pointer = format!(
                "version https://git-lfs.github.com/spec/v1\nsize {}\n",
                file.size
            );
            (None, git_blob_sha1(pointer.as_bytes()))
        }
    };
    if let Some(v) = linked.as_deref().and_then(quoted) {
        h.insert("x-linked-etag", v);
    }
    if let Some(v) = quoted(&etag) {
        h.insert(header::ETAG, v);
    }
    Ok(())
}

/// Unsatisfiable range: answer 416.
#[derive(Debug, PartialEq, Eq)]
struct Unsatisfiable;

/// Inclusive `(first, last)` byte positions, or `None` for the whole file.
type RangeAnswer = Result<Option<(u64, u64)>, Unsatisfiable>;

/// A single `bytes=` range of a file of `size` bytes: `Ok(None)` = serve the whole file
/// (no Range, or one we ignore as RFC 9110 §14.2 allows), `Err` = unsatisfiable (416).
fn parse_range(value: Option<&HeaderValue>, size: u64) -> RangeAnswer {
    let Some(spec) = value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().strip_prefix("bytes="))
    else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return Ok(None);
    };
    let (a, b) = (a.trim(), b.trim());
    let range = if a.is_empty() {
        let Ok(n) = b.parse::<u64>() else {
            return Ok(None);
        };
        if n == 0 || size == 0 {
            return Err(Unsatisfiable);
        }
        (size - n.min(size), size - 1)
    } else {
        let Ok(start) = a.parse::<u64>() else {
            return Ok(None);
        };
        let end = if b.is_empty() {
            u64::MAX
        } else {
            match b.parse::<u64>() {
                Ok(e) if e >= start => e,
                _ => return Ok(None),
            }
        };
        if start >= size {
            return Err(Unsatisfiable);
        }
        (start, end.min(size - 1))
    };
    Ok(Some(range))
}

async fn serve_file(
    file: &FileEntry,
    commit: Option<&str>,
    hashes: PublishedHashes,
    method: &Method,
    headers: &HeaderMap,
    fault: Option<FaultKind>,
    link: &Arc<link::Shaper>,
) -> Response {
    link.first_byte().await;
    if fault == Some(FaultKind::StallBeforeHeaders) {
        // Accept the request and never answer (until the client gives up).
        return std::future::pending().await;
    }
    let compute = *method == Method::HEAD || is_probe(headers);
    let mut range = match parse_range(headers.get(header::RANGE), file.size) {
        Ok(r) => r,
        Err(Unsatisfiable) => {
            let mut resp = Response::new(Body::empty());
            *resp.status_mut() = StatusCode::RANGE_NOT_SATISFIABLE;
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{}", file.size)) {
                resp.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return resp;
        }
    };
    if fault == Some(FaultKind::FullBodyFor206) {
        range = None;
    }
    let (start, len) = match range {
        Some((a, b)) => (a, b - a + 1),
        None => (0, file.size),
    };
    let mut resp = Response::new(Body::empty());
    let h = resp.headers_mut();
    let answer = FileAnswer {
        commit,
        fault: fault.as_ref(),
        compute,
        hashes,
    };
    if let Err(e) = file_headers(h, file, &answer).await {
        return internal(&file.path, e);
    }
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    if let Some((a, b)) = range {
        let (a, b) = if fault == Some(FaultKind::WrongContentRange) {
            (a + 1, b + 1)
        } else {
            (a, b)
        };
        if let Ok(v) = HeaderValue::from_str(&format!("bytes {a}-{b}/{}", file.size)) {
            h.insert(header::CONTENT_RANGE, v);
        }
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
    }
    if *method == Method::HEAD || len == 0 {
        return resp;
    }
    if let Some(FaultKind::SwappedBody(bytes)) = &fault {
        if bytes.len() as u64 != file.size {
            let e = std::io::Error::other(format!(
                "SwappedBody: {} bytes for a file of {}",
                bytes.len(),
                file.size
            ));
            return internal(&file.path, e);
        }
        let (a, n) = (start as usize, len as usize);
        *resp.body_mut() = Body::from(Bytes::copy_from_slice(&bytes[a..a + n]));
        return resp;
    }
    let mut f = match tokio::fs::File::open(&file.abs).await {
        Ok(f) => f,
        Err(e) => return internal(&file.path, e),
    };
    if let Err(e) = f.seek(std::io::SeekFrom::Start(start)).await {
        return internal(&file.path, e);
    }
    // Where a scripted body fault cuts the body, and whether it ends with an error.
    let cut = match fault {
        Some(FaultKind::ResetMidBody) => Some((len / 2, true)),
        Some(FaultKind::TruncatedBody) => Some((len / 2, false)),
        _ => None,
    };
    *resp.body_mut() = match fault {
        Some(FaultKind::Stall) => {
            Body::from_stream(futures_util::stream::pending::<std::io::Result<Bytes>>())
        }
        Some(FaultKind::BurstThenStall { bytes }) => {
            let burst = body_stream(f, len, Some((bytes.min(len), false)));
            Body::from_stream(futures_util::StreamExt::chain(
                burst,
                futures_util::stream::pending(),
            ))
        }
        Some(FaultKind::SlowDrip { bytes, every_ms }) => Body::from_stream(drip_stream(
            f,
            len,
            bytes.max(1),
            std::time::Duration::from_millis(every_ms),
        )),
        _ if link.shape.is_shaped() => {
            Body::from_stream(link.clone().shape(Box::pin(body_stream(f, len, cut))))
        }
        _ => Body::from_stream(body_stream(f, len, cut)),
    };
    resp
}

/// The body in pieces of `bytes`, one every `every` (the first after one `every`).
fn drip_stream(
    file: tokio::fs::File,
    len: u64,
    bytes: usize,
    every: std::time::Duration,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> + Send {
    futures_util::stream::unfold((file, len), move |(mut file, left)| async move {
        if left == 0 {
            return None;
        }
        tokio::time::sleep(every).await;
        let want = left.min(bytes as u64) as usize;
        let mut buf = BytesMut::zeroed(want);
        match file.read_exact(&mut buf).await {
            Ok(_) => Some((Ok(buf.freeze()), (file, left - want as u64))),
            Err(e) => Some((Err(e), (file, 0))),
        }
    })
}

struct BodyState {
    /// The open file, positioned at the next byte to send (`None` while a read is out).
    file: Option<std::fs::File>,
    /// Bytes still to send before the stream ends (or fails).
    left: u64,
    /// Fail with a reset once `left` reaches 0 (instead of ending).
    then_reset: bool,
    done: bool,
}

fn body_stream(
    file: tokio::fs::File,
    len: u64,
    cut: Option<(u64, bool)>,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> + Send {
    let (left, then_reset) = cut.unwrap_or((len, false));
    let start = BodyState {
        file: None,
        left,
        then_reset,
        done: false,
    };
    futures_util::stream::unfold((start, Some(file)), |(mut s, tokio_file)| async move {
        if let Some(f) = tokio_file {
            s.file = Some(f.into_std().await);
        }
        if s.done {
            return None;
        }
        if s.left == 0 {
            s.done = true;
            if s.then_reset {
                // Let the bytes already yielded reach the socket before the abort.
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                let e = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "scripted reset");
                return Some((Err(e), (s, None)));
            }
            return None;
        }
        let want = s.left.min(CHUNK as u64) as usize;
        // One blocking read straight into the chunk's (uninitialised) capacity: the
        // hub shares the benchmarks' cores with the client, so it should cost no more
        // than the page-cache copy (tokio::fs read through a buffer of its own, into a
        // zeroed chunk: two copies and a fill).
        let mut f = s.file.take()?;
        let read = tokio::task::spawn_blocking(move || {
            use std::io::Read;
            let mut v = Vec::with_capacity(want);
            let r = (&mut f).take(want as u64).read_to_end(&mut v);
            (f, r.map(|_| v))
        })
        .await;
        let (f, got) = match read {
            Ok(r) => r,
            Err(e) => {
                s.done = true;
                return Some((Err(std::io::Error::other(e)), (s, None)));
            }
        };
        s.file = Some(f);
        match got {
            Ok(v) if v.len() == want => {
                s.left -= want as u64;
                Some((Ok(Bytes::from(v)), (s, None)))
            }
            Ok(_) => {
                s.done = true;
                let e = std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "file shrank while being served",
                );
                Some((Err(e), (s, None)))
            }
            Err(e) => {
                s.done = true;
                Some((Err(e), (s, None)))
            }
        }
    })
}

/// Percent-encode one URL path segment (everything but RFC 3986 unreserved characters).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn encode_path(path: &str) -> String {
    path.split('/')
        .map(encode_segment)
        .collect::<Vec<_>>()
        .join("/")
}

// ---------------------------------------------------------------------------------------
// gturbo-dev hub

/// Serve snapshot directories as a local Hugging Face-compatible hub. Prints the base
/// URL on the first line of stdout, then serves until killed.
#[derive(Debug, clap::Args)]
pub struct HubArgs {
    /// A repo to serve: `ORG/NAME=DIR` (repeatable).
    #[arg(long = "repo", required = true, value_name = "ORG/NAME=DIR")]
    repos: Vec<String>,
    /// The commit `main` resolves to, 40 hex, one per `--repo` in order
    /// (default: derived from the repo name).
    #[arg(long = "commit", value_name = "HEX")]
    commits: Vec<String>,
    /// Port on the bind address (0: any free port).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Address to listen on (both the hub and, with `--cdn`, the CDN port). Keep the
    /// default unless the hub runs in a network namespace of its own, as the install
    /// benchmark's aggregate-cap mode does.
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    /// Redirect LFS downloads to a separate `/cdn/...` location, as the hub does.
    #[arg(long)]
    cdn: bool,
    /// A repo (`ORG/NAME`) that needs the token (repeatable).
    #[arg(long = "gated", value_name = "ORG/NAME")]
    gated: Vec<String>,
    /// The token gated repos accept.
    #[arg(long, env = "GTURBO_HUB_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Files at least this large are LFS files.
    #[arg(long, default_value_t = DEFAULT_LFS_THRESHOLD)]
    lfs_threshold: u64,
    /// Tree entries per page.
    #[arg(long, default_value_t = DEFAULT_TREE_PAGE_SIZE)]
    page_size: usize,
    /// Do not hash files for tree listings (header-only replicas of hundreds of GB):
    /// listings then give `lfs` only where an `--oids` file has the hash.
    #[arg(long)]
    no_hash: bool,
    /// Where LFS files' SHA-256 is published (a mirror may publish less than the hub).
    #[arg(long, value_enum, default_value_t = PublishedHashes::Everywhere)]
    published_hashes: PublishedHashes,
    /// Known SHA-256s of a repo's files, `ORG/NAME=FILE` with FILE a JSON
    /// `{"path": "sha256 hex"}` map outside the served directory (repeatable).
    #[arg(long = "oids", value_name = "ORG/NAME=FILE")]
    oids: Vec<String>,
    /// Bytes per second of each file answer's body, as a CDN caps one connection.
    #[arg(long, value_name = "BYTES/S")]
    conn_rate: Option<u64>,
    /// Milliseconds before each file answer's headers (time to first byte).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    latency_ms: u64,
    /// Bytes per second of all file answers together (the link's capacity).
    #[arg(long, value_name = "BYTES/S")]
    aggregate_rate: Option<u64>,
}

/// `gturbo-dev hub …`: serves until killed.
pub fn cli_main(args: HubArgs) -> std::process::ExitCode {
    match run_cli(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gturbo-dev hub: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run_cli(args: HubArgs) -> Result<(), HubError> {
    if !args.commits.is_empty() && args.commits.len() != args.repos.len() {
        return Err(HubError::Config(format!(
            "{} --commit values for {} --repo values: give one per repo, or none",
            args.commits.len(),
            args.repos.len()
        )));
    }
    let mut repos = Vec::new();
    for (i, spec) in args.repos.iter().enumerate() {
        let Some((repo, dir)) = spec.split_once('=') else {
            return Err(HubError::Config(format!(
                "--repo {spec:?}: expected ORG/NAME=DIR"
            )));
        };
        let mut r = HubRepo::new(repo, dir);
        if let Some(c) = args.commits.get(i) {
            r.commit = c.to_ascii_lowercase();
        }
        repos.push(r);
    }
    for spec in &args.oids {
        let Some((repo, file)) = spec.split_once('=') else {
            return Err(HubError::Config(format!(
                "--oids {spec:?}: expected ORG/NAME=FILE"
            )));
        };
        let Some(r) = repos.iter_mut().find(|r| r.repo == repo) else {
            return Err(HubError::Config(format!(
                "--oids {spec:?}: {repo} is not one of the --repo values"
            )));
        };
        r.oids = Some(PathBuf::from(file));
    }
    let config = HubConfig {
        repos,
        redirect_to_cdn: args.cdn,
        gated: args.gated,
        token: args.token,
        lfs_threshold: args.lfs_threshold,
        tree_page_size: args.page_size,
        port: args.port,
        bind: args.bind,
        hash_on_listing: !args.no_hash,
        published_hashes: args.published_hashes,
        link: LinkShape {
            conn_rate: args.conn_rate,
            latency: std::time::Duration::from_millis(args.latency_ms),
            aggregate_rate: args.aggregate_rate,
        },
        resolver_limit: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| HubError::Io {
            path: "tokio runtime".into(),
            source,
        })?;
    rt.block_on(async {
        let hub = start(config).await?;
        println!("{}", hub.url());
        let _ = std::io::Write::flush(&mut std::io::stdout());
        let _ = tokio::signal::ctrl_c().await;
        drop(hub);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_like_rfc_9110() {
        let hv = |s: &str| HeaderValue::from_str(s).unwrap();
        let cases: &[(&str, u64, RangeAnswer)] = &[
            ("bytes=0-0", 10, Ok(Some((0, 0)))),
            ("bytes=2-5", 10, Ok(Some((2, 5)))),
            ("bytes=2-", 10, Ok(Some((2, 9)))),
            ("bytes=5-100", 10, Ok(Some((5, 9)))),
            ("bytes=-3", 10, Ok(Some((7, 9)))),
            ("bytes=-30", 10, Ok(Some((0, 9)))),
            ("bytes=10-12", 10, Err(Unsatisfiable)),
            ("bytes=0-1,3-4", 10, Ok(None)),
            ("bytes=5-2", 10, Ok(None)),
            ("items=0-1", 10, Ok(None)),
        ];
        for (v, size, want) in cases {
            assert_eq!(&parse_range(Some(&hv(v)), *size), want, "{v}");
        }
        assert_eq!(parse_range(None, 10), Ok(None));
    }

    #[test]
    fn git_blob_sha1_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            git_blob_sha1(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(encode_path("a b/c#d.bin"), "a%20b/c%23d.bin");
    }
}
