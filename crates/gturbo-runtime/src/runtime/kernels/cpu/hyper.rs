//! The CPU's [`HyperConnectionOps`].

use super::rows_of;
use crate::runtime::kernels::ops::{HcDims, HyperConnectionOps};
use crate::runtime::kernels::{Cpu, OpResult};

impl HyperConnectionOps for Cpu {
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
}
