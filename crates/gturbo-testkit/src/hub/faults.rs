//! Scripted faults for the test hub: each [`Fault`] applies to the next N requests that
//! match it (route kind, optionally one file), then disarms itself.
//!
//! Faults are checked in the order they were pushed; the first armed fault that matches a
//! request is used (and only one per request). A fault with [`Fault::skip`] lets that many
//! matching requests through first (e.g. a shard's header read); [`Fault::always`] keeps
//! it armed for good ("a server that stalls every read"). Body faults only match answers that would
//! carry file bytes (a `GET` of `/resolve` that is not redirected, or of `/cdn`: resets,
//! truncations, slow bodies, swapped bytes); header
//! faults only match file answers (`/resolve`, `/cdn`); status faults match any route.

use std::sync::{Arc, Mutex, PoisonError};

/// The kinds of request the hub counts and faults can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// `GET /api/models/{repo}/revision/{rev}`.
    Revision,
    /// `GET /api/models/{repo}/tree/{rev}`.
    Tree,
    /// `HEAD`/`GET /{repo}/resolve/{rev}/{path}`.
    Resolve,
    /// `HEAD`/`GET /cdn/...` (the redirect target in CDN mode).
    Cdn,
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// Answer with this status and an empty body, with `Retry-After` when given
    /// (delta-seconds or an HTTP-date, sent verbatim).
    Status {
        /// The HTTP status (429, 503, 403, ...).
        code: u16,
        /// The `Retry-After` header value, if any.
        retry_after: Option<String>,
    },
    /// Send about half of the body, then drop the connection with an error.
    ResetMidBody,
    /// Declare the full `Content-Length`, send about half of the body, then close cleanly.
    TruncatedBody,
    /// Ignore `Range`: answer `200` with the whole file.
    FullBodyFor206,
    /// Answer `206` with the right bytes but a `Content-Range` shifted by one byte.
    WrongContentRange,
    /// Announce a different `ETag` / `X-Linked-Etag` than the file's.
    ChangedEtag,
    /// Announce a different `X-Repo-Commit` than the repo's.
    ChangedCommit,
    /// Send the headers, then `bytes` of the body every `every_ms` milliseconds: a
    /// trickle that a per-read timeout never catches.
    SlowDrip {
        /// Bytes per piece (at least 1).
        bytes: usize,
        /// Milliseconds before each piece.
        every_ms: u64,
    },
    /// Send the headers, then no body byte ever (until the client gives up).
    Stall,
    /// Send the headers and the first `bytes` of the body at once, then nothing more
    /// (until the client gives up): a burst that passes one low-speed window, then a
    /// stall (issue 22).
    BurstThenStall {
        /// Bytes sent before the stall (the whole body when it is shorter).
        bytes: u64,
    },
    /// Accept the request and never answer it.
    StallBeforeHeaders,
    /// Serve these bytes instead of the file's, as a server that tampers with a file
    /// and keeps its listing and `ETag` would: the same length (the answer's
    /// headers, `Content-Range` included, are the file's own; bytes of another length
    /// are answered 500), the asked-for range of them.
    SwappedBody(Vec<u8>),
}

impl FaultKind {
    fn is_body_fault(&self) -> bool {
        matches!(
            self,
            Self::ResetMidBody
                | Self::TruncatedBody
                | Self::FullBodyFor206
                | Self::WrongContentRange
                | Self::SlowDrip { .. }
                | Self::Stall
                | Self::BurstThenStall { .. }
                | Self::StallBeforeHeaders
                | Self::SwappedBody(_)
        )
    }

    fn is_file_fault(&self) -> bool {
        matches!(self, Self::ChangedEtag | Self::ChangedCommit)
    }
}

/// One scripted fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// How many matching requests it still applies to.
    pub times: u32,
    /// Only requests for this repo-relative file path (`None`: any).
    pub path: Option<String>,
    /// Only this kind of request (`None`: any).
    pub route: Option<RouteKind>,
    /// Matching requests let through untouched before the fault applies (e.g. a shard's
    /// header read, so the fault hits its weight reads).
    pub skip: u32,
}

impl Fault {
    /// A fault for the next matching request.
    pub fn new(kind: FaultKind) -> Self {
        Self {
            kind,
            times: 1,
            path: None,
            route: None,
            skip: 0,
        }
    }

    /// `status` with no `Retry-After`.
    pub fn status(code: u16) -> Self {
        Self::new(FaultKind::Status {
            code,
            retry_after: None,
        })
    }

    /// `429 Too Many Requests` with `Retry-After: value`.
    pub fn too_many_requests(retry_after: impl Into<String>) -> Self {
        Self::new(FaultKind::Status {
            code: 429,
            retry_after: Some(retry_after.into()),
        })
    }

    /// Apply to every matching request from now on ("a server that stalls every read").
    pub fn always(self) -> Self {
        self.times(u32::MAX)
    }

    /// Apply to the next `n` matching requests.
    pub fn times(mut self, n: u32) -> Self {
        self.times = n;
        self
    }

    /// Only requests for this repo-relative file path.
    pub fn path(mut self, path: impl Into<String>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// Let the first `n` matching requests through before applying.
    pub fn skip(mut self, n: u32) -> Self {
        self.skip = n;
        self
    }

    /// Only this kind of request.
    pub fn route(mut self, route: RouteKind) -> Self {
        self.route = Some(route);
        self
    }
}

/// A handle to script faults on a running hub; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    armed: Arc<Mutex<Vec<Fault>>>,
}

/// What a request is, for matching faults.
pub(crate) struct RequestShape<'a> {
    pub route: RouteKind,
    pub path: Option<&'a str>,
    /// The answer would carry file bytes.
    pub file_body: bool,
}

impl Faults {
    /// Arm a fault.
    pub fn push(&self, fault: Fault) {
        self.lock().push(fault);
    }

    /// Disarm every fault.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// How many request-applications are still armed, over all faults.
    pub fn pending(&self) -> u32 {
        self.lock()
            .iter()
            .fold(0u32, |n, f| n.saturating_add(f.times))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Fault>> {
        // A panic while holding this lock cannot leave the list inconsistent.
        self.armed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Take one application of the first armed fault that matches `req`.
    pub(crate) fn take(&self, req: &RequestShape<'_>) -> Option<FaultKind> {
        let mut armed = self.lock();
        let matches = |f: &Fault| {
            f.times > 0
                && f.route.is_none_or(|r| r == req.route)
                && f.path.as_deref().is_none_or(|p| req.path == Some(p))
                && (!f.kind.is_body_fault() || req.file_body)
                && (!f.kind.is_file_fault()
                    || matches!(req.route, RouteKind::Resolve | RouteKind::Cdn))
        };
        // A fault still skipping counts this request and lets later faults have it.
        let mut idx = None;
        for (i, f) in armed.iter_mut().enumerate() {
            if !matches(f) {
                continue;
            }
            if f.skip > 0 {
                f.skip -= 1;
                continue;
            }
            idx = Some(i);
            break;
        }
        let idx = idx?;
        let fault = &mut armed[idx];
        fault.times -= 1;
        let kind = fault.kind.clone();
        if fault.times == 0 {
            armed.remove(idx);
        }
        Some(kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_match_route_path_and_body_and_disarm_after_n() {
        let faults = Faults::default();
        faults.push(Fault::new(FaultKind::TruncatedBody).times(2).path("a.bin"));
        faults.push(Fault::status(503).route(RouteKind::Tree));
        let head = RequestShape {
            route: RouteKind::Resolve,
            path: Some("a.bin"),
            file_body: false,
        };
        assert_eq!(faults.take(&head), None, "a body fault never hits a HEAD");
        let get_b = RequestShape {
            route: RouteKind::Resolve,
            path: Some("b.bin"),
            file_body: true,
        };
        assert_eq!(faults.take(&get_b), None, "path filter");
        let get_a = RequestShape {
            route: RouteKind::Cdn,
            path: Some("a.bin"),
            file_body: true,
        };
        assert_eq!(faults.take(&get_a), Some(FaultKind::TruncatedBody));
        assert_eq!(faults.take(&get_a), Some(FaultKind::TruncatedBody));
        assert_eq!(faults.take(&get_a), None, "disarmed after 2");
        let tree = RequestShape {
            route: RouteKind::Tree,
            path: None,
            file_body: false,
        };
        assert_eq!(faults.pending(), 1);
        assert!(matches!(
            faults.take(&tree),
            Some(FaultKind::Status { code: 503, .. })
        ));
        assert_eq!(faults.pending(), 0);
    }

    #[test]
    fn a_skipping_fault_lets_the_first_requests_through() {
        let faults = Faults::default();
        faults.push(Fault::new(FaultKind::Stall).path("a.bin").skip(2).always());
        let get_a = RequestShape {
            route: RouteKind::Resolve,
            path: Some("a.bin"),
            file_body: true,
        };
        assert_eq!(faults.take(&get_a), None);
        assert_eq!(faults.take(&get_a), None);
        for _ in 0..3 {
            assert_eq!(faults.take(&get_a), Some(FaultKind::Stall));
        }
        assert!(faults.pending() > 1_000_000, "always stays armed");
    }
}
