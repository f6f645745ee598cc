//! [`Backend`] for [`Cpu`]: tensors are `Vec<f32>` and weights the [`Matrix`] views of
//! the install's mapped bytes, so nothing is copied at load. Each op is the loop the
//! decoder ran inline before the seam, in the same order (same tokens, bit for bit);
//! products go through [`Cpu::matmul`].

use std::ops::Range;

use super::backend::{
    AttentionSpec, Backend, BackendError, Causal, ExpertRef, KvRows, NormGain, OpResult,
    RopeLayout, Routing,
};
use super::routing::{RouterBias, RoutingSpec, route_logits};
use super::{Cpu, Matrix, axpy, dot, expert_matrices, rms_norm, silu_mul, softmax_inplace};
use crate::format::pools::ExpertPool;

mod elementwise;
mod hyper;
mod linear_attention;
pub(crate) mod math;
mod ngram;
mod sparse_attention;

pub use linear_attention::{causal_conv_silu, delta_rule_step, gdn_recurrence};
pub use sparse_attention::{CpuAttnCache, allowed_positions, block_scores};

/// RoPE frequencies; the angles are computed per position as they are used.
#[derive(Debug, Clone)]
pub struct CpuRope {
    inv_freq: Vec<f32>,
    layout: RopeLayout,
    /// The positions the table is for: the angles are computed per call, but a call
    /// outside them is the caller's error on every backend.
    positions: Range<usize>,
}

/// One layer's keys `[positions, kv_heads·qk_dim]` and values `[positions,
/// kv_heads·v_dim]` of the positions `start..` it holds, grown as tokens arrive. A
/// windowed cache ([`AttentionSpec::window`]) drops the positions no query can see
/// again ([`CpuKv::slide`]), so it holds about a window, not the whole context.
#[derive(Debug, Clone)]
pub struct CpuKv {
    k: Vec<f32>,
    v: Vec<f32>,
    spec: AttentionSpec,
    /// The first position held (0 unless a window slid past it).
    start: usize,
}

/// Bytes of `n` f32 values.
pub(crate) fn f32_bytes(n: usize) -> u64 {
    (n as u64).saturating_mul(size_of::<f32>() as u64)
}

impl CpuKv {
    /// The end (exclusive) of the positions held.
    pub fn positions(&self) -> usize {
        self.start + self.k.len() / self.spec.k_width()
    }

    /// The first position held.
    pub fn start(&self) -> usize {
        self.start
    }

    /// After a pass whose first query was at `pos`: drop the positions no query sees
    /// again when [`AttentionSpec::slide_to`] says so; the capacity follows when it is
    /// more than twice what is held (a long prefill's).
    fn slide(&mut self, pos: usize) {
        let Some(keep_from) = self.spec.slide_to(pos, self.start) else {
            return;
        };
        let drop = keep_from - self.start;
        self.k.drain(..drop * self.spec.k_width());
        self.v.drain(..drop * self.spec.stored_v_width());
        self.start = keep_from;
        for c in [&mut self.k, &mut self.v] {
            if c.capacity() > 2 * c.len() {
                c.shrink_to(c.len() * 3 / 2);
            }
        }
    }
}

/// `x = softmax([x, sink])` without the sink's own weight: `e^(x_j − m) / (Σ e^(x_j −
/// m) + e^(sink − m))` with `m` the largest of `x` and `sink`.
fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum += (sink - max).exp();
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Rows of `x` for a `width`-wide tensor, panicking when the length is not a multiple.
pub(super) fn rows_of(op: &str, len: usize, width: usize) -> usize {
    assert!(
        width > 0 && len.is_multiple_of(width),
        "{op}: {len} elements are not rows of {width}"
    );
    len / width
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(xr, w, eps, or);
    }
}

impl Backend for Cpu {
    type Weights<'w> = Matrix<'w>;
    type Buf = Vec<f32>;
    type Rope = CpuRope;
    type Kv = CpuKv;
    type Slots = ();
    type Expert<'e> = [Matrix<'e>; 3];

    fn name(&self) -> &str {
        self.isa_name()
    }

    fn weights<'w>(&self, m: Matrix<'w>) -> OpResult<Matrix<'w>> {
        Ok(m)
    }

    fn upload(&self, data: &[f32]) -> OpResult<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn zeros(&self, len: usize) -> OpResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn zero(&self, x: &mut Vec<f32>) -> OpResult {
        x.fill(0.0);
        Ok(())
    }

    fn copy_rows(&self, x: &Vec<f32>, width: usize, rows: Range<usize>) -> OpResult<Vec<f32>> {
        Ok(x[rows.start * width..rows.end * width].to_vec())
    }

    fn copy(&self, x: &Vec<f32>) -> OpResult<Vec<f32>> {
        Ok(x.clone())
    }

    fn buf_bytes(&self, x: &Vec<f32>) -> u64 {
        f32_bytes(x.capacity())
    }

    fn read(&self, x: &Vec<f32>) -> OpResult<Vec<f32>> {
        Ok(x.clone())
    }

    fn read_owned(&self, x: Vec<f32>) -> OpResult<Vec<f32>> {
        Ok(x)
    }

    fn embed(&self, table: &Matrix<'_>, tokens: &[u32], out: &mut Vec<f32>) -> OpResult {
        let h = table.cols();
        assert_eq!(out.len(), tokens.len() * h, "embed: out length");
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(h)) {
            table.widen_row(t as usize, row);
        }
        Ok(())
    }

    fn linear(&self, w: &Matrix<'_>, x: &Vec<f32>, out: &mut Vec<f32>) -> OpResult {
        let n = rows_of("linear", x.len(), w.cols());
        self.matmul(w, x, n, out);
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        gain: NormGain,
        out: &mut Vec<f32>,
    ) -> OpResult {
        rows_of("rms_norm", x.len(), w.len());
        assert_eq!(x.len(), out.len(), "rms_norm: out length");
        match gain {
            NormGain::Weight => rms_norm_rows(x, w, eps, out),
            NormGain::OnePlusWeight => {
                let w: Vec<f32> = w.iter().map(|w| 1.0 + w).collect();
                rms_norm_rows(x, &w, eps, out);
            }
        }
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> OpResult {
        assert_eq!(x.len(), y.len(), "add: lengths differ");
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> OpResult {
        rows_of("add_bias", x.len(), bias.len());
        for row in x.chunks_exact_mut(bias.len()) {
            for (a, b) in row.iter_mut().zip(bias) {
                *a += b;
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> OpResult {
        silu_mul(gate, up);
        Ok(())
    }

    fn ffn_swiglu(
        &self,
        gate: &Matrix<'_>,
        up: &Matrix<'_>,
        down: &Matrix<'_>,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let n = rows_of("ffn_swiglu", x.len(), gate.cols());
        let i = gate.rows();
        let mut g = vec![0f32; n * i];
        let mut u = vec![0f32; n * i];
        self.matmul(gate, x, n, &mut g);
        self.matmul(up, x, n, &mut u);
        silu_mul(&mut g, &u);
        self.matmul(down, &g, n, out);
        Ok(())
    }

    fn rope_table(
        &self,
        inv_freq: &[f32],
        positions: Range<usize>,
        layout: RopeLayout,
    ) -> OpResult<CpuRope> {
        Ok(CpuRope {
            inv_freq: inv_freq.to_vec(),
            layout,
            positions,
        })
    }

    fn rope(
        &self,
        rope: &CpuRope,
        x: &mut Vec<f32>,
        heads: usize,
        head_dim: usize,
        pos: usize,
    ) -> OpResult {
        let half = rope.inv_freq.len();
        assert!(2 * half <= head_dim, "rope: rotary width exceeds the head");
        let n = rows_of("rope", x.len(), heads * head_dim);
        assert!(
            pos >= rope.positions.start && pos + n <= rope.positions.end,
            "rope: positions {pos}..{} outside the table's {:?}",
            pos + n,
            rope.positions
        );
        for (i, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let p = pos + i;
            for head in token.chunks_exact_mut(head_dim) {
                for j in 0..half {
                    let ang = p as f32 * rope.inv_freq[j];
                    let (s, c) = ang.sin_cos();
                    let (ia, ib) = match rope.layout {
                        RopeLayout::HalfSplit => (j, j + half),
                        RopeLayout::Interleaved => (2 * j, 2 * j + 1),
                    };
                    let (x1, x2) = (head[ia], head[ib]);
                    head[ia] = x1 * c - x2 * s;
                    head[ib] = x2 * c + x1 * s;
                }
            }
        }
        Ok(())
    }

    fn kv_cache(&self, spec: AttentionSpec, _max_positions: usize) -> OpResult<CpuKv> {
        if let Err(e) = spec.check() {
            panic!("kv_cache: {e}");
        }
        Ok(CpuKv {
            k: Vec::new(),
            v: Vec::new(),
            spec,
            start: 0,
        })
    }

    fn copy_kv(&self, kv: &CpuKv) -> OpResult<CpuKv> {
        Ok(kv.clone())
    }

    fn kv_bytes(&self, kv: &CpuKv) -> u64 {
        f32_bytes(kv.k.capacity() + kv.v.capacity())
    }

    fn read_kv(&self, kv: &CpuKv) -> OpResult<KvRows> {
        Ok(KvRows {
            k: kv.k.clone(),
            v: kv.v.clone(),
        })
    }

    fn load_kv(&self, kv: &mut CpuKv, rows: &KvRows) -> OpResult {
        rows.positions(&kv.spec, usize::MAX)
            .map_err(|e| BackendError::new(self.name(), "load_kv", e))?;
        kv.k.clone_from(&rows.k);
        kv.v.clone_from(&rows.v);
        Ok(())
    }

    fn attention(
        &self,
        kv: &mut CpuKv,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        at: Causal,
        sinks: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let spec = kv.spec;
        let (qd, vd) = (spec.qk_dim, spec.v_dim);
        let (kw, vw) = (spec.k_width(), spec.v_width());
        let n = rows_of("attention", k.len(), kw);
        let (qw, ow) = (at.heads * qd, at.heads * vd);
        assert!(
            at.heads.is_multiple_of(spec.kv_heads) && at.heads > 0,
            "attention: {} query heads over {} KV heads",
            at.heads,
            spec.kv_heads
        );
        assert!(
            q.len() == n * qw && (spec.values_in_keys || v.len() == n * vw) && out.len() == n * ow,
            "attention: lengths"
        );
        assert!(
            sinks.is_none_or(|s| s.len() == at.heads),
            "attention: sinks are not one per query head"
        );
        assert!(
            at.pos <= kv.positions(),
            "attention: position past the cache"
        );
        // A windowed cache that slid: the positions this pass reads must still be held.
        let start = kv.start;
        assert!(
            spec.first_seen(at.pos) >= start,
            "attention: position {} sees from {}, but the window cache holds from {start}",
            at.pos,
            spec.first_seen(at.pos)
        );
        let (kc, vc) = (&mut kv.k, &mut kv.v);
        kc.truncate((at.pos - start) * kw);
        kc.extend_from_slice(k);
        // Values in the keys: head `h`'s value row is its key's first `vd` dims.
        let (vc, vw, vh): (&Vec<f32>, usize, usize) = if spec.values_in_keys {
            (kc, kw, qd)
        } else {
            vc.truncate((at.pos - start) * vw);
            vc.extend_from_slice(v);
            (vc, vw, vd)
        };
        let group = at.heads / spec.kv_heads;
        let mut scores = vec![0f32; at.pos + n];
        for i in 0..n {
            let upto = at.pos + i + 1;
            let first = spec.first_seen(at.pos + i);
            for hh in 0..at.heads {
                let kvh = hh / group;
                let qh = &q[i * qw + hh * qd..i * qw + (hh + 1) * qd];
                let seen = &mut scores[first..upto];
                for (j, sc) in (first..upto).zip(seen.iter_mut()) {
                    let j = j - start;
                    let kj = &kc[j * kw + kvh * qd..j * kw + (kvh + 1) * qd];
                    *sc = dot(qh, kj) * at.scale;
                }
                match sinks {
                    None => softmax_inplace(seen),
                    Some(s) => softmax_with_sink(seen, s[hh]),
                }
                let ah = &mut out[i * ow + hh * vd..i * ow + (hh + 1) * vd];
                ah.fill(0.0);
                for (j, &p) in (first..upto).zip(seen.iter()) {
                    let j = j - start;
                    let vj = &vc[j * vw + kvh * vh..j * vw + kvh * vh + vd];
                    axpy(p, vj, ah);
                }
            }
        }
        kv.slide(at.pos);
        Ok(())
    }

    fn route(
        &self,
        router: &Matrix<'_>,
        x: &Vec<f32>,
        spec: &RoutingSpec,
        bias: RouterBias<'_>,
    ) -> OpResult<Routing> {
        let experts = router.rows();
        let n = rows_of("route", x.len(), router.cols());
        let mut logits = vec![0f32; n * experts];
        self.matmul(router, x, n, &mut logits);
        bias.add_to_logits(&mut logits, experts)
            .and_then(|()| route_logits(spec, &logits, bias.selection, experts))
            .map_err(|e| BackendError::new(self.name(), "route", e))
    }

    fn expert_slots(&self, _slots: Option<usize>, _pools: &[&ExpertPool]) -> OpResult<()> {
        Ok(())
    }

    fn expert<'e>(&'e self, _slots: &'e (), blob: ExpertRef<'e>) -> OpResult<[Matrix<'e>; 3]> {
        Ok(expert_matrices(blob.pool, blob.bytes))
    }

    fn expert_weights<'x, 'e>(&self, expert: &'x [Matrix<'e>; 3]) -> &'x [Matrix<'e>; 3]
    where
        Self: 'e,
    {
        expert
    }

    fn expert_ffn(
        &self,
        expert: &[Matrix<'_>; 3],
        x: &Vec<f32>,
        routes: &[(usize, f32)],
        out: &mut Vec<f32>,
    ) -> OpResult {
        let [gate, up, down] = expert;
        let (h, inter) = (gate.cols(), gate.rows());
        assert_eq!(x.len(), out.len(), "expert_ffn: out length");
        let m = routes.len();
        let mut xs = vec![0f32; m * h];
        for (r, &(t, _)) in routes.iter().enumerate() {
            xs[r * h..(r + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        let mut g = vec![0f32; m * inter];
        let mut u = vec![0f32; m * inter];
        self.matmul(gate, &xs, m, &mut g);
        self.matmul(up, &xs, m, &mut u);
        silu_mul(&mut g, &u);
        let mut d = vec![0f32; m * h];
        self.matmul(down, &g, m, &mut d);
        for (r, &(t, w)) in routes.iter().enumerate() {
            axpy(w, &d[r * h..(r + 1) * h], &mut out[t * h..(t + 1) * h]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::runtime::kernels::backend::WINDOW_REWIND;

    /// A window of 8 over 1000 decode steps holds at most the window, the rewind
    /// margin and the amortizing slack (`8 + 8 + 8` positions), not the context; a full
    /// cache holds all 1000.
    #[test]
    fn a_window_cache_holds_about_its_window_and_a_full_one_everything() {
        let cpu = Cpu::portable(1);
        let spec = AttentionSpec::dense(2, 16);
        let row = f32_bytes(spec.k_width() + spec.v_width());
        let windowed = AttentionSpec {
            window: Some(8),
            ..spec
        };
        let (mut full, mut ring) = (
            cpu.kv_cache(spec, 1000).unwrap(),
            cpu.kv_cache(windowed, 1000).unwrap(),
        );
        let x = vec![0.5f32; spec.k_width()];
        let q = vec![0.25f32; 2 * spec.qk_dim];
        for pos in 0..1000 {
            let at = Causal {
                pos,
                heads: 2,
                scale: 0.25,
            };
            for kv in [&mut full, &mut ring] {
                let mut out = vec![0f32; 2 * spec.v_dim];
                cpu.attention(kv, &q, &x, &x, at, None, &mut out).unwrap();
            }
        }
        assert_eq!((full.start(), full.positions()), (0, 1000));
        assert_eq!(ring.positions(), 1000);
        let held = (ring.positions() - ring.start()) as u64;
        let most = 8 + WINDOW_REWIND as u64 + 8.max(WINDOW_REWIND) as u64;
        assert!(held <= most, "{held} positions held");
        assert!(ring.start() > 900, "the window slid: {}", ring.start());
        // Capacity: at most twice the most it holds (a Vec's growth).
        assert!(
            cpu.kv_bytes(&ring) <= row * 2 * most,
            "{}",
            cpu.kv_bytes(&ring)
        );
        assert!(cpu.kv_bytes(&full) >= row * 1000);
    }
}
