//! Opening an artifact: map the file, check the prelude, decode and validate the
//! header. Nothing here executes code; see `code.rs` for that.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::huge::HugeBuf;

use crate::format::*;

/// The most GPU tasks one task of a launch may become (`KernelEntry::gpu_task_split`;
/// the kernel library's largest is a token's heads or a row's chunks, far below).
pub const MAX_GPU_TASK_SPLIT: u32 = 1 << 16;

/// Why an artifact cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}: cannot read the artifact: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a maxc artifact (bad magic); compile one with `maxc compile`")]
    BadMagic { path: PathBuf },
    #[error("{path}: is {kind}, not an artifact file; give the .mef file `maxc compile -o` wrote")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error(
        "{path}: artifact format {found_major}.{found_minor} is not supported by this maxrun (format {FORMAT_MAJOR}.{FORMAT_MINOR}); \
         recompile it with maxc {} or use a maxrun that reads format {found_major}.x",
        env!("CARGO_PKG_VERSION")
    )]
    Version { path: PathBuf, found_major: u32, found_minor: u32 },
    #[error("{path}: {what}: the artifact is truncated or corrupt ({detail}); recompile it")]
    Corrupt { path: PathBuf, what: String, detail: String },
    #[error(
        "{path}: {what} checksum mismatch: expected {expected:016x}, found {found:016x}; \
         the artifact is corrupt: recompile it or copy it again"
    )]
    Checksum { path: PathBuf, what: String, expected: u64, found: u64 },
    #[error(
        "{path}: the artifact's code is for {triple}, but this machine is {arch}; \
         recompile it for this machine with --target cpu or --target {}",
        crate::cpu::portable_target()
    )]
    WrongArch { path: PathBuf, triple: String, arch: String },
    #[error(
        "{path}: the artifact's code needs CPU features this machine lacks: {}; \
         recompile with --target cpu (this machine) or {}",
        missing.join(", "), crate::cpu::lower_target_hint()
    )]
    MissingFeatures { path: PathBuf, missing: Vec<String> },
    #[error(
        "{path}: weight `{weight}` uses the encoding `{encoding}`, which this maxrun's kernels do not know \
         (known: {}); run it with a newer maxrun or recompile with a supported --quantization-encoding",
        WeightEncoding::all_names()
    )]
    UnknownEncoding { path: PathBuf, weight: String, encoding: String },
    #[error(
        "{path}: weight `{weight}` is stored in the layout `{layout}`, which this maxrun's kernels do not know \
         (known: {}); run it with a newer maxrun or recompile it with this maxrun's maxc",
        crate::format::LAYOUTS.join(", ")
    )]
    UnknownLayout { path: PathBuf, weight: String, layout: String },
    #[error(
        "{path}: the artifact has no CPU code, only GPU code for {}; run it on a machine with an NVIDIA GPU \
         and driver, or recompile with a CPU fallback: --target cpu,cuda:{}",
        archs.join(", "), archs.first().map(String::as_str).unwrap_or("sm_90")
    )]
    NoCpuCode { path: PathBuf, archs: Vec<String> },
    #[error(
        "{path}: none of the artifact's CPU variants runs on this machine: {}; \
         recompile with --target cpu (this machine) or add a lower level such as x86-64-v2 to the target list",
        variants.iter().map(|(cpu, missing)| format!("{cpu} needs {}", missing.join(", "))).collect::<Vec<_>>().join("; ")
    )]
    NoCpuVariant { path: PathBuf, variants: Vec<(String, Vec<String>)> },
}

/// The bytes of an artifact: a read-only mapping, a private copy on huge pages
/// (`maxrun --huge-pages`, see [`Artifact::open_resident`]), or memory (tests and fuzzing).
enum Backing {
    Map(Mmap),
    Resident(HugeBuf),
    Bytes(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Resident(b) => b.as_slice(),
            Backing::Bytes(b) => b,
        }
    }
}

/// A mapped artifact with a validated header.
pub struct Artifact {
    pub path: PathBuf,
    /// The header, with the chosen CPU variant's target, kernels and plans in
    /// `target`, `kernels` and `sub_models` (see [`Artifact::cpu_variant`]).
    pub header: Header,
    /// The format minor version of the file.
    pub minor: u32,
    /// The CPU variants' targets as written (one for a single-target
    /// artifact; none without CPU code), and the index of the one this
    /// process runs: the variant this machine supports with the most
    /// features (`MAXRUN_DISABLE_CPU_FEATURES` takes features away, which is
    /// how tests force a lower variant).
    pub cpu_variants: Vec<TargetInfo>,
    pub cpu_variant: usize,
    map: Backing,
}

impl std::fmt::Debug for Artifact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Artifact").field("path", &self.path).field("bytes", &self.map.len()).finish()
    }
}

/// Refuses what is not a regular file (a directory, a device such as /dev/null,
/// a FIFO) before it is mapped: the mapping's own error ("No such device") says
/// nothing useful.
fn regular_file(path: &Path, file: &std::fs::File) -> Result<(), ArtifactError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = file.metadata().map_err(|error| ArtifactError::Io { path: path.to_path_buf(), error })?;
    let t = meta.file_type();
    let kind = if t.is_file() {
        return Ok(());
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(ArtifactError::NotAFile { path: path.to_path_buf(), kind })
}

impl Artifact {
    /// Maps and validates an artifact: prelude, header checksum, section and weight
    /// bounds, and the checksums of every section but the weights (see [`Artifact::verify_weights`]).
    pub fn open(path: &Path) -> Result<Self, ArtifactError> {
        let p = path.to_path_buf();
        let io = |error| ArtifactError::Io { path: p.clone(), error };
        let file = std::fs::File::open(path).map_err(io)?;
        regular_file(path, &file)?;
        // SAFETY: read-only mapping; artifacts are not modified while running.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let artifact = Self::from_backing(p, Backing::Map(map))?;
        artifact.advise_expert_weights();
        Ok(artifact)
    }

    /// A mixture of experts reads a few of its experts a token, and the
    /// kernel's readahead around each page it faults in (up to the disk's
    /// `read_ahead_kb`: 8 MiB on the VMs here) would page in their neighbours
    /// too: the weights every `moe` launch reads are marked `MADV_RANDOM`, so
    /// that a decode pages in what it reads (docs/performance.md, "Mixtures of
    /// experts"). The dense weights keep the default (they are all read). A
    /// hint: a kernel that refuses it changes nothing but the pages read.
    fn advise_expert_weights(&self) {
        let Backing::Map(map) = &self.map else { return };
        if self.header.model.experts.is_none() {
            return;
        }
        let h = &self.header;
        let experts = h.weights_read(h.sub_models.iter().flat_map(|m| m.plans()), |family| family == "moe");
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        for w in experts.into_iter().filter_map(|i| h.weights.get(i)) {
            let Some(section) = h.sections.iter().find(|s| s.kind == SectionKind::Weights(w.device)) else { continue };
            let start = (section.offset + w.offset) as usize;
            let (from, to) = (start / page * page, (start + w.len as usize).div_ceil(page) * page);
            let _ = map.advise_range(memmap2::Advice::Random, from, to.min(map.len()) - from);
        }
    }

    /// Opens an artifact to run it: the file is read into private memory on
    /// transparent huge pages, which decode streams faster than a file mapping
    /// (no TLB miss and no prefetcher stop every 4 KiB; docs/performance.md).
    /// Falls back to [`Artifact::open`]'s mapping when the file is larger than half
    /// the memory the system reports available, or when the memory cannot be had.
    pub fn open_resident(path: &Path) -> Result<Self, ArtifactError> {
        use std::io::Read;
        let p = path.to_path_buf();
        let io = |error| ArtifactError::Io { path: p.clone(), error };
        let mut file = std::fs::File::open(path).map_err(io)?;
        regular_file(path, &file)?;
        let len = file.metadata().map_err(io)?.len();
        let fits = crate::huge::available_memory().is_none_or(|available| len <= available / 2);
        match usize::try_from(len).ok().filter(|_| fits).and_then(HugeBuf::zeroed) {
            Some(mut buf) => {
                file.read_exact(buf.as_mut_slice()).map_err(io)?;
                Self::from_backing(p, Backing::Resident(buf))
            }
            None => Self::open(path),
        }
    }

    /// Whether the bytes are a private copy on huge pages ([`Artifact::open_resident`])
    /// rather than a file mapping.
    pub fn is_resident(&self) -> bool {
        matches!(self.map, Backing::Resident(_))
    }

    /// Validates an artifact held in memory (`name` is used in messages).
    pub fn from_bytes(name: &Path, bytes: Vec<u8>) -> Result<Self, ArtifactError> {
        Self::from_backing(name.to_path_buf(), Backing::Bytes(bytes))
    }

    fn from_backing(p: PathBuf, map: Backing) -> Result<Self, ArtifactError> {
        let corrupt = |what: &str, detail: String| ArtifactError::Corrupt { path: p.clone(), what: what.into(), detail };
        if map.len() < 16 || map[..8] != MAGIC {
            if map.len() >= 8 && map[..8] == MAGIC {
                return Err(corrupt("prelude", format!("{} bytes", map.len())));
            }
            return Err(ArtifactError::BadMagic { path: p });
        }
        let u32_at = |o: usize| u32::from_le_bytes(map[o..o + 4].try_into().unwrap());
        let (major, minor) = (u32_at(8), u32_at(12));
        if map.len() < PRELUDE_LEN {
            return Err(corrupt("prelude", format!("{} bytes", map.len())));
        }
        if major != FORMAT_MAJOR {
            return Err(ArtifactError::Version { path: p, found_major: major, found_minor: minor });
        }
        let header_len = u64::from_le_bytes(map[16..24].try_into().unwrap());
        if header_len > MAX_HEADER_LEN || PRELUDE_LEN as u64 + header_len > map.len() as u64 {
            return Err(corrupt("header", format!("header length {header_len} exceeds the file size {}", map.len())));
        }
        let body = &map[PRELUDE_LEN..PRELUDE_LEN + header_len as usize];
        let expected = u64::from_le_bytes(map[24..32].try_into().unwrap());
        let found = checksum(body);
        if expected != found {
            return Err(ArtifactError::Checksum { path: p, what: "header".into(), expected, found });
        }
        let (header, used): (Header, usize) = bincode::serde::decode_from_slice(body, bincode_config())
            .map_err(|e| corrupt("header", e.to_string()))?;
        if used != body.len() {
            return Err(corrupt("header", format!("{} trailing bytes", body.len() - used)));
        }
        let mut header = header;
        let cpu_variants: Vec<TargetInfo> = if header.has_cpu_code() { header.cpu_targets().cloned().collect() } else { Vec::new() };
        let cpu_variant = choose_cpu_variant(&cpu_variants);
        header.select_cpu_variant(cpu_variant);
        let artifact = Artifact { path: p, header, minor, cpu_variants, cpu_variant, map };
        artifact.validate()?;
        let ptx = (0..artifact.header.gpu_archs.len() as u32).map(SectionKind::Ptx);
        let variant_code = (0..artifact.header.cpu_variants.len() as u32).map(SectionKind::VariantCode);
        for kind in [SectionKind::Code, SectionKind::Tokenizer, SectionKind::ChatTemplate].into_iter().chain(ptx).chain(variant_code) {
            artifact.verify_section(kind)?;
        }
        Ok(artifact)
    }

    /// Checks one section's checksum (a no-op for an absent section).
    pub fn verify_section(&self, kind: SectionKind) -> Result<(), ArtifactError> {
        self.verify_section_with_progress(kind, &mut |_, _| {})
    }

    /// Checks the weights section's checksum, streaming; `progress(done, total)` is
    /// called after every chunk.
    pub fn verify_weights(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), ArtifactError> {
        let total: u64 = self.weight_sections().map(|k| self.section(k).len() as u64).sum();
        let mut before = 0;
        for kind in self.weight_sections() {
            self.verify_section_with_progress(kind, &mut |done, _| progress(before + done, total))?;
            before += self.section(kind).len() as u64;
        }
        Ok(())
    }

    /// The weights section of every sub-model, in device order.
    pub fn weight_sections(&self) -> impl Iterator<Item = SectionKind> {
        (0..self.header.sub_models.len() as u32).map(SectionKind::Weights)
    }

    fn verify_section_with_progress(&self, kind: SectionKind, progress: &mut dyn FnMut(u64, u64)) -> Result<(), ArtifactError> {
        let Some(s) = self.header.sections.iter().find(|s| s.kind == kind) else { return Ok(()) };
        let bytes = self.section(kind);
        let mut state = ChecksumState::new();
        let mut done = 0u64;
        for chunk in bytes.chunks(8 << 20) {
            state.update(chunk);
            done += chunk.len() as u64;
            progress(done, bytes.len() as u64);
        }
        let found = state.digest();
        if found != s.checksum {
            return Err(ArtifactError::Checksum { path: self.path.clone(), what: format!("{kind:?} section"), expected: s.checksum, found });
        }
        Ok(())
    }

    /// The whole file size.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    fn validate(&self) -> Result<(), ArtifactError> {
        let corrupt = |what: String, detail: String| ArtifactError::Corrupt { path: self.path.clone(), what, detail };
        for s in &self.header.sections {
            let end = s.offset.checked_add(s.len);
            if s.offset % SECTION_ALIGN != 0 || end.is_none_or(|e| e > self.map.len() as u64) {
                return Err(corrupt(
                    format!("{:?} section", s.kind),
                    format!("{} bytes at offset {} but the file has {}", s.len, s.offset, self.map.len()),
                ));
            }
        }
        let h = &self.header;
        if h.sub_models.is_empty() || h.sub_models.len() != h.mesh.len() {
            return Err(corrupt("device mesh".into(), format!("{} sub-models for a mesh of {} devices", h.sub_models.len(), h.mesh.len())));
        }
        for kind in self.weight_sections().chain([SectionKind::Tokenizer]) {
            if !self.header.sections.iter().any(|s| s.kind == kind) {
                return Err(corrupt(format!("{kind:?} section"), "missing".into()));
            }
        }
        let archs = self.header.gpu_archs.len() as u32;
        for s in &self.header.sections {
            if let SectionKind::Ptx(i) = s.kind {
                if i >= archs {
                    return Err(corrupt(format!("{:?} section", s.kind), format!("names GPU architecture {i} of {archs}")));
                }
            }
        }
        if !self.header.has_cpu_code() && archs == 0 {
            return Err(corrupt("Code section".into(), "missing, and there is no GPU code either".into()));
        }
        for w in &self.header.weights {
            if w.device as usize >= h.sub_models.len() {
                return Err(corrupt(format!("weight `{}`", w.name), format!("belongs to device {} of {}", w.device, h.sub_models.len())));
            }
            let weights_len = self.section(SectionKind::Weights(w.device)).len() as u64;
            if w.offset.checked_add(w.len).is_none_or(|e| e > weights_len) {
                return Err(corrupt(format!("weight `{}`", w.name), format!("runs past the weights section ({weights_len} bytes)")));
            }
            let Some(encoding) = WeightEncoding::from_name(&w.encoding) else {
                return Err(ArtifactError::UnknownEncoding { path: self.path.clone(), weight: w.name.clone(), encoding: w.encoding.clone() });
            };
            let Some(layout) = Layout::from_name(&w.layout) else {
                return Err(ArtifactError::UnknownLayout { path: self.path.clone(), weight: w.name.clone(), layout: w.layout.clone() });
            };
            let layout_ok = layout.admits(encoding, &w.shape);
            if !layout_ok {
                return Err(corrupt(format!("weight `{}`", w.name), format!("layout `{}` for {} {:?}", w.layout, w.encoding, w.shape)));
            }
            let part = encoding.parts().iter().position(|(name, dtype, _)| *name == w.part && *dtype == w.dtype);
            let expected = part.and_then(|p| encoding.part_elems(p, &w.shape)).map(|n| n * w.dtype.size());
            if expected != Some(w.len) {
                return Err(corrupt(
                    format!("weight `{}`", w.name),
                    format!("{} bytes of {} part `{}` ({:?}) for shape {:?}", w.len, w.encoding, w.part, w.dtype, w.shape),
                ));
            }
        }
        if h.kv_cache.layers > 0 && (h.kv_cache.head_dim == 0 || h.kv_cache.position_bytes().is_none_or(|b| b == 0)) {
            return Err(corrupt("KV cache layout".into(), format!("{:?}: its head rows are not whole blocks of its encoding", h.kv_cache)));
        }
        if h.sub_models.iter().any(|m| m.batch.is_some()) != h.batch.is_some() {
            return Err(corrupt("batch plans".into(), "the header's batch limits and the sub-models' batch plans disagree".into()));
        }
        if let Some(b) = &h.batch {
            let blocks = h.max_length.div_ceil(b.block_size.max(1));
            if b.block_size == 0 || b.blocks_per_sequence != blocks || b.max_sequences == 0 || b.max_rows < b.max_sequences || !(b.max_sequences..=b.max_rows).contains(&b.max_logit_rows) || b.block_bytes(&h.kv_cache).is_none() {
                return Err(corrupt("batch limits".into(), format!("{b:?} for a context of {} positions", h.max_length)));
            }
        }
        for (d, e) in h.sub_models.iter().enumerate().filter_map(|(d, m)| Some((d, m.encode_batch.as_ref()?))) {
            // An encoder's batch step holds whole sequences of up to `max_length`
            // rows, on one device (the plan has no collectives).
            let ok = h.model.embedding_width.is_some()
                && h.sub_models.len() == 1
                && e.max_sequences >= 1
                && e.max_rows >= e.max_sequences
                && e.max_rows >= h.max_length
                && e.plan.max_seq == e.max_rows
                && e.plan.collectives.is_empty()
                // The embeddings of a full step lie inside the arena.
                && matches!(e.plan.logits, BufferRef::Arena { offset } if h.model.embedding_width.and_then(|w| w.checked_mul(e.max_sequences)?.checked_mul(4)?.checked_add(offset)).is_some_and(|end| end <= e.plan.arena_bytes));
            if !ok {
                return Err(corrupt(
                    "encoder batch plan".into(),
                    format!("sub-model {d}: {} sequences of {} rows per step (plan of {} rows, {} collectives) for a context of {} positions", e.max_sequences, e.max_rows, e.plan.max_seq, e.plan.collectives.len(), h.max_length),
                ));
            }
        }
        let plans = h.sub_models.iter().enumerate().flat_map(|(d, m)| {
            let batch = m.batch.as_ref().map(|b| [&b.mixed, &b.decode, &b.single]).into_iter().flatten().map(|p| (p, PlanKind::Batch));
            let encode = m.encode_batch.as_ref().map(|e| (&e.plan, PlanKind::Encode));
            [Some(&m.prefill), Some(&m.decode), m.prefill_last.as_ref()]
                .into_iter()
                .flatten()
                .map(|p| (p, PlanKind::Sequence))
                .chain(batch)
                .chain(encode)
                .map(move |(p, kind)| (d, p, kind))
        });
        for (device, plan, kind) in plans {
            // A buffer of `elems` f32 at the largest step lies inside the arena.
            let arena_ok = |r: &BufferRef, elems: u64| {
                matches!(*r, BufferRef::Arena { offset } if elems.checked_mul(4).and_then(|b| b.checked_add(offset)).is_some_and(|end| end <= plan.arena_bytes))
            };
            let mut last = 0;
            for c in &plan.collectives {
                // Counts of the rows with logits: at most a batch step's sequences.
                let rows = match (c.rows, &h.batch) {
                    (crate::format::RowCount::Step, _) => Some(plan.max_seq),
                    (crate::format::RowCount::Logits, Some(b)) if kind == PlanKind::Batch => Some(b.max_logit_rows.min(plan.max_seq)),
                    (crate::format::RowCount::Logits, _) => None,
                };
                let sizes = rows.map(|r| (c.op.input_elems(r), c.op.output_elems(r, h.sub_models.len() as u64)));
                let ok = sizes.is_some_and(|(n_in, n_out)| arena_ok(&c.input, n_in) && arena_ok(&c.output, n_out))
                    && c.input != c.output
                    && c.before_launch as usize <= plan.launches.len()
                    && c.before_launch >= last;
                if !ok || h.sub_models.len() < 2 {
                    return Err(corrupt("launch plan".into(), format!("collective {c:?} is out of range or order")));
                }
                last = c.before_launch;
            }
            for l in &plan.launches {
                let k = self.header.kernels.get(l.kernel as usize);
                let bad_kernel = |k: &crate::format::KernelEntry| {
                    k.num_params as usize != l.args.len() || !matches!(k.gpu_threads_per_task, 1 | 32 | 128) || !(1..=MAX_GPU_TASK_SPLIT).contains(&k.gpu_task_split)
                };
                if k.is_none_or(bad_kernel) || (l.rows == crate::format::RowCount::Logits && kind == PlanKind::Sequence) {
                    return Err(corrupt("launch plan".into(), format!("launch of kernel {} has a bad kernel, argument count, GPU threads per task or GPU task split", l.kernel)));
                }
                for a in &l.args {
                    let ok = match *a {
                        BufferRef::Weight(i) => self.header.weights.get(i as usize).is_some_and(|w| w.device as usize == device),
                        // An encoder's batch plan has no KV cache.
                        BufferRef::KeyCache { layer, part } | BufferRef::ValueCache { layer, part } => {
                            (layer as u64) < self.header.kv_cache.layers && (part as usize) < self.header.kv_cache.encoding.parts().len() && kind != PlanKind::Encode
                        }
                        // Kernels may use 16-byte vector accesses from a buffer's start (GPU).
                        BufferRef::Arena { offset } => offset < plan.arena_bytes && offset % 16 == 0,
                        BufferRef::Tokens | BufferRef::Positions => true,
                        // The batch step's inputs exist in batch plans only.
                        BufferRef::Slots | BufferRef::BlockTables | BufferRef::LogitRows => kind == PlanKind::Batch,
                        BufferRef::RowSequences => kind != PlanKind::Sequence,
                        BufferRef::SequenceStarts => kind == PlanKind::Encode,
                    };
                    if !ok {
                        return Err(corrupt("launch plan".into(), format!("argument {a:?} is out of range")));
                    }
                }
            }
        }
        Ok(())
    }

    /// The bytes of a section (empty when absent).
    pub fn section(&self, kind: SectionKind) -> &[u8] {
        match self.header.sections.iter().find(|s| s.kind == kind) {
            Some(s) => &self.map[s.offset as usize..(s.offset + s.len) as usize],
            None => &[],
        }
    }

    /// The bytes of weight `index`, zero-copy from the mapping.
    pub fn weight_bytes(&self, index: usize) -> &[u8] {
        let w = &self.header.weights[index];
        &self.section(SectionKind::Weights(w.device))[w.offset as usize..(w.offset + w.len) as usize]
    }

    /// Checks that this machine can run the chosen CPU variant's code.
    pub fn check_cpu(&self) -> Result<(), ArtifactError> {
        if !self.header.has_cpu_code() {
            return Err(ArtifactError::NoCpuCode { path: self.path.clone(), archs: self.header.gpu_archs.clone() });
        }
        let arch = std::env::consts::ARCH;
        if !self.header.target.triple.starts_with(arch) {
            return Err(ArtifactError::WrongArch { path: self.path.clone(), triple: self.header.target.triple.clone(), arch: arch.into() });
        }
        let missing = crate::cpu::missing_features(&self.header.target.required_features);
        if !missing.is_empty() {
            if self.cpu_variants.len() > 1 {
                let variants = self.cpu_variants.iter().map(|t| (variant_name(t), crate::cpu::missing_features(&t.required_features))).collect();
                return Err(ArtifactError::NoCpuVariant { path: self.path.clone(), variants });
            }
            return Err(ArtifactError::MissingFeatures { path: self.path.clone(), missing });
        }
        Ok(())
    }

    /// Which CPU code this process runs, for `--verbose`, `bench` and `serve`:
    /// `cpu variant cpu:x86-64-v4 (of cpu:x86-64-v2, cpu:x86-64-v3, cpu:x86-64-v4)`,
    /// or the one target of a single-target artifact.
    pub fn cpu_variant_note(&self) -> String {
        let Some(chosen) = self.cpu_variants.get(self.cpu_variant) else { return "no CPU code".into() };
        if self.cpu_variants.len() == 1 {
            return format!("CPU code for {} ({})", variant_name(chosen), chosen.cpu);
        }
        let all: Vec<String> = self.cpu_variants.iter().map(variant_name).collect();
        format!("CPU variant {} (of {})", variant_name(chosen), all.join(", "))
    }

    /// The section holding the chosen CPU variant's shared object.
    pub fn code_section(&self) -> SectionKind {
        SectionKind::cpu_code(self.cpu_variant)
    }

    /// The chosen CPU variant's shared object.
    pub fn code(&self) -> &[u8] {
        self.section(self.code_section())
    }

    /// The tokenizer.json text.
    pub fn tokenizer_json(&self) -> Result<&str, ArtifactError> {
        std::str::from_utf8(self.section(SectionKind::Tokenizer))
            .map_err(|e| ArtifactError::Corrupt { path: self.path.clone(), what: "Tokenizer section".into(), detail: e.to_string() })
    }
}

/// Which kind of plan a launch belongs to, for the inputs it may name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum PlanKind {
    /// Prefill, decode, last-row prefill: one sequence over the KV cache.
    Sequence,
    /// The batched engine's plans over the paged KV cache.
    Batch,
    /// A sentence encoder's batch plan: whole sequences, no KV cache.
    Encode,
}

/// A CPU variant's name for messages: its target as written
/// (`cpu:x86-64-v4+avx512vnni`), else its LLVM CPU.
pub fn variant_name(t: &TargetInfo) -> String {
    if t.spec.is_empty() {
        t.cpu.clone()
    } else {
        t.spec.clone()
    }
}

/// Which of `variants` (targets as written) this process runs: among those
/// for this machine's architecture whose features it has, the one with the
/// most features (a later level's features include the earlier ones'); ties
/// go to the first written. 0 when none fits (`Artifact::check_cpu` then
/// refuses, naming what each variant lacks).
fn choose_cpu_variant(variants: &[TargetInfo]) -> usize {
    let arch = std::env::consts::ARCH;
    let mut best: Option<(usize, usize)> = None;
    for (i, t) in variants.iter().enumerate() {
        let runs = t.triple.starts_with(arch) && crate::cpu::missing_features(&t.required_features).is_empty();
        if runs && best.is_none_or(|(_, n)| t.required_features.len() > n) {
            best = Some((i, t.required_features.len()));
        }
    }
    best.map_or(0, |(i, _)| i)
}
/// A fingerprint of a tokenizer.json: what tells two artifacts' tokenizers
/// apart (a draft model must share the target's; a perplexity base file
/// records its run's).
pub fn tokenizer_fingerprint(json: &str) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(json.as_bytes()))
}

