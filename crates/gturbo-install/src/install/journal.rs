//! The resume journal, `<out>.partial.journal`: what a partial install has durably
//! done, so a rerun keeps it.
//!
//! # Format (internal, JSON Lines)
//! Each line is one JSON object with sorted keys and no whitespace:
//! - line 1, the head: `{"fingerprint":"<plan fingerprint>","journal":"gturbo-install","version":1}`;
//! - line 2, what the plan was made from (`Plan::facts`): `{"plan_facts":{"--quant":"int4",…}}`,
//!   so a rerun with another fingerprint can say what changed (journals without it,
//!   written by earlier builds, still resume; earlier builds skip it as unreadable);
//! - a completed read: `{"digest":"<hex>","read":<index>}`, plus `"sha":{"len":…,"pending":"<hex>","state":[…]}`
//!   (the source shard's hash state after it) for reads of a verified shard;
//! - a shard whose bytes failed their published SHA-256: `{"discard_shard":<index>}`;
//!   every read of that shard journaled before it no longer counts.
//!
//! A line counts only once it is whole and fsynced; a torn last line (a crash mid-append)
//! does not parse and is skipped (reopening ends it with a newline, so the next line
//! stands on its own). A head that does not parse (a crash before it was
//! durable) starts a new journal. A journal of another plan fingerprint is refused; one
//! in another journal format is refused too, rather than guessed at.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::nofollow;
use super::source_hash::ResumableSha256;
use super::{InstallError, io_err};

/// The head's `journal` value.
const JOURNAL: &str = "gturbo-install";
/// The head's `version` value this code reads and writes.
const VERSION: u32 = 1;

/// Line 1 of the journal.
#[derive(Debug, Serialize, Deserialize)]
struct Head {
    /// Fingerprint of the plan the partial install follows.
    fingerprint: String,
    /// Always [`JOURNAL`].
    journal: String,
    /// Always [`VERSION`].
    version: u32,
}

/// Every line after the head.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Entry {
    /// What the plan was made from (line 2).
    Facts {
        /// `Plan::facts`.
        plan_facts: BTreeMap<String, String>,
    },
    /// The reads of this shard journaled so far no longer count.
    DiscardShard {
        /// Index into the plan's shards.
        discard_shard: usize,
    },
    /// A read completed, its output bytes durable.
    Read {
        /// Digest of the bytes it wrote (see `tile::digest_on_disk`).
        digest: String,
        /// Index into the plan's reads.
        read: usize,
        /// The shard's hash state after this read (verified shards only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sha: Option<ResumableSha256>,
    },
}

/// One journaled read.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Done {
    /// Index into the plan's reads.
    pub read: usize,
    /// Digest of the bytes it wrote.
    pub digest: String,
    /// The shard's hash state after this read (verified shards only).
    pub sha: Option<ResumableSha256>,
}

/// The open journal, appended to as reads complete.
pub(super) struct Journal {
    path: PathBuf,
    file: File,
}

/// One line of the journal: canonical JSON (keys sorted, as `serde_json::Value`
/// writes them), so the bytes do not depend on field declaration order.
fn line<T: Serialize>(path: &Path, v: &T) -> Result<String, InstallError> {
    serde_json::to_value(v)
        .and_then(|v| serde_json::to_string(&v))
        .map_err(|e| InstallError::Internal(format!("{}: {e}", path.display())))
}

impl Journal {
    /// Open the journal of `fingerprint`'s plan, or start one (always, with
    /// `discard`). Returns the journaled reads still counting; `shard_of` maps a read
    /// to its shard (for `discard_shard` lines).
    pub fn open(
        path: &Path,
        fingerprint: &str,
        facts: &BTreeMap<String, String>,
        discard: bool,
        shard_of: impl Fn(usize) -> Option<usize>,
    ) -> Result<(Journal, Vec<Done>), InstallError> {
        // Never followed: a link here is refused (its target would be overwritten).
        let present = nofollow::kind(path)?.is_some();
        if present && !discard {
            let f = nofollow::open_read(path)?;
            let mut lines = BufReader::new(f).lines();
            let head = match lines.next() {
                Some(Ok(l)) => serde_json::from_str::<Head>(&l).ok(),
                _ => None,
            };
            if let Some(head) = head {
                if head.journal != JOURNAL || head.version != VERSION {
                    return Err(InstallError::JournalFormat {
                        journal: path.display().to_string(),
                        found: format!("{:?} version {}", head.journal, head.version),
                    });
                }
                if head.fingerprint != fingerprint {
                    let theirs =
                        lines.map_while(Result::ok).find_map(|l| {
                            match serde_json::from_str::<Entry>(&l) {
                                Ok(Entry::Facts { plan_facts }) => Some(plan_facts),
                                _ => None,
                            }
                        });
                    let changed = match theirs {
                        Some(theirs) => match crate::plan::changed(&theirs, facts) {
                            c if c.is_empty() => "none of its recorded inputs changed, so another gturbo version planned it differently".to_string(),
                            c => format!("changed: {c}"),
                        },
                        None => "another revision, family or flags; its journal predates the record of what changed".to_string(),
                    };
                    return Err(InstallError::PlanChanged {
                        journal: path.display().to_string(),
                        theirs: head.fingerprint,
                        ours: fingerprint.to_string(),
                        changed,
                    });
                }
                let mut done: Vec<Done> = Vec::new();
                for l in lines.map_while(Result::ok) {
                    // A torn last line (a crash mid-append) simply does not count.
                    match serde_json::from_str::<Entry>(&l) {
                        Ok(Entry::DiscardShard { discard_shard }) => {
                            done.retain(|d| shard_of(d.read) != Some(discard_shard));
                        }
                        Ok(Entry::Read { read, digest, sha }) => {
                            done.push(Done { read, digest, sha })
                        }
                        Ok(Entry::Facts { .. }) | Err(_) => {}
                    }
                }
                let mut file = nofollow::open(path, OpenOptions::new().read(true).append(true))?;
                // End a torn last line, so the next line is not glued onto it.
                let len = file.metadata().map_err(|e| io_err(path, e))?.len();
                let mut last = [0u8; 1];
                file.read_exact_at(&mut last, len - 1)
                    .map_err(|e| io_err(path, e))?;
                if last != *b"\n" {
                    writeln!(file).map_err(|e| io_err(path, e))?;
                    file.sync_data().map_err(|e| io_err(path, e))?;
                }
                let journal = Journal {
                    path: path.to_path_buf(),
                    file,
                };
                return Ok((journal, done));
            }
        }
        let head = Head {
            fingerprint: fingerprint.to_string(),
            journal: JOURNAL.into(),
            version: VERSION,
        };
        let head = line(path, &head)?;
        let facts = line(
            path,
            &Entry::Facts {
                plan_facts: facts.clone(),
            },
        )?;
        let mut file = nofollow::create_fresh(path)?;
        writeln!(file, "{head}\n{facts}").map_err(|e| io_err(path, e))?;
        file.sync_all().map_err(|e| io_err(path, e))?;
        let journal = Journal {
            path: path.to_path_buf(),
            file,
        };
        Ok((journal, Vec::new()))
    }

    fn append(&mut self, entry: &Entry) -> Result<(), InstallError> {
        let l = line(&self.path, entry)?;
        writeln!(self.file, "{l}").map_err(|e| io_err(&self.path, e))?;
        self.file.sync_data().map_err(|e| io_err(&self.path, e))
    }

    /// Record a completed read, durably.
    pub fn record(
        &mut self,
        read: usize,
        digest: &str,
        sha: Option<&ResumableSha256>,
    ) -> Result<(), InstallError> {
        self.append(&Entry::Read {
            digest: digest.to_string(),
            read,
            sha: sha.cloned(),
        })
    }

    /// Record that `shard`'s journaled reads no longer count, durably.
    pub fn discard_shard(&mut self, shard: usize) -> Result<(), InstallError> {
        self.append(&Entry::DiscardShard {
            discard_shard: shard,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(bytes: &[u8]) -> ResumableSha256 {
        let mut h = ResumableSha256::default();
        h.update(bytes);
        h
    }

    /// The bytes the journal had when it was written with `serde_json::json!` values;
    /// partial installs made by earlier builds must still resume.
    #[test]
    fn lines_keep_the_bytes_of_earlier_builds() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("j");
        let (mut j, done) =
            Journal::open(&path, "ab12", &BTreeMap::new(), false, |_| None).unwrap();
        assert!(done.is_empty());
        let sha = hash_of(b"hello, journal: seventy bytes of text so one block is compressed..");
        j.record(3, "d3", None).unwrap();
        j.record(4, "d4", Some(&sha)).unwrap();
        j.discard_shard(1).unwrap();
        let mut sha_json = serde_json::json!({ "digest": "d4", "read": 4 });
        sha_json["sha"] = serde_json::to_value(&sha).unwrap();
        let want = format!(
            "{}\n{}\n{}\n{sha_json}\n{}\n",
            serde_json::json!({ "journal": "gturbo-install", "version": 1, "fingerprint": "ab12" }),
            serde_json::json!({ "plan_facts": {} }),
            serde_json::json!({ "read": 3, "digest": "d3" }),
            serde_json::json!({ "discard_shard": 1 }),
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), want);
        assert!(want.starts_with(
            "{\"fingerprint\":\"ab12\",\"journal\":\"gturbo-install\",\"version\":1}\n{\"plan_facts\":{}}\n{\"digest\":\"d3\",\"read\":3}\n{\"digest\":\"d4\",\"read\":4,\"sha\":{\"len\":"
        ));
    }

    #[test]
    fn reopening_keeps_reads_drops_discarded_shards_and_torn_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("j");
        let sha = hash_of(b"abc");
        {
            let (mut j, _) = Journal::open(&path, "f", &BTreeMap::new(), false, |_| None).unwrap();
            j.record(0, "d0", Some(&sha)).unwrap();
            j.record(1, "d1", None).unwrap();
            j.record(2, "d2", None).unwrap();
            j.discard_shard(7).unwrap();
            j.record(3, "d3", None).unwrap();
        }
        // A crash mid-append leaves a torn last line.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"digest\":\"d4\",\"re").unwrap();
        drop(f);
        // Reads 1 and 2 are of shard 7.
        let shard_of = |r: usize| Some(if r == 1 || r == 2 { 7 } else { 0 });
        let (mut j, done) = Journal::open(&path, "f", &BTreeMap::new(), false, shard_of).unwrap();
        let got: Vec<(usize, &str, bool)> = done
            .iter()
            .map(|d| (d.read, d.digest.as_str(), d.sha.is_some()))
            .collect();
        assert_eq!(got, vec![(0, "d0", true), (3, "d3", false)]);
        assert_eq!(done[0].sha.as_ref(), Some(&sha));
        // Appending after a reopen continues the same file.
        j.record(5, "d5", None).unwrap();
        let (_, done) = Journal::open(&path, "f", &BTreeMap::new(), false, shard_of).unwrap();
        assert_eq!(done.last().map(|d| d.read), Some(5));
        // --discard-partial starts a new journal.
        let (_, done) = Journal::open(&path, "f", &BTreeMap::new(), true, shard_of).unwrap();
        assert!(done.is_empty());
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
    }

    #[test]
    fn another_fingerprint_names_what_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("p.gturbo.partial.journal");
        let facts = |sha: &str, quant: &str| -> BTreeMap<String, String> {
            [
                ("a.safetensors: published SHA-256", sha),
                ("--quant", quant),
                ("revision", "main"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        };
        Journal::open(&path, "theirs", &facts("aa", "int4"), false, |_| None).unwrap();
        let e = Journal::open(&path, "ours", &facts("bb", "int4"), false, |_| None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(
                "this plan is ours (changed: a.safetensors: published SHA-256: was aa, now bb); refusing to mix them"
            ),
            "{e}"
        );
        let e = Journal::open(&path, "ours", &facts("bb", "bf16"), false, |_| None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("(changed: --quant: was int4, now bf16; a.safetensors: published SHA-256: was aa, now bb)"),
            "{e}"
        );
        // A journal of an earlier build has no record: the general words.
        std::fs::write(
            &path,
            "{\"fingerprint\":\"theirs\",\"journal\":\"gturbo-install\",\"version\":1}\n",
        )
        .unwrap();
        let e = Journal::open(&path, "ours", &facts("bb", "int4"), false, |_| None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("(another revision, family or flags; its journal predates"),
            "{e}"
        );
    }

    #[test]
    fn a_planted_link_is_never_followed() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = tmp.path().join("p.gturbo.partial.journal");
        symlink(&victim, &path).unwrap();
        for discard in [false, true] {
            let e = Journal::open(&path, "f", &BTreeMap::new(), discard, |_| None)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.starts_with(&format!("{}: a symbolic link", path.display())),
                "{e}"
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    #[test]
    fn another_fingerprint_or_format_is_refused_naming_the_journal() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("p.gturbo.partial.journal");
        Journal::open(&path, "theirs", &BTreeMap::new(), false, |_| None).unwrap();
        let e = Journal::open(&path, "ours", &BTreeMap::new(), false, |_| None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "{}: the partial install was planned with fingerprint theirs, this plan is ours",
                path.display()
            )),
            "{e}"
        );
        std::fs::write(
            &path,
            "{\"fingerprint\":\"ours\",\"journal\":\"gturbo-install\",\"version\":2}\n",
        )
        .unwrap();
        let e = Journal::open(&path, "ours", &BTreeMap::new(), false, |_| None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "{}: written in journal format \"gturbo-install\" version 2",
                path.display()
            )),
            "{e}"
        );
        // A head that never became durable: a new journal.
        std::fs::write(&path, "{\"finger").unwrap();
        let (_, done) = Journal::open(&path, "ours", &BTreeMap::new(), false, |_| None).unwrap();
        assert!(done.is_empty());
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .starts_with("{\"fingerprint\":\"ours\"")
        );
    }
}
