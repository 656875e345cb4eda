//! A GEMM launched with a pinned kernel, for benchmarks and tests of one variant.

use kiln_engine::{Error, Matmul, Result};
use kiln_lowering::{plan_matmul, record_matmul, MatmulPlan, MatmulVariant};

use crate::device::WgpuDevice;

impl WgpuDevice {
    /// Records `mm` with a pinned kernel (for benchmarks and tests of one variant).
    pub fn launch_matmul(&self, mm: &Matmul, variant: Option<MatmulVariant>) -> Result<MatmulPlan> {
        let kernel = kiln_engine::Kernel::Matmul(mm.clone());
        kernel.validate()?;
        if matches!(variant, Some(MatmulVariant::Gemv { .. })) && mm.n != 1 {
            return Err(Error::InvalidArgument(format!(
                "matmul: the gemv kernel computes one output column, but n = {}",
                mm.n
            )));
        }
        let plan = plan_matmul(mm, &self.caps, variant)?;
        self.call(|| {
            let mut s = self.lock();
            self.check_live(&s, "matmul", &mm.buffers())?;
            record_matmul(self, &mut s, mm, &plan)
        })?;
        Ok(plan)
    }
}
