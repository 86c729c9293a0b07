//! The weights table a device's plans share: one slot per stored part of each
//! constant (checkpoint weights, stacked weights, computed constants such as
//! RoPE's frequencies), named stably and deduplicated per device.

use super::*;

/// Where a constant's bytes come from when the weights section is written.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    /// A checkpoint tensor, decoded to f32.
    Checkpoint(String),
    /// Checkpoint tensors concatenated along axis 0 (stacked projections).
    Stacked(Vec<String>),
    /// Values computed at compile time.
    Values(Vec<f32>),
}

/// One entry of the weights table: one stored part of a tensor (a float tensor
/// has one part; a block-quantized one has its quants, scales, ... as
/// consecutive slots with the same `data`).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSlot {
    /// The tensor's name, with `#PART` appended for parts after the first.
    pub name: String,
    /// The logical shape of the whole tensor.
    pub shape: Vec<u64>,
    pub data: WeightData,
    /// How the values are stored in the artifact.
    pub encoding: WeightEncoding,
    /// Which part of the encoding this slot holds.
    pub part: usize,
    /// How the elements are ordered in the artifact.
    pub layout: Layout,
    /// The device (sub-model) whose weights section holds it.
    pub device: u32,
    /// The slice of each checkpoint tensor in `data` it holds (`shape` is the slice's).
    pub shard: Option<WeightShard>,
}

/// The suffix of a weight's name in `layout` (one tensor may be stored in several).
pub(super) fn layout_suffix(layout: Layout) -> &'static str {
    match layout {
        Layout::RowMajor => "",
        Layout::Panel16 => "@panel16",
        Layout::Interleaved16 => "@x16",
    }
}

impl WeightSlot {
    /// A float32 tensor (one part).
    pub(super) fn plain(name: String, shape: Vec<u64>, data: WeightData) -> WeightSlot {
        WeightSlot { name, shape, data, encoding: WeightEncoding::Float32, part: 0, layout: Layout::RowMajor, device: 0, shard: None }
    }

    /// All the slots of a tensor stored in `encoding` and `layout`.
    pub(super) fn parts(name: &str, shape: Vec<u64>, data: WeightData, encoding: WeightEncoding, layout: Layout, shard: Option<WeightShard>) -> Vec<WeightSlot> {
        let mut name = name.to_string();
        if let Some(sh) = shard {
            name.push_str(&format!("@shard{}/{}", sh.index, sh.devices));
        }
        name.push_str(layout_suffix(layout));
        encoding
            .parts()
            .iter()
            .enumerate()
            .map(|(part, (part_name, _, _))| WeightSlot {
                name: if part == 0 { name.clone() } else { format!("{name}#{part_name}") },
                shape: shape.clone(),
                data: data.clone(),
                encoding,
                part,
                layout,
                device: 0,
                shard,
            })
            .collect()
    }
}

/// Constants shared by a device's plans; each device of a mesh has its own.
#[derive(Debug, Default)]
pub struct WeightTable {
    pub slots: Vec<WeightSlot>,
    by_name: HashMap<(u32, String), u32>,
    /// The device whose plans are being scheduled: new slots belong to it.
    pub device: u32,
    /// Keep every weight row-major and use the GPU forms of the matmuls: for
    /// artifacts without CPU code, whose GPU kernels read a matmul's rows with a
    /// whole warp (`panel16` and the block matmul's per-lane accumulators suit
    /// the CPU's vector registers, not a warp).
    pub row_major_only: bool,
    /// How block-quantized matmuls take their activations
    /// (`--activation-encoding`): float, or quantized per block to integers and
    /// multiplied with integer dot products.
    pub activations: ActivationEncoding,
    /// The prefill register tile of the panel and interleaved matmuls, sized to
    /// the CPU target's vector registers.
    pub register_tile: RegisterTile,
    /// The prefill register tile of Q4_K matmuls with int8 activations where
    /// the CPU runs another than `register_tile` faster
    /// (`CpuTarget::q4_k_int8_tiles_take_eight_rows`: 8 x 2).
    pub q4_k_int8_tile: Option<RegisterTile>,
    /// The CPU target's byte dots take Q8_0's stored bytes (`q + 128`) as they
    /// are (VNNI's `vpdpbusd`; NEON's signed dots take `q`): int16 activations
    /// as byte planes suit prefill tiles there. Without it (x86 without VNNI:
    /// `vpmaddubsw` saturates above 128, so each row and plane moves the weights'
    /// signs onto its activations first) Q8_0 takes words in tiles too.
    pub byte_dots_take_q8_0: bool,
    /// The CPU target is x86 with AVX2 but neither AVX-512 nor VNNI: int16
    /// activations meet nibble and Q8_0 weights in prefill tiles as word pairs
    /// (`ActivationLevels::Int16WordPairs`) rather than byte planes or words.
    pub tiles_take_word_pairs: bool,
}

impl WeightTable {
    pub(super) fn intern(&mut self, mut slot: WeightSlot) -> u32 {
        slot.device = self.device;
        let key = (self.device, slot.name.clone());
        if let Some(&i) = self.by_name.get(&key) {
            return i;
        }
        let i = self.slots.len() as u32;
        self.by_name.insert(key, i);
        self.slots.push(slot);
        i
    }
}

/// Places a constant node in the weights table: one slot per stored part.
pub(super) fn constant_slots(graph: &Graph, interp: &mut crate::interp::Interpreter<'_>, v: ValueId, weights: &mut WeightTable, layout: Layout) -> Result<Vec<u32>> {
    let node = graph.node(v);
    let shape: Vec<u64> = node.ty.shape.iter().map(|d| d.fixed().expect("constants are static")).collect();
    let slots = match &node.op {
        Op::Weight { name, shard, .. } => WeightSlot::parts(name, shape, WeightData::Checkpoint(name.clone()), node.ty.quant, layout, *shard),
        Op::Concat { axis: 0 } if same_shard_weights(graph, &node.inputs).is_some() => {
            let names: Vec<String> = node
                .inputs
                .iter()
                .map(|i| match &graph.node(*i).op {
                    Op::Weight { name, .. } => name.clone(),
                    _ => unreachable!("checked above"),
                })
                .collect();
            let shard = same_shard_weights(graph, &node.inputs).flatten();
            WeightSlot::parts(&stack_name(&names), shape, WeightData::Stacked(names), node.ty.quant, layout, shard)
        }
        _ => {
            let t = interp.constant_value(v)?;
            let values = t.as_f32().to_vec();
            let bits: String = values.iter().map(|f| format!("{:08x}", f.to_bits())).collect();
            let mut slot = WeightSlot::plain(format!("const.{}", short_hash(&bits)), shape, WeightData::Values(values));
            if layout == Layout::Panel16 {
                slot.name.push_str(layout_suffix(layout));
                slot.layout = layout;
            }
            vec![slot]
        }
    };
    Ok(slots.into_iter().map(|slot| weights.intern(slot)).collect())
}

/// The weights-table name of checkpoint tensors `names` stacked: `stack(a,b,c)`;
/// past 4 tensors (a layer's experts: 256 of them in Qwen3-30B-A3B, whose
/// names would make each header entry kilobytes long) the first and last
/// with the count and a hash of all of them: `stack(a,...,z;256;HASH)`.
fn stack_name(names: &[String]) -> String {
    match names {
        [first, .., last] if names.len() > 4 => format!("stack({first},...,{last};{};{})", names.len(), short_hash(&names.join(","))),
        _ => format!("stack({})", names.join(",")),
    }
}

/// `Some(shard)` when every input is a checkpoint weight with the same shard (or none).
pub(super) fn same_shard_weights(graph: &Graph, inputs: &[ValueId]) -> Option<Option<WeightShard>> {
    let shard_of = |v: &ValueId| match &graph.node(*v).op {
        Op::Weight { shard, .. } => Some(*shard),
        _ => None,
    };
    let first = shard_of(inputs.first()?)?;
    inputs.iter().all(|v| shard_of(v) == Some(first)).then_some(first)
}

/// A stable 64-bit FNV-1a hash in hex (names must not depend on hash-map order or process).
pub fn short_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}
