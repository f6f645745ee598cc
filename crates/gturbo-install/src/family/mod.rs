//! Family files: the data that says what a model family's tensors are and where they go.
//!
//! A family (`families/<id>.json`, embedded at build time; `--family-file` loads one
//! from disk) names its source pin, how `config.json` maps to architecture axes, a
//! list of tensor rules (pattern → role), the quantization policy and its sidecars.
//! Adding a family whose tensors fit the existing roles needs no Rust code.
//!
//! # Patterns
//! Rules match whole tensor names. Literal text matches itself; `*` matches one
//! dot-free segment; `**` matches anything (one character or more); `{layer}`,
//! `{expert}` and `{shard}` capture a decimal number; `{name:a|b}` captures one of
//! the alternatives; `{a|b}` matches one of them without capturing. The first rule
//! that matches wins; a tensor no rule matches is an error, never dropped.

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::format::Scheme;

pub use crate::format::axes;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/families.rs"));
}

/// Largest family file accepted from disk.
const MAX_FAMILY_FILE: u64 = 4 << 20;

/// A family file, as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FamilyFile {
    /// Schema version of the family file format (1).
    pub schema: u32,
    /// Family id, also the file stem.
    pub id: String,
    /// Human name.
    pub name: String,
    /// Default source and its pins.
    pub source: SourcePin,
    /// `model_type` values in `config.json` this family accepts.
    pub model_types: Vec<String>,
    /// Key of the nested text config inside `config.json` (multimodal wrappers).
    #[serde(default)]
    pub config_root: Option<String>,
    /// Architecture axes.
    pub arch: ArchSpec,
    /// Tensor rules, first match wins.
    pub tensors: Vec<TensorRule>,
    /// Quantization policy.
    pub quant: QuantPolicy,
    /// Optional parts that flags can drop (e.g. the MTP draft layer).
    #[serde(default)]
    pub sidecars: BTreeMap<String, Sidecar>,
    /// A tokenizer the repos ship as a tiktoken BPE file instead of a `tokenizer.json`
    /// (Kimi-K2), converted at install ([`crate::tiktoken`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiktoken: Option<crate::tiktoken::TiktokenSpec>,
    /// Files beside the weights that this family's tokenizer is made of, copied into
    /// `tokenizer/` and verified like the standard ones when the repo has them (Kimi-K2
    /// ships `tiktoken.model` and the Python class that reads it instead of a
    /// `tokenizer.json`). Plain file names at the repo's top level.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokenizer_files: Vec<String>,
}

/// Where a family's reference checkpoint lives.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourcePin {
    /// `org/name` on the hub.
    pub repo: String,
    /// Pinned 40-hex commit, when the family pins one.
    pub revision: Option<String>,
    /// Pinned SHA-256 of `model.safetensors.index.json` at that commit.
    pub index_sha256: Option<String>,
}

/// How `config.json` maps to architecture axes.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchSpec {
    /// Axis name → config key under `config_root`; a key ending in `?` is optional, a
    /// dotted key (`rope_parameters.rope_theta`) reads a nested object's field.
    pub axes: BTreeMap<String, String>,
    /// Capabilities a runner must implement to run this family.
    pub required_axes: Vec<String>,
}

/// What a matched tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Lives in the resident weights file.
    Resident,
    /// Fused routed experts of one layer: `gate_up_proj [E, 2I, H]` or `down_proj [E, H, I]`
    /// (needs `{layer}` and `{part}`).
    ExpertsFused,
    /// One routed expert's projection (needs `{layer}`, `{expert}` and `{part}`).
    Expert,
    /// One projection of every routed expert of a layer, stacked as MLX stores them:
    /// `gate_proj`/`up_proj [E, I, H]`, `down_proj [E, H, I]` (needs `{layer}` and
    /// `{part}`).
    ExpertsStacked,
    /// One shard of a row-lookup table `[rows, width]` (needs `{layer}`; `{shard}` optional).
    Rows,
    /// Not installed (e.g. a vision tower); counted in the plan.
    Excluded,
}

/// One tensor rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRule {
    /// Name pattern (see the module doc).
    #[serde(rename = "match")]
    pub pattern: String,
    /// Role of matching tensors.
    pub role: Role,
    /// Sidecar this tensor belongs to (dropped when the sidecar is skipped; its experts
    /// go to an auxiliary pool).
    #[serde(default)]
    pub sidecar: Option<String>,
    /// Row pool name for `rows` (file `ple/layer_NN_<pool>.bin`).
    #[serde(default)]
    pub pool: Option<String>,
    /// Why a tensor is excluded.
    #[serde(default)]
    pub why: Option<String>,
    /// Expert part names of this checkpoint mapped to the pool's parts
    /// ([`EXPERT_PARTS`]): Mixtral's `{"w1": "gate_proj", "w3": "up_proj", "w2":
    /// "down_proj"}`. A part not listed keeps its own name.
    #[serde(default)]
    pub parts: BTreeMap<String, String>,
    /// For a fused `gate_up_proj` (`experts_fused`): its rows alternate gate, up (row
    /// `2i` is gate row `i`, `2i + 1` up row `i`: gpt-oss, MLX-LM `gpt_oss.py`
    /// `sanitize`), instead of all gate rows then all up rows.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gate_up_interleaved: bool,
    /// For `experts_fused`: each expert's matrix is stored transposed, `[E, in, out]`
    /// (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`), a `gate_up_proj`'s out axis
    /// interleaving gate and up (even columns gate, odd up): transformers' gpt-oss
    /// layout (`GptOssExperts`, `is_transposed=True`). The install writes the pool's
    /// `[I, H]` gate and up and `[H, I]` down from it.
    #[serde(default)]
    pub transposed: bool,
}

/// The expert part names the planner knows: one expert's `gate_proj`, `up_proj` and
/// `down_proj` (or stacked over the experts of a layer), or the fused `gate_up_proj`.
pub const EXPERT_PARTS: [&str; 4] = ["gate_proj", "up_proj", "down_proj", "gate_up_proj"];

impl TensorRule {
    /// The pool part a captured `{part:…}` name stands for.
    pub fn part<'a>(&'a self, captured: &'a str) -> &'a str {
        self.parts.get(captured).map_or(captured, String::as_str)
    }
}

/// Quantization policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantPolicy {
    /// Scheme for eligible tensors (BF16 2-D `.weight` with last dim % 64 == 0, routed
    /// experts, and row tables whose width is a multiple of 64).
    pub default: Scheme,
    /// Names containing any of these stay at their source dtype.
    #[serde(default)]
    pub never_quantize_name_contains: Vec<String>,
    /// Per-pattern scheme overrides (first match wins).
    #[serde(default)]
    pub overrides: Vec<QuantOverride>,
    /// Whether `gturbo run` needs a recorded quality result (`gturbo eval --record`)
    /// before it runs a quantized install of the family; written into the manifest as
    /// `quantized_at_install.quality_gate.required_for_run` (FORMAT.md, "quality.json").
    #[serde(default)]
    pub run_requires_recorded_quality: bool,
}

/// One quantization override.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantOverride {
    /// Name pattern.
    #[serde(rename = "match")]
    pub pattern: String,
    /// Scheme for matching tensors.
    pub scheme: Scheme,
    /// Why.
    #[serde(default)]
    pub why: Option<String>,
}

/// An optional part of the checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sidecar {
    /// What it is, for humans.
    pub what: String,
    /// `carry` or `skip` by default ([`SIDECAR_DEFAULTS`]): `--skip-<name>` drops a
    /// carried one, `--keep-<name>` keeps a skipped one.
    pub default: String,
    /// The install flag that changes the default (documentation).
    pub skip_flag: String,
    /// Decoder layers numbered at or past this axis's value belong to the sidecar,
    /// whatever rule matched them: DeepSeek-V3's and GLM-4.5's NextN layers are
    /// `model.layers.{num_hidden_layers}.*` beside the main layers (MLX-LM's
    /// `glm4_moe.py` `sanitize` drops `model.layers.{num_hidden_layers}`; its
    /// `deepseek_v3.py` builds only `range(num_hidden_layers)`).
    #[serde(default)]
    pub from_layer_axis: Option<String>,
}

/// The values of a sidecar's `default`: carried unless `--skip-<name>`, or skipped
/// unless `--keep-<name>`.
pub const SIDECAR_DEFAULTS: [&str; 2] = ["carry", "skip"];

impl Sidecar {
    /// Whether the install drops it unless asked to keep it.
    pub fn skipped_by_default(&self) -> bool {
        self.default == SIDECAR_DEFAULTS[1]
    }
}

/// A family file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FamilyError {
    /// No such family id.
    #[error("unknown family `{id}`; known families: {known}")]
    Unknown {
        /// Asked-for id.
        id: String,
        /// Known ids.
        known: String,
    },
    /// The file does not parse or is inconsistent.
    #[error("{file}: field `{field}`: {detail}")]
    Invalid {
        /// Family file.
        file: String,
        /// Field.
        field: String,
        /// What is wrong.
        detail: String,
    },
}

/// A compiled pattern.
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    regex: Regex,
}

/// Captures of a matched name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Captures {
    /// `{layer}`.
    pub layer: Option<u64>,
    /// `{expert}`.
    pub expert: Option<u64>,
    /// `{shard}`.
    pub shard: Option<u64>,
    /// `{part:...}`.
    pub part: Option<String>,
}

impl Pattern {
    /// Compile a pattern; errors name the pattern and the problem.
    pub fn compile(pattern: &str) -> Result<Pattern, String> {
        let mut re = String::from("^");
        let mut chars = pattern.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '*' => {
                    if chars.peek() == Some(&'*') {
                        chars.next();
                        re.push_str(".+");
                    } else {
                        re.push_str("[^.]+");
                    }
                }
                '{' => {
                    let mut body = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(ch) => body.push(ch),
                            None => return Err(format!("unclosed `{{` in `{pattern}`")),
                        }
                    }
                    match body.as_str() {
                        "layer" | "expert" | "shard" => {
                            re.push_str(&format!("(?P<{body}>[0-9]{{1,9}})"));
                        }
                        _ => {
                            let (name, alts) = match body.split_once(':') {
                                Some((name, alts)) => (Some(name), alts),
                                None if body.contains('|') => (None, body.as_str()),
                                None => (Some(body.as_str()), ""),
                            };
                            if let Some(other) = name.filter(|n| *n != "part") {
                                return Err(format!(
                                    "unknown capture `{other}` (known: layer, expert, shard, part)"
                                ));
                            }
                            if alts.is_empty() || alts.split('|').any(str::is_empty) {
                                return Err(format!("empty alternative in `{{{body}}}`"));
                            }
                            let alts: Vec<String> = alts.split('|').map(regex::escape).collect();
                            match name {
                                Some(_) => re.push_str(&format!("(?P<part>{})", alts.join("|"))),
                                _ => re.push_str(&format!("(?:{})", alts.join("|"))),
                            }
                        }
                    }
                }
                _ => re.push_str(&regex::escape(&c.to_string())),
            }
        }
        re.push('$');
        let regex = Regex::new(&re).map_err(|e| format!("`{pattern}`: {e}"))?;
        Ok(Pattern {
            source: pattern.to_string(),
            regex,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Match a whole name.
    pub fn matches(&self, name: &str) -> Option<Captures> {
        let caps = self.regex.captures(name)?;
        let num = |k: &str| caps.name(k).and_then(|m| m.as_str().parse::<u64>().ok());
        Some(Captures {
            layer: num("layer"),
            expert: num("expert"),
            shard: num("shard"),
            part: caps.name("part").map(|m| m.as_str().to_string()),
        })
    }
}

/// A loaded, validated family with compiled patterns.
#[derive(Debug, Clone)]
pub struct Family {
    /// The file as written.
    pub file: FamilyFile,
    /// Where it came from (`families/<id>.json` or a path).
    pub origin: String,
    rules: Vec<Pattern>,
    overrides: Vec<Pattern>,
}

/// A matched rule.
#[derive(Debug, Clone)]
pub struct RuleMatch<'a> {
    /// The rule.
    pub rule: &'a TensorRule,
    /// Its index in the family's list.
    pub index: usize,
    /// Captured values.
    pub captures: Captures,
}

/// The compiled `tensors[*].match` patterns of `file`, each rule checked: the captures
/// its role needs, its expert parts, its sidecar declared.
fn tensor_rules(
    file: &FamilyFile,
    invalid: &dyn Fn(&str, String) -> FamilyError,
) -> Result<Vec<Pattern>, FamilyError> {
    let mut rules = Vec::with_capacity(file.tensors.len());
    for (i, rule) in file.tensors.iter().enumerate() {
        let field = format!("tensors[{i}].match");
        let p = Pattern::compile(&rule.pattern).map_err(|e| invalid(&field, e))?;
        let needs: &[&str] = match rule.role {
            Role::ExpertsFused | Role::ExpertsStacked => &["{layer}", "{part:"],
            Role::Expert => &["{layer}", "{expert}", "{part:"],
            Role::Rows => &["{layer}"],
            Role::Resident | Role::Excluded => &[],
        };
        for n in needs {
            if !rule.pattern.contains(n) {
                return Err(invalid(
                    &field,
                    format!("role {:?} needs a `{n}…` capture", rule.role),
                ));
            }
        }
        if rule.transposed && rule.role != Role::ExpertsFused {
            return Err(invalid(
                &format!("tensors[{i}].transposed"),
                format!(
                    "only experts_fused rules are transposed, not {:?}",
                    rule.role
                ),
            ));
        }
        if let Some((from, to)) = rule
            .parts
            .iter()
            .find(|(_, to)| !EXPERT_PARTS.contains(&to.as_str()))
        {
            return Err(invalid(
                &format!("tensors[{i}].parts.{from}"),
                format!(
                    "{to:?} is not an expert part (one of {})",
                    EXPERT_PARTS.join(", ")
                ),
            ));
        }
        if let Some(s) = &rule.sidecar
            && !file.sidecars.contains_key(s)
        {
            return Err(invalid(
                &format!("tensors[{i}].sidecar"),
                format!("sidecar `{s}` is not declared in `sidecars`"),
            ));
        }
        rules.push(p);
    }
    Ok(rules)
}

impl Family {
    /// Parse and validate a family file.
    pub fn parse(origin: &str, text: &str) -> Result<Family, FamilyError> {
        let invalid = |field: &str, detail: String| FamilyError::Invalid {
            file: origin.to_string(),
            field: field.to_string(),
            detail,
        };
        let file: FamilyFile = serde_json::from_str(text).map_err(|e| {
            invalid(
                "(document)",
                format!("{e} (line {}, column {})", e.line(), e.column()),
            )
        })?;
        if file.schema != 1 {
            return Err(invalid(
                "schema",
                format!("version {} is not supported (1)", file.schema),
            ));
        }
        if file.id.is_empty()
            || !file
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(invalid(
                "id",
                format!("{:?} is not a plain identifier", file.id),
            ));
        }
        if let Some(rev) = &file.source.revision
            && !is_commit(rev)
        {
            return Err(invalid(
                "source.revision",
                format!("{rev:?} is not a 40-hex commit"),
            ));
        }
        if let Some(h) = &file.source.index_sha256
            && !is_sha256(h)
        {
            return Err(invalid(
                "source.index_sha256",
                format!("{h:?} is not 64 lowercase hex digits"),
            ));
        }
        let rules = tensor_rules(&file, &invalid)?;
        for (i, f) in file.tokenizer_files.iter().enumerate() {
            let plain = !f.is_empty()
                && f != "."
                && f != ".."
                && !f.contains(['/', '\\'])
                && !f.chars().any(char::is_control);
            if !plain {
                return Err(invalid(
                    &format!("tokenizer_files[{i}]"),
                    format!("{f:?} is not a plain file name at the repo's top level"),
                ));
            }
        }
        for (name, sc) in &file.sidecars {
            if !SIDECAR_DEFAULTS.contains(&sc.default.as_str()) {
                return Err(invalid(
                    &format!("sidecars.{name}.default"),
                    format!(
                        "{:?} is not one of {}",
                        sc.default,
                        SIDECAR_DEFAULTS.join(", ")
                    ),
                ));
            }
        }
        let mut overrides = Vec::new();
        for (i, o) in file.quant.overrides.iter().enumerate() {
            overrides.push(
                Pattern::compile(&o.pattern)
                    .map_err(|e| invalid(&format!("quant.overrides[{i}].match"), e))?,
            );
        }
        Ok(Family {
            file,
            origin: origin.to_string(),
            rules,
            overrides,
        })
    }

    /// Load an embedded family by id.
    pub fn builtin(id: &str) -> Result<Family, FamilyError> {
        for (name, text) in embedded::EMBEDDED {
            if name.strip_suffix(".json") == Some(id) {
                return Family::parse(&format!("families/{name}"), text);
            }
        }
        Err(FamilyError::Unknown {
            id: id.to_string(),
            known: builtin_ids().join(", "),
        })
    }

    /// Load a family file from disk.
    pub fn from_path(path: &Path) -> Result<Family, FamilyError> {
        let origin = path.display().to_string();
        let io = |e: std::io::Error| FamilyError::Invalid {
            file: origin.clone(),
            field: "(file)".into(),
            detail: e.to_string(),
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_FAMILY_FILE {
            return Err(FamilyError::Invalid {
                file: origin,
                field: "(file)".into(),
                detail: format!("{len} bytes, over the {MAX_FAMILY_FILE} byte limit"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        Family::parse(&origin, &text)
    }

    /// Every embedded family, in id order.
    pub fn all_builtin() -> Result<Vec<Family>, FamilyError> {
        embedded::EMBEDDED
            .iter()
            .map(|(name, text)| Family::parse(&format!("families/{name}"), text))
            .collect()
    }

    /// Family id.
    pub fn id(&self) -> &str {
        &self.file.id
    }

    /// The first rule matching `name`, else the first matching its normalised form
    /// ([`normalise_prefix`]), with the name the tensor is installed under.
    pub fn classify_normalised<'n>(
        &self,
        name: &'n str,
    ) -> Option<(RuleMatch<'_>, std::borrow::Cow<'n, str>)> {
        if let Some(m) = self.classify(name) {
            return Some((m, name.into()));
        }
        let alt = normalise_prefix(name)?;
        self.classify(&alt).map(|m| (m, alt.into()))
    }

    /// The first rule matching `name`.
    pub fn classify(&self, name: &str) -> Option<RuleMatch<'_>> {
        self.rules.iter().enumerate().find_map(|(index, p)| {
            p.matches(name).map(|captures| RuleMatch {
                rule: &self.file.tensors[index],
                index,
                captures,
            })
        })
    }

    /// The override scheme for `name`, if a quantization override matches it.
    pub fn quant_override(&self, name: &str) -> Option<Scheme> {
        self.overrides
            .iter()
            .zip(&self.file.quant.overrides)
            .find(|(p, _)| p.matches(name).is_some())
            .map(|(_, o)| o.scheme)
    }

    /// The sidecar a tensor of decoder layer `layer` belongs to by its number (the
    /// first sidecar whose `from_layer_axis` value `layer` reaches), given the
    /// config's axes.
    pub fn layer_sidecar(
        &self,
        layer: Option<u64>,
        axes: &BTreeMap<String, serde_json::Value>,
    ) -> Option<&str> {
        let layer = layer?;
        self.file.sidecars.iter().find_map(|(name, sc)| {
            let from = axes.get(sc.from_layer_axis.as_ref()?)?.as_u64()?;
            (layer >= from).then_some(name.as_str())
        })
    }

    /// Whether the policy keeps `name` at its source dtype by name (norms, convs).
    pub fn never_quantize(&self, name: &str) -> bool {
        self.file
            .quant
            .never_quantize_name_contains
            .iter()
            .any(|s| name.contains(s.as_str()))
    }
}

/// The text model's name for a tensor a multimodal wrapper prefixes:
/// `language_model.model.X` and `model.language_model.X` are `model.X`, and
/// `language_model.lm_head.weight` is `lm_head.weight` (mlx-lm and transformers write
/// both forms). `None` when `name` has neither prefix. Families name the text model's
/// tensors; a rule for a prefixed name (Flash-Next's) matches before this is tried.
pub fn normalise_prefix(name: &str) -> Option<String> {
    for prefix in ["language_model.model.", "model.language_model."] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return Some(format!("model.{rest}"));
        }
    }
    name.strip_prefix("language_model.")
        .filter(|rest| rest.starts_with("lm_head."))
        .map(str::to_string)
}

/// Ids of the embedded families.
pub fn builtin_ids() -> Vec<String> {
    embedded::EMBEDDED
        .iter()
        .filter_map(|(n, _)| n.strip_suffix(".json").map(str::to_string))
        .collect()
}

/// Pins are written as the format writes digests: lowercase hex.
pub use crate::format::digest::{is_commit, is_sha256};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_family_parses() {
        let all = Family::all_builtin().unwrap();
        let ids: Vec<&str> = all.iter().map(|f| f.id()).collect();
        assert_eq!(
            ids,
            [
                "deepseek_v3",
                "glm4_moe",
                "gpt_oss",
                "llama",
                "minimax_m2",
                "mixtral",
                "qwen3",
                "qwen38flashnext",
                "qwen3_moe",
                "qwen3_next"
            ]
        );
        for f in &all {
            assert_eq!(format!("families/{}.json", f.id()), f.origin);
        }
    }

    #[test]
    fn patterns_capture_layers_experts_and_parts() {
        let p = Pattern::compile(
            "model.layers.{layer}.mlp.experts.{expert}.{part:gate_proj|up_proj|down_proj}.weight",
        )
        .unwrap();
        let c = p
            .matches("model.layers.12.mlp.experts.511.down_proj.weight")
            .unwrap();
        assert_eq!(
            (c.layer, c.expert, c.part.as_deref()),
            (Some(12), Some(511), Some("down_proj"))
        );
        assert!(
            p.matches("model.layers.12.mlp.experts.511.down_proj.bias")
                .is_none()
        );
        assert!(
            p.matches("xmodel.layers.1.mlp.experts.1.up_proj.weight")
                .is_none()
        );
        let star = Pattern::compile("a.*.c").unwrap();
        assert!(star.matches("a.b.c").is_some());
        assert!(star.matches("a.b.x.c").is_none());
        let deep = Pattern::compile("model.visual.**").unwrap();
        assert!(
            deep.matches("model.visual.blocks.3.attn.qkv.weight")
                .is_some()
        );
        assert!(deep.matches("model.visual.").is_none());
    }

    #[test]
    fn flash_next_rules_classify_reference_names() {
        let f = Family::builtin("qwen38flashnext").unwrap();
        let role = |n: &str| f.classify(n).map(|m| m.rule.role);
        assert_eq!(
            role("model.language_model.layers.7.mlp.experts.gate_up_proj"),
            Some(Role::ExpertsFused)
        );
        assert_eq!(
            role("mtp.layers.0.mlp.experts.down_proj"),
            Some(Role::ExpertsFused)
        );
        assert_eq!(
            f.classify("mtp.layers.0.mlp.experts.down_proj")
                .unwrap()
                .rule
                .sidecar
                .as_deref(),
            Some("mtp")
        );
        let rows = f
            .classify(
                "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_127.weight",
            )
            .unwrap();
        assert_eq!(
            (rows.rule.role, rows.captures.layer, rows.captures.shard),
            (Role::Rows, Some(1), Some(127))
        );
        assert_eq!(
            role("model.visual.blocks.0.attn.qkv.weight"),
            Some(Role::Excluded)
        );
        assert_eq!(
            role("model.language_model.layers.3.self_attn.indexer.index_qk_proj.weight"),
            Some(Role::Resident)
        );
        assert_eq!(
            role("model.language_model.layers.3.self_attn.surprise.weight"),
            None
        );
        assert_eq!(
            f.quant_override("model.language_model.layers.0.mlp.gate.weight"),
            Some(Scheme::Int8G64)
        );
        assert_eq!(
            f.quant_override("model.language_model.layers.0.mlp.gate_proj.weight"),
            None
        );
        assert!(f.never_quantize("model.language_model.layers.0.linear_attn.conv1d.weight"));
    }

    #[test]
    fn bad_family_files_name_the_field() {
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../families/qwen3.json"
        ))
        .unwrap();
        let cases = [
            (
                base.replace("\"role\": \"resident\"", "\"role\": \"teleport\""),
                "field `(document)`: unknown variant `teleport`",
            ),
            (
                base.replace(
                    "model.layers.{layer}.self_attn",
                    "model.layers.{layr}.self_attn",
                ),
                "field `tensors[0].match`: unknown capture",
            ),
            (
                base.replace("\"schema\": 1", "\"schema\": 9"),
                "field `schema`: version 9",
            ),
            (
                base.replace("\"revision\": null", "\"revision\": \"main\""),
                "field `source.revision`: \"main\" is not a 40-hex commit",
            ),
        ];
        for (text, want) in cases {
            let err = Family::parse("families/x.json", &text)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("families/x.json: "), "{err}");
            assert!(err.contains(want), "want {want:?} in {err}");
        }
        let err = Family::builtin("nope").unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown family `nope`; known families: deepseek_v3, glm4_moe, gpt_oss, llama, minimax_m2, mixtral, \
             qwen3, qwen38flashnext, qwen3_moe, qwen3_next"
        );
    }

    /// A NextN layer (`model.layers.{num_hidden_layers}`) belongs to the family's
    /// `mtp` sidecar by its number; a sidecar default other than carry/skip is refused.
    #[test]
    fn nextn_layers_belong_to_the_mtp_sidecar_by_number() {
        let glm = Family::builtin("glm4_moe").unwrap();
        assert!(glm.file.sidecars["mtp"].skipped_by_default());
        let axes: BTreeMap<String, serde_json::Value> =
            [("num_layers".to_string(), serde_json::json!(46))].into();
        assert_eq!(glm.layer_sidecar(Some(46), &axes), Some("mtp"));
        assert_eq!(glm.layer_sidecar(Some(45), &axes), None);
        assert_eq!(glm.layer_sidecar(None, &axes), None);
        assert_eq!(glm.layer_sidecar(Some(46), &BTreeMap::new()), None);
        let next = Family::builtin("qwen3_next").unwrap();
        let m = next
            .classify("mtp.layers.0.mlp.experts.3.up_proj.weight")
            .unwrap();
        assert_eq!(
            (m.rule.role, m.rule.sidecar.as_deref()),
            (Role::Expert, Some("mtp"))
        );
        assert_eq!(
            next.classify("mtp.fc.weight")
                .unwrap()
                .rule
                .sidecar
                .as_deref(),
            Some("mtp")
        );
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../families/glm4_moe.json"
        ))
        .unwrap();
        let bad = base.replace("\"default\": \"skip\"", "\"default\": \"drop\"");
        let err = Family::parse("families/x.json", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("field `sidecars.mtp.default`: \"drop\" is not one of carry, skip"),
            "{err}"
        );
    }

    /// A tensor rule's `parts` map names the checkpoint's expert parts after the pool's
    /// (`w1` → `gate_proj`); a target that is not a pool part is refused naming the key.
    #[test]
    fn expert_part_names_map_to_the_pools_parts() {
        let mixtral = Family::builtin("mixtral").unwrap();
        let rule = &mixtral.file.tensors[0];
        assert_eq!(
            ["w1", "w3", "w2", "w4"].map(|p| rule.part(p)),
            ["gate_proj", "up_proj", "down_proj", "w4"]
        );
        let base = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../families/mixtral.json"
        ))
        .unwrap();
        let bad = base.replace("\"w2\": \"down_proj\"", "\"w2\": \"down\"");
        let err = Family::parse("families/x.json", &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("field `tensors[0].parts.w2`: \"down\" is not an expert part"),
            "{err}"
        );
    }
}
