//! Running a sharded artifact on a mesh of CPU devices: one [`Session`] per
//! sub-model, each with its own worker threads, KV cache and arenas, all stepping
//! together and exchanging activations through a [`MeshHub`] at the plans'
//! collectives. The logits are replicated after the final all-gather; device 0's
//! are returned.

use std::sync::Arc;

use crate::artifact::Artifact;
use crate::collectives::MeshHub;
use crate::format::DeviceKind;
use crate::executor::{RunCounts, RunError};
use crate::session::Session;

/// One sequence over every sub-model of a sharded artifact.
pub struct MeshSession<'a> {
    sessions: Vec<Session<'a>>,
}

impl std::fmt::Debug for MeshSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MeshSession({} devices)", self.sessions.len())
    }
}

impl<'a> MeshSession<'a> {
    /// Opens every sub-model; `threads` are divided among the devices (at least one each).
    pub fn new(artifact: &'a Artifact, threads: usize) -> Result<Self, RunError> {
        let h = &artifact.header;
        if h.mesh.kind != DeviceKind::Cpu {
            return Err(RunError::Gpu(format!("the artifact is split over {}; the CPU runner runs CPU meshes", h.mesh.spec())));
        }
        let devices = h.sub_models.len();
        let hub = Arc::new(MeshHub::for_artifact(h));
        let per_device = (threads / devices).max(1);
        let sessions = (0..devices).map(|d| Session::on_device(artifact, per_device, d, Some(hub.clone()))).collect::<Result<_, _>>()?;
        Ok(MeshSession { sessions })
    }

    /// Worker threads of all devices together.
    pub fn threads(&self) -> usize {
        self.sessions.iter().map(Session::threads).sum()
    }

    pub fn devices(&self) -> usize {
        self.sessions.len()
    }

    /// Runs `f` on every device at once (device 0 on this thread) and returns
    /// device 0's result, or the first error.
    fn on_all<F>(&mut self, last_only: bool, f: F) -> Result<&[f32], RunError>
    where
        F: Fn(&mut Session<'a>) -> Result<(), RunError> + Sync,
    {
        let (first, rest) = self.sessions.split_first_mut().expect("a mesh has a device");
        let results: Vec<Result<(), RunError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = rest.iter_mut().map(|s| scope.spawn(|| f(s))).collect();
            let mine = f(first);
            std::iter::once(mine).chain(handles.into_iter().map(|h| h.join().expect("a device thread panicked"))).collect()
        });
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(self.sessions[0].logits(last_only))
    }

    /// Appends `ids` on every device and returns their logits, `[ids.len(), vocab]`.
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        // Checked once here, so that no device starts a step the others refuse.
        crate::session::check_tokens(&self.sessions[0].artifact().header, self.sessions[0].position, ids)?;
        self.on_all(false, |s| s.forward(ids).map(|_| ()))
    }

    /// Appends `ids` and returns the last token's logits only.
    pub fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        crate::session::check_tokens(&self.sessions[0].artifact().header, self.sessions[0].position, ids)?;
        self.on_all(true, |s| s.forward_last(ids).map(|_| ()))
    }

    pub fn reset(&mut self) {
        self.sessions.iter_mut().for_each(Session::reset);
    }

    pub fn truncate(&mut self, len: u64) {
        self.sessions.iter_mut().for_each(|s| s.truncate(len));
    }

    pub fn counts(&self) -> RunCounts {
        self.sessions[0].counts
    }

    pub fn position(&self) -> u64 {
        self.sessions[0].position
    }
}
