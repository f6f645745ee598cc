//! The CPU's [`FlashOps`] (the Flash-Next runner's operations beyond the core
//! [`Backend`] seam, declared in [`super::seam`]), over the pure slice functions of
//! this module's siblings.
//!
//! The runner ([`super::model`]) calls the core ops for everything they cover
//! (projections [`Backend::linear`], per-head and per-row norms [`Backend::rms_norm`],
//! RoPE, the embedding, routing, expert slots and expert FFNs, the shared expert's
//! SwiGLU, additions) and these for the rest: the grouped offset norm of the `[S·H]`
//! residual, the hyper-connection mix and write-back, the causal (dilated) depthwise
//! conv with its state, the gated-delta-rule recurrence, the GDN's gated norm, the PLE
//! gate, the indexer's block scores and the attention over the indexer's selection.
//! Every tensor stays a backend [`Backend::Buf`]; what crosses to the host is what the
//! host decides with: the indexer's block scores (the selection follows torch's tie
//! rule, [`super::topk`]), and the routing.
//!
//! Each op's doc gives its formula; the CPU computes exactly what the runner computed
//! inline before the seam (same order of operations, so the goldens' agreement did
//! not move). Lengths that disagree with the documented shapes are a runner bug: the
//! CPU panics (never reads out of bounds).

use std::ops::Range;

use super::attention::{allowed_positions, block_scores};
use super::gdn::{causal_conv_silu, gdn_recurrence};
use super::norm::{GateAct, gated_rms_norm, offset_rms_norm, sigmoid, silu};
/// The seam, where its users have long found it.
pub use super::seam::{Act, FlashOps};
use super::seam::{GdnDims, HcDims, IndexerDims};
use crate::runtime::kernels::{
    Backend, Causal, Cpu, CpuRope, NormGain, OpResult, axpy, dot, softmax_inplace,
};

/// Rows of a `width`-wide tensor of `len` elements, panicking when it is not whole.
fn rows_of(op: &str, len: usize, width: usize) -> usize {
    assert!(
        width > 0 && len.is_multiple_of(width),
        "{op}: {len} elements are not rows of {width}"
    );
    len / width
}

/// The CPU's indexed-attention cache.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuAttnCache {
    /// Keys after norm and RoPE, `[len, nkv·d]`.
    pub k: Vec<f32>,
    /// Values `[len, nkv·d]`.
    pub v: Vec<f32>,
    /// The indexer's raw keys `[len, d_i]`.
    pub raw_keys: Vec<f32>,
    /// Pooled, normed and rotated keys of the complete blocks `[len / cr, d_i]`.
    pub block_keys: Vec<f32>,
    kv_width: usize,
    head_dim: usize,
    indexer: Option<IndexerDims>,
}

impl FlashOps for Cpu {
    type AttnCache = CpuAttnCache;

    fn norm_grouped(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        group: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> OpResult {
        offset_rms_norm(x, w, group, eps, out);
        Ok(())
    }

    fn act(&self, x: &mut Vec<f32>, act: Act) -> OpResult {
        match act {
            Act::SiluOver(d) => x.iter_mut().for_each(|v| *v = silu(*v / d)),
            Act::Sigmoid => x.iter_mut().for_each(|v| *v = sigmoid(*v)),
            Act::TwoSigmoidOver(d) => x.iter_mut().for_each(|v| *v = 2.0 * sigmoid(*v / d)),
        }
        Ok(())
    }

    fn sigmoid_mul(&self, x: &mut Vec<f32>, gate: &Vec<f32>) -> OpResult {
        assert_eq!(x.len(), gate.len(), "sigmoid_mul: lengths");
        for (x, &g) in x.iter_mut().zip(gate) {
            *x *= sigmoid(g);
        }
        Ok(())
    }

    fn scale_rows_sigmoid(&self, x: &mut Vec<f32>, g: &Vec<f32>) -> OpResult {
        let width = x.len() / g.len().max(1);
        assert_eq!(width * g.len(), x.len(), "scale_rows_sigmoid: lengths");
        for (row, &g) in x.chunks_exact_mut(width.max(1)).zip(g) {
            let s = sigmoid(g);
            for v in row {
                *v *= s;
            }
        }
        Ok(())
    }

    fn gather_cols(
        &self,
        x: &Vec<f32>,
        width: usize,
        cols: Range<usize>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let n = rows_of("gather_cols", x.len(), width);
        assert!(cols.end <= width, "gather_cols: columns past the row");
        assert_eq!(out.len(), n * cols.len(), "gather_cols: out length");
        for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(cols.len())) {
            o.copy_from_slice(&row[cols.clone()]);
        }
        Ok(())
    }

    fn hc_expand(&self, e: &Vec<f32>, d: HcDims, out: &mut Vec<f32>) -> OpResult {
        let (s, h) = (d.streams, d.hidden);
        let n = rows_of("hc_expand", e.len(), h);
        assert_eq!(out.len(), n * s * h, "hc_expand: out length");
        for (xr, er) in out.chunks_exact_mut(s * h).zip(e.chunks_exact(h)) {
            for j in 0..s {
                xr[j * h..(j + 1) * h].copy_from_slice(er);
            }
        }
        Ok(())
    }

    fn hc_mix(&self, mix: &Vec<f32>, xn: &Vec<f32>, d: HcDims, out: &mut Vec<f32>) -> OpResult {
        let (s, h, w) = (d.streams, d.hidden, d.width());
        let n = rows_of("hc_mix", mix.len(), w);
        assert!(
            xn.len() == mix.len() && out.len() == n * h,
            "hc_mix: lengths"
        );
        for ((u, m), xn) in out
            .chunks_exact_mut(h)
            .zip(mix.chunks_exact(w))
            .zip(xn.chunks_exact(w))
        {
            for (c, uc) in u.iter_mut().enumerate() {
                let mut acc = 0f32;
                for j in 0..s {
                    acc += m[j * h + c] * xn[j * h + c];
                }
                *uc = acc / s as f32;
            }
        }
        Ok(())
    }

    fn hc_inject(&self, x: &mut Vec<f32>, inject: &Vec<f32>, y: &Vec<f32>, d: HcDims) -> OpResult {
        let (s, h, w) = (d.streams, d.hidden, d.width());
        let n = rows_of("hc_inject", y.len(), h);
        assert!(
            x.len() == n * w && inject.len() == n * s,
            "hc_inject: lengths"
        );
        for ((xt, it), yt) in x
            .chunks_exact_mut(w)
            .zip(inject.chunks_exact(s))
            .zip(y.chunks_exact(h))
        {
            for (j, &g) in it.iter().enumerate() {
                for (xv, &yv) in xt[j * h..(j + 1) * h].iter_mut().zip(yt) {
                    *xv += yv * g;
                }
            }
        }
        Ok(())
    }

    fn causal_conv_silu(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        taps: usize,
        dilation: usize,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        causal_conv_silu(x, w, taps, dilation, state, out);
        Ok(())
    }

    fn gdn_recurrence(
        &self,
        conv: &Vec<f32>,
        b: &Vec<f32>,
        a: &Vec<f32>,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        dims: &GdnDims,
        state: &mut Vec<f32>,
        core: &mut Vec<f32>,
    ) -> OpResult {
        gdn_recurrence(conv, b, a, a_log, dt_bias, dims, state, core);
        Ok(())
    }

    fn gated_norm(
        &self,
        o: &Vec<f32>,
        z: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        act: GateAct,
        out: &mut Vec<f32>,
    ) -> OpResult {
        gated_rms_norm(o, z, w, eps, act, out);
        Ok(())
    }

    fn ple_gate(
        &self,
        key: &Vec<f32>,
        qry: &Vec<f32>,
        value: &Vec<f32>,
        d: HcDims,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let (streams, h, wide) = (d.streams, d.hidden, d.width());
        let t = rows_of("ple_gate", value.len(), h);
        assert!(
            key.len() == t * wide && qry.len() == key.len() && out.len() == key.len(),
            "ple_gate: lengths"
        );
        let scale = (h as f32).sqrt();
        for ti in 0..t {
            let v = &value[ti * h..(ti + 1) * h];
            for j in 0..streams {
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
                for (o, &vv) in out[a..a + h].iter_mut().zip(v) {
                    *o = gate * vv;
                }
            }
        }
        Ok(())
    }

    fn attn_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        indexer: IndexerDims,
    ) -> OpResult<CpuAttnCache> {
        assert!(kv_heads > 0 && head_dim > 0, "attn_cache: empty heads");
        Ok(CpuAttnCache {
            kv_width: kv_heads * head_dim,
            head_dim,
            indexer: Some(indexer),
            ..CpuAttnCache::default()
        })
    }

    fn indexer_scores(
        &self,
        cache: &mut CpuAttnCache,
        iq: &Vec<f32>,
        raw: &Vec<f32>,
        k_norm: &Vec<f32>,
        eps: f32,
        rope: &CpuRope,
        pos: usize,
    ) -> OpResult<Vec<Vec<f32>>> {
        let ix = cache
            .indexer
            .expect("indexer_scores: a cache made by attn_cache");
        let (di, cr, ni) = (ix.head_dim, ix.compress, ix.heads);
        let t = rows_of("indexer_scores", raw.len(), di);
        assert_eq!(iq.len(), t * ni * di, "indexer_scores: iq length");
        assert!(
            pos * di <= cache.raw_keys.len(),
            "indexer_scores: position past the cache"
        );
        cache.raw_keys.truncate(pos * di);
        cache.block_keys.truncate(pos / cr * di);
        cache.raw_keys.extend_from_slice(raw);
        let mut scores = Vec::with_capacity(t);
        for ti in 0..t {
            let p = pos + ti;
            // Blocks completed up to this query get their pooled keys.
            let n = (p + 1) / cr;
            while cache.block_keys.len() / di < n {
                let b = cache.block_keys.len() / di;
                let blk = &cache.raw_keys[b * cr * di..(b + 1) * cr * di];
                let mut mean = vec![0f32; di];
                for r in blk.chunks_exact(di) {
                    for (m, &x) in mean.iter_mut().zip(r) {
                        *m += x;
                    }
                }
                for m in &mut mean {
                    *m /= cr as f32;
                }
                let mut key = vec![0f32; di];
                self.rms_norm(&mean, k_norm, eps, NormGain::OnePlusWeight, &mut key)?;
                self.rope(rope, &mut key, 1, di, b * cr)?;
                cache.block_keys.extend_from_slice(&key);
            }
            scores.push(block_scores(
                &iq[ti * ni * di..(ti + 1) * ni * di],
                &cache.block_keys[..n * di],
                di,
            ));
        }
        Ok(scores)
    }

    fn indexed_attention(
        &self,
        cache: &mut CpuAttnCache,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        at: Causal,
        blocks: &[Vec<usize>],
        out: &mut Vec<f32>,
    ) -> OpResult {
        let ix = cache
            .indexer
            .expect("indexed_attention: a cache made by attn_cache");
        let (hd, kvw) = (cache.head_dim, cache.kv_width);
        let kv_heads = kvw / hd;
        let n = rows_of("indexed_attention", k.len(), kvw);
        let qw = at.heads * hd;
        assert!(
            at.heads.is_multiple_of(kv_heads) && at.heads > 0,
            "indexed_attention: {} query heads over {kv_heads} KV heads",
            at.heads
        );
        assert!(
            q.len() == n * qw && v.len() == k.len() && out.len() == q.len() && blocks.len() == n,
            "indexed_attention: lengths"
        );
        assert!(
            at.pos * kvw <= cache.k.len(),
            "indexed_attention: position past the cache"
        );
        cache.k.truncate(at.pos * kvw);
        cache.v.truncate(at.pos * kvw);
        cache.k.extend_from_slice(k);
        cache.v.extend_from_slice(v);
        let group = at.heads / kv_heads;
        for (i, sel) in blocks.iter().enumerate() {
            let p = at.pos + i;
            let allowed = allowed_positions(sel, ix.compress, p);
            let mut att = vec![0f32; allowed.len()];
            for h in 0..at.heads {
                let kvh = h / group;
                let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
                for (s, &j) in att.iter_mut().zip(&allowed) {
                    *s = dot(qh, &cache.k[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) * at.scale;
                }
                softmax_inplace(&mut att);
                let oh = &mut out[i * qw + h * hd..i * qw + (h + 1) * hd];
                oh.fill(0.0);
                for (&pr, &j) in att.iter().zip(&allowed) {
                    axpy(
                        pr,
                        &cache.v[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd],
                        oh,
                    );
                }
            }
        }
        Ok(())
    }
}
