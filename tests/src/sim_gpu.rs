//! A simulated GPU for the batched GPU executor's host side
//! (runtime-stub/src/executor/gpu.rs): device memory as host byte vectors at
//! made-up addresses, and every launch run through the kernel interpreter's GPU
//! semantics (`maxc_kernels::interp::run_warp`: loops dealt to lanes, warp
//! reductions) on the kernels' GPU forms, which `maxc compile --dump-ir`
//! writes under `kernels-gpu/`.
//!
//! What it checks as it goes, so that a host-side mistake fails loudly rather
//! than as wrong numbers: every address a launch uses lies in an allocation,
//! each launch's grid is the task count its kernel's GPU form has for the row
//! count the launch points at, and captured graphs replay only launches that
//! were recorded.

use std::path::Path;

use maxc_kernels::interp::{run_warp, Buffer};
use maxc_kernels::{ElemType, Kernel};
use maxrun_runtime::executor::gpu::GpuDevice;
use maxrun_runtime::executor::RunError;

/// One queued launch.
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    kernel: u32,
    args: u64,
    dims: u64,
    tasks: u64,
}

/// What a device did: launches run (replayed ones included), graphs captured,
/// graph replays. A test keeps a handle while the engine owns the device.
#[derive(Debug, Default)]
pub struct SimCounts {
    pub launches: std::cell::Cell<u64>,
    pub captures: std::cell::Cell<u64>,
    pub replays: std::cell::Cell<u64>,
}

/// Device memory and the kernels.
pub struct SimDevice {
    kernels: Vec<Kernel>,
    /// Allocations: base address and bytes, in address order.
    memory: Vec<(u64, Vec<u8>)>,
    next: u64,
    capturing: Option<Vec<Launch>>,
    pub counts: std::rc::Rc<SimCounts>,
}

/// Gaps between allocations, so that an address past one's end is in none.
const GAP: u64 = 1 << 16;

impl SimDevice {
    /// A device with `kernels`, in the artifact's kernel order.
    pub fn new(kernels: Vec<Kernel>) -> SimDevice {
        SimDevice { kernels, memory: Vec::new(), next: 1 << 32, capturing: None, counts: Default::default() }
    }

    /// A device with the GPU forms `maxc compile --dump-ir DIR` wrote for the
    /// kernels `symbols` (the artifact's kernel table, in order).
    pub fn from_dump(dir: &Path, symbols: &[String]) -> SimDevice {
        let kernels = symbols
            .iter()
            .map(|s| {
                let path = dir.join("kernels-gpu").join(format!("{s}.kir"));
                let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                maxc_kernels::ir_text::parse(&text).unwrap_or_else(|e| panic!("{}: {e:?}", path.display()))
            })
            .collect();
        SimDevice::new(kernels)
    }

    /// The allocation holding `address`: its index and the offset in it.
    fn find(&self, address: u64, what: &str) -> Result<(usize, usize), RunError> {
        let i = self.memory.partition_point(|(base, _)| *base <= address);
        match i.checked_sub(1).map(|i| (i, &self.memory[i])) {
            Some((i, (base, bytes))) if address - base < bytes.len() as u64 => Ok((i, (address - base) as usize)),
            _ => Err(RunError::Gpu(format!("{what}: address {address:#x} is in no allocation"))),
        }
    }

    fn read_u64(&self, address: u64, what: &str) -> Result<u64, RunError> {
        let (i, at) = self.find(address, what)?;
        let bytes = self.memory[i].1.get(at..at + 8).ok_or_else(|| RunError::Gpu(format!("{what}: 8 bytes at {address:#x} run past their allocation")))?;
        Ok(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
    }

    fn run(&mut self, l: Launch) -> Result<(), RunError> {
        let kernel = self.kernels.get(l.kernel as usize).ok_or_else(|| RunError::Gpu(format!("kernel {} is not in the table", l.kernel)))?.clone();
        let seq = self.read_u64(l.dims, &format!("`{}`'s row count", kernel.name))?;
        let expected = kernel.tasks.eval(seq);
        if l.tasks != expected {
            return Err(RunError::Gpu(format!("`{}` launched over {} tasks; its GPU form has {expected} for {seq} rows", kernel.name, l.tasks)));
        }
        // Each parameter sees its allocation from its address on.
        let mut views = Vec::with_capacity(kernel.params.len());
        for (p, param) in kernel.params.iter().enumerate() {
            let address = self.read_u64(l.args + 8 * p as u64, &format!("`{}`'s argument table", kernel.name))?;
            let (i, at) = self.find(address, &format!("`{}` argument `{}`", kernel.name, param.name))?;
            views.push((i, at));
        }
        let mut buffers: Vec<Buffer> = kernel.params.iter().zip(&views).map(|(param, &(i, at))| to_buffer(param.elem, &self.memory[i].1[at..])).collect();
        run_warp(&kernel, &mut buffers, seq);
        // Only what a written parameter changed goes back: several parameters
        // may view one allocation (an arena) from different places.
        for ((param, &(i, at)), buffer) in kernel.params.iter().zip(&views).zip(&buffers) {
            if !param.writes {
                continue;
            }
            let new = from_buffer(buffer);
            let old = &mut self.memory[i].1[at..];
            for (o, n) in old.iter_mut().zip(&new) {
                if *o != *n {
                    *o = *n;
                }
            }
        }
        self.counts.launches.set(self.counts.launches.get() + 1);
        Ok(())
    }
}

/// `bytes` as a buffer of `elem`s (a trailing partial element is dropped).
fn to_buffer(elem: ElemType, bytes: &[u8]) -> Buffer {
    match elem {
        ElemType::F32 => Buffer::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()),
        ElemType::I32 => Buffer::I32(bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()),
        ElemType::BF16 => Buffer::BF16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
        ElemType::F16 => Buffer::F16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
        ElemType::I8 => Buffer::I8(bytes.iter().map(|&b| b as i8).collect()),
        ElemType::U8 => Buffer::U8(bytes.to_vec()),
    }
}

fn from_buffer(b: &Buffer) -> Vec<u8> {
    match b {
        Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::BF16(v) | Buffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::I8(v) => v.iter().map(|&x| x as u8).collect(),
        Buffer::U8(v) => v.clone(),
    }
}

impl GpuDevice for SimDevice {
    type Graph = Vec<Launch>;

    fn name(&self) -> String {
        "simulated GPU (kernel interpreter)".into()
    }

    fn free_memory(&self) -> Option<u64> {
        None
    }

    fn alloc(&mut self, bytes: usize) -> Result<u64, RunError> {
        let base = self.next;
        self.next += (bytes as u64).div_ceil(256) * 256 + GAP;
        self.memory.push((base, vec![0; bytes]));
        Ok(base)
    }

    fn upload(&mut self, dst: u64, data: &[u8]) -> Result<(), RunError> {
        if self.capturing.is_some() {
            return Err(RunError::Gpu("an upload inside a graph capture".into()));
        }
        let (i, at) = self.find(dst, "upload")?;
        let room = &mut self.memory[i].1[at..];
        if room.len() < data.len() {
            return Err(RunError::Gpu(format!("an upload of {} bytes at {dst:#x} runs past its allocation", data.len())));
        }
        room[..data.len()].copy_from_slice(data);
        Ok(())
    }

    fn download(&mut self, src: u64, out: &mut [u8]) -> Result<(), RunError> {
        let (i, at) = self.find(src, "download")?;
        let have = &self.memory[i].1[at..];
        if have.len() < out.len() {
            return Err(RunError::Gpu(format!("a download of {} bytes at {src:#x} runs past its allocation", out.len())));
        }
        out.copy_from_slice(&have[..out.len()]);
        Ok(())
    }

    fn launch(&mut self, kernel: u32, args: u64, dims: u64, tasks: u64) -> Result<(), RunError> {
        let l = Launch { kernel, args, dims, tasks };
        match &mut self.capturing {
            Some(graph) => {
                graph.push(l);
                Ok(())
            }
            None => self.run(l),
        }
    }

    fn begin_capture(&mut self) -> Result<(), RunError> {
        if self.capturing.replace(Vec::new()).is_some() {
            return Err(RunError::Gpu("a capture inside a capture".into()));
        }
        Ok(())
    }

    fn end_capture(&mut self) -> Result<Vec<Launch>, RunError> {
        self.counts.captures.set(self.counts.captures.get() + 1);
        self.capturing.take().ok_or_else(|| RunError::Gpu("end of a capture that was not begun".into()))
    }

    fn replay(&mut self, graph: &Vec<Launch>) -> Result<(), RunError> {
        self.counts.replays.set(self.counts.replays.get() + 1);
        graph.iter().try_for_each(|&l| self.run(l))
    }
}
