//! DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention
//! (`layers::mla`), YaRN RoPE on the rope parts in the interleaved layout, the first
//! `first_k_dense_replace` layers dense SwiGLU MLPs and the others routed experts beside
//! an ungated shared expert. The router is transformers' `DeepseekV3TopkRouter`:
//! f32 logits, `sigmoid` scores, the choice on the scores plus
//! `e_score_correction_bias` (kept f32) limited to the `topk_group` best of `n_group`
//! groups, the weights the unbiased scores renormalised (`norm_topk_prob`, with its
//! `+1e-20`) and times `routed_scaling_factor` (`kernels::routing`).
//!
//! A field the config omits takes transformers' `DeepseekV3Config` default
//! ([`DEFAULTS`]), except `q_lora_rank`: the axes read null as absent, and V2-Lite-style
//! configs write `"q_lora_rank": null` for a plain `q_proj`, so absent means plain.

use crate::format::manifest::{self, Manifest};
use crate::runtime::error::{InputError, RunError};
use crate::runtime::generate::{LanguageModel, Stat};
use crate::runtime::kernels::{Backend, FloatDtype, Matrix, NormGain, Ops};
use crate::runtime::layers::axes::{Axes, axis_err};
use crate::runtime::layers::head::OutputHead;
use crate::runtime::layers::mla::{Absorbed, KvLayout, Mla, MlaDims, MlaStep, Query};
use crate::runtime::layers::mlp::{SharedExpert, SwiGlu};
use crate::runtime::layers::moe::{
    Ffn, MoeBlock, MoeStack, RoutedExperts, SigmoidDefaults, expert_slots,
};
use crate::runtime::layers::rope::{Layout, RopeSpec};
use crate::runtime::load::Install;
use crate::runtime::models::state::{self, SessionData};

use super::decoder::{context_length, expert_pool};

/// The runner reads integer axes below 2^32.
const AXIS_BELOW: u64 = 1 << 32;
/// transformers' `DeepseekV3Config` default `rms_norm_eps`.
pub const EPS: f64 = 1e-6;
/// The defaults of transformers 5.24's `DeepseekV3Config` for the MoE fields (and
/// `rope_interleave` true, set in [`Config::from_manifest`]).
pub const DEFAULTS: SigmoidDefaults = SigmoidDefaults {
    norm_topk_prob: true,
    n_group: 8,
    topk_group: 4,
    routed_scaling_factor: 2.5,
    n_shared_experts: 1,
    first_k_dense_replace: 3,
};
/// The `model_type`s this model runs (Kimi-K2 is DeepSeek-V3's architecture).
pub const MODEL_TYPES: [&str; 2] = ["deepseek_v3", "kimi_k2"];
/// Bytes of one cached f32 value.
const F32_BYTES: usize = 4;

/// Architecture numbers read from the manifest's `arch.axes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Decoder layers.
    pub layers: usize,
    /// The attention's shape.
    pub mla: MlaDims,
    /// Dense MLP width (`intermediate_size`) of the first layers.
    pub intermediate: usize,
    /// The routed experts, their router, the dense first layers and the shared expert.
    pub moe: MoeStack,
    /// Vocabulary.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Longest sequence.
    pub max_positions: usize,
    /// RoPE of the rope parts (`qk_rope_head_dim` wide).
    pub rope: RopeSpec,
    /// The softmax scale: `1/√(nope + rope)` times YaRN's `mscale(factor,
    /// mscale_all_dim)²` (`yarn_apply_mscale`).
    pub softmax_scale: f32,
}

impl Config {
    /// Read the model's numbers from the manifest.
    pub fn from_manifest(m: &Manifest) -> Result<Config, RunError> {
        let a = Axes::new(m, AXIS_BELOW, "missing");
        crate::format::axes::check(&m.arch.axes).map_err(|e| a.err(&e.axis, &e.detail))?;
        let hidden = a.usize("hidden_size")?;
        let heads = a.usize("num_attention_heads")?;
        if let Some(kv) = a.opt_usize("num_key_value_heads")?
            && kv != heads
        {
            return Err(a.err(
                "num_key_value_heads",
                &format!("{kv}: MLA expands one key and value head per query head ({heads})"),
            ));
        }
        let eps = a.opt_f64("rms_norm_eps")?.unwrap_or(EPS) as f32;
        let mla = MlaDims {
            hidden,
            heads,
            q_lora: a.opt_usize("q_lora_rank")?,
            kv_lora: a.usize("kv_lora_rank")?,
            nope: a.usize("qk_nope_head_dim")?,
            rope: a.usize("qk_rope_head_dim")?,
            v: a.usize("v_head_dim")?,
            eps,
        };
        if !mla.rope.is_multiple_of(2) {
            return Err(a.err("qk_rope_head_dim", "RoPE needs an even width"));
        }
        let mut rope = RopeSpec::from_manifest(m, mla.rope)?;
        // DeepseekV3Config interleaves unless the config says otherwise.
        rope.layout = match a.opt_bool("rope_interleave")? {
            Some(false) => Layout::HalfSplit,
            _ => Layout::Interleaved,
        };
        let trained = a.opt_usize("max_position_embeddings")?.unwrap_or(1 << 16);
        let softmax_scale = rope.softmax_scale(1.0 / (mla.qk() as f64).sqrt()) as f32;
        let layers = a.usize("num_layers")?;
        let moe = MoeStack::sigmoid(&a, layers, &DEFAULTS)?;
        Ok(Config {
            layers,
            mla,
            intermediate: if moe.dense_layers > 0 {
                a.usize("intermediate_size")?
            } else {
                0
            },
            moe,
            vocab: a.usize("vocab_size")?,
            eps,
            max_positions: context_length(&rope, trained),
            rope,
            softmax_scale,
        })
    }

    /// Bytes one token adds to the KV caches of every layer in `layout`.
    pub fn kv_bytes_per_token(&self, layout: KvLayout) -> usize {
        self.mla.cache_values(layout) * self.layers * F32_BYTES
    }
}

struct Layer<'a, B: Backend> {
    input_norm: B::Buf,
    post_norm: B::Buf,
    attn: Mla<'a, B>,
    ffn: Ffn<'a, B>,
}

/// A loaded DeepSeek-V3 over an install's mapped weights, computing on `B`.
pub struct Model<'a, B: Backend> {
    /// Architecture numbers.
    pub cfg: Config,
    install: &'a Install,
    backend: &'a B,
    embed: B::Weights<'a>,
    head: Option<B::Weights<'a>>,
    final_norm: B::Buf,
    layers: Vec<Layer<'a, B>>,
    rope: B::Rope,
    slots: B::Slots,
    layout: KvLayout,
    /// The bytes of the matrices derived at load (the absorbed `W_UK_hᵀ`), which
    /// `layers` holds views of. Declared last, so dropped after every view.
    _derived: Vec<Box<[u8]>>,
}

/// Per-sequence state: every layer's (expanded) KV cache.
pub struct Session<B: Backend> {
    kv: Vec<B::Kv>,
    /// Tokens already in the caches.
    pub pos: usize,
}

impl<'a, B: Ops> Model<'a, B> {
    /// Bind the install's tensors; the KV cache holds the latent
    /// ([`KvLayout::Latent`]) where the backend's attention takes its widths, else
    /// every head's keys and values (both backends take DeepSeek-V3's 576-wide latent
    /// keys; the expanded cache remains for a backend that does not).
    pub fn new(install: &'a Install, backend: &'a B) -> Result<Model<'a, B>, RunError> {
        let cfg = Config::from_manifest(&install.manifest)?;
        let layout = if backend.attends(&cfg.mla.cache_spec(KvLayout::Latent)) {
            KvLayout::Latent
        } else {
            KvLayout::Expanded
        };
        Model::with_layout(install, backend, layout)
    }

    /// Bind the install's tensors for a KV cache of `layout`.
    pub fn with_layout(
        install: &'a Install,
        backend: &'a B,
        layout: KvLayout,
    ) -> Result<Model<'a, B>, RunError> {
        let m = &install.manifest;
        if !MODEL_TYPES.contains(&m.arch.model_type.as_str()) {
            return Err(RunError::invalid(
                manifest::FILE_NAME,
                format!(
                    "arch.model_type is {:?}; the deepseek_v3 runner runs {MODEL_TYPES:?}",
                    m.arch.model_type
                ),
            ));
        }
        let cfg = Config::from_manifest(m)?;
        let h = cfg.mla.hidden;
        let matrix = |name: &str, rows, cols| -> Result<B::Weights<'a>, RunError> {
            Ok(backend.weights(install.matrix(name, rows, cols)?)?)
        };
        let embed = matrix("model.embed_tokens.weight", cfg.vocab, h)?;
        let head = if install.has("lm_head.weight") {
            Some(matrix("lm_head.weight", cfg.vocab, h)?)
        } else {
            None
        };
        if install.has(&format!(
            "model.layers.{}.input_layernorm.weight",
            cfg.layers
        )) {
            return Err(axis_err(
                m,
                "num_layers",
                &format!(
                    "{}, but the install holds tensors of layer {} (a multi-token-prediction layer is not decoded)",
                    cfg.layers, cfg.layers
                ),
            ));
        }
        let mut layers = Vec::new();
        layers.try_reserve_exact(cfg.layers).map_err(|_| {
            axis_err(
                m,
                "num_layers",
                &format!("{} layers do not fit in memory", cfg.layers),
            )
        })?;
        let mut pools = Vec::new();
        let mut derived = Vec::new();
        for l in 0..cfg.layers {
            if l >= cfg.moe.dense_layers {
                pools.push(expert_pool(install, &cfg.moe.moe, h, l)?);
            }
            let mut layer = bind_layer(install, backend, &cfg, l)?;
            if layout == KvLayout::Latent {
                layer.attn.absorbed = Some(absorb(install, backend, &cfg.mla, l, &mut derived)?);
            }
            layers.push(layer);
        }
        let slots = expert_slots(backend, &install.experts, &pools, cfg.layers)?;
        Ok(Model {
            final_norm: backend.upload(&install.vector("model.norm.weight", h)?)?,
            rope: backend.rope_table(
                &cfg.rope.inv_freq(0),
                0..cfg.max_positions,
                cfg.rope.layout,
            )?,
            slots,
            cfg,
            install,
            backend,
            embed,
            head,
            layers,
            layout,
            _derived: derived,
        })
    }

    /// What the KV cache holds.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Run `tokens` after the session's cache: the logits of every position when `all`,
    /// else of the last.
    pub fn forward(
        &self,
        s: &mut Session<B>,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        let (c, b) = (&self.cfg, self.backend);
        let pos = s.pos;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        self.check_input(pos, tokens)?;
        if s.kv.len() != c.layers {
            s.kv = (0..c.layers)
                .map(|_| b.kv_cache(c.mla.cache_spec(self.layout), c.max_positions))
                .collect::<Result<_, _>>()?;
        }
        let h = c.mla.hidden;
        let mut x = b.zeros(n * h)?;
        b.embed(&self.embed, tokens, &mut x)?;
        let mut xn = b.zeros(n * h)?;
        let mut out = b.zeros(n * h)?;
        let step = MlaStep {
            table: &self.rope,
            pos,
            scale: c.softmax_scale,
            rope_factor: c.rope.attention_scaling(),
        };
        for (l, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&x, &layer.input_norm, c.eps, NormGain::Weight, &mut xn)?;
            layer
                .attn
                .forward(b, &c.mla, &step, &mut s.kv[l], &xn, n, &mut out)?;
            b.add(&mut x, &out)?;
            b.rms_norm(&x, &layer.post_norm, c.eps, NormGain::Weight, &mut xn)?;
            self.ffn(l, &layer.ffn, &xn, n, &mut out)?;
            b.add(&mut x, &out)?;
        }
        s.pos += n;
        let out = OutputHead {
            norm: &self.final_norm,
            eps: c.eps,
            gain: NormGain::Weight,
            head: self.head.as_ref().unwrap_or(&self.embed),
            hidden: h,
            vocab: c.vocab,
        };
        out.logits(b, x, n, all)
    }

    /// A layer's MLP, or its routed experts plus the shared expert.
    fn ffn(
        &self,
        l: usize,
        ffn: &Ffn<'a, B>,
        xn: &B::Buf,
        n: usize,
        out: &mut B::Buf,
    ) -> Result<(), RunError> {
        let experts = RoutedExperts {
            b: self.backend,
            store: &self.install.experts,
            slots: &self.slots,
            layer: l,
        };
        let c = &self.cfg;
        ffn.forward(&experts, Some(&c.moe), xn, n, c.mla.hidden, out)
    }

    /// A sequence past the context or a token outside the vocabulary.
    fn check_input(&self, pos: usize, tokens: &[u32]) -> Result<(), RunError> {
        let c = &self.cfg;
        if pos + tokens.len() > c.max_positions {
            return Err(InputError::SequenceTooLong {
                tokens: pos + tokens.len(),
                max: c.max_positions,
            }
            .into());
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(InputError::TokenOutsideVocabulary {
                token: t,
                vocab: c.vocab,
            }
            .into());
        }
        Ok(())
    }
}

/// Layer `l`'s `kv_b_proj` absorbed for the latent cache: per head `W_UV_h` as a view
/// of its rows, and `W_UK_hᵀ` transposed into bytes pushed onto `derived`.
fn absorb<'a, B: Ops>(
    install: &'a Install,
    b: &B,
    d: &MlaDims,
    l: usize,
    derived: &mut Vec<Box<[u8]>>,
) -> Result<Absorbed<'a, B>, RunError> {
    let name = format!("model.layers.{l}.self_attn.kv_b_proj.weight");
    let per_head = d.nope + d.v;
    let kv_b = install.matrix(&name, d.heads * per_head, d.kv_lora)?;
    let mut k_t = Vec::with_capacity(d.heads);
    let mut v = Vec::with_capacity(d.heads);
    for h in 0..d.heads {
        let first = h * per_head;
        v.push(b.weights(kv_b.row_range(first + d.nope..first + per_head))?);
        let (dtype, bytes) = transposed(&kv_b.row_range(first..first + d.nope));
        #[allow(unsafe_code)]
        // SAFETY: the view borrows the heap allocation of `bytes`, which is moved (the
        // box, not its allocation) into `derived`, the model's last field: it is never
        // written, freed or reallocated while the model lives, and the model's fields
        // holding views (`layers`) are dropped before it. The slice is that allocation's
        // whole length.
        let data: &'a [u8] = unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
        derived.push(bytes);
        k_t.push(b.weights(Matrix::Float {
            dtype,
            data,
            rows: d.kv_lora,
            cols: d.nope,
        })?);
    }
    Ok(Absorbed { k_t, v })
}

/// `w` `[rows, cols]` transposed into row-major `[cols, rows]` bytes: a float matrix's
/// elements moved as they are (exact, at its own width: BF16 stays 2 bytes), a
/// quantized one widened to f32 first.
fn transposed(w: &Matrix<'_>) -> (FloatDtype, Box<[u8]>) {
    let (rows, cols) = (w.rows(), w.cols());
    match *w {
        Matrix::Float { dtype, data, .. } => {
            let e = dtype.bytes();
            let mut t = vec![0u8; data.len()];
            for i in 0..rows {
                for j in 0..cols {
                    let (from, to) = ((i * cols + j) * e, (j * rows + i) * e);
                    t[to..to + e].copy_from_slice(&data[from..from + e]);
                }
            }
            (dtype, t.into_boxed_slice())
        }
        Matrix::Quant { .. } | Matrix::Mxfp4 { .. } => {
            let mut row = vec![0f32; cols];
            let mut t = vec![0f32; rows * cols];
            for i in 0..rows {
                w.widen_row(i, &mut row);
                for (j, &x) in row.iter().enumerate() {
                    t[j * rows + i] = x;
                }
            }
            (
                FloatDtype::F32,
                t.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        }
    }
}

/// Layer `l`'s weights.
fn bind_layer<'a, B: Ops>(
    install: &'a Install,
    b: &B,
    cfg: &Config,
    l: usize,
) -> Result<Layer<'a, B>, RunError> {
    let d = &cfg.mla;
    let h = d.hidden;
    let t = |n: &str| format!("model.layers.{l}.{n}");
    let matrix = |name: &str, rows, cols| -> Result<B::Weights<'a>, RunError> {
        Ok(b.weights(install.matrix(&t(name), rows, cols)?)?)
    };
    let vector = |name: &str, len| -> Result<B::Buf, RunError> {
        Ok(b.upload(&install.vector(&t(name), len)?)?)
    };
    let q_rows = d.heads * d.qk();
    let q = match d.q_lora {
        Some(r) => Query::LowRank {
            a: matrix("self_attn.q_a_proj.weight", r, h)?,
            norm: vector("self_attn.q_a_layernorm.weight", r)?,
            b: matrix("self_attn.q_b_proj.weight", q_rows, r)?,
        },
        None => Query::Plain(matrix("self_attn.q_proj.weight", q_rows, h)?),
    };
    let attn = Mla {
        q,
        kv_a: matrix("self_attn.kv_a_proj_with_mqa.weight", d.kv_lora + d.rope, h)?,
        kv_norm: vector("self_attn.kv_a_layernorm.weight", d.kv_lora)?,
        kv_b: matrix(
            "self_attn.kv_b_proj.weight",
            d.heads * (d.nope + d.v),
            d.kv_lora,
        )?,
        o: matrix("self_attn.o_proj.weight", h, d.heads * d.v)?,
        absorbed: None,
    };
    let swiglu = |part: &str, i: usize| SwiGlu::bind(install, b, &t(part), i, h);
    let ffn = if l < cfg.moe.dense_layers {
        Ffn::Dense(swiglu("mlp", cfg.intermediate)?)
    } else {
        let e = cfg.moe.moe.experts;
        Ffn::Moe(MoeBlock {
            router: matrix("mlp.gate.weight", e, h)?,
            bias: Some(install.vector(&t("mlp.gate.e_score_correction_bias"), e)?),
            shared: (cfg.moe.shared_intermediate > 0)
                .then(|| {
                    Ok::<_, RunError>(SharedExpert {
                        mlp: swiglu("mlp.shared_experts", cfg.moe.shared_intermediate)?,
                        gate: None,
                    })
                })
                .transpose()?,
        })
    };
    Ok(Layer {
        input_norm: vector("input_layernorm.weight", h)?,
        post_norm: vector("post_attention_layernorm.weight", h)?,
        attn,
        ffn,
    })
}

impl<B: Ops> LanguageModel for Model<'_, B> {
    type Session = Session<B>;
    fn new_session(&self) -> Session<B> {
        Session {
            kv: Vec::new(),
            pos: 0,
        }
    }
    fn run(&self, s: &mut Session<B>, tokens: &[u32], all: bool) -> Result<Vec<f32>, RunError> {
        self.forward(s, tokens, all)
    }
    fn copy_session(&self, s: &Session<B>) -> Result<Session<B>, RunError> {
        let kv =
            s.kv.iter()
                .map(|kv| self.backend.copy_kv(kv))
                .collect::<Result<Vec<_>, _>>()?;
        Ok(Session { kv, pos: s.pos })
    }
    fn session_bytes(&self, s: &Session<B>) -> u64 {
        s.kv.iter().map(|kv| self.backend.kv_bytes(kv)).sum()
    }
    fn export_session(&self, s: &Session<B>) -> Result<SessionData, RunError> {
        let mut parts = Vec::new();
        for kv in &s.kv {
            state::export_kv(self.backend, kv, &mut parts)?;
        }
        Ok(SessionData { pos: s.pos, parts })
    }
    fn import_session(&self, d: &SessionData) -> Result<Session<B>, RunError> {
        let c = &self.cfg;
        if d.parts.is_empty() && d.pos == 0 {
            return Ok(self.new_session());
        }
        let spec = c.mla.cache_spec(self.layout);
        let mut r = d.reader();
        let mut kv = Vec::with_capacity(c.layers);
        for _ in 0..c.layers {
            let mut cache = self.backend.kv_cache(spec, c.max_positions)?;
            state::import_kv(
                self.backend,
                &mut cache,
                (spec, c.max_positions),
                &mut r,
                d.pos,
            )?;
            kv.push(cache);
        }
        r.finish()?;
        Ok(Session { kv, pos: d.pos })
    }
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn backend_name(&self) -> String {
        self.backend.name().to_string()
    }
    fn device_memory_bytes(&self) -> Option<u64> {
        self.backend.device_memory_bytes()
    }
    fn stats(&self, positions: usize) -> Vec<Stat> {
        let per_token = self.cfg.kv_bytes_per_token(self.layout);
        let name = match self.layout {
            KvLayout::Latent => "latent",
            KvLayout::Expanded => "expanded",
        };
        vec![Stat {
            text: format!(
                "KV cache {per_token} B/token ({name} MLA), {} KiB",
                per_token * positions / 1024
            ),
            key: "kv_bytes_per_token",
            value: per_token.into(),
        }]
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::runtime::kernels::routing::GroupLimit;

    /// The toy's axes (tests/data/deepseek_toy/config.json through the family file).
    fn axes() -> Value {
        json!({
            "hidden_size": 128, "num_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "norm_topk_prob": true, "vocab_size": 512, "rope_theta": 10000,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "rope_interleave": true,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0,
                "mscale_all_dim": 0.8, "original_max_position_embeddings": 64, "type": "yarn"}
        })
    }

    fn manifest(axes: Value) -> Manifest {
        serde_json::from_value(json!({
            "arch": {"axes": axes, "model_type": "deepseek_v3", "required_axes": []},
            "excluded_tensors": 0, "expert_pools": [], "family": "deepseek_v3", "files": [],
            "format": "gturbo", "minor_version": 1, "model_id": "t/t", "plan_fingerprint": "0",
            "quantized_at_install": {"bits": 4, "group_size": 64, "overrides": [],
                "parity_gate": "", "quality_gate": null, "scheme": "int4_g64"},
            "resident": {"entries": 0, "file": "resident.bin", "payload_start": 0},
            "row_pools": [], "sidecars": {},
            "source": {"commit": null, "index_sha256": null, "repo": "t/t", "revision": "main"},
            "tool": {"name": "gturbo", "version": "0"}, "version": 1
        }))
        .expect("test manifest")
    }

    fn with(key: &str, v: Value) -> Result<Config, RunError> {
        let mut a = axes();
        a[key] = v;
        Config::from_manifest(&manifest(a))
    }

    #[test]
    fn the_toy_reads_as_transformers_builds_it() {
        let c = Config::from_manifest(&manifest(axes())).unwrap();
        assert_eq!(c.mla.qk(), 48);
        assert_eq!(c.moe.dense_layers, 1);
        assert_eq!(c.moe.shared_intermediate, 64);
        assert_eq!(c.rope.layout, Layout::Interleaved);
        assert_eq!(
            c.moe.routing.groups,
            Some(GroupLimit {
                n_group: 4,
                topk_group: 2
            })
        );
        assert_eq!(
            (c.moe.routing.scaling, c.moe.routing.renormalize),
            (2.5, true)
        );
        // transformers' `scaling` for the toy (golden/meta.json `softmax_scale`):
        // 48^-0.5 · (0.1 · 0.8 · ln 4 + 1)².
        assert!((f64::from(c.softmax_scale) - 0.1781279581324309).abs() < 1e-7);
        // mscale 1.0 over mscale_all_dim 0.8: the rope parts carry a factor ≠ 1.
        let a = (0.1 * 4f64.ln() + 1.0) / (0.08 * 4f64.ln() + 1.0);
        assert!((f64::from(c.rope.attention_scaling()) - a).abs() < 1e-6);
    }

    #[test]
    fn absent_fields_take_transformers_defaults() {
        let mut a = axes();
        a["num_experts"] = json!(16);
        a["num_layers"] = json!(4);
        for k in [
            "q_lora_rank",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "norm_topk_prob",
            "rope_interleave",
            "first_k_dense_replace",
            "n_shared_experts",
        ] {
            a.as_object_mut().unwrap().remove(k);
        }
        let c = Config::from_manifest(&manifest(a)).unwrap();
        assert_eq!(c.mla.q_lora, None);
        assert_eq!(
            c.moe.routing.groups,
            Some(GroupLimit {
                n_group: 8,
                topk_group: 4
            })
        );
        assert_eq!(
            (c.moe.routing.scaling, c.moe.routing.renormalize),
            (2.5, true)
        );
        assert_eq!(c.rope.layout, Layout::Interleaved);
        assert_eq!((c.moe.dense_layers, c.moe.shared_intermediate), (3, 64));
        let mut a = axes();
        a["n_group"] = json!(1);
        a["topk_group"] = json!(1);
        assert_eq!(
            Config::from_manifest(&manifest(a))
                .unwrap()
                .moe
                .routing
                .groups,
            None
        );
        assert_eq!(
            with("first_k_dense_replace", json!(0))
                .unwrap()
                .moe
                .dense_layers,
            0
        );
        assert_eq!(
            with("rope_interleave", json!(false)).unwrap().rope.layout,
            Layout::HalfSplit
        );
        assert_eq!(
            with("n_shared_experts", json!(0))
                .unwrap()
                .moe
                .shared_intermediate,
            0
        );
    }

    #[test]
    fn transposing_keeps_float_bytes_and_widens_quantized_rows() {
        let bf16 = |x: f32| ((x.to_bits() >> 16) as u16).to_le_bytes();
        let data: Vec<u8> = [1f32, 2., 3., 4., 5., 6.]
            .iter()
            .flat_map(|&x| bf16(x))
            .collect();
        let w = Matrix::Float {
            dtype: FloatDtype::Bf16,
            data: &data,
            rows: 2,
            cols: 3,
        };
        let (dtype, t) = transposed(&w);
        assert_eq!(dtype, FloatDtype::Bf16);
        let want: Vec<u8> = [1f32, 4., 2., 5., 3., 6.]
            .iter()
            .flat_map(|&x| bf16(x))
            .collect();
        assert_eq!(&t[..], &want[..]);
        // The transposed view's rows are the columns of the original.
        let tm = Matrix::Float {
            dtype,
            data: &t,
            rows: 3,
            cols: 2,
        };
        let mut row = [0f32; 2];
        tm.widen_row(2, &mut row);
        assert_eq!(row, [3., 6.]);
    }

    #[test]
    fn untrusted_axes_are_refused_naming_the_manifest_and_the_field() {
        for (key, v, says) in [
            ("n_group", json!(3), "arch.axes.n_group"),
            ("topk_group", json!(5), "arch.axes.n_group"),
            (
                "num_key_value_heads",
                json!(2),
                "arch.axes.num_key_value_heads",
            ),
            (
                "first_k_dense_replace",
                json!(4),
                "arch.axes.first_k_dense_replace",
            ),
            ("qk_rope_head_dim", json!(15), "arch.axes.qk_rope_head_dim"),
            ("kv_lora_rank", json!(0), "arch.axes.kv_lora_rank"),
            ("v_head_dim", json!(-1), "arch.axes.v_head_dim"),
            ("routed_scaling_factor", json!("x"), "routed_scaling_factor"),
            ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
        ] {
            let e = with(key, v.clone()).unwrap_err().to_string();
            assert!(
                e.contains(manifest::FILE_NAME) && e.contains(says),
                "{key} = {v}: {e}"
            );
        }
    }
}
