//! The GPU's [`ElementwiseOps`] (`shaders/flash_elementwise.wgsl`, `flash_norm.wgsl`).

use super::launch::*;
use crate::runtime::kernels::backend::OpResult;
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::error::Result;
use std::ops::Range;

use crate::runtime::kernels::gpu::shaders::{FlashElementwiseParams, FlashNormParams};
use crate::runtime::kernels::ops::{Act, ClampedGlu, ElementwiseOps};

impl ElementwiseOps for Gpu {
    fn norm_grouped(
        &self,
        x: &GpuBuf,
        w: &GpuBuf,
        group: usize,
        eps: f32,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "norm_grouped";
        let run = || -> Result<()> {
            need(
                OP,
                group > 0 && w.len().is_multiple_of(group) && !w.is_empty(),
                || format!("a weight of {} is not pieces of {group}", w.len()),
            )?;
            rows(OP, "x", x.len(), w.len())?;
            need(OP, out.len() == x.len(), || {
                format!("out has {} elements, x {}", out.len(), x.len())
            })?;
            let p = FlashNormParams {
                n: u32_of(OP, x.len() / group)?,
                d: u32_of(OP, group)?,
                wd: u32_of(OP, w.len())?,
                eps,
                ..FlashNormParams::default()
            };
            self.norm_kernel(
                "norm_grouped",
                p,
                &[(1, buf(x)), (2, buf(w)), (3, buf(out))],
            )
        };
        self.flash(OP, run())
    }

    fn act(&self, x: &mut GpuBuf, act: Act) -> OpResult {
        let (mode, c) = match act {
            Act::SiluOver(d) => (0, d),
            Act::Sigmoid => (1, 1.0),
            Act::TwoSigmoidOver(d) => (2, d),
        };
        let run = || -> Result<()> {
            let p = FlashElementwiseParams {
                n: u32_of("act", x.len())?,
                mode,
                c,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("act", p, &[(1, buf(x))])
        };
        self.flash("act", run())
    }

    fn sigmoid_mul(&self, x: &mut GpuBuf, gate: &GpuBuf) -> OpResult {
        const OP: &str = "sigmoid_mul";
        let run = || -> Result<()> {
            need(OP, x.len() == gate.len(), || {
                format!("lengths differ: {} and {}", x.len(), gate.len())
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("sigmoid_mul", p, &[(1, buf(x)), (2, buf(gate))])
        };
        self.flash(OP, run())
    }

    fn scale_rows_sigmoid(&self, x: &mut GpuBuf, g: &GpuBuf) -> OpResult {
        const OP: &str = "scale_rows_sigmoid";
        let run = || -> Result<()> {
            if x.is_empty() {
                return Ok(());
            }
            rows(OP, "x", x.len(), g.len())?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                d: u32_of(OP, x.len() / g.len())?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("scale_rows", p, &[(1, buf(x)), (2, buf(g))])
        };
        self.flash(OP, run())
    }

    fn gather_cols(
        &self,
        x: &GpuBuf,
        width: usize,
        cols: Range<usize>,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gather_cols";
        let run = || -> Result<()> {
            let n = rows(OP, "x", x.len(), width)?;
            need(OP, cols.start <= cols.end && cols.end <= width, || {
                format!("columns {cols:?} of rows of {width}")
            })?;
            need(OP, out.len() == n * cols.len(), || {
                format!("out has {} elements for {n} rows of {cols:?}", out.len())
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, width)?,
                s: u32_of(OP, cols.len())?,
                mode: u32_of(OP, cols.start)?,
                c: 0.0,
            };
            self.elementwise("gather_cols", p, &[(1, buf(out)), (2, buf(x))])
        };
        self.flash(OP, run())
    }

    fn scatter_cols(
        &self,
        x: &GpuBuf,
        scale: f32,
        width: usize,
        cols: Range<usize>,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "scatter_cols";
        let run = || -> Result<()> {
            let n = rows(OP, "out", out.len(), width)?;
            need(OP, cols.start <= cols.end && cols.end <= width, || {
                format!("columns {cols:?} of rows of {width}")
            })?;
            need(OP, x.len() == n * cols.len(), || {
                format!("x has {} elements for {n} rows of {cols:?}", x.len())
            })?;
            if x.is_empty() {
                return Ok(());
            }
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                d: u32_of(OP, width)?,
                s: u32_of(OP, cols.len())?,
                mode: u32_of(OP, cols.start)?,
                c: scale,
            };
            self.elementwise("scatter_cols", p, &[(1, buf(out)), (2, buf(x))])
        };
        self.flash(OP, run())
    }

    fn clamped_swiglu(&self, gate: &mut GpuBuf, up: &GpuBuf, glu: ClampedGlu) -> OpResult {
        const OP: &str = "clamped_swiglu";
        let run = || -> Result<()> {
            need(OP, gate.len() == up.len(), || {
                format!("lengths differ: {} and {}", gate.len(), up.len())
            })?;
            if gate.is_empty() {
                return Ok(());
            }
            let p = FlashElementwiseParams {
                n: u32_of(OP, gate.len())?,
                mode: glu.alpha.to_bits(),
                c: glu.limit,
                ..FlashElementwiseParams::default()
            };
            self.elementwise(OP, p, &[(1, buf(gate)), (2, buf(up))])
        };
        self.flash(OP, run())
    }

    fn gather_rows(&self, x: &GpuBuf, width: usize, rows: &[usize], out: &mut GpuBuf) -> OpResult {
        const OP: &str = "gather_rows";
        let run = || -> Result<()> {
            let n = super::launch::rows(OP, "x", x.len(), width)?;
            need(OP, out.len() == rows.len() * width, || {
                format!(
                    "out has {} elements for {} rows of {width}",
                    out.len(),
                    rows.len()
                )
            })?;
            need(OP, rows.iter().all(|&r| r < n), || {
                format!("rows {rows:?} of {n}")
            })?;
            let idx = u32_rows(OP, rows)?;
            self.context()
                .gather_rows(x.tensor(), out.tensor(), &idx, width)
        };
        self.flash(OP, run())
    }

    fn scatter_add_rows(
        &self,
        x: &GpuBuf,
        width: usize,
        routes: &[(usize, f32)],
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "scatter_add_rows";
        let run = || -> Result<()> {
            let n = super::launch::rows(OP, "out", out.len(), width)?;
            need(OP, x.len() == routes.len() * width, || {
                format!(
                    "x has {} elements for {} rows of {width}",
                    x.len(),
                    routes.len()
                )
            })?;
            let rows: Vec<usize> = routes.iter().map(|r| r.0).collect();
            let mut seen = vec![false; n];
            need(
                OP,
                rows.iter()
                    .all(|&t| t < n && !std::mem::replace(&mut seen[t], true)),
                || format!("rows {rows:?} are not distinct rows below {n}"),
            )?;
            let idx = u32_rows(OP, &rows)?;
            let weights: Vec<f32> = routes.iter().map(|r| r.1).collect();
            self.context()
                .scatter_add_rows(x.tensor(), out.tensor(), &idx, &weights, width)
        };
        self.flash(OP, run())
    }
}

/// Row indices as the kernels' `u32`s.
fn u32_rows(op: &'static str, rows: &[usize]) -> Result<Vec<u32>> {
    rows.iter().map(|&r| u32_of(op, r)).collect()
}
