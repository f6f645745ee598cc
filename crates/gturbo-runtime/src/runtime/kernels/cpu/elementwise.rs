//! The CPU's [`ElementwiseOps`].

use std::ops::Range;

use super::math::{offset_rms_norm, sigmoid, silu};
use super::rows_of;
use crate::runtime::kernels::Cpu;
use crate::runtime::kernels::OpResult;
use crate::runtime::kernels::axpy;
use crate::runtime::kernels::ops::{Act, ClampedGlu, ElementwiseOps};

impl ElementwiseOps for Cpu {
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

    fn scatter_cols(
        &self,
        x: &Vec<f32>,
        scale: f32,
        width: usize,
        cols: Range<usize>,
        out: &mut Vec<f32>,
    ) -> OpResult {
        let n = rows_of("scatter_cols", out.len(), width);
        assert!(cols.end <= width, "scatter_cols: columns past the row");
        assert_eq!(x.len(), n * cols.len(), "scatter_cols: x length");
        for (row, o) in x
            .chunks_exact(cols.len().max(1))
            .zip(out.chunks_exact_mut(width))
        {
            for (d, &v) in o[cols.clone()].iter_mut().zip(row) {
                *d = v * scale;
            }
        }
        Ok(())
    }

    fn clamped_swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, glu: ClampedGlu) -> OpResult {
        assert_eq!(gate.len(), up.len(), "clamped_swiglu: lengths");
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = glu.apply(*g, u);
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> OpResult {
        let n = rows_of("gather_rows", x.len(), width);
        assert_eq!(out.len(), rows.len() * width, "gather_rows: out length");
        for (o, &r) in out.chunks_exact_mut(width.max(1)).zip(rows) {
            assert!(r < n, "gather_rows: row {r} of {n}");
            o.copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        routes: &[(usize, f32)],
        out: &mut Vec<f32>,
    ) -> OpResult {
        let n = rows_of("scatter_add_rows", out.len(), width);
        assert_eq!(x.len(), routes.len() * width, "scatter_add_rows: x length");
        for (row, &(t, w)) in x.chunks_exact(width.max(1)).zip(routes) {
            assert!(t < n, "scatter_add_rows: row {t} of {n}");
            axpy(w, row, &mut out[t * width..(t + 1) * width]);
        }
        Ok(())
    }
}
