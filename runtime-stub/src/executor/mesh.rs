//! The mesh executor: a sharded artifact's batch plans on a mesh of CPU
//! devices (`maxc compile --devices cpu:0,1`), one [`CpuExecutor`] per
//! sub-model, stepping together.
//!
//! Every device holds its sub-model's weights, its share of the KV heads in a
//! pool of the same blocks (the engine's block ids address every device's pool
//! alike), and its own worker threads; a step runs on all devices at once
//! (device 0 on the caller's thread) and they meet at the plans' collectives
//! (`collectives.rs`). The logits are replicated after the final all-gather;
//! device 0's are returned.

use std::sync::Arc;

use super::cpu::CpuExecutor;
use super::{BatchStep, Executor, PoolLimits, ProfileRow, RunError};
use crate::artifact::Artifact;
use crate::collectives::MeshHub;
use crate::format::DeviceKind;

/// Every sub-model of a sharded artifact, stepped together.
pub struct MeshExecutor<'a> {
    devices: Vec<CpuExecutor<'a>>,
}

impl<'a> MeshExecutor<'a> {
    /// Opens every sub-model with a KV pool of `kv_bytes` bytes over all devices
    /// (`None`: [`super::default_kv_bytes`]); `threads` are divided among the
    /// devices (at least one each).
    pub fn new(artifact: &'a Artifact, threads: usize, kv_bytes: Option<u64>) -> Result<Self, RunError> {
        let h = &artifact.header;
        if h.mesh.kind != DeviceKind::Cpu {
            return Err(RunError::Gpu(format!("the artifact is split over {}; the CPU mesh executor runs CPU meshes", h.mesh.spec())));
        }
        let limits = super::batch_limits(artifact)?;
        let blocks = super::pool_blocks(h, &limits, kv_bytes)?;
        let count = h.sub_models.len();
        let hub = Arc::new(MeshHub::for_artifact(h));
        let per_device = (threads / count).max(1);
        let devices = (0..count).map(|d| CpuExecutor::on_device(artifact, per_device, d, Some(hub.clone()), blocks)).collect::<Result<_, _>>()?;
        Ok(MeshExecutor { devices })
    }
}

impl Executor for MeshExecutor<'_> {
    fn limits(&self) -> PoolLimits {
        self.devices[0].limits()
    }

    fn step(&mut self, step: &BatchStep<'_>) -> Result<&[f32], RunError> {
        // Refused before any device starts, so that none waits at a collective
        // for a device that refused the step.
        step.check_adapters()?;
        let (first, rest) = self.devices.split_first_mut().expect("a mesh has a device");
        let results: Vec<Result<(), RunError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = rest.iter_mut().map(|d| scope.spawn(|| d.run(step))).collect();
            let mine = first.run(step);
            std::iter::once(mine).chain(handles.into_iter().map(|h| h.join().expect("a device thread panicked"))).collect()
        });
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(self.devices[0].last_logits())
    }

    fn threads(&self) -> usize {
        self.devices.iter().map(|d| d.threads()).sum()
    }

    fn describe(&self) -> String {
        format!("devices: {}, threads: {}", self.devices.len(), self.threads())
    }

    fn enable_profile(&mut self) {
        self.devices.iter_mut().for_each(|d| d.enable_profile());
    }

    /// Device 0's kernels (every device runs the same launches on its shard).
    fn profile(&self) -> Vec<ProfileRow> {
        self.devices[0].profile()
    }
}
