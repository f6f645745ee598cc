//! The qwen4_exp text model: weights bound from the install, the per-sequence state,
//! and the forward pass as a plain sequence of the module's op calls.
//!
//! ```text
//! x = [e, e, …, e]                          e = embed_tokens[id]; S copies
//! for each layer:
//!     if PLE layer: x += ple(x, ids)
//!     u, inj = attn_hc(x);  x += inj ⊗ (GDN or attention)(u)
//!     u, inj = mlp_hc(x);   x += inj ⊗ MoE(u)
//! logits = lm_head · mixer(x)               (no final norm)
//! ```
//! The same call runs a prompt and a cached decode step: every op continues from the
//! session's state (KV cache and block keys, GDN conv and recurrent state, PLE
//! history and conv state), so decoding token by token equals re-running the prefix.

use std::collections::BTreeMap;

use super::attention::{AttnCache, AttnWeights, IndexerWeights, attention_forward};
use super::config::{FlashConfig, LayerKind};
use super::gdn::{GdnState, GdnWeights, gdn_forward};
use super::hc::{HcRead, HyperConnection, hc_read, hc_write};
use super::install::FlashInstall;
use super::moe::{MoeWeights, moe_forward};
use super::ple::{PleState, PleTables, PleWeights, ple_forward};
use super::rope::Rope;
use crate::runtime::kernels::{Backend, Matrix};
use crate::runtime::load::LoadError;

/// Prefix of the text model's tensors.
const LM: &str = "model.language_model.";

/// A layer's token mixer.
pub enum Mixer<'a> {
    /// Gated DeltaNet.
    Gdn(GdnWeights<'a>),
    /// Gated attention with the indexer.
    Attn(AttnWeights<'a>),
}

/// One decoder layer's weights.
pub struct FlashLayer<'a> {
    /// The PLE block, on the layers that have one.
    pub ple: Option<PleWeights<'a>>,
    /// The hyper-connection around the mixer.
    pub attn_hc: HyperConnection<'a>,
    /// GDN or attention.
    pub mixer: Mixer<'a>,
    /// The hyper-connection around the MoE.
    pub mlp_hc: HyperConnection<'a>,
    /// The MoE's resident weights.
    pub moe: MoeWeights<'a>,
}

/// The loaded model.
pub struct FlashModel<'a> {
    /// The numbers.
    pub cfg: FlashConfig,
    /// Per layer: its kind.
    pub kinds: Vec<LayerKind>,
    install: &'a FlashInstall,
    backend: &'a dyn Backend,
    embed: Matrix<'a>,
    head: Matrix<'a>,
    mixer: HyperConnection<'a>,
    layers: Vec<FlashLayer<'a>>,
    rope: Rope,
}

/// One layer's mixer state.
#[derive(Debug, Clone, PartialEq)]
pub enum MixerState {
    /// GDN conv and recurrent state.
    Gdn(GdnState),
    /// KV cache, raw indexer keys and block keys.
    Attn(AttnCache),
}

/// Per-sequence state.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashSession {
    /// Per layer: the mixer's state.
    pub mixers: Vec<MixerState>,
    /// Per layer: the PLE state, on PLE layers.
    pub ple: Vec<Option<PleState>>,
    /// Tokens seen.
    pub pos: usize,
}

impl FlashSession {
    /// Bytes of KV cache, block keys, GDN and PLE state.
    pub fn state_bytes(&self) -> usize {
        let m: usize = self
            .mixers
            .iter()
            .map(|s| match s {
                MixerState::Gdn(g) => g.bytes(),
                MixerState::Attn(a) => a.bytes(),
            })
            .sum();
        m + self
            .ple
            .iter()
            .flatten()
            .map(PleState::bytes)
            .sum::<usize>()
    }
}

/// Intermediate values of a forward pass, named as the goldens name them
/// (`layers.{i}.gdn.core`, `layers.{i}.moe.topk_idx`, …). Every call appends, so a
/// prefill followed by decode steps accumulates rows.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// f32 tensors, rows concatenated.
    pub f32s: BTreeMap<String, Vec<f32>>,
    /// Integer tensors (PLE row ids, router indices).
    pub ints: BTreeMap<String, Vec<i64>>,
    /// Per query: the indexer's selected blocks, per indexed layer.
    pub blocks: BTreeMap<String, Vec<Vec<usize>>>,
    /// Per query: the indexer's block scores, per indexed layer.
    pub scores: BTreeMap<String, Vec<Vec<f32>>>,
}

impl Trace {
    fn put(&mut self, key: String, v: &[f32]) {
        self.f32s.entry(key).or_default().extend_from_slice(v);
    }

    fn put_ints(&mut self, key: String, v: impl IntoIterator<Item = i64>) {
        self.ints.entry(key).or_default().extend(v);
    }

    fn put_hc(&mut self, p: &str, r: &HcRead) {
        self.put(format!("{p}.mix"), &r.mix);
        self.put(format!("{p}.mixed"), &r.mixed);
        self.put(format!("{p}.inject"), &r.inject);
    }
}

fn hc<'a>(
    inst: &'a FlashInstall,
    cfg: &FlashConfig,
    p: &str,
    inject: bool,
) -> Result<HyperConnection<'a>, LoadError> {
    let w = cfg.hc.width();
    Ok(HyperConnection {
        norm: inst.floats(&format!("{p}hc_norm.weight"), &[w])?,
        down: inst.matrix(
            &format!("{p}input_mix_weight_down.weight"),
            cfg.hc_lowrank,
            w,
        )?,
        up: inst.matrix(&format!("{p}input_mix_weight_up.weight"), w, cfg.hc_lowrank)?,
        inject: if inject {
            Some(inst.matrix(&format!("{p}block_inject_weight.weight"), cfg.hc.streams, w)?)
        } else {
            None
        },
    })
}

/// The layer's kind, from which mixer's tensors the install holds.
fn layer_kind(inst: &FlashInstall, l: usize) -> Result<LayerKind, LoadError> {
    let linear = inst.has(&format!("{LM}layers.{l}.linear_attn.in_proj_qkv.weight"));
    let indexed = inst.has(&format!("{LM}layers.{l}.self_attn.q_proj.weight"));
    match (linear, indexed) {
        (true, false) => Ok(LayerKind::Linear),
        (false, true) => Ok(LayerKind::Indexed),
        _ => Err(LoadError::invalid(
            &inst.manifest.resident.file,
            format!(
                "layer {l} has {} linear_attn.in_proj_qkv and {} self_attn.q_proj; a qwen4_exp layer has exactly one",
                if linear { "a" } else { "no" },
                if indexed { "a" } else { "no" }
            ),
        )),
    }
}

/// The first `count` primes ≥ `from` (trial division: the bases are small).
fn primes_from(from: u64, count: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(count);
    let mut v = from;
    while out.len() < count {
        if is_prime(v) {
            out.push(v);
        }
        v += 1;
    }
    out
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3u64;
    while d.saturating_mul(d) <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// Read layer `l`'s PLE tables and check them against the config and its row pool;
/// `rank` is the layer's place among the PLE layers (its `ple_layer_index`). Every
/// error names the tensor (or pool) that disagrees.
pub fn load_ple_tables(
    inst: &FlashInstall,
    cfg: &FlashConfig,
    l: usize,
    rank: usize,
) -> Result<PleTables, LoadError> {
    let p = format!("{LM}layers.{l}.ple.ple_embedding.");
    let (mn, vn, on) = (
        format!("{p}layer_multipliers"),
        format!("{p}ngram_heads_vocab_sizes"),
        format!("{p}ngram_heads_offsets"),
    );
    let heads = cfg.ple.heads();
    let file = &inst.manifest.resident.file;
    let bad = |name: &str, msg: String| LoadError::invalid(file, format!("tensor {name}: {msg}"));
    let multipliers = inst.i64s(&mn, cfg.ple.ngram)?;
    let vocab_sizes = inst.i64s(&vn, heads)?;
    let offsets = inst.i64s(&on, heads)?;
    // The reference draws odd multipliers below (2^63 − 1) / vocab_size, so that a
    // token id times a multiplier never overflows.
    let bound = i64::MAX / cfg.vocab as i64;
    for (i, &m) in multipliers.iter().enumerate() {
        if m <= 0 || m % 2 == 0 || m > bound {
            return Err(bad(
                &mn,
                format!(
                    "multiplier {i} is {m}; the reference's are odd and in 1..={bound} for vocab_size {}",
                    cfg.vocab
                ),
            ));
        }
    }
    for (h, &v) in vocab_sizes.iter().enumerate() {
        if v <= 0 {
            return Err(bad(&vn, format!("head {h} has vocabulary {v}")));
        }
    }
    // What the config implies: head h of the PLE layer ranked `rank` among the PLE
    // layers has the (rank·heads + h + 1)-th prime ≥ ngram_vocab_size_base.
    if let Some(base) = cfg.ngram_vocab_size_base {
        let want = primes_from(base, (rank + 1) * heads);
        for (h, (&v, &w)) in vocab_sizes.iter().zip(&want[rank * heads..]).enumerate() {
            if v as u64 != w {
                return Err(bad(
                    &vn,
                    format!(
                        "head {h} has vocabulary {v}; the config implies {w} (prime {} from ngram_vocab_size_base {base}, PLE layer {rank})",
                        rank * heads + h + 1
                    ),
                ));
            }
        }
    }
    let mut total = 0i64;
    for (h, (&o, &v)) in offsets.iter().zip(&vocab_sizes).enumerate() {
        if o != total {
            return Err(bad(
                &on,
                format!("head {h} starts at row {o}; the vocabularies before it end at {total}"),
            ));
        }
        total += v;
    }
    let rows = inst.row_cache(l).ok_or_else(|| {
        LoadError::invalid(
            "manifest.json",
            format!("layer {l} has PLE tensors but no row pool"),
        )
    })?;
    let pool = rows.pool();
    if rows.width() * heads != cfg.ple_embed_dim {
        return Err(LoadError::invalid(
            &pool.file,
            format!(
                "rows are {} wide; ple_embed_dim {} over {heads} heads needs {}",
                rows.width(),
                cfg.ple_embed_dim,
                cfg.ple_embed_dim / heads
            ),
        ));
    }
    let want = match cfg.ngram_vocab_divisor {
        Some(d) => (total as u64).div_ceil(d) * d,
        None => total as u64,
    };
    if (cfg.ngram_vocab_divisor.is_some() && rows.rows() != want) || rows.rows() < total as u64 {
        return Err(LoadError::invalid(
            &pool.file,
            format!(
                "the table has {} rows; {vn} sums to {total}, padded to {want}",
                rows.rows()
            ),
        ));
    }
    Ok(PleTables {
        multipliers,
        vocab_sizes,
        offsets,
    })
}

impl<'a> FlashModel<'a> {
    /// Bind the install's tensors and check every shape against the config.
    pub fn new(
        install: &'a FlashInstall,
        backend: &'a dyn Backend,
    ) -> Result<FlashModel<'a>, LoadError> {
        let cfg = FlashConfig::from_manifest(&install.manifest)?;
        let inst = install;
        let h = cfg.hidden;
        let w = cfg.hc.width();
        let mut ple_layers: Vec<usize> = inst.rows.iter().map(|(l, _)| *l).collect();
        ple_layers.sort_unstable();
        for &l in &ple_layers {
            if l >= cfg.layers {
                return Err(LoadError::invalid(
                    "manifest.json",
                    format!("a row pool for layer {l}, past the {} layers", cfg.layers),
                ));
            }
        }
        let mut kinds = Vec::with_capacity(cfg.layers);
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("{LM}layers.{l}.");
            let t = |n: &str| format!("{p}{n}");
            let kind = layer_kind(inst, l)?;
            let ple = if let Some(rank) = ple_layers.iter().position(|&p| p == l) {
                if kind != LayerKind::Linear {
                    return Err(LoadError::invalid(
                        "manifest.json",
                        format!("layer {l} has PLE rows but is not a linear_attention layer"),
                    ));
                }
                let e = cfg.ple_embed_dim;
                let k = cfg.ple.conv_kernel;
                Some(PleWeights {
                    key: inst.matrix(&t("ple.key_proj.weight"), w, e)?,
                    value: inst.matrix(&t("ple.value_proj.weight"), h, e)?,
                    norm_key: inst.floats(&t("ple.norm_key.weight"), &[w])?,
                    norm_query: inst.floats(&t("ple.norm_query.weight"), &[w])?,
                    norm_conv: inst.floats(&t("ple.norm_conv.weight"), &[w])?,
                    conv: inst.floats(&t("ple.conv1d.weight"), &[w, 1, k])?,
                    tables: load_ple_tables(inst, &cfg, l, rank)?,
                })
            } else {
                None
            };
            let mixer = match kind {
                LayerKind::Linear => {
                    let g = &cfg.gdn;
                    let (kd, vd, ch) = (
                        g.key_heads * g.key_dim,
                        g.value_heads * g.value_dim,
                        g.channels(),
                    );
                    debug_assert_eq!(ch, 2 * kd + vd);
                    let q = |n: &str| format!("{p}linear_attn.{n}");
                    Mixer::Gdn(GdnWeights {
                        qkv: inst.matrix(&q("in_proj_qkv.weight"), ch, h)?,
                        z: inst.matrix(&q("in_proj_z.weight"), vd, h)?,
                        b: inst.matrix(&q("in_proj_b.weight"), g.value_heads, h)?,
                        a: inst.matrix(&q("in_proj_a.weight"), g.value_heads, h)?,
                        conv: inst.floats(&q("conv1d.weight"), &[ch, 1, g.conv_kernel])?,
                        a_log: inst.floats(&q("A_log"), &[g.value_heads])?,
                        dt_bias: inst.floats(&q("dt_bias"), &[g.value_heads])?,
                        norm: inst.floats(&q("norm.weight"), &[g.value_dim])?,
                        out: inst.matrix(&q("out_proj.weight"), h, vd)?,
                    })
                }
                LayerKind::Indexed => {
                    let a = &cfg.attn;
                    let (qw, kvw) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
                    let ix = &a.indexer;
                    let q = |n: &str| format!("{p}self_attn.{n}");
                    Mixer::Attn(AttnWeights {
                        q: inst.matrix(&q("q_proj.weight"), 2 * qw, h)?,
                        k: inst.matrix(&q("k_proj.weight"), kvw, h)?,
                        v: inst.matrix(&q("v_proj.weight"), kvw, h)?,
                        o: inst.matrix(&q("o_proj.weight"), h, qw)?,
                        q_norm: inst.floats(&q("q_norm.weight"), &[a.head_dim])?,
                        k_norm: inst.floats(&q("k_norm.weight"), &[a.head_dim])?,
                        indexer: IndexerWeights {
                            qk: inst.matrix(
                                &q("indexer.index_qk_proj.weight"),
                                (ix.heads + 1) * ix.head_dim,
                                h,
                            )?,
                            q_norm: inst
                                .floats(&q("indexer.q_layernorm.weight"), &[ix.head_dim])?,
                            k_norm: inst
                                .floats(&q("indexer.k_layernorm.weight"), &[ix.head_dim])?,
                        },
                    })
                }
            };
            let pool = inst.experts.pool(l).ok_or_else(|| {
                LoadError::invalid("manifest.json", format!("no expert pool for layer {l}"))
            })?;
            let (i, hh) = (cfg.moe_intermediate as u64, h as u64);
            let shapes: Vec<(u64, u64)> = pool.parts.iter().map(|b| (b.rows, b.cols)).collect();
            let want = [(i, hh), (i, hh), (hh, i)];
            if pool.experts != cfg.moe.experts as u64 || shapes != want {
                return Err(LoadError::invalid(
                    &pool.file,
                    format!(
                        "{} experts of shapes {shapes:?}, the config implies {} of {want:?}",
                        pool.experts, cfg.moe.experts
                    ),
                ));
            }
            let si = cfg.shared_intermediate;
            layers.push(FlashLayer {
                ple,
                attn_hc: hc(inst, &cfg, &t("attn_hyper_connection."), true)?,
                mixer,
                mlp_hc: hc(inst, &cfg, &t("mlp_hyper_connection."), true)?,
                moe: MoeWeights {
                    router: inst.matrix(&t("mlp.gate.weight"), cfg.moe.experts, h)?,
                    shared_gate: inst.matrix(&t("mlp.shared_expert_gate.weight"), 1, h)?,
                    shared_w_gate: inst.matrix(&t("mlp.shared_expert.gate_proj.weight"), si, h)?,
                    shared_w_up: inst.matrix(&t("mlp.shared_expert.up_proj.weight"), si, h)?,
                    shared_w_down: inst.matrix(&t("mlp.shared_expert.down_proj.weight"), h, si)?,
                },
            });
            kinds.push(kind);
        }
        Ok(FlashModel {
            embed: inst.matrix(&format!("{LM}embed_tokens.weight"), cfg.vocab, h)?,
            head: inst.matrix("lm_head.weight", cfg.vocab, h)?,
            mixer: hc(inst, &cfg, &format!("{LM}hyper_connection_mixer."), false)?,
            rope: Rope::new(cfg.rope_theta, cfg.rotary_dim),
            cfg,
            kinds,
            install,
            backend,
            layers,
        })
    }

    /// The layers' weights (each op can be run on its own, as the tests do).
    pub fn layers(&self) -> &[FlashLayer<'a>] {
        &self.layers
    }

    /// The final hyper-connection mixer.
    pub fn mixer(&self) -> &HyperConnection<'a> {
        &self.mixer
    }

    /// An empty session.
    pub fn session(&self) -> FlashSession {
        FlashSession {
            mixers: self
                .kinds
                .iter()
                .map(|k| match k {
                    LayerKind::Linear => MixerState::Gdn(GdnState::new(&self.cfg.gdn)),
                    LayerKind::Indexed => MixerState::Attn(AttnCache::default()),
                })
                .collect(),
            ple: self
                .layers
                .iter()
                .map(|l| l.ple.as_ref().map(|_| PleState::new(&self.cfg.ple)))
                .collect(),
            pos: 0,
        }
    }

    /// Run `tokens` after the session's state; returns the logits of every position
    /// (`[T, vocab]`). With a trace, records the intermediate values. Bad input (a
    /// token outside the vocabulary, a sequence past `max_position_embeddings`) is
    /// refused before anything changes; after an I/O error part-way the session is
    /// part-way too and should be dropped.
    pub fn forward(
        &self,
        s: &mut FlashSession,
        tokens: &[u32],
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, LoadError> {
        let c = &self.cfg;
        let be = self.backend;
        let t = tokens.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            return Err(LoadError::invalid(
                "input",
                format!("token id {bad} is outside the vocabulary ({})", c.vocab),
            ));
        }
        if s.pos + t > c.max_positions {
            return Err(LoadError::invalid(
                "input",
                format!(
                    "sequence of {} tokens exceeds max_position_embeddings {}",
                    s.pos + t,
                    c.max_positions
                ),
            ));
        }
        let (h, w) = (c.hidden, c.hc.width());
        let ids: Vec<i64> = tokens.iter().map(|&id| id as i64).collect();
        let mut e = vec![0f32; t * h];
        for (i, &id) in tokens.iter().enumerate() {
            be.row(&self.embed, id as usize, &mut e[i * h..(i + 1) * h]);
        }
        let mut x = vec![0f32; t * w];
        for (xr, er) in x.chunks_exact_mut(w).zip(e.chunks_exact(h)) {
            for j in 0..c.hc.streams {
                xr[j * h..(j + 1) * h].copy_from_slice(er);
            }
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.put("embed".into(), &e);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("layers.{l}");
            if let Some(tr) = trace.as_deref_mut() {
                tr.put(format!("{p}.in"), &x);
            }
            if let (Some(pw), Some(ps)) = (&layer.ple, s.ple[l].as_mut()) {
                let rows = self.install.row_cache(l).ok_or_else(|| {
                    LoadError::invalid("manifest.json", format!("no row pool for layer {l}"))
                })?;
                let o = ple_forward(be, pw, &c.ple, rows, ps, &x, &ids)?;
                for (a, b) in x.iter_mut().zip(&o.out) {
                    *a += b;
                }
                if let Some(tr) = trace.as_deref_mut() {
                    tr.put_ints(format!("{p}.ple.ids"), o.ids.iter().map(|&i| i as i64));
                    tr.put(format!("{p}.ple.emb"), &o.emb);
                    tr.put(format!("{p}.ple.out"), &o.out);
                }
            }
            let r = hc_read(be, &layer.attn_hc, c.hc, &x, t);
            let y = match (&layer.mixer, &mut s.mixers[l]) {
                (Mixer::Gdn(gw), MixerState::Gdn(gs)) => {
                    let o = gdn_forward(be, gw, &c.gdn, gs, &r.mixed, t);
                    if let Some(tr) = trace.as_deref_mut() {
                        tr.put(format!("{p}.gdn.qkv"), &o.qkv);
                        tr.put(format!("{p}.gdn.core"), &o.core);
                        tr.put(format!("{p}.gdn.gated"), &o.gated);
                        tr.put(format!("{p}.gdn.out"), &o.out);
                    }
                    o.out
                }
                (Mixer::Attn(aw), MixerState::Attn(ac)) => {
                    let o = attention_forward(be, aw, &c.attn, &self.rope, ac, &r.mixed, t);
                    if let Some(tr) = trace.as_deref_mut() {
                        tr.put(format!("{p}.attn.gated"), &o.gated);
                        tr.put(format!("{p}.attn.out"), &o.out);
                        tr.blocks.entry(p.clone()).or_default().extend(o.blocks);
                        tr.scores.entry(p.clone()).or_default().extend(o.scores);
                    }
                    o.out
                }
                _ => {
                    return Err(LoadError::invalid(
                        "session",
                        format!("layer {l}: the session was made for another model"),
                    ));
                }
            };
            if let Some(tr) = trace.as_deref_mut() {
                tr.put_hc(&format!("{p}.attn_hc"), &r);
            }
            hc_write(&mut x, &r.inject, &y, c.hc);
            if let Some(tr) = trace.as_deref_mut() {
                tr.put(format!("{p}.after_attn"), &x);
            }
            let r = hc_read(be, &layer.mlp_hc, c.hc, &x, t);
            let o = moe_forward(
                be,
                &layer.moe,
                &c.moe,
                &self.install.experts,
                l,
                &r.mixed,
                t,
            )?;
            hc_write(&mut x, &r.inject, &o.out, c.hc);
            if let Some(tr) = trace.as_deref_mut() {
                tr.put_hc(&format!("{p}.mlp_hc"), &r);
                tr.put(format!("{p}.moe.router_logits"), &o.router_logits);
                for rt in &o.routes {
                    tr.put_ints(
                        format!("{p}.moe.topk_idx"),
                        rt.experts.iter().map(|&e| e as i64),
                    );
                    tr.put(format!("{p}.moe.topk_w"), &rt.weights);
                }
                tr.put(format!("{p}.moe.shared"), &o.shared);
                tr.put(format!("{p}.moe.out"), &o.out);
                tr.put(format!("{p}.out"), &x);
            }
        }
        let r = hc_read(be, &self.mixer, c.hc, &x, t);
        let mut logits = vec![0f32; t * c.vocab];
        be.matmul(&self.head, &r.mixed, t, &mut logits);
        if let Some(tr) = trace {
            tr.put("mixer.out".into(), &r.mixed);
            tr.put("logits".into(), &logits);
        }
        s.pos += t;
        Ok(logits)
    }
}
