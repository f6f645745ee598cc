//! The GPU's [`LinearAttentionOps`] (`shaders/flash_conv.wgsl`, `flash_gdn.wgsl`).

use super::launch::*;
use crate::runtime::kernels::backend::OpResult;
use crate::runtime::kernels::gpu::backend::{Gpu, GpuBuf};
use crate::runtime::kernels::gpu::error::Result;
use crate::runtime::kernels::gpu::shaders::FlashShader;
use crate::runtime::kernels::gpu::shaders::{ConvParams, FlashNormParams, GdnParams};
use crate::runtime::kernels::ops::{GateAct, GdnDims, LinearAttentionOps};

impl LinearAttentionOps for Gpu {
    fn causal_conv_silu(
        &self,
        x: &GpuBuf,
        w: &GpuBuf,
        taps: usize,
        dilation: usize,
        state: &mut GpuBuf,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "causal_conv_silu";
        let run = |state: &mut GpuBuf| -> Result<()> {
            need(OP, taps > 0 && dilation > 0, || {
                format!("{taps} taps at dilation {dilation}")
            })?;
            let ch = rows(OP, "w", w.len(), taps)?;
            let n = rows(OP, "x", x.len(), ch)?;
            let past = (taps - 1) * dilation;
            need(OP, state.len() == past * ch && out.len() == x.len(), || {
                format!(
                    "state of {} (want {}), out of {} for x of {}",
                    state.len(),
                    past * ch,
                    out.len(),
                    x.len()
                )
            })?;
            if n == 0 {
                return Ok(());
            }
            let p = ConvParams {
                n: u32_of(OP, n)?,
                ch: u32_of(OP, ch)?,
                taps: u32_of(OP, taps)?,
                dilation: u32_of(OP, dilation)?,
                past: u32_of(OP, past)?,
            };
            let ctx = self.context();
            ctx.dispatch_at(
                &kernel(FlashShader::Conv, "conv_silu"),
                &p.bytes(),
                &[(1, buf(x)), (2, buf(w)), (3, buf(state)), (4, buf(out))],
                (n * ch).div_ceil(WG_ELEMENTS),
            )?;
            if past == 0 {
                return Ok(());
            }
            if n >= past {
                // The new state is the last `past` rows of x.
                let bytes = (past * ch * 4) as u64;
                ctx.copy(buf(x), ((n - past) * ch * 4) as u64, buf(state), 0, bytes);
                return Ok(());
            }
            // The state shifts by n rows: read the old one from a copy.
            let old = self.scratch(state.len())?;
            ctx.copy(buf(state), 0, buf(&old), 0, (state.len() * 4) as u64);
            ctx.dispatch_at(
                &kernel(FlashShader::Conv, "conv_state"),
                &p.bytes(),
                &[(1, buf(x)), (3, buf(&old)), (5, buf(state))],
                (past * ch).div_ceil(WG_ELEMENTS),
            )
        };
        self.flash(OP, run(state))
    }

    fn gdn_recurrence(
        &self,
        conv: &GpuBuf,
        b: &GpuBuf,
        a: &GpuBuf,
        a_log: &GpuBuf,
        dt_bias: &GpuBuf,
        dims: &GdnDims,
        state: &mut GpuBuf,
        core: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gdn_recurrence";
        let run = |state: &mut GpuBuf, core: &mut GpuBuf| -> Result<()> {
            let (nk, dk, nv, dv) = (
                dims.key_heads,
                dims.key_dim,
                dims.value_heads,
                dims.value_dim,
            );
            need(
                OP,
                nk > 0 && nv.is_multiple_of(nk) && (1..=MAX_WIDTH).contains(&dk) && dv > 0,
                || {
                    format!(
                        "{nv} value heads of {dv} over {nk} key heads of {dk} (at most {MAX_WIDTH})"
                    )
                },
            )?;
            let n = rows(OP, "conv", conv.len(), dims.channels())?;
            need(
                OP,
                b.len() == n * nv
                    && a.len() == n * nv
                    && a_log.len() == nv
                    && dt_bias.len() == nv
                    && core.len() == n * nv * dv
                    && state.len() == nv * dk * dv,
                || {
                    format!(
                        "b {}, a {}, A_log {}, dt_bias {}, core {}, state {} for {n} tokens",
                        b.len(),
                        a.len(),
                        a_log.len(),
                        dt_bias.len(),
                        core.len(),
                        state.len()
                    )
                },
            )?;
            if n == 0 {
                return Ok(());
            }
            let p = GdnParams {
                n: u32_of(OP, n)?,
                nk: u32_of(OP, nk)?,
                dk: u32_of(OP, dk)?,
                nv: u32_of(OP, nv)?,
                dv: u32_of(OP, dv)?,
                scale: (dk as f32).sqrt(),
            };
            self.context().dispatch_at(
                &kernel(FlashShader::Gdn, "gdn"),
                &p.bytes(),
                &[
                    (1, buf(conv)),
                    (2, buf(b)),
                    (3, buf(a)),
                    (4, buf(a_log)),
                    (5, buf(dt_bias)),
                    (6, buf(state)),
                    (7, buf(core)),
                ],
                nv,
            )
        };
        self.flash(OP, run(state, core))
    }

    fn gated_norm(
        &self,
        o: &GpuBuf,
        z: &GpuBuf,
        w: &GpuBuf,
        eps: f32,
        act: GateAct,
        out: &mut GpuBuf,
    ) -> OpResult {
        const OP: &str = "gated_norm";
        let run = || -> Result<()> {
            let n = rows(OP, "o", o.len(), w.len())?;
            need(OP, z.len() == o.len() && out.len() == o.len(), || {
                format!(
                    "z of {}, out of {} for o of {}",
                    z.len(),
                    out.len(),
                    o.len()
                )
            })?;
            let p = FlashNormParams {
                n: u32_of(OP, n)?,
                d: u32_of(OP, w.len())?,
                wd: u32_of(OP, w.len())?,
                mode: match act {
                    GateAct::Sigmoid => 0,
                    GateAct::Silu => 1,
                },
                eps,
                scale: 1.0,
            };
            self.norm_kernel(
                "gated_norm",
                p,
                &[(1, buf(o)), (2, buf(w)), (3, buf(out)), (4, buf(z))],
            )
        };
        self.flash(OP, run())
    }
}
