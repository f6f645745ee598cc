//! The GPU's [`NgramOps`].

use super::launch::*;
use crate::runtime::kernels::backend::OpResult;
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::error::Result;
use crate::runtime::kernels::gpu::shaders::FlashNormParams;
use crate::runtime::kernels::ops::{HcDims, NgramOps};

impl NgramOps for Gpu {
    fn ple_gate(
        &self,
        key: &GpuBuf,
        qry: &GpuBuf,
        value: &GpuBuf,
        d: HcDims,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "ple_gate";
        let run = || -> Result<()> {
            let t = rows(OP, "value", value.len(), d.hidden)?;
            need(
                OP,
                key.len() == t * d.width() && qry.len() == key.len() && out.len() == key.len(),
                || {
                    format!(
                        "key {}, qry {}, out {} for {t} tokens of {}",
                        key.len(),
                        qry.len(),
                        out.len(),
                        d.width()
                    )
                },
            )?;
            let p = FlashNormParams {
                n: u32_of(OP, t * d.streams)?,
                d: u32_of(OP, d.hidden)?,
                wd: u32_of(OP, d.streams)?,
                mode: 0,
                eps: 0.0,
                scale: (d.hidden as f32).sqrt(),
            };
            self.norm_kernel(
                "ple_gate",
                p,
                &[(1, buf(key)), (2, buf(value)), (3, buf(out)), (4, buf(qry))],
            )
        };
        self.flash(OP, run())
    }
}
