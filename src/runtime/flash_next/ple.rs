//! The PLE n-gram embedding (`Qwen4ExpTextNGramEmbedding`, `Qwen4ExpTextPLELayer`),
//! added to the residual before the attention block of the layers in `ple_layer_ids`.
//!
//! # Row ids (exact integer arithmetic)
//! With `t_s` the token `s` places back (or `eos` where that crosses the start or the
//! token right after an EOS: an EOS ends its segment), `m = layer_multipliers`, head
//! vocabularies `V_h` and offsets `O_h` read from the install's I64 tables (never
//! recomputed):
//! ```text
//! bigram heads  h < hpn:      id_h = ((t0·m0) ^ (t1·m1)) mod V_h + O_h
//! trigram heads hpn ≤ h < 2hpn: id_h = ((t0·m0) ^ (t1·m1) ^ (t2·m2)) mod V_h + O_h
//! ```
//! in int64 as the reference computes it: wrapping products, XOR, and a floor `mod`
//! (`torch.remainder`, non-negative for `V_h > 0`). The reference's multipliers are
//! bounded so that the products never wrap for valid ids, but this is exact either way.
//! The history is the last `ngram_size − 1` raw ids (EOS before the prompt), and the
//! segment rule is applied inside that window, as the reference's cache does.
//!
//! # The layer
//! Per token, with `x` the `[S·H]` residual entering the layer:
//! ```text
//! E     = concat_h rows[id_h]                       [ple_embed_dim]
//! key   = norm_key(key_proj · E)                    [S, H] per-stream offset norm
//! value = value_proj · E                            [H]    (no norm)
//! qry   = norm_query(x)                             [S, H]
//! g_j   = Σ key_j ⊙ qry_j / √H;  g_j = sign(g_j) · √max(|g_j|, 1e-6)
//! gv_j  = sigmoid(g_j) · value                      [S·H]
//! c[t]  = silu(Σ_i conv1d[ch, i] · norm_conv(gv)[t − (K−1−i)·D])   dilation D = ngram_size
//! x    += gv + c
//! ```
//! The conv state is the last `(K−1)·D` columns of `norm_conv(gv)` (zeros before the
//! prompt).

use super::norm::{offset_rms_norm, offset_rms_norm_inplace, sigmoid, silu};
use super::rows::RowCache;
use crate::runtime::kernels::{Backend, Matrix};
use crate::runtime::load::LoadError;

/// The I64 tables of one PLE layer, as installed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleTables {
    /// `layer_multipliers` `[ngram_size]`.
    pub multipliers: Vec<i64>,
    /// `ngram_heads_vocab_sizes` `[heads]`.
    pub vocab_sizes: Vec<i64>,
    /// `ngram_heads_offsets` `[heads]`.
    pub offsets: Vec<i64>,
}

/// PLE geometry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PleDims {
    /// `ngram_size` (3): orders 2 ..= ngram_size, and the conv dilation.
    pub ngram: usize,
    /// Heads per order (`heads_per_ngram`).
    pub heads_per_ngram: usize,
    /// Elements per row (`ple_embed_dim / heads`).
    pub row_width: usize,
    /// Conv taps `K` (`ple_conv_kernel_size`).
    pub conv_kernel: usize,
    /// Streams `S`.
    pub streams: usize,
    /// Stream width `H`.
    pub hidden: usize,
    /// Norm epsilon.
    pub eps: f32,
    /// `eos_token_id`.
    pub eos: i64,
}

impl PleDims {
    /// Heads: `(ngram_size − 1) · heads_per_ngram`.
    pub fn heads(&self) -> usize {
        self.ngram.saturating_sub(1) * self.heads_per_ngram
    }

    /// `ple_embed_dim`.
    pub fn embed_dim(&self) -> usize {
        self.heads() * self.row_width
    }

    /// Conv state columns: `(K − 1) · D`.
    pub fn conv_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.ngram
    }
}

/// One PLE layer's resident weights (its rows live in the row cache).
pub struct PleWeights<'a> {
    /// `key_proj` `[S·H, E]`.
    pub key: Matrix<'a>,
    /// `value_proj` `[H, E]`.
    pub value: Matrix<'a>,
    /// `norm_key.weight` `[S·H]` (offset, per stream).
    pub norm_key: Vec<f32>,
    /// `norm_query.weight` `[S·H]`.
    pub norm_query: Vec<f32>,
    /// `norm_conv.weight` `[S·H]`.
    pub norm_conv: Vec<f32>,
    /// `conv1d.weight` `[S·H, 1, K]` flattened (`ch·K + i`).
    pub conv: Vec<f32>,
    /// The I64 tables.
    pub tables: PleTables,
}

/// Per-sequence PLE state of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct PleState {
    /// The last `ngram_size − 1` token ids, oldest first (EOS before the prompt).
    pub history: Vec<i64>,
    /// The last `(K−1)·D` rows of `norm_conv(gv)` (`[(K−1)·D, S·H]`, oldest first).
    pub conv: Vec<f32>,
}

impl PleState {
    /// The state before the first token.
    pub fn new(d: &PleDims) -> PleState {
        PleState {
            history: vec![d.eos; d.ngram.saturating_sub(1)],
            conv: vec![0.0; d.conv_len() * d.streams * d.hidden],
        }
    }

    /// Bytes the state holds.
    pub fn bytes(&self) -> usize {
        self.history.len() * 8 + self.conv.len() * 4
    }
}

/// The row ids of `tokens` (`[T, heads]`, global rows of the concatenated table),
/// advancing `history`.
pub fn ngram_ids(tables: &PleTables, d: &PleDims, history: &mut [i64], tokens: &[i64]) -> Vec<u64> {
    let (n, hpn) = (d.ngram, d.heads_per_ngram);
    let ctx = n.saturating_sub(1);
    assert!(
        history.len() == ctx
            && tables.multipliers.len() == n
            && tables.vocab_sizes.len() == d.heads(),
        "ngram_ids: table lengths (validated at load)"
    );
    let mut hist = history.to_vec();
    hist.extend_from_slice(tokens);
    let mut out = Vec::with_capacity(tokens.len() * d.heads());
    // The segment start for a position: one past the last EOS strictly before it.
    let mut seg_start = 0usize;
    for (p, _) in hist.iter().enumerate().take(ctx) {
        if hist[p] == d.eos {
            seg_start = p + 1;
        }
    }
    for p in ctx..hist.len() {
        let t = |s: usize| {
            if p >= seg_start + s {
                hist[p - s]
            } else {
                d.eos
            }
        };
        let mut mix = t(0).wrapping_mul(tables.multipliers[0]);
        for order in 2..=n {
            mix ^= t(order - 1).wrapping_mul(tables.multipliers[order - 1]);
            let base = (order - 2) * hpn;
            for h in base..base + hpn {
                // Sizes are validated positive at load; rem_euclid is torch.remainder.
                let id = mix.rem_euclid(tables.vocab_sizes[h]) + tables.offsets[h];
                out.push(id as u64);
            }
        }
        if hist[p] == d.eos {
            seg_start = p + 1;
        }
    }
    history.copy_from_slice(&hist[hist.len() - ctx..]);
    out
}

/// What one PLE call computes for `T` tokens.
#[derive(Debug, Clone, Default)]
pub struct PleOut {
    /// Row ids `[T, heads]`.
    pub ids: Vec<u64>,
    /// The concatenated rows `E` `[T, ple_embed_dim]`.
    pub emb: Vec<f32>,
    /// What the layer adds to the residual, `gv + c` `[T, S·H]`.
    pub out: Vec<f32>,
}

/// Run `T` tokens through one PLE layer: `x` is the residual entering the layer
/// (`[T, S·H]`), `tokens` their ids. Advances `state`.
pub fn ple_forward(
    be: &dyn Backend,
    w: &PleWeights,
    d: &PleDims,
    rows: &RowCache,
    state: &mut PleState,
    x: &[f32],
    tokens: &[i64],
) -> Result<PleOut, LoadError> {
    let t = tokens.len();
    let (s, h) = (d.streams, d.hidden);
    let wide = s * h;
    let (heads, rw, e) = (d.heads(), d.row_width, d.embed_dim());
    assert_eq!(x.len(), t * wide, "ple_forward: x length");
    let ids = ngram_ids(&w.tables, d, &mut state.history, tokens);
    let mut emb = vec![0f32; t * e];
    for (row, dst) in ids.iter().zip(emb.chunks_exact_mut(rw)) {
        rows.fetch(*row, dst)?;
    }
    debug_assert_eq!(ids.len(), t * heads);
    let mut key = vec![0f32; t * wide];
    be.matmul(&w.key, &emb, t, &mut key);
    offset_rms_norm_inplace(&mut key, &w.norm_key, h, d.eps);
    let mut value = vec![0f32; t * h];
    be.matmul(&w.value, &emb, t, &mut value);
    let mut qry = vec![0f32; t * wide];
    offset_rms_norm(x, &w.norm_query, h, d.eps, &mut qry);
    let scale = (h as f32).sqrt();
    let mut gv = vec![0f32; t * wide];
    for ti in 0..t {
        let v = &value[ti * h..(ti + 1) * h];
        for j in 0..s {
            let a = ti * wide + j * h;
            let mut g: f32 = key[a..a + h]
                .iter()
                .zip(&qry[a..a + h])
                .map(|(k, q)| k * q)
                .sum();
            g /= scale;
            let mag = g.abs().max(1e-6).sqrt();
            // sign(0) = 0, as torch.sign.
            let g = if g > 0.0 {
                mag
            } else if g < 0.0 {
                -mag
            } else {
                0.0
            };
            let gate = sigmoid(g);
            for (o, &vv) in gv[a..a + h].iter_mut().zip(v) {
                *o = gate * vv;
            }
        }
    }
    let mut gvn = vec![0f32; t * wide];
    offset_rms_norm(&gv, &w.norm_conv, h, d.eps, &mut gvn);
    // Dilated depthwise conv over rows −(K−1)·D … T−1.
    let (k, dil, past) = (d.conv_kernel, d.ngram, d.conv_len());
    let mut ext = Vec::with_capacity(state.conv.len() + gvn.len());
    ext.extend_from_slice(&state.conv);
    ext.extend_from_slice(&gvn);
    let mut out = gv;
    for ti in 0..t {
        for ch in 0..wide {
            let taps = &w.conv[ch * k..(ch + 1) * k];
            let mut acc = 0f32;
            for (i, &wt) in taps.iter().enumerate() {
                // Row t − (K−1−i)·D, offset by the `past` rows of state.
                acc += wt * ext[(ti + past - (k - 1 - i) * dil) * wide + ch];
            }
            out[ti * wide + ch] += silu(acc);
        }
    }
    let keep = state.conv.len();
    state.conv.copy_from_slice(&ext[ext.len() - keep..]);
    Ok(PleOut { ids, emb, out })
}
