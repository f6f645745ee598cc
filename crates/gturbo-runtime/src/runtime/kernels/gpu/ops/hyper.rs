//! The GPU's [`HyperConnectionOps`].

use super::launch::*;
use crate::runtime::kernels::backend::OpResult;
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::error::Result;
use crate::runtime::kernels::gpu::shaders::FlashElementwiseParams;
use crate::runtime::kernels::ops::{HcDims, HyperConnectionOps};

impl HyperConnectionOps for Gpu {
    fn hc_expand(&self, e: &GpuBuf, d: HcDims, out: &mut GpuBuf) -> OpResult {
        const OP: &str = "hc_expand";
        let run = || -> Result<()> {
            let n = rows(OP, "e", e.len(), d.hidden)?;
            need(OP, out.len() == n * d.width(), || {
                format!(
                    "out has {} elements for {n} rows of {}",
                    out.len(),
                    d.width()
                )
            })?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("hc_expand", p, &[(1, buf(out)), (2, buf(e))])
        };
        self.flash(OP, run())
    }

    fn hc_mix(&self, mix: &GpuBuf, xn: &GpuBuf, d: HcDims, out: &mut GpuBuf) -> OpResult {
        const OP: &str = "hc_mix";
        let run = || -> Result<()> {
            let n = rows(OP, "mix", mix.len(), d.width())?;
            need(
                OP,
                xn.len() == mix.len() && out.len() == n * d.hidden,
                || {
                    format!(
                        "xn of {}, out of {} for mix of {}",
                        xn.len(),
                        out.len(),
                        mix.len()
                    )
                },
            )?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, out.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise("hc_mix", p, &[(1, buf(out)), (2, buf(mix)), (3, buf(xn))])
        };
        self.flash(OP, run())
    }

    fn hc_inject(&self, x: &mut GpuBuf, inject: &GpuBuf, y: &GpuBuf, d: HcDims) -> OpResult {
        const OP: &str = "hc_inject";
        let run = || -> Result<()> {
            let n = rows(OP, "y", y.len(), d.hidden)?;
            need(
                OP,
                x.len() == n * d.width() && inject.len() == n * d.streams,
                || format!("x of {}, inject of {} for {n} rows", x.len(), inject.len()),
            )?;
            let p = FlashElementwiseParams {
                n: u32_of(OP, x.len())?,
                d: u32_of(OP, d.hidden)?,
                s: u32_of(OP, d.streams)?,
                ..FlashElementwiseParams::default()
            };
            self.elementwise(
                "hc_inject",
                p,
                &[(1, buf(x)), (2, buf(y)), (3, buf(inject))],
            )
        };
        self.flash(OP, run())
    }
}
