//! The decoder runner: one transformer decoder parametrised by the install's axes,
//! covering `llama` (tied head), `qwen3` (QK-norm) and `qwen3_moe` (routed experts).
//!
//! Numerics follow mlx-lm's models with f32 activations: RMSNorm
//! `x · rsqrt(mean(x²) + ε) · w`; RoPE in the rotate-half (Hugging Face) layout,
//! `inv_freq_i = θ^(-2i/d)`; softmax attention scaled by `1/√head_dim`; SwiGLU
//! `down(silu(gate x) · up x)`; MoE routing `softmax(router x)` over all experts,
//! top-k, optionally renormalised to sum 1 (`norm_topk_prob`).

use super::error::{InputError, RunError};
use super::gate::{QK_NORM, ROUTED_MOE};
use super::kernels::{
    Cpu, Matrix, axpy, dot, expert_matrices, rms_norm, silu_mul, softmax_inplace,
};
use super::load::Install;
use crate::format::manifest::{self, Manifest};

/// Architecture numbers read from the manifest's `arch.axes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Model width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Dense MLP width (0 for MoE models).
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Per-head RMSNorm of q and k.
    pub qk_norm: bool,
    /// Routed experts, when the install has them.
    pub moe: Option<MoeConfig>,
    /// Longest sequence (prompt + generated), from `max_position_embeddings`.
    pub max_positions: usize,
}

/// Routed-expert settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Expert MLP width.
    pub intermediate: usize,
    /// Renormalise the top-k probabilities to sum 1.
    pub norm_topk_prob: bool,
}

fn axis_err(m: &Manifest, axis: &str, msg: &str) -> RunError {
    RunError::invalid(
        manifest::FILE_NAME,
        format!("arch.axes.{axis} (family {}): {msg}", m.family),
    )
}

fn axis_usize(m: &Manifest, axis: &str) -> Result<Option<usize>, RunError> {
    match m.arch.axes.get(axis) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0 && n < 1 << 32)
            .map(|n| Some(n as usize))
            .ok_or_else(|| axis_err(m, axis, &format!("{v} is not a positive integer"))),
    }
}

fn need_usize(m: &Manifest, axis: &str) -> Result<usize, RunError> {
    axis_usize(m, axis)?.ok_or_else(|| axis_err(m, axis, "missing"))
}

fn axis_f64(m: &Manifest, axis: &str) -> Result<Option<f64>, RunError> {
    match m.arch.axes.get(axis) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .map(Some)
            .ok_or_else(|| axis_err(m, axis, &format!("{v} is not a positive number"))),
    }
}

fn axis_bool(m: &Manifest, axis: &str) -> Result<Option<bool>, RunError> {
    match m.arch.axes.get(axis) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| axis_err(m, axis, &format!("{v} is not a boolean"))),
    }
}

impl Config {
    /// Read the decoder's numbers from the manifest. Defaults follow the Hugging Face
    /// configs: `head_dim = hidden / heads`, `norm_topk_prob = false`,
    /// `rms_norm_eps = 1e-6`, `rope_theta = 10000`.
    pub fn from_manifest(m: &Manifest) -> Result<Config, RunError> {
        if m.arch
            .axes
            .get("rope_scaling")
            .is_some_and(|v| !v.is_null())
        {
            return Err(axis_err(
                m,
                "rope_scaling",
                "RoPE scaling is not implemented by the decoder runner (only plain RoPE)",
            ));
        }
        let hidden = need_usize(m, "hidden_size")?;
        let heads = need_usize(m, "num_attention_heads")?;
        let kv_heads = axis_usize(m, "num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(axis_err(
                m,
                "num_key_value_heads",
                &format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = axis_usize(m, "head_dim")?.unwrap_or(hidden / heads);
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(axis_err(m, "head_dim", "RoPE needs an even head width"));
        }
        let moe = if m.arch.required_axes.iter().any(|a| a == ROUTED_MOE) {
            Some(MoeConfig {
                experts: need_usize(m, "num_experts")?,
                top_k: need_usize(m, "num_experts_per_tok")?,
                intermediate: need_usize(m, "moe_intermediate_size")?,
                norm_topk_prob: axis_bool(m, "norm_topk_prob")?.unwrap_or(false),
            })
        } else {
            None
        };
        if let Some(moe) = &moe
            && moe.top_k > moe.experts
        {
            return Err(axis_err(m, "num_experts_per_tok", "more than num_experts"));
        }
        Ok(Config {
            hidden,
            layers: need_usize(m, "num_layers")?,
            heads,
            kv_heads,
            head_dim,
            intermediate: if moe.is_some() {
                0
            } else {
                need_usize(m, "intermediate_size")?
            },
            vocab: need_usize(m, "vocab_size")?,
            rope_theta: axis_f64(m, "rope_theta")?.unwrap_or(10_000.0),
            eps: axis_f64(m, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            qk_norm: m.arch.required_axes.iter().any(|a| a == QK_NORM),
            moe,
            max_positions: axis_usize(m, "max_position_embeddings")?.unwrap_or(1 << 16),
        })
    }
}

enum Mlp<'a> {
    Dense {
        gate: Matrix<'a>,
        up: Matrix<'a>,
        down: Matrix<'a>,
    },
    Moe {
        router: Matrix<'a>,
    },
}

struct Layer<'a> {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Matrix<'a>,
    k: Matrix<'a>,
    v: Matrix<'a>,
    o: Matrix<'a>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    mlp: Mlp<'a>,
}

/// A loaded decoder over an install's mapped weights.
pub struct Model<'a> {
    /// Architecture numbers.
    pub cfg: Config,
    install: &'a Install,
    backend: &'a Cpu,
    embed: Matrix<'a>,
    head: Matrix<'a>,
    final_norm: Vec<f32>,
    layers: Vec<Layer<'a>>,
    inv_freq: Vec<f32>,
}

/// Per-sequence state: the KV cache.
pub struct Session {
    /// Per layer: keys then values, `[pos, kv_heads × head_dim]` each.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Tokens already in the cache.
    pub pos: usize,
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(xr, w, eps, or);
    }
}

impl<'a> Model<'a> {
    /// Bind the install's tensors (no weight bytes are read here beyond norms).
    pub fn new(install: &'a Install, backend: &'a Cpu) -> Result<Model<'a>, RunError> {
        let cfg = Config::from_manifest(&install.manifest)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let embed = install.matrix("model.embed_tokens.weight", cfg.vocab, h)?;
        // A checkpoint without `lm_head.weight` ties the head to the embedding.
        let head = if install.has("lm_head.weight") {
            install.matrix("lm_head.weight", cfg.vocab, h)?
        } else {
            embed
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}.");
            let t = |n: &str| format!("{p}{n}");
            let mlp = match &cfg.moe {
                Some(moe) => {
                    let pool = install.experts.pool(l).ok_or_else(|| {
                        RunError::invalid(
                            manifest::FILE_NAME,
                            format!("no expert pool for layer {l}"),
                        )
                    })?;
                    let i = moe.intermediate as u64;
                    let want = [(i, h as u64), (i, h as u64), (h as u64, i)];
                    let got: Vec<(u64, u64)> =
                        pool.parts.iter().map(|b| (b.rows, b.cols)).collect();
                    if pool.experts != moe.experts as u64 || got != want {
                        return Err(RunError::invalid(
                            &pool.file,
                            format!(
                                "{} experts of shapes {got:?}, the config implies {} of {want:?}",
                                pool.experts, moe.experts
                            ),
                        ));
                    }
                    Mlp::Moe {
                        router: install.matrix(&t("mlp.gate.weight"), moe.experts, h)?,
                    }
                }
                None => Mlp::Dense {
                    gate: install.matrix(&t("mlp.gate_proj.weight"), cfg.intermediate, h)?,
                    up: install.matrix(&t("mlp.up_proj.weight"), cfg.intermediate, h)?,
                    down: install.matrix(&t("mlp.down_proj.weight"), h, cfg.intermediate)?,
                },
            };
            layers.push(Layer {
                input_norm: install.vector(&t("input_layernorm.weight"), h)?,
                post_norm: install.vector(&t("post_attention_layernorm.weight"), h)?,
                q: install.matrix(&t("self_attn.q_proj.weight"), cfg.heads * hd, h)?,
                k: install.matrix(&t("self_attn.k_proj.weight"), cfg.kv_heads * hd, h)?,
                v: install.matrix(&t("self_attn.v_proj.weight"), cfg.kv_heads * hd, h)?,
                o: install.matrix(&t("self_attn.o_proj.weight"), h, cfg.heads * hd)?,
                q_norm: cfg
                    .qk_norm
                    .then(|| install.vector(&t("self_attn.q_norm.weight"), hd))
                    .transpose()?,
                k_norm: cfg
                    .qk_norm
                    .then(|| install.vector(&t("self_attn.k_norm.weight"), hd))
                    .transpose()?,
                mlp,
            });
        }
        let half = hd / 2;
        let inv_freq = (0..half)
            .map(|i| (1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)) as f32)
            .collect();
        Ok(Model {
            final_norm: install.vector("model.norm.weight", h)?,
            cfg,
            install,
            backend,
            embed,
            head,
            layers,
            inv_freq,
        })
    }

    /// An empty KV cache.
    pub fn session(&self) -> Session {
        Session {
            kv: (0..self.cfg.layers)
                .map(|_| (Vec::new(), Vec::new()))
                .collect(),
            pos: 0,
        }
    }

    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = self.cfg.head_dim / 2;
        for head in x.chunks_exact_mut(self.cfg.head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let ang = pos as f32 * self.inv_freq[i];
                let (s, c) = ang.sin_cos();
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c - x2 * s;
                b[i] = x2 * c + x1 * s;
            }
        }
    }

    /// Run `tokens` (appended after the session's cache) through the model. Returns
    /// the logits of every position (`tokens.len() × vocab`) when `all` is true, else
    /// those of the last position only.
    pub fn forward(
        &self,
        s: &mut Session,
        tokens: &[u32],
        all: bool,
    ) -> Result<Vec<f32>, RunError> {
        let c = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if s.pos + n > c.max_positions {
            // The install is fine: the prompt plus what was generated is too long.
            return Err(InputError::SequenceTooLong {
                tokens: s.pos + n,
                max: c.max_positions,
            }
            .into());
        }
        let (h, hd) = (c.hidden, c.head_dim);
        let (qw, kvw) = (c.heads * hd, c.kv_heads * hd);
        let mut x = vec![0f32; n * h];
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= c.vocab {
                return Err(InputError::TokenOutsideVocabulary {
                    token: t,
                    vocab: c.vocab,
                }
                .into());
            }
            self.backend
                .row(&self.embed, t as usize, &mut x[i * h..(i + 1) * h]);
        }
        let mut xn = vec![0f32; n * h];
        let mut q = vec![0f32; n * qw];
        let mut k = vec![0f32; n * kvw];
        let mut v = vec![0f32; n * kvw];
        let mut att = vec![0f32; n * qw];
        let mut out = vec![0f32; n * h];
        let scale = 1.0 / (hd as f32).sqrt();
        let group = c.heads / c.kv_heads;
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm_rows(&x, &layer.input_norm, c.eps, &mut xn);
            self.backend.matmul(&layer.q, &xn, n, &mut q);
            self.backend.matmul(&layer.k, &xn, n, &mut k);
            self.backend.matmul(&layer.v, &xn, n, &mut v);
            for i in 0..n {
                let qi = &mut q[i * qw..(i + 1) * qw];
                let ki = &mut k[i * kvw..(i + 1) * kvw];
                if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                    let tmp = qi.to_vec();
                    rms_norm_rows(&tmp, qn, c.eps, qi);
                    let tmp = ki.to_vec();
                    rms_norm_rows(&tmp, kn, c.eps, ki);
                }
                self.rope(qi, s.pos + i);
                self.rope(ki, s.pos + i);
            }
            let (kc, vc) = &mut s.kv[l];
            kc.extend_from_slice(&k);
            vc.extend_from_slice(&v);
            let total = s.pos + n;
            let mut scores = vec![0f32; total];
            for i in 0..n {
                let upto = s.pos + i + 1;
                for hh in 0..c.heads {
                    let kvh = hh / group;
                    let qh = &q[i * qw + hh * hd..i * qw + (hh + 1) * hd];
                    for (j, sc) in scores[..upto].iter_mut().enumerate() {
                        let kj = &kc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd];
                        *sc = dot(qh, kj) * scale;
                    }
                    softmax_inplace(&mut scores[..upto]);
                    let ah = &mut att[i * qw + hh * hd..i * qw + (hh + 1) * hd];
                    ah.fill(0.0);
                    for (j, &p) in scores[..upto].iter().enumerate() {
                        let vj = &vc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd];
                        axpy(p, vj, ah);
                    }
                }
            }
            self.backend.matmul(&layer.o, &att, n, &mut out);
            for (a, b) in x.iter_mut().zip(&out) {
                *a += b;
            }
            rms_norm_rows(&x, &layer.post_norm, c.eps, &mut xn);
            match &layer.mlp {
                Mlp::Dense { gate, up, down } => {
                    let i = c.intermediate;
                    let mut g = vec![0f32; n * i];
                    let mut u = vec![0f32; n * i];
                    self.backend.matmul(gate, &xn, n, &mut g);
                    self.backend.matmul(up, &xn, n, &mut u);
                    silu_mul(&mut g, &u);
                    self.backend.matmul(down, &g, n, &mut out);
                }
                Mlp::Moe { router } => self.moe(l, router, &xn, n, &mut out)?,
            }
            for (a, b) in x.iter_mut().zip(&out) {
                *a += b;
            }
        }
        s.pos += n;
        let rows: &[f32] = if all { &x } else { &x[(n - 1) * h..] };
        let m = rows.len() / h;
        let mut normed = vec![0f32; m * h];
        rms_norm_rows(rows, &self.final_norm, c.eps, &mut normed);
        let mut logits = vec![0f32; m * c.vocab];
        self.backend.matmul(&self.head, &normed, m, &mut logits);
        Ok(logits)
    }

    /// Routed experts for `n` tokens: route each token, then run each chosen expert
    /// once over the tokens that chose it (one cache lookup per expert per call).
    fn moe(
        &self,
        l: usize,
        router: &Matrix,
        xn: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), RunError> {
        let moe = self
            .cfg
            .moe
            .as_ref()
            .ok_or_else(|| RunError::invalid(manifest::FILE_NAME, "no MoE config"))?;
        let (h, e_count, inter) = (self.cfg.hidden, moe.experts, moe.intermediate);
        let mut probs = vec![0f32; n * e_count];
        self.backend.matmul(router, xn, n, &mut probs);
        // chosen[e] = (token, weight) pairs.
        let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
        for t in 0..n {
            let p = &mut probs[t * e_count..(t + 1) * e_count];
            softmax_inplace(p);
            let mut idx: Vec<usize> = (0..e_count).collect();
            // Highest probability first; ties to the lower expert id.
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &idx[..moe.top_k];
            let sum: f32 = top.iter().map(|&e| p[e]).sum();
            for &e in top {
                let w = if moe.norm_topk_prob { p[e] / sum } else { p[e] };
                chosen[e].push((t, w));
            }
        }
        out.fill(0.0);
        let pool = self.install.experts.pool(l).ok_or_else(|| {
            RunError::invalid(manifest::FILE_NAME, format!("no expert pool for layer {l}"))
        })?;
        for (e, toks) in chosen.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let blob = self.install.experts.get(l, e)?;
            let [gate, up, down] = expert_matrices(pool, blob.bytes());
            let m = toks.len();
            let mut xs = vec![0f32; m * h];
            for (r, &(t, _)) in toks.iter().enumerate() {
                xs[r * h..(r + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
            }
            let mut g = vec![0f32; m * inter];
            let mut u = vec![0f32; m * inter];
            self.backend.matmul(&gate, &xs, m, &mut g);
            self.backend.matmul(&up, &xs, m, &mut u);
            silu_mul(&mut g, &u);
            let mut d = vec![0f32; m * h];
            self.backend.matmul(&down, &g, m, &mut d);
            for (r, &(t, w)) in toks.iter().enumerate() {
                axpy(w, &d[r * h..(r + 1) * h], &mut out[t * h..(t + 1) * h]);
            }
        }
        Ok(())
    }
}
