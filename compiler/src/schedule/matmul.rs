//! The matmul decision: which weight layout a matmul's weights are stored in
//! (`panel16`, `interleaved16`, row-major), whether its activations are
//! quantized to integers first (`ActivationEncoding`), and which kernel of the
//! library computes it, with its GPU form.

use super::*;

/// The kernel element type that reads a float weight stored as `q`.
pub(super) fn elem_of(q: WeightEncoding) -> maxc_kernels::ElemType {
    q.parts()[0].1
}

/// The activations of block-quantized matmuls (`compile.activation_encoding`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ActivationEncoding {
    /// Float activations times the decoded weight values (`matmul_blocks`).
    #[default]
    Float32,
    /// Int8 levels per block of 32, llama.cpp's scheme: integer dot products
    /// (`matmul_interleaved`, or `matmul_int8` for rows not in groups of 16).
    Int8,
    /// 16-bit levels per block of 32, float-like error (interleaved weights
    /// only; other matmuls keep float activations): in two byte planes for
    /// nibble weights (the int8 kernels' dot instructions twice), as words for
    /// Q8_0 (one word dot per 16 weights).
    Int16,
    /// bfloat16 weight panels only (other matmuls keep float activations):
    /// each activation rounded to bfloat16 (`round_bf16`) and multiplied with
    /// the weights two k at a time (`Stmt::PairDot`: `vdpbf16ps` on x86 with
    /// AVX512_BF16, twice the multiply-adds of an FMA per instruction),
    /// llama.cpp's scheme for BF16 files.
    BFloat16,
}

impl ActivationEncoding {
    /// The name `--activation-encoding` takes.
    pub fn name(self) -> &'static str {
        match self {
            ActivationEncoding::Float32 => "float32",
            ActivationEncoding::Int8 => "int8",
            ActivationEncoding::Int16 => "int16",
            ActivationEncoding::BFloat16 => "bfloat16",
        }
    }

    /// Whether block weights in `encoding` keep int16 activations by default:
    /// Q4_0 and Q4_1, whose logits int16 levels keep within the float32
    /// tolerance (the README artifact's exactness rests on it), and
    /// float8_e4m3fn, which llama.cpp has no type for to measure int8 beside
    /// (its matmuls take float activations; its q8_0 embedding / lm_head keep
    /// the exact default).
    pub fn keeps_int16(encoding: WeightEncoding) -> bool {
        matches!(encoding, WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Float8E4M3)
    }

    /// The default activations of CPU code with block weights: int16 when any
    /// weight keeps them ([`ActivationEncoding::keeps_int16`]), else int8,
    /// llama.cpp's scheme, chosen by measurement (docs/quantization.md,
    /// "Activation encodings by measurement": on every K-quant and Q8_0 file
    /// measured, int8's mean KL against the float32 model is within 5% of
    /// llama.cpp's own on that file).
    pub fn default_for_blocks(any_keeps_int16: bool) -> ActivationEncoding {
        if any_keeps_int16 {
            ActivationEncoding::Int16
        } else {
            ActivationEncoding::Int8
        }
    }

    /// The integer levels, if the activations are quantized (16-bit ones as
    /// planes; `integer_matmul` takes words where the weights are bytes).
    pub fn levels(self) -> Option<ActivationLevels> {
        match self {
            ActivationEncoding::Float32 | ActivationEncoding::BFloat16 => None,
            ActivationEncoding::Int8 => Some(ActivationLevels::Int8),
            ActivationEncoding::Int16 => Some(ActivationLevels::Int16Planes),
        }
    }
}

impl Scheduler<'_, '_, '_> {
    pub(super) fn weight_parts(&mut self, v: ValueId) -> Result<Vec<Arg>> {
        self.weight_parts_in(v, Layout::RowMajor)
    }

    pub(super) fn weight_parts_in(&mut self, v: ValueId, layout: Layout) -> Result<Vec<Arg>> {
        let key = (v.index(), layout);
        if let Some(a) = self.weight_loc.get(&key) {
            return Ok(a.clone());
        }
        let a: Vec<Arg> = constant_slots(self.graph, self.interp, v, self.weights, layout)?.into_iter().map(Arg::Weight).collect();
        if layout == Layout::RowMajor {
            self.loc[v.index()] = Some(a[0]);
        }
        self.weight_loc.insert(key, a.clone());
        Ok(a)
    }

    /// `x` then every part of weight `w` (in `layout`) then the rest: a matmul's or embedding's arguments.
    pub(super) fn weight_args(&mut self, before: &[ValueId], w: ValueId, after: &[ValueId], layout: Layout) -> Result<Vec<Arg>> {
        let mut args = self.inputs(before)?;
        args.extend(self.weight_parts_in(w, layout)?);
        args.extend(self.inputs(after)?);
        Ok(args)
    }

    /// The weight-layout decision, one per weight for every kernel that reads it:
    /// with int8 activations, a Q8_0 / Q4_0 / Q4_1 / Q4_K weight whose rows come in whole
    /// groups of 16 is interleaved for `matmul_interleaved`; a float or fp8 matmul
    /// weight whose rows come in whole panels is packed for `matmul_panel`. A tied
    /// embedding table takes either too (the gather reads both layouts), unless it
    /// is sharded by rows; never in GPU-only artifacts.
    pub(super) fn weight_layout(&self, w: ValueId) -> Layout {
        let ty = self.graph.ty(w);
        let shape: Vec<u64> = ty.shape.iter().map(|d| d.fixed().unwrap_or(0)).collect();
        let encoding = ty.quant;
        let gathered = self.graph.nodes.iter().any(|node| node.op == Op::Embedding && node.inputs.first() == Some(&w));
        // A table sharded by rows is gathered per device range (`embedding_range`), row-major.
        let sharded_gather = gathered && matches!(&self.graph.node(w).op, Op::Weight { shard: Some(_), .. });
        if self.weights.row_major_only || shape.contains(&0) {
            Layout::RowMajor
        } else if self.weights.activations.levels().is_some() && Layout::Interleaved16.admits(encoding, &shape) && !sharded_gather {
            Layout::Interleaved16
        } else if Layout::Panel16.admits(encoding, &shape) && !sharded_gather {
            Layout::Panel16
        } else {
            Layout::RowMajor
        }
    }

    /// Value `v` (`k` wide) quantized per block: to int8 in `form`'s order
    /// (`quantize_q8`), or to 16-bit levels stored as `levels` says
    /// (`quantize_q16`: byte planes or words; `form` unused). One launch per
    /// value and form, shared by every matmul reading it.
    pub(super) fn quantized_activations(&mut self, v: ValueId, k: u64, (levels, form): (ActivationLevels, DotForm), seq: SeqMode) -> Result<(Arg, Arg)> {
        let key = (v.index(), levels, (levels == ActivationLevels::Int8).then_some(form));
        if let Some(&q) = self.quantized.get(&key) {
            return Ok(q);
        }
        let x = self.input(v)?;
        // Levels (one or two bytes per value); f32 scales (every block's d, then every d * sum).
        let scale_elems = 2 * (k / 32);
        let kernel = quantize_to(k, levels, form, seq);
        let outputs = self.launch_outputs(kernel, vec![x], &[k * levels.bytes(), scale_elems * 4], TaskCount { per_seq: scale_elems, fixed: 0 });
        let q = (outputs[0], outputs[1]);
        self.quantized.insert(key, q);
        Ok(q)
    }

    /// Value `v` (`k` wide) rounded to bfloat16 (`round_bf16`), one launch per
    /// value, shared by every pair-dot matmul reading it.
    fn bf16_activations(&mut self, v: ValueId, k: u64, seq: SeqMode) -> Result<Arg> {
        if let Some(&xb) = self.rounded_bf16.get(&v.index()) {
            return Ok(xb);
        }
        let x = self.input(v)?;
        let xb = self.launch_outputs(round_bf16(k, seq), vec![x], &[k * 2], TaskCount { per_seq: 1, fixed: 0 })[0];
        self.rounded_bf16.insert(v.index(), xb);
        Ok(xb)
    }

    /// The sums per 16 values of `v`'s integer levels `q` (`level_half_sums`),
    /// one launch per value and levels.
    fn activation_half_sums(&mut self, v: ValueId, k: u64, levels: ActivationLevels, q: Arg, seq: SeqMode) -> Arg {
        if let Some(&h) = self.half_sums.get(&(v.index(), levels)) {
            return h;
        }
        let sums = k / 16;
        let h = self.launch_outputs(level_half_sums(k, levels, seq), vec![q], &[sums * 4], TaskCount { per_seq: sums, fixed: 0 })[0];
        self.half_sums.insert((v.index(), levels), h);
        h
    }

    /// The integer levels of a block weight's matmul (`encoding`, `[n, k]`)
    /// when integer activations are enabled: 16-bit ones as planes, words or
    /// word pairs by the weight's levels, the step and the target.
    pub(super) fn integer_levels(&self, encoding: WeightEncoding, (n, k): (u64, u64), seq: SeqMode) -> Option<ActivationLevels> {
        let levels = self.weights.activations.levels().filter(|_| encoding.is_block())?;
        // 16-bit levels: in byte planes (byte dots take nibbles as they are), and
        // as words for Q8_0's bytes at decode (widened once, one word dot per
        // 16: int8's instruction count). Prefill tiles keep Q8_0 on planes where
        // the byte dots take its bytes as they are: a words tile holds four
        // accumulators per row and takes half the rows, each widened weight
        // vector costing a shuffle-port `vpmovzxbw` for two rows' dots; planes
        // reuse the raw bytes across the full tile. Intel Xeon VM (AVX-512
        // VNNI), 2 threads, pp512 planes against words: 1.17B Q8_0 139.8 / 107.8
        // tok/s, Q4_K_M (its Q6_K tensors as q8_0) 161 / 148, SmolLM2 q8_0 1062 /
        // 765. Without VNNI each row and plane moves the weights' signs first
        // (`vpsignb`), and words win: Zen 3 VM (AVX2), SmolLM2 q8_0 pp512 words
        // against planes 1.24x, the batched step's q8_0 lm_head 1.06x.
        // Nibbles (Q4_0, Q4_1, Q4_K) in prefill tiles on AVX2 without VNNI take
        // the levels as word pairs: masked out of 16-bit lanes, one `vpmaddwd`
        // per 16 products with its pair of activation words broadcast, one i32
        // accumulator per 8 weight rows, where two byte planes issue two
        // `vpmaddubsw` per 32 products and keep four i16 sums per tile row
        // (AVX2's 4 x 1 tile spilled 107 times per 128 `vpmaddubsw` in the
        // 1.17B Q4_K block loop). Decode keeps planes (the same integers, so a
        // row gets the same bits in a GEMV and in a tile). Measured in
        // docs/performance-log.md ("Nibbles as word pairs"). Q8_0's prefill tiles
        // there take word pairs too (its signed bytes split out of 16-bit
        // lanes, two vectors per 32 bytes, the decode words' integers): where
        // the 8-row words tile kept four i32 accumulators per row and spilled
        // 294 times per 256 `vpmaddwd`, the batched step's lm_head ran
        // 1.18x faster (docs/performance-log.md, "Q8_0 as word pairs").
        // Q5's five-bit and Q6_K's six-bit levels too: their high bits ORed
        // into the masked nibble words (docs/performance-log.md, "Five- and
        // six-bit levels as word pairs").
        let nibbles = matches!(maxc_kernels::library::dequant::rows_form(encoding, n, k), Some(maxc_kernels::ir::RowsForm::Nibbles | maxc_kernels::ir::RowsForm::Nibbles5 | maxc_kernels::ir::RowsForm::Nibbles6));
        Some(match levels {
            ActivationLevels::Int16Planes if (nibbles || encoding == WeightEncoding::Q8_0) && !seq.is_decode() && self.weights.tiles_take_word_pairs => ActivationLevels::Int16WordPairs,
            ActivationLevels::Int16Planes if encoding == WeightEncoding::Q8_0 && (seq.is_decode() || !self.weights.byte_dots_take_q8_0) => ActivationLevels::Int16Words,
            other => other,
        })
    }

    /// The integer-activation form of a matmul of `x` with block weight `w`
    /// (plus `addend`), when enabled and the encoding has integer levels: the
    /// interleaved kernel where the weight has that layout, else (int8 only)
    /// block dots.
    pub(super) fn integer_matmul(&mut self, x: ValueId, w: ValueId, addend: Option<(ValueId, Broadcast)>, seq: SeqMode) -> Result<Option<Arg>> {
        let ty = self.graph.ty(w);
        let (n, k) = (ty.shape[0].fixed().expect("static"), ty.shape[1].fixed().expect("static"));
        let Some(levels) = self.integer_levels(ty.quant, (n, k), seq) else { return Ok(None) };
        let (encoding, bc) = (ty.quant, addend.map(|(_, bc)| bc));
        let (form, layout, kernel) = match (self.weight_layout(w), levels, maxc_kernels::library::matmul_int8::dot_form(encoding, k)) {
            (Layout::Interleaved16, _, _) => {
                let tile = match self.weights.q4_k_int8_tile {
                    Some(tile) if encoding == WeightEncoding::Q4K && levels == ActivationLevels::Int8 => tile,
                    _ => self.weights.register_tile,
                };
                (DotForm::Int8, Layout::Interleaved16, matmul_interleaved(k, n, encoding, bc, seq, tile, levels))
            }
            (_, ActivationLevels::Int8, Some(form)) => (form, Layout::RowMajor, maxc_kernels::library::matmul_int8::matmul_int8(k, n, encoding, bc, seq)),
            _ => return Ok(None),
        };
        let (q, scales) = self.quantized_activations(x, k, (levels, form), seq)?;
        let mut args = vec![q, scales];
        // Q6_K's row dots apply their offset per 16 values through the activations' sums.
        if layout == Layout::Interleaved16 && maxc_kernels::library::matmul_interleaved::reads_half_sums(encoding, n, k) {
            args.push(self.activation_half_sums(x, k, levels, q, seq));
        }
        args.extend(self.weight_parts_in(w, layout)?);
        if let Some((r, _)) = addend {
            args.push(self.input(r)?);
        }
        Ok(Some(self.launch(kernel, args, n)))
    }

    /// `x @ w^T` (plus `addend`, broadcast as given) for a weight `w`: the int8
    /// form when enabled, else the kernel for the weight's encoding and layout,
    /// with its GPU form recorded where the CPU one suits vector registers.
    pub(super) fn weight_matmul(&mut self, x: ValueId, w: ValueId, addend: Option<(ValueId, Broadcast)>, seq: SeqMode) -> Result<Arg> {
        if let Some(out) = self.integer_matmul(x, w, addend, seq)? {
            return Ok(out);
        }
        let ty = self.graph.ty(w);
        let (n, k) = (ty.shape[0].fixed().expect("static"), ty.shape[1].fixed().expect("static"));
        let (quant, bc) = (ty.quant, addend.map(|(_, bc)| bc));
        let layout = self.weight_layout(w);
        let after: Vec<ValueId> = addend.map(|(r, _)| r).into_iter().collect();
        // bfloat16 panels meet activations rounded to bfloat16 in pair dots
        // (`--activation-encoding bfloat16`), two k at a time.
        let pairs = layout == Layout::Panel16 && quant == WeightEncoding::BFloat16 && self.weights.activations == ActivationEncoding::BFloat16 && k % 2 == 0;
        let args = if pairs {
            let mut args = vec![self.bf16_activations(x, k, seq)?];
            args.extend(self.weight_args(&[], w, &after, layout)?);
            args
        } else {
            self.weight_args(&[x], w, &after, layout)?
        };
        let (kernel, gpu_form) = match layout {
            Layout::Panel16 if pairs => (matmul_panel(k, n, PanelWeights::BFloat16Pairs, bc, seq, self.weights.register_tile), None),
            Layout::Panel16 => {
                let weights = PanelWeights::of(quant).expect("panel16 weights have a panel form (weight_layout)");
                (matmul_panel(k, n, weights, bc, seq, self.weights.register_tile), Some(matmul_panel_rowwise(k, n, weights, bc, seq)))
            }
            _ if quant.is_block() && self.weights.row_major_only => (matmul_blocks_rowwise(k, n, quant, bc, seq), None),
            _ if quant.is_block() => (matmul_blocks(k, n, quant, bc, seq), Some(matmul_blocks_rowwise(k, n, quant, bc, seq))),
            Layout::RowMajor => {
                let gpu = Some(matmul_rowwise(k, n, elem_of(quant), bc, seq));
                match bc {
                    None => (matmul(k, n, elem_of(quant), seq), gpu),
                    Some(bc) => (matmul_add(k, n, bc, elem_of(quant), seq), gpu),
                }
            }
            Layout::Interleaved16 => unreachable!("interleaved weights are read by the integer matmul (integer_matmul)"),
        };
        if let Some(gpu) = gpu_form {
            self.kernels.set_gpu_form(&kernel, gpu);
        }
        Ok(self.launch(kernel, args, n))
    }
}
