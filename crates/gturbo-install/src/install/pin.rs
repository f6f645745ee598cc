//! Which family reads the target, and which source pin an install follows: the repo,
//! the revision and the expected SHA-256 of the index (the hard gate of
//! [`super::prepare`]).
//!
//! The policy, decided here from the flags and the family file alone, before any
//! request:
//! - The target is a family id (`qwen38flashnext`: the family's pinned repo) or a repo
//!   `ORG/NAME` (then `--family` or `--family-file` says how to read it).
//! - The revision is `--revision` when given, else the family's pinned commit when the
//!   repo is the family's own, else `main`.
//! - The index pin is `--index-sha256` when given (a warning when it replaces a
//!   different family pin of the same repo), else the family's pin when the install
//!   follows the family's pinned repo *and* revision (a pin made for one commit says
//!   nothing about another), else none (`prepare` then warns that the index is unpinned).

use std::path::Path;

use crate::family::{self, Family, FamilyError};

use super::IndexPin;

/// Why the flags do not make an install.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// The family could not be loaded.
    #[error(transparent)]
    Family(#[from] FamilyError),
    /// A repo target without a family.
    #[error("`{target}` is a repo; say which family reads it with --family (known: {known})")]
    RepoNeedsFamily {
        /// The target.
        target: String,
        /// Built-in family ids.
        known: String,
    },
    /// A family-id target that is not the chosen family.
    #[error("target `{target}` is not a repo (ORG/NAME) and not the family `{family}`")]
    NotTheFamily {
        /// The target.
        target: String,
        /// The family chosen by --family or --family-file.
        family: String,
    },
    /// No built-in family reads the checkpoint's `model_type`.
    #[error(
        "config.json: field `model_type`: {model_type} (architectures {architectures}) is not \
         a model type of any known family ({known}); say which family reads it with --family \
         or --family-file"
    )]
    NoFamilyForConfig {
        /// `model_type` as written (`missing` when absent).
        model_type: String,
        /// `architectures` as written.
        architectures: String,
        /// Each known family and its model types.
        known: String,
    },
    /// Several built-in families list the checkpoint's `model_type`.
    #[error(
        "config.json: field `model_type`: `{model_type}` is a model type of families {families}; \
         say which reads it with --family"
    )]
    AmbiguousFamily {
        /// `model_type`.
        model_type: String,
        /// The families listing it.
        families: String,
    },
    /// `--index-sha256` is not a SHA-256.
    #[error("--index-sha256: {value:?} is not 64 lowercase hex digits")]
    BadIndexSha256 {
        /// What was given.
        value: String,
    },
}

/// The flags that choose the family and the pin.
#[derive(Debug, Clone, Copy, Default)]
pub struct PinFlags<'a> {
    /// A family id or a repo `ORG/NAME`.
    pub target: &'a str,
    /// `--family`.
    pub family: Option<&'a str>,
    /// `--family-file`.
    pub family_file: Option<&'a Path>,
    /// `--revision`.
    pub revision: Option<&'a str>,
    /// `--index-sha256`.
    pub index_sha256: Option<&'a str>,
}

/// The source an install follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceChoice {
    /// `ORG/NAME`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// The expected index hash.
    pub index_pin: IndexPin,
    /// Things the user should know before the install starts.
    pub warnings: Vec<String>,
}

impl PinFlags<'_> {
    /// Whether the target names a repo rather than a family.
    pub fn target_is_repo(&self) -> bool {
        self.target.contains('/')
    }

    /// The family that reads the target: `--family-file`, else `--family`, else the
    /// built-in family the target names.
    pub fn family(&self) -> Result<Family, PinError> {
        self.named_family()?
            .ok_or_else(|| PinError::RepoNeedsFamily {
                target: self.target.to_string(),
                known: family::builtin_ids().join(", "),
            })
    }

    /// [`PinFlags::family`], or `None` for a repo target with no family flag: then
    /// the checkpoint's `config.json` picks it ([`family_for_config`]).
    pub fn named_family(&self) -> Result<Option<Family>, PinError> {
        Ok(Some(match (self.family_file, self.family) {
            (Some(p), _) => Family::from_path(p)?,
            (None, Some(id)) => Family::builtin(id)?,
            (None, None) if !self.target_is_repo() => Family::builtin(self.target)?,
            (None, None) => return Ok(None),
        }))
    }

    /// The repo, revision and index pin `family` reads the target at (see the module
    /// doc).
    pub fn source(&self, family: &Family) -> Result<SourceChoice, PinError> {
        let pin = &family.file.source;
        let repo = if self.target_is_repo() {
            self.target.to_string()
        } else {
            if self.target != family.id() {
                return Err(PinError::NotTheFamily {
                    target: self.target.to_string(),
                    family: family.id().to_string(),
                });
            }
            pin.repo.clone()
        };
        let on_pinned_repo = repo == pin.repo;
        let revision = self
            .revision
            .map(str::to_string)
            .or_else(|| pin.revision.clone().filter(|_| on_pinned_repo))
            .unwrap_or_else(|| "main".to_string());
        let mut warnings = Vec::new();
        let index_pin = match (self.index_sha256, &pin.index_sha256) {
            (Some(h), family_pin) => {
                if !family::is_sha256(h) {
                    return Err(PinError::BadIndexSha256 {
                        value: h.to_string(),
                    });
                }
                if let Some(fp) = family_pin.as_ref().filter(|fp| *fp != h && on_pinned_repo) {
                    warnings.push(format!(
                        "--index-sha256 overrides the pin of {} ({fp})",
                        family.origin
                    ));
                }
                IndexPin::Flag(h.to_string())
            }
            (None, Some(fp)) if on_pinned_repo && Some(&revision) == pin.revision.as_ref() => {
                IndexPin::Family(fp.clone())
            }
            _ => IndexPin::None,
        };
        Ok(SourceChoice {
            repo,
            revision,
            index_pin,
            warnings,
        })
    }
}

/// The built-in family whose `model_types` lists `config.json`'s `model_type` (the
/// key transformers itself dispatches on, `AutoConfig`; `architectures` only names the
/// model class, and one class serves several model types: Kimi-K2's `kimi_k2` is
/// `DeepseekV3ForCausalLM`), with the sentence that says why it was picked.
pub fn family_for_config(config: &serde_json::Value) -> Result<(Family, String), PinError> {
    let model_type = config.get("model_type").and_then(|v| v.as_str());
    let all = Family::all_builtin()?;
    let mut hits: Vec<Family> = all
        .iter()
        .filter(|f| model_type.is_some_and(|m| f.file.model_types.iter().any(|t| t == m)))
        .cloned()
        .collect();
    match (hits.len(), model_type) {
        (1, Some(m)) => {
            let f = hits.remove(0);
            let why = format!(
                "family {} picked by config.json model_type `{m}` (--family names another)",
                f.id()
            );
            Ok((f, why))
        }
        (0, _) | (_, None) => Err(PinError::NoFamilyForConfig {
            model_type: model_type.map_or_else(|| "missing".into(), |m| format!("`{m}`")),
            architectures: config
                .get("architectures")
                .map_or_else(|| "missing".into(), |a| a.to_string()),
            known: all
                .iter()
                .map(|f| format!("{} [{}]", f.id(), f.file.model_types.join(", ")))
                .collect::<Vec<_>>()
                .join(", "),
        }),
        (_, Some(m)) => Err(PinError::AmbiguousFamily {
            model_type: m.to_string(),
            families: hits.iter().map(|f| f.id()).collect::<Vec<_>>().join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "de4b8e4d43b917e7706784d8bb445c9af86a3540";
    const PIN: &str = "99e815241ef03325536b0aaa4441deea45174c17fae31e10f0bb456410c590de";
    const OTHER: &str = "1111111111111111111111111111111111111111111111111111111111111111";

    /// The pins the decisions below are about; fails first if the family file moves.
    fn flash() {
        let f = Family::builtin("qwen38flashnext").unwrap();
        assert_eq!(f.file.source.repo, "Qwen/Qwen3.8-Flash-Next");
        assert_eq!(f.file.source.revision.as_deref(), Some(COMMIT));
        assert_eq!(f.file.source.index_sha256.as_deref(), Some(PIN));
    }

    fn source(flags: PinFlags<'_>) -> Result<SourceChoice, PinError> {
        let family = flags.family()?;
        flags.source(&family)
    }

    #[test]
    fn a_family_target_follows_the_family_commit_and_its_index_pin() {
        flash();
        let flags = PinFlags {
            target: "qwen38flashnext",
            ..Default::default()
        };
        assert_eq!(flags.family().unwrap().id(), "qwen38flashnext");
        assert_eq!(
            source(flags).unwrap(),
            SourceChoice {
                repo: "Qwen/Qwen3.8-Flash-Next".into(),
                revision: COMMIT.into(),
                index_pin: IndexPin::Family(PIN.into()),
                warnings: vec![],
            }
        );
        // Naming the pinned commit itself changes nothing.
        let same = PinFlags {
            revision: Some(COMMIT),
            ..flags
        };
        assert_eq!(source(same).unwrap(), source(flags).unwrap());
    }

    #[test]
    fn another_revision_drops_the_index_pin_made_for_the_pinned_commit() {
        let flags = PinFlags {
            target: "qwen38flashnext",
            revision: Some("main"),
            ..Default::default()
        };
        let s = source(flags).unwrap();
        assert_eq!(s.revision, "main");
        assert_eq!(s.index_pin, IndexPin::None);
        assert!(s.warnings.is_empty());
    }

    #[test]
    fn a_repo_target_reads_main_unpinned_unless_it_is_the_family_repo() {
        let other = PinFlags {
            target: "someone/fork",
            family: Some("qwen38flashnext"),
            ..Default::default()
        };
        let s = source(other).unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str()),
            ("someone/fork", "main")
        );
        assert_eq!(s.index_pin, IndexPin::None);
        // The family's own repo named as a repo: the family's commit and pin apply.
        let own = PinFlags {
            target: "Qwen/Qwen3.8-Flash-Next",
            ..other
        };
        let s = source(own).unwrap();
        assert_eq!(s.revision, COMMIT);
        assert_eq!(s.index_pin, IndexPin::Family(PIN.into()));
    }

    #[test]
    fn index_sha256_overrides_the_pin_with_a_warning_only_when_it_differs() {
        let flags = PinFlags {
            target: "qwen38flashnext",
            index_sha256: Some(OTHER),
            ..Default::default()
        };
        let s = source(flags).unwrap();
        assert_eq!(s.index_pin, IndexPin::Flag(OTHER.into()));
        assert_eq!(
            s.warnings,
            vec![format!(
                "--index-sha256 overrides the pin of families/qwen38flashnext.json ({PIN})"
            )]
        );
        // The same hash as the pin: no warning, still the flag's pin.
        let s = source(PinFlags {
            index_sha256: Some(PIN),
            ..flags
        })
        .unwrap();
        assert_eq!(s.index_pin, IndexPin::Flag(PIN.into()));
        assert!(s.warnings.is_empty());
        // On another repo the family pin is not in play: no warning.
        let s = source(PinFlags {
            target: "someone/fork",
            family: Some("qwen38flashnext"),
            ..flags
        })
        .unwrap();
        assert_eq!(s.index_pin, IndexPin::Flag(OTHER.into()));
        assert!(s.warnings.is_empty());
        // With another revision the flag still pins the index.
        let s = source(PinFlags {
            revision: Some("main"),
            ..flags
        })
        .unwrap();
        assert_eq!(s.index_pin, IndexPin::Flag(OTHER.into()));
    }

    #[test]
    fn a_family_without_pins_reads_main_unpinned() {
        let flags = PinFlags {
            target: "qwen3",
            ..Default::default()
        };
        let s = source(flags).unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str()),
            ("Qwen/Qwen3-0.6B", "main")
        );
        assert_eq!(s.index_pin, IndexPin::None);
    }

    #[test]
    fn config_json_model_type_picks_the_family() {
        let (f, why) = family_for_config(&serde_json::json!({"model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"]}))
        .unwrap();
        assert_eq!(f.id(), "qwen3_moe");
        assert_eq!(
            why,
            "family qwen3_moe picked by config.json model_type `qwen3_moe` (--family names another)"
        );
        let e = family_for_config(&serde_json::json!({"model_type": "bert",
            "architectures": ["BertModel"]}))
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(
                "config.json: field `model_type`: `bert` (architectures [\"BertModel\"]) is not \
                 a model type of any known family ("
            ),
            "{e}"
        );
        assert!(
            e.contains("llama [llama], ") && e.contains("qwen38flashnext [qwen4_exp], "),
            "{e}"
        );
        assert!(e.ends_with("say which family reads it with --family or --family-file"));
        let e = family_for_config(&serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("field `model_type`: missing (architectures missing)"),
            "{e}"
        );
    }

    #[test]
    fn bad_flags_are_refused_with_the_text_users_see() {
        let e = |flags: PinFlags<'_>| source(flags).unwrap_err().to_string();
        assert_eq!(
            e(PinFlags {
                target: "org/name",
                ..Default::default()
            }),
            format!(
                "`org/name` is a repo; say which family reads it with --family (known: {})",
                family::builtin_ids().join(", ")
            )
        );
        assert_eq!(
            e(PinFlags {
                target: "qwen3",
                family: Some("llama"),
                ..Default::default()
            }),
            "target `qwen3` is not a repo (ORG/NAME) and not the family `llama`"
        );
        assert_eq!(
            e(PinFlags {
                target: "qwen38flashnext",
                index_sha256: Some("ABC"),
                ..Default::default()
            }),
            "--index-sha256: \"ABC\" is not 64 lowercase hex digits"
        );
        assert!(
            e(PinFlags {
                target: "nosuchfamily",
                ..Default::default()
            })
            .contains("nosuchfamily"),
        );
    }
}
