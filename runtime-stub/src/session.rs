//! Running an artifact: the KV cache, the activation arenas, and the launch loop.
//!
//! A [`Session`] holds one sequence. [`Session::forward`] runs the prefill plan over
//! chunks of up to `prefill.max_seq` tokens, or the decode plan for a single token,
//! appending to the KV cache; nothing is allocated per step.

use crate::artifact::Artifact;
use crate::code::{KernelFn, LoadedCode};
use crate::collectives::MeshHub;
pub use crate::executor::{ProfileRow, RunCounts};
use crate::executor::RunError;
use crate::format::{BufferRef, CollectiveOp, CollectiveStep, Plan, RowCount, SubModel};
use crate::kv_cache::KvCache;
use crate::pool::ThreadPool;

/// Refuses `ids` before any work: an id outside the vocabulary, or a sequence
/// that would outgrow the artifact's maximum length from `position` (shared by the
/// CPU and GPU sessions).
pub fn check_tokens(h: &crate::format::Header, position: u64, ids: &[u32]) -> Result<(), RunError> {
    let vocab = h.model.vocab_size;
    if let Some(&id) = ids.iter().find(|&&id| id as u64 >= vocab) {
        return Err(RunError::BadToken { id, vocab });
    }
    let needed = position + ids.len() as u64;
    if needed > h.max_length {
        return Err(RunError::ContextFull { needed, max: h.max_length });
    }
    Ok(())
}

/// Which plan a step runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Which {
    Prefill,
    Decode,
    PrefillLast,
}

/// A 64-byte aligned, zeroed byte buffer.
struct AlignedBuf {
    words: Vec<u128>,
}

impl AlignedBuf {
    fn new(bytes: u64) -> Self {
        // u128 gives 16-byte alignment; add slack so the start can be moved to 64.
        AlignedBuf { words: vec![0u128; (bytes as usize).div_ceil(16) + 4] }
    }
    fn ptr(&mut self) -> *mut u8 {
        let p = self.words.as_mut_ptr() as *mut u8;
        let skew = p.align_offset(64);
        // SAFETY: the buffer has 64 bytes of slack.
        unsafe { p.add(skew) }
    }
}

pub(crate) struct PlanState {
    kernels: Vec<KernelFn>,
    arena: AlignedBuf,
    /// Per launch: (calls, total seconds, bytes moved), when profiling.
    profile: Option<Vec<(u64, f64, u64)>>,
    /// Per launch: the weight parts idle workers prefetch while it runs (the next
    /// launch that streams weights over several tasks, wrapping around to the
    /// next step); empty where nothing is prefetched (prefill: its matmuls are
    /// compute-bound and keep every thread busy).
    ahead: Vec<Vec<(usize, usize)>>,
}

impl PlanState {
    /// The state of `plan`: its kernels resolved, its arena, and with `decode`
    /// the weights idle workers prefetch.
    pub(crate) fn new(artifact: &Artifact, plan: &Plan, resolved: &[KernelFn], decode: bool) -> PlanState {
        PlanState {
            kernels: plan.launches.iter().map(|l| resolved[l.kernel as usize]).collect(),
            arena: AlignedBuf::new(plan.arena_bytes),
            profile: None,
            ahead: if decode { prefetch_plan(artifact, plan) } else { vec![] },
        }
    }

    /// Starts timing every launch of `plan` (this state's plan).
    pub(crate) fn enable_profile(&mut self, plan: &Plan) {
        self.profile = Some(vec![(0, 0.0, 0); plan.launches.len()]);
    }

    /// The first `n` floats of the plan's output (its logits) after a run.
    pub(crate) fn output(&mut self, plan: &Plan, n: usize) -> &[f32] {
        let arena = self.arena.ptr();
        match plan.logits {
            // SAFETY: the plan's logits buffer holds the step's output floats.
            BufferRef::Arena { offset } => unsafe { std::slice::from_raw_parts(arena.add(offset as usize) as *const f32, n) },
            other => panic!("logits in {other:?}: the compiler places them in the arena"),
        }
    }
}

/// Checks the CPU, loads the artifact's code and resolves every kernel (in the
/// header's order).
pub(crate) fn load_kernels(artifact: &Artifact) -> Result<(LoadedCode, Vec<KernelFn>), RunError> {
    artifact.check_cpu()?;
    let code = LoadedCode::load(artifact.code())?;
    let resolved = artifact.header.kernels.iter().map(|k| code.kernel(&k.symbol)).collect::<Result<_, _>>()?;
    Ok((code, resolved))
}

/// One row per kernel and plan of the profiled `plans` (name, plan, its state),
/// slowest first; kernels of plans under the same name are summed.
pub(crate) fn profile_rows<'p>(h: &crate::format::Header, plans: impl Iterator<Item = (&'static str, &'p Plan, &'p PlanState)>) -> Vec<ProfileRow> {
    let mut rows: Vec<ProfileRow> = Vec::new();
    for (name, plan, state) in plans {
        let Some(times) = &state.profile else { continue };
        for (launch, &(calls, secs, bytes)) in plan.launches.iter().zip(times) {
            let k = &h.kernels[launch.kernel as usize];
            match rows.iter_mut().find(|r| r.plan == name && r.kernel == k.symbol) {
                Some(r) => {
                    r.calls += calls;
                    r.seconds += secs;
                    r.bytes += bytes;
                }
                None => rows.push(ProfileRow { plan: name, kernel: k.symbol.clone(), family: k.family.clone(), calls, seconds: secs, bytes }),
            }
        }
    }
    rows.retain(|r| r.calls > 0);
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    rows
}

/// The buffers a step's launches read besides the arena, the weights and the KV
/// cache: empty where a plan does not use them (the batch inputs of single-stream plans).
#[derive(Default)]
pub(crate) struct StepInputs<'b> {
    pub tokens: &'b [i32],
    pub positions: &'b [i32],
    pub slots: &'b [i32],
    pub row_sequences: &'b [i32],
    pub block_tables: &'b [i32],
    pub logit_rows: &'b [i32],
    /// An encoder batch step's sequences as runs of rows (`executor/cpu_encoder.rs`).
    pub sequence_starts: &'b [i32],
}

/// What one plan's run shares with the others: the artifact, the threads, the
/// KV cache, the run-time checks, and on a device mesh the hub and this device.
pub(crate) struct Run<'r> {
    pub artifact: &'r Artifact,
    pub pool: &'r ThreadPool,
    pub kv_cache: &'r mut KvCache,
    pub check_nan: bool,
    pub plan_name: &'static str,
    pub mesh: Option<(&'r MeshHub, usize)>,
}

/// Runs collective `c` of a plan on this device's `arena` for a step of
/// `dims` rows (`dims[1]`: rows with logits, which the collectives after a
/// batch plan's gather count).
fn exchange(mesh: Option<(&MeshHub, usize)>, arena: *mut u8, c: &CollectiveStep, dims: [i64; 2]) {
    let (hub, device) = mesh.expect("plans with collectives run on a mesh");
    let at_arena = |r: &BufferRef| match *r {
        // SAFETY: collective buffers were validated against the arena at open.
        BufferRef::Arena { offset } => unsafe { arena.add(offset as usize) as *mut f32 },
        other => panic!("collective buffer {other:?}: the compiler places them in the arena"),
    };
    let (input, output) = (at_arena(&c.input), at_arena(&c.output));
    let rows = match c.rows {
        RowCount::Step => dims[0],
        RowCount::Logits => dims[1],
    } as u64;
    // SAFETY: the compiler sized both buffers for the plan's rows.
    unsafe {
        match c.op {
            CollectiveOp::AllReduceSum { elems } => hub.all_reduce_sum(device, input, output, elems.eval(rows) as usize),
            CollectiveOp::AllGather { rows: r, cols } => hub.all_gather(device, input, output, r.eval(rows) as usize, cols as usize),
        }
    }
}

impl Run<'_> {
    /// Runs every launch of `plan` for a step of `dims[0]` rows (`dims[1]`: rows
    /// with logits, for the launches that follow them), and the plan's
    /// collectives at their places.
    pub(crate) fn plan(
        &mut self,
        plan: &Plan,
        state: &mut PlanState,
        inputs: &StepInputs<'_>,
        dims: [i64; 2],
    ) -> Result<(), RunError> {
        let header = &self.artifact.header;
        let arena = state.arena.ptr();
        let mut args: Vec<*mut u8> = Vec::with_capacity(8);
        let mut collectives = plan.collectives.iter().peekable();
        let input = |s: &[i32]| s.as_ptr() as *mut u8;
        for (index, (launch, kernel)) in plan.launches.iter().zip(&state.kernels).enumerate() {
            while let Some(c) = collectives.next_if(|c| c.before_launch as usize == index) {
                exchange(self.mesh, arena, c, dims);
            }
            args.clear();
            for a in &launch.args {
                args.push(match *a {
                    // SAFETY: offsets were validated against the arena size at open.
                    BufferRef::Arena { offset } => unsafe { arena.add(offset as usize) },
                    BufferRef::Weight(i) => self.artifact.weight_bytes(i as usize).as_ptr() as *mut u8,
                    BufferRef::Tokens => input(inputs.tokens),
                    BufferRef::Positions => input(inputs.positions),
                    BufferRef::KeyCache { layer, part } => self.kv_cache.keys(layer as usize, part as usize),
                    BufferRef::ValueCache { layer, part } => self.kv_cache.values(layer as usize, part as usize),
                    BufferRef::Slots => input(inputs.slots),
                    BufferRef::RowSequences => input(inputs.row_sequences),
                    BufferRef::BlockTables => input(inputs.block_tables),
                    BufferRef::LogitRows => input(inputs.logit_rows),
                    BufferRef::SequenceStarts => input(inputs.sequence_starts),
                });
            }
            if let Some(parts) = state.ahead.get(index).filter(|p| !p.is_empty()) {
                self.pool.prefetch_ahead(parts);
            }
            // A launch over the rows with logits sees `dims[1]` as its length.
            let (rows, dims_at) = match launch.rows {
                crate::format::RowCount::Step => (dims[0] as u64, 0),
                crate::format::RowCount::Logits => (dims[1] as u64, 1),
            };
            let started = state.profile.as_ref().map(|_| std::time::Instant::now());
            // SAFETY: the compiler sized every buffer for `plan.max_seq` rows and the
            // caches for their positions; the caller checked both bounds.
            unsafe { self.pool.launch(*kernel, args.as_ptr(), dims[dims_at..].as_ptr(), launch.tasks.eval(rows)) };
            if let (Some(t), Some(p)) = (started, state.profile.as_mut()) {
                let weights: u64 = launch
                    .args
                    .iter()
                    .map(|a| match a {
                        BufferRef::Weight(i) => header.weights[*i as usize].len,
                        _ => 0,
                    })
                    .sum();
                p[index].0 += 1;
                p[index].1 += t.elapsed().as_secs_f64();
                p[index].2 += weights + launch.output_elems.eval(rows) * 4;
            }
            let written = launch.output_elems.eval(rows) as usize;
            if self.check_nan && written > 0 {
                if let Some(&BufferRef::Arena { offset }) = launch.args.last() {
                    // SAFETY: the launch wrote `written` floats there (the compiler sized it).
                    let out = unsafe { std::slice::from_raw_parts(arena.add(offset as usize) as *const f32, written) };
                    if let Some((at, &value)) = out.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                        let kernel = header.kernels[launch.kernel as usize].symbol.clone();
                        return Err(RunError::NonFinite { kernel, launch: index, plan: self.plan_name, index: at, value });
                    }
                }
            }
        }
        for c in collectives {
            exchange(self.mesh, arena, c, dims);
        }
        Ok(())
    }
}

/// For each launch of a decode `plan`, the weight parts of the next launch that
/// reads at least 4 KiB of weights over more than one task ([`PlanState::ahead`]).
fn prefetch_plan(artifact: &Artifact, plan: &Plan) -> Vec<Vec<(usize, usize)>> {
    let parts = |l: &crate::format::Launch| -> Vec<(usize, usize)> {
        l.args
            .iter()
            .filter_map(|a| match *a {
                BufferRef::Weight(i) => artifact.weight_bytes(i as usize).as_ptr_range().into(),
                _ => None,
            })
            .map(|r: std::ops::Range<*const u8>| (r.start as usize, r.end as usize - r.start as usize))
            .collect()
    };
    // A mixture of experts' matmuls read only the experts the step's rows chose
    // (kernel family `moe`): fetching all of their weights ahead would read
    // every expert.
    let experts = |l: &crate::format::Launch| artifact.header.kernels.get(l.kernel as usize).is_some_and(|k| k.family == "moe");
    let streamed = |l: &crate::format::Launch| {
        let p = parts(l);
        (l.tasks.eval(1) > 1 && !experts(l) && p.iter().map(|p| p.1).sum::<usize>() >= 4096).then_some(p)
    };
    let n = plan.launches.len();
    (0..n).map(|i| (1..=n).find_map(|d| streamed(&plan.launches[(i + d) % n])).unwrap_or_default()).collect()
}

/// One running sequence over an artifact.
pub struct Session<'a> {
    artifact: &'a Artifact,
    /// Which sub-model (device of the mesh) this session runs.
    device: usize,
    /// The other devices, when the artifact is split over several.
    hub: Option<std::sync::Arc<MeshHub>>,
    _code: LoadedCode,
    pool: ThreadPool,
    prefill: PlanState,
    decode: PlanState,
    /// The prefill plan that computes only the last token's logits, if the artifact has one.
    prefill_last: Option<PlanState>,
    kv_cache: KvCache,
    tokens: Vec<i32>,
    positions: Vec<i32>,
    /// Tokens already in the KV cache.
    pub position: u64,
    pub counts: RunCounts,
    logits: Vec<f32>,
    /// Scan every launch's output for NaN / Inf (`maxrun --check-nan`).
    pub check_nan: bool,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("position", &self.position).finish()
    }
}

impl<'a> Session<'a> {
    /// Checks the CPU, loads the code, resolves kernels and allocates the caches.
    pub fn new(artifact: &'a Artifact, threads: usize) -> Result<Self, RunError> {
        Self::on_device(artifact, threads, 0, None)
    }

    /// A session for sub-model `device` of a sharded artifact, exchanging data with
    /// the sessions of the other devices through `hub` (`None` on one device).
    pub fn on_device(artifact: &'a Artifact, threads: usize, device: usize, hub: Option<std::sync::Arc<MeshHub>>) -> Result<Self, RunError> {
        let (code, resolved) = load_kernels(artifact)?;
        let state = |plan: &Plan, decode: bool| PlanState::new(artifact, plan, &resolved, decode);
        let h = &artifact.header;
        let sub = &h.sub_models[device];
        let kv_cache = KvCache::for_layout(&h.kv_cache, h.max_length, h.max_length)?;
        Ok(Session {
            artifact,
            device,
            hub,
            pool: ThreadPool::new(threads),
            prefill: state(&sub.prefill, false),
            decode: state(&sub.decode, true),
            prefill_last: sub.prefill_last.as_ref().map(|p| state(p, false)),
            _code: code,
            kv_cache,
            tokens: Vec::with_capacity(sub.prefill.max_seq as usize),
            positions: Vec::with_capacity(sub.prefill.max_seq as usize),
            position: 0,
            counts: RunCounts::default(),
            logits: Vec::new(),
            check_nan: false,
        })
    }

    /// Whether the KV cache asked for huge pages (`kv_cache.rs`).
    pub fn kv_cache_on_huge_pages(&self) -> bool {
        self.kv_cache.on_huge_pages()
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The artifact this session runs.
    pub fn artifact(&self) -> &'a Artifact {
        self.artifact
    }

    /// The logits of the last `forward` (all rows), or with `last_only` those of
    /// the last token: what `forward` / `forward_last` returned.
    pub fn logits(&self, last_only: bool) -> &[f32] {
        let vocab = self.artifact.header.model.vocab_size as usize;
        if last_only {
            &self.logits[self.logits.len().saturating_sub(vocab)..]
        } else {
            &self.logits
        }
    }

    /// The sub-model this session runs.
    fn sub(&self) -> &'a SubModel {
        &self.artifact.header.sub_models[self.device]
    }

    /// Starts timing every launch (adds a clock read per launch).
    pub fn enable_profile(&mut self) {
        let sub = self.sub();
        self.prefill.enable_profile(&sub.prefill);
        self.decode.enable_profile(&sub.decode);
        if let (Some(state), Some(plan)) = (self.prefill_last.as_mut(), sub.prefill_last.as_ref()) {
            state.enable_profile(plan);
        }
    }

    /// The profile so far, one row per kernel and plan, slowest first.
    pub fn profile(&self) -> Vec<ProfileRow> {
        let sub = self.sub();
        let last = sub.prefill_last.as_ref().zip(self.prefill_last.as_ref()).map(|(p, s)| ("prefill", p, s));
        profile_rows(&self.artifact.header, [("prefill", &sub.prefill, &self.prefill), ("decode", &sub.decode, &self.decode)].into_iter().chain(last))
    }

    /// Forgets the sequence (the cache is overwritten as positions are reused).
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Keeps only the first `len` tokens of the sequence (a chat turn that diverges
    /// from what is cached re-runs from there).
    pub fn truncate(&mut self, len: u64) {
        self.position = self.position.min(len);
    }

    /// Appends `ids` to the sequence and returns their logits, `[ids.len(), vocab]`
    /// (for an encoder: the sentence embedding, after a single step over all ids).
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        let h = &self.artifact.header;
        check_tokens(h, self.position, ids)?;
        self.logits.clear();
        if ids.len() == 1 {
            self.step(ids, Which::Decode)?;
        } else {
            for chunk in ids.chunks(self.sub().prefill.max_seq as usize) {
                self.step(chunk, Which::Prefill)?;
            }
        }
        Ok(&self.logits)
    }

    /// Appends `ids` and returns the logits of the last one only, `[vocab]`: what
    /// generation needs. Uses the artifact's last-row prefill plan when it has one
    /// (every chunk skips the other rows' final norm and lm_head).
    pub fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        let h = &self.artifact.header;
        if ids.len() <= 1 || self.prefill_last.is_none() || h.model.embedding_width.is_some() {
            let vocab = h.model.vocab_size as usize;
            let all = self.forward(ids)?.len();
            return Ok(&self.logits[all.saturating_sub(vocab)..]);
        }
        check_tokens(h, self.position, ids)?;
        for chunk in ids.chunks(self.sub().prefill.max_seq as usize) {
            self.logits.clear();
            self.step(chunk, Which::PrefillLast)?;
        }
        Ok(&self.logits)
    }

    fn step(&mut self, ids: &[u32], which: Which) -> Result<(), RunError> {
        let header = &self.artifact.header;
        let sub = &header.sub_models[self.device];
        let prefill = which != Which::Decode;
        let (plan, state) = match which {
            Which::Prefill => (&sub.prefill, &mut self.prefill),
            Which::Decode => (&sub.decode, &mut self.decode),
            Which::PrefillLast => (sub.prefill_last.as_ref().expect("checked by forward_last"), self.prefill_last.as_mut().expect("checked by forward_last")),
        };
        let seq = ids.len() as u64;
        debug_assert!(seq <= plan.max_seq);
        self.tokens.clear();
        self.tokens.extend(ids.iter().map(|&i| i as i32));
        self.positions.clear();
        self.positions.extend((self.position..self.position + seq).map(|p| p as i32));
        let inputs = StepInputs { tokens: &self.tokens, positions: &self.positions, ..StepInputs::default() };
        let name = if prefill { "prefill" } else { "decode" };
        let mesh = self.hub.as_deref().map(|hub| (hub, self.device));
        let mut run = Run { artifact: self.artifact, pool: &self.pool, kv_cache: &mut self.kv_cache, check_nan: self.check_nan, plan_name: name, mesh };
        run.plan(plan, state, &inputs, [seq as i64, 0])?;
        let n = match header.model.embedding_width {
            Some(width) => width as usize,
            None if which == Which::PrefillLast => header.model.vocab_size as usize,
            None => (seq * header.model.vocab_size) as usize,
        };
        self.logits.extend_from_slice(state.output(plan, n));
        self.position += seq;
        if prefill {
            self.counts.prefill += 1;
        } else {
            self.counts.decode += 1;
        }
        Ok(())
    }
}
