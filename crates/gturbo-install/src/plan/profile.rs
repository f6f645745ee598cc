//! Quant profiles: which tensors of a BF16 source go at which width and group
//! (`gturbo install --quant int4|int8|bf16|mixed-3-4|mixed-3-6|mixed-4-6|auto`).
//!
//! A profile is data (`profiles/quant.json`, embedded at build time): a default scheme
//! and rules, first match wins, each a set of name fragments, optionally limited to a
//! named set of layers, and the scheme matching tensors get. The mixed profiles are
//! mlx-lm's `mixed_*` quant predicates written as such rules (tests hold them to
//! mlx-lm's own choice, tensor by tensor). The family's policy applies on top: its
//! overrides (routers at INT8) and its `never_quantize_name_contains` (norms), and a
//! matrix whose rows are not whole groups of its scheme stays at its dtype.
//!
//! `auto` is not a profile but a choice among them by the machine's memory: see
//! [`auto_rule`], the one place the rule lives (the install and `gturbo doctor` both
//! call it).

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::family::Family;
use crate::format::Scheme;

/// The profiles file, as shipped.
const PROFILES_JSON: &str = include_str!("../../../../profiles/quant.json");

/// Where the profiles come from (for messages).
pub const PROFILES_FILE: &str = "profiles/quant.json";

/// The profiles file, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfilesFile {
    schema: u32,
    layer_sets: std::collections::BTreeMap<String, LayerSet>,
    profiles: Vec<ProfileSpec>,
}

/// A named set of layers, as fractions of the layer count `n`: `[a, b]` is
/// `floor(a·n/b)`. A layer is in the set when any clause holds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerSet {
    #[allow(dead_code)]
    why: String,
    any: Vec<LayerClause>,
}

/// One clause of a layer set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerClause {
    /// `layer < floor(a·n/b)`.
    #[serde(default)]
    below: Option<[u64; 2]>,
    /// `layer >= floor(a·n/b)`.
    #[serde(default)]
    at_least: Option<[u64; 2]>,
    /// With `every` and `phase`: `(layer − floor(a·n/b)) mod every == phase`
    /// (Euclidean modulo, as Python's `%`).
    #[serde(default)]
    from: Option<[u64; 2]>,
    #[serde(default)]
    every: Option<u64>,
    #[serde(default)]
    phase: Option<u64>,
}

/// One profile, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileSpec {
    id: String,
    summary: String,
    /// A scheme label, or `family` for the family's default scheme.
    default: String,
    #[serde(default)]
    rules: Vec<RuleSpec>,
    /// Whether the family's overrides apply (not for a passthrough reference install).
    #[serde(default = "yes")]
    family_overrides: bool,
}

fn yes() -> bool {
    true
}

/// One rule of a profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    /// The tensor's name contains one of these.
    name_contains: Vec<String>,
    /// And its `{layer}` (0 for a tensor without one, as mlx-lm counts) is in this set.
    #[serde(default)]
    layers: Option<String>,
    /// Then it gets this scheme.
    scheme: Scheme,
}

/// A quant profile, checked.
#[derive(Debug, Clone)]
pub struct Profile {
    spec: ProfileSpec,
    default: Option<Scheme>,
    sets: Vec<Option<LayerSet>>,
}

fn parsed() -> &'static Result<Vec<Profile>, String> {
    static P: OnceLock<Result<Vec<Profile>, String>> = OnceLock::new();
    P.get_or_init(|| parse(PROFILES_JSON))
}

/// Parse and check a profiles file (every layer set a rule names exists, every default
/// is a scheme or `family`, ids are unique and not `auto`).
fn parse(text: &str) -> Result<Vec<Profile>, String> {
    let f: ProfilesFile =
        serde_json::from_str(text).map_err(|e| format!("{PROFILES_FILE}: {e}"))?;
    if f.schema != 1 {
        return Err(format!(
            "{PROFILES_FILE}: field `schema`: {} (expects 1)",
            f.schema
        ));
    }
    for (name, set) in &f.layer_sets {
        for (k, c) in set.any.iter().enumerate() {
            let ok = match (c.below, c.at_least, c.from) {
                (Some(_), None, None) | (None, Some(_), None) => {
                    c.every.is_none() && c.phase.is_none()
                }
                (None, None, Some(_)) => c.every.is_some_and(|e| e > 0) && c.phase.is_some(),
                _ => false,
            };
            let fractions_ok = [c.below, c.at_least, c.from]
                .into_iter()
                .flatten()
                .all(|[_, b]| b > 0);
            if !ok || !fractions_ok {
                return Err(format!(
                    "{PROFILES_FILE}: field `layer_sets.{name}.any[{k}]`: one of `below`, \
                     `at_least`, or `from` with `every` > 0 and `phase`, each [a, b] with b > 0"
                ));
            }
        }
    }
    let mut out: Vec<Profile> = Vec::new();
    for (i, p) in f.profiles.into_iter().enumerate() {
        let at = |field: &str| format!("{PROFILES_FILE}: field `profiles[{i}].{field}`");
        if p.id == AUTO || out.iter().any(|o| o.spec.id == p.id) {
            return Err(format!("{}: `{}` is reserved or repeated", at("id"), p.id));
        }
        let default = match p.default.as_str() {
            "family" => None,
            s => Some(Scheme::parse(s).map_err(|e| format!("{}: {e}", at("default")))?),
        };
        let mut sets = Vec::new();
        for (j, r) in p.rules.iter().enumerate() {
            sets.push(match &r.layers {
                None => None,
                Some(name) => Some(f.layer_sets.get(name).cloned().ok_or_else(|| {
                    format!(
                        "{}: layer set `{name}` is not in `layer_sets`",
                        at(&format!("rules[{j}].layers"))
                    )
                })?),
            });
        }
        out.push(Profile {
            spec: p,
            default,
            sets,
        });
    }
    Ok(out)
}

/// Every shipped profile, in file order.
pub fn all() -> &'static [Profile] {
    match parsed() {
        Ok(p) => p,
        // The file is embedded and checked by a unit test; no profiles is the honest
        // answer should that ever fail (every lookup then names the file).
        Err(_) => &[],
    }
}

/// The shipped profile `id`.
pub fn get(id: &str) -> Result<&'static Profile, String> {
    if let Err(e) = parsed() {
        return Err(e.clone());
    }
    all().iter().find(|p| p.spec.id == id).ok_or_else(|| {
        format!(
            "`{id}` is not a quant profile (expects {}, or {AUTO})",
            ids().join(", ")
        )
    })
}

/// Ids of the shipped profiles.
pub fn ids() -> Vec<&'static str> {
    all().iter().map(|p| p.spec.id.as_str()).collect()
}

fn floor_frac([a, b]: [u64; 2], n: u64) -> u64 {
    a.saturating_mul(n) / b.max(1)
}

impl LayerSet {
    fn contains(&self, layer: u64, n: u64) -> bool {
        self.any.iter().any(|c| {
            if let Some(f) = c.below {
                return layer < floor_frac(f, n);
            }
            if let Some(f) = c.at_least {
                return layer >= floor_frac(f, n);
            }
            match (c.from, c.every, c.phase) {
                (Some(f), Some(every), Some(phase)) => {
                    let d = layer as i128 - floor_frac(f, n) as i128;
                    d.rem_euclid(every as i128) == phase as i128
                }
                _ => false,
            }
        })
    }
}

impl Profile {
    /// Its id (`mixed-3-6`).
    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// One line on what it does.
    pub fn summary(&self) -> &str {
        &self.spec.summary
    }

    /// Whether it needs the layer count (some rule is limited to a layer set).
    pub fn needs_layers(&self) -> bool {
        self.sets.iter().any(Option::is_some)
    }

    /// Whether it has rules (some tensors at another scheme than its default).
    pub fn has_rules(&self) -> bool {
        !self.spec.rules.is_empty()
    }

    /// Whether the family's overrides apply under it.
    pub fn family_overrides(&self) -> bool {
        self.spec.family_overrides
    }

    /// Its default scheme for `family`.
    pub fn default_scheme(&self, family: &Family) -> Scheme {
        self.default.unwrap_or(family.file.quant.default)
    }

    /// Whether it stores everything at the source dtype.
    pub fn is_passthrough(&self, family: &Family) -> bool {
        self.default_scheme(family) == Scheme::Passthrough && self.spec.rules.is_empty()
    }

    /// The scheme its rules give the tensor `name` of layer `layer` (0 when it has none,
    /// as mlx-lm reads the index) in a model of `num_layers` layers, before the family's
    /// policy and the group fit.
    pub fn rule_scheme(&self, family: &Family, name: &str, layer: u64, num_layers: u64) -> Scheme {
        for (r, set) in self.spec.rules.iter().zip(&self.sets) {
            if !r.name_contains.iter().any(|s| name.contains(s.as_str())) {
                continue;
            }
            if set
                .as_ref()
                .is_some_and(|set| !set.contains(layer, num_layers))
            {
                continue;
            }
            return r.scheme;
        }
        self.default_scheme(family)
    }
}

/// `--quant auto`.
pub const AUTO: &str = "auto";

/// What `--quant` asked for: a profile id or `auto` (checked against the shipped
/// profiles when made). A finished plan records the profile it used, never `auto`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct QuantMode(String);

impl Default for QuantMode {
    fn default() -> Self {
        QuantMode("int4".into())
    }
}

impl QuantMode {
    /// `id` if it is a shipped profile or `auto`.
    pub fn new(id: &str) -> Result<QuantMode, String> {
        let id = id.trim().to_ascii_lowercase();
        if id != AUTO {
            get(&id)?;
        }
        Ok(QuantMode(id))
    }

    /// The profile everything-at-source-dtype (`bf16`).
    pub fn bf16() -> QuantMode {
        QuantMode("bf16".into())
    }

    /// The id as given (`int4`, `auto`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is `auto`.
    pub fn is_auto(&self) -> bool {
        self.0 == AUTO
    }

    /// The profile (`None` for `auto`).
    pub fn profile(&self) -> Option<Result<&'static Profile, String>> {
        (!self.is_auto()).then(|| get(&self.0))
    }
}

impl std::fmt::Display for QuantMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The machine's memory, as `auto` sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// Physical memory, in bytes.
    pub ram_bytes: u64,
    /// Where the figure came from (`/proc/meminfo MemTotal`, `GTURBO_TEST_RAM_BYTES`).
    pub ram_source: String,
}

impl Machine {
    /// This machine's memory: `GTURBO_TEST_RAM_BYTES` when set (test-only), else the
    /// OS's figure; `None` when neither is known.
    pub fn detect() -> Result<Option<Machine>, String> {
        let key = crate::env::GTURBO_TEST_RAM_BYTES;
        if let Some(v) = std::env::var_os(key) {
            let v = v.to_string_lossy();
            let ram_bytes = v
                .trim()
                .parse()
                .map_err(|_| format!("{key}={v:?}: not a whole number of bytes"))?;
            return Ok(Some(Machine {
                ram_bytes,
                ram_source: key.into(),
            }));
        }
        Ok(os_ram().map(|(ram_bytes, src)| Machine {
            ram_bytes,
            ram_source: src.into(),
        }))
    }
}

/// Physical memory from the OS.
fn os_ram() -> Option<(u64, &'static str)> {
    if let Ok(text) = std::fs::read_to_string("/proc/meminfo") {
        let kib: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()?;
        return Some((kib * 1024, "/proc/meminfo MemTotal"));
    }
    // macOS and the BSDs.
    let out = std::process::Command::new("sysctl")
        .args(["-n", "hw.memsize"])
        .output()
        .ok()?;
    let n = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some((n, "sysctl hw.memsize"))
}

/// One GiB.
pub const GIB: u64 = 1 << 30;

/// RAM from which `auto` picks INT4.
pub const AUTO_INT4_RAM: u64 = 48 * GIB;
/// RAM from which `auto` picks mixed 3/4 (below it too, as the smallest profile,
/// while the install fits).
pub const AUTO_MIXED_RAM: u64 = 32 * GIB;

/// What `auto` chose, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoChoice {
    /// The profile.
    pub profile: String,
    /// Why, in a sentence.
    pub reason: String,
    /// RAM it was measured against.
    pub ram_bytes: u64,
    /// Where the RAM figure came from.
    pub ram_source: String,
    /// Resident + working-set bytes of the chosen profile's install, when known.
    pub footprint_bytes: Option<u64>,
}

/// `b` bytes for a message: GiB with one decimal from 1 GiB, else MiB.
pub fn gib(b: u64) -> String {
    if b >= GIB {
        format!("{:.1} GiB", b as f64 / GIB as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// The `auto` rule, the one place it lives:
///
/// - RAM ≥ 48 GiB: `int4`; 32–47 GiB: `mixed-3-4`; below 32 GiB: `mixed-3-4` too (the
///   smallest profile `auto` picks).
/// - The chosen profile's install must fit: its resident file plus its working set
///   (the experts one token routes to, `num_experts_per_tok` blobs per expert pool) at
///   most the RAM. When `int4` does not fit, `mixed-3-4` is tried; when that does not
///   fit either, `auto` refuses (name a profile with `--quant` to install anyway).
///
/// `footprint(profile)` gives an install's resident + working-set bytes at a profile
/// (`None` when it cannot be known, e.g. `gturbo doctor` offline: the RAM rule alone
/// then decides, and the reason says so). GPU memory is not part of the rule: wgpu
/// reports no adapter memory size.
pub fn auto_rule(
    machine: &Machine,
    mut footprint: impl FnMut(&str) -> Option<u64>,
) -> Result<AutoChoice, String> {
    let ram = machine.ram_bytes;
    let (candidates, why): (&[&str], String) = if ram >= AUTO_INT4_RAM {
        (
            &["int4", "mixed-3-4"],
            format!("{} RAM is at least 48 GiB", gib(ram)),
        )
    } else if ram >= AUTO_MIXED_RAM {
        (&["mixed-3-4"], format!("{} RAM is 32–47 GiB", gib(ram)))
    } else {
        (
            &["mixed-3-4"],
            format!(
                "{} RAM is below 32 GiB: the smallest profile auto picks",
                gib(ram)
            ),
        )
    };
    let mut too_big = Vec::new();
    for &c in candidates {
        match footprint(c) {
            Some(n) if n > ram => too_big.push(format!("{c} needs {}", gib(n))),
            n => {
                let fit = match n {
                    Some(n) => format!("its resident + working set, {}, fits", gib(n)),
                    None => "the install's size is not known here, so the fit is unchecked".into(),
                };
                let before = if too_big.is_empty() {
                    String::new()
                } else {
                    format!(" ({} > RAM)", too_big.join(", "))
                };
                return Ok(AutoChoice {
                    profile: c.into(),
                    reason: format!("{why}{before}; {fit}"),
                    ram_bytes: ram,
                    ram_source: machine.ram_source.clone(),
                    footprint_bytes: n,
                });
            }
        }
    }
    Err(format!(
        "--quant auto: no profile fits this machine's {} RAM ({}): {}; name one with --quant \
         to install anyway, or use a machine with more memory",
        gib(ram),
        machine.ram_source,
        too_big.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(gib_: u64) -> Machine {
        Machine {
            ram_bytes: gib_ * GIB,
            ram_source: "test".into(),
        }
    }

    #[test]
    fn the_shipped_profiles_parse() {
        let ids = ids();
        assert_eq!(
            ids,
            [
                "int4",
                "int8",
                "bf16",
                "mixed-3-4",
                "mixed-3-6",
                "mixed-4-6"
            ]
        );
        assert!(get("mixed-3-6").unwrap().needs_layers());
        assert!(!get("int4").unwrap().needs_layers());
        assert!(QuantMode::new("auto").unwrap().is_auto());
        assert_eq!(
            QuantMode::new("int5").unwrap_err(),
            "`int5` is not a quant profile (expects int4, int8, bf16, mixed-3-4, mixed-3-6, mixed-4-6, or auto)"
        );
    }

    /// mlx-lm's use_more_bits, as Python computes it, for every layer count to 64.
    #[test]
    fn more_bits_is_mlx_lms_use_more_bits() {
        let f: ProfilesFile = serde_json::from_str(PROFILES_JSON).unwrap();
        let set = &f.layer_sets["more_bits"];
        for n in 1..=64i64 {
            for i in 0..n {
                let py = i < n / 8 || i >= 7 * n / 8 || (i - n / 8).rem_euclid(3) == 2;
                assert_eq!(set.contains(i as u64, n as u64), py, "layer {i} of {n}");
            }
        }
    }

    #[test]
    fn bad_profile_files_are_refused_naming_the_field() {
        let e = parse(r#"{"schema":1,"layer_sets":{},"profiles":[{"id":"x","summary":"","default":"int4_g64","rules":[{"name_contains":["a"],"layers":"nope","scheme":"int4_g64"}]}]}"#).unwrap_err();
        assert!(
            e.contains("profiles[0].rules[0].layers") && e.contains("nope"),
            "{e}"
        );
        let e = parse(r#"{"schema":1,"layer_sets":{},"profiles":[{"id":"auto","summary":"","default":"int4_g64"}]}"#).unwrap_err();
        assert!(e.contains("profiles[0].id"), "{e}");
        let e = parse(
            r#"{"schema":1,"layer_sets":{"s":{"why":"","any":[{"from":[1,8]}]}},"profiles":[]}"#,
        )
        .unwrap_err();
        assert!(e.contains("layer_sets.s.any[0]"), "{e}");
    }

    #[test]
    fn auto_follows_the_ram_rule_at_its_boundaries() {
        let none = |_: &str| None;
        let pick = |r: Result<AutoChoice, String>| r.unwrap().profile;
        assert_eq!(pick(auto_rule(&m(48), none)), "int4");
        assert_eq!(pick(auto_rule(&m(47), none)), "mixed-3-4");
        let just_under = Machine {
            ram_bytes: AUTO_INT4_RAM - 1,
            ram_source: "t".into(),
        };
        assert_eq!(pick(auto_rule(&just_under, none)), "mixed-3-4");
        assert_eq!(pick(auto_rule(&m(32), none)), "mixed-3-4");
        let low = auto_rule(&m(16), none).unwrap();
        assert_eq!(low.profile, "mixed-3-4");
        assert!(low.reason.contains("below 32 GiB"), "{}", low.reason);
        // int4 does not fit 48 GiB: mixed 3/4 does.
        let r = auto_rule(&m(48), |p| {
            Some(if p == "int4" { 49 * GIB } else { 40 * GIB })
        })
        .unwrap();
        assert_eq!(r.profile, "mixed-3-4");
        assert!(r.reason.contains("int4 needs 49.0 GiB"), "{}", r.reason);
        // Exactly the RAM fits.
        assert_eq!(pick(auto_rule(&m(64), |_| Some(64 * GIB))), "int4");
        // Nothing fits.
        let e = auto_rule(&m(32), |_| Some(33 * GIB)).unwrap_err();
        assert!(
            e.contains("no profile fits") && e.contains("mixed-3-4 needs 33.0 GiB"),
            "{e}"
        );
    }
}
