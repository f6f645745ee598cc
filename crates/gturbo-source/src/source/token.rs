//! The Hugging Face access token: where it is found, and a type that cannot leak it.
//!
//! [`HfToken`] prints as `HfToken(***)` through both `Debug` and `Display`, so a token
//! held in a config struct cannot reach a log line or an error message by accident; the
//! only way to the secret is [`HfToken::expose`], used where the `Authorization` header is
//! built. Discovery follows the Python client's order (see [`discover`]).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::env;

/// An access token. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct HfToken(String);

impl HfToken {
    /// Wrap a token; surrounding whitespace is trimmed, and an empty token is `None`.
    pub fn new(token: impl AsRef<str>) -> Option<Self> {
        let t = token.as_ref().trim();
        if t.is_empty() {
            None
        } else {
            Some(Self(t.to_string()))
        }
    }

    /// The secret itself, for the `Authorization` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for HfToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HfToken(***)")
    }
}

impl fmt::Display for HfToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HfToken(***)")
    }
}

/// The token from the environment, in the Python client's order: `HF_TOKEN`, else the
/// file named by `HF_TOKEN_PATH`, else `$HF_HOME/token`, else
/// `~/.cache/huggingface/token`. Values are trimmed; an empty value or an unreadable file
/// counts as absent (and the search stops at the first source that is set).
pub fn discover() -> Option<HfToken> {
    discover_from(|k| std::env::var_os(k).map(PathBuf::from), home_dir())
}

fn home_dir() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .or_else(|| std::env::var_os("USERPROFILE"))
        .map(PathBuf::from)
}

/// [`discover`] with the environment and home directory given, for tests.
fn discover_from(var: impl Fn(&str) -> Option<PathBuf>, home: Option<PathBuf>) -> Option<HfToken> {
    if let Some(v) = var(env::HF_TOKEN) {
        return v.to_str().and_then(HfToken::new);
    }
    let file = if let Some(p) = var(env::HF_TOKEN_PATH) {
        p
    } else if let Some(h) = var(env::HF_HOME) {
        h.join("token")
    } else {
        home?.join(".cache").join("huggingface").join("token")
    };
    read_token_file(&file)
}

fn read_token_file(path: &Path) -> Option<HfToken> {
    let text = std::fs::read_to_string(path).ok()?;
    HfToken::new(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_never_prints() {
        let t = HfToken::new("  hf_secretvalue\n").unwrap();
        assert_eq!(t.expose(), "hf_secretvalue");
        assert_eq!(format!("{t:?}"), "HfToken(***)");
        assert_eq!(format!("{t}"), "HfToken(***)");
        assert_eq!(format!("{:?}", Some(t)), "Some(HfToken(***))");
        assert_eq!(HfToken::new(" \n"), None);
    }

    #[test]
    fn discovery_order_follows_the_python_client() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, text).unwrap();
            p
        };
        let path_file = write("explicit/token", "from_path\n");
        let home_file_dir = dir.path().join("hfhome");
        write("hfhome/token", " from_hf_home ");
        write("home/.cache/huggingface/token", "from_home");
        let home = Some(dir.path().join("home"));
        let env = |pairs: Vec<(&'static str, PathBuf)>| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        let got = |pairs: Vec<(&'static str, PathBuf)>| {
            discover_from(env(pairs), home.clone()).map(|t| t.expose().to_string())
        };
        let all = vec![
            (env::HF_TOKEN, PathBuf::from("from_env")),
            (env::HF_TOKEN_PATH, path_file.clone()),
            (env::HF_HOME, home_file_dir.clone()),
        ];
        assert_eq!(got(all.clone()).as_deref(), Some("from_env"));
        assert_eq!(got(all[1..].to_vec()).as_deref(), Some("from_path"));
        assert_eq!(got(all[2..].to_vec()).as_deref(), Some("from_hf_home"));
        assert_eq!(got(vec![]).as_deref(), Some("from_home"));
        assert_eq!(got(vec![(env::HF_TOKEN, PathBuf::from("  "))]), None);
        assert_eq!(
            got(vec![(env::HF_TOKEN_PATH, dir.path().join("missing"))]),
            None
        );
        assert_eq!(discover_from(env(vec![]), None), None);
    }
}
