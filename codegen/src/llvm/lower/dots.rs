//! The dot-product idioms of the lowering: [`Stmt::DotBlock`] and
//! [`Stmt::DotRows`] as vector code, four-byte dot products by the target's
//! instructions ([`ByteDots`]: `vpdpbusd`, `vpmaddubsw` + `vpmaddwd`, `sdot`,
//! `smull` + `saddlp` + `addp`, or widened multiplies), word dots by
//! `vpmaddwd`, and the epilogues that scale and add them (one explicit
//! `llvm.fmuladd`, no fast-math flags: a row gets the same bits in a GEMV and a
//! tile).

use super::*;

/// How a CPU target computes four-byte dot products (unsigned bytes times signed
/// bytes, each i32 lane the sum of four products), the core of the int8 matmuls.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum ByteDots {
    /// VNNI `vpdpbusd`, exact for any unsigned byte: one instruction on zmm
    /// (AVX-512 VNNI) or two on ymm halves (AVX-VNNI, Intel's cores without
    /// AVX-512 since Alder Lake).
    Vnni { zmm: bool },
    /// `vpmaddubsw` then `vpmaddwd` by ones, on zmm (AVX-512BW) or two ymm halves
    /// (AVX2), as llama.cpp does without VNNI: pairs of products are summed in
    /// i16 with saturation, so the unsigned bytes must stay at most 128.
    Madd { zmm: bool },
    /// aarch64 (NEON), signed bytes by signed bytes on 128-bit parts: with
    /// FEAT_DotProd one `sdot` per 16 bytes, without it `smull` / `smull2`
    /// (byte products in i16), `saddlp` (pairs in i32) and `addp` (fours), as
    /// llama.cpp does on such cores. The levels that are unsigned elsewhere go
    /// in as they are where they are below 128 (nibbles), and Q8_0's as its
    /// signed `w` (the -128 minimum folded, as on the `Madd` form). No `usdot`
    /// (unsigned by signed) without i8mm, which not every dotprod core has.
    Arm { sdot: bool },
    /// Widened i32 multiplies (x86-64 without AVX2, and the GPU).
    Widened,
}

/// How the weight bytes of a four-byte dot read (see [`KernelLowering::dot_fours`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum WeightBytes {
    /// Signed (Q8_0's `w`): `sdot` takes them; x86 moves their sign first.
    Signed,
    /// Unsigned, any value (Q8_0's stored levels `w + 128`): `vpdpbusd`.
    Unsigned,
    /// Unsigned and below 128 (nibbles): both readings agree, so every
    /// instruction takes them.
    Small,
}

/// `x` in all [`DOT_LANES`] lanes of a vector: the dot epilogues' f32
/// scalars, and the i32 sums added to every row's dot.
fn splat_lanes<'ctx>(b: &Builder<'ctx>, x: impl BasicValue<'ctx>, name: &str) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
    let x = x.as_basic_value_enum();
    let lanes = match x {
        BasicValueEnum::FloatValue(f) => f.get_type().vec_type(DOT_LANES as u32),
        BasicValueEnum::IntValue(i) => i.get_type().vec_type(DOT_LANES as u32),
        other => unreachable!("dot scalars are floats or integers, not {other:?}"),
    };
    let i32t = lanes.get_context().i32_type();
    let one = b.build_insert_element(lanes.get_undef(), x, i32t.const_zero(), name).map_err(llvm_err)?;
    b.build_shuffle_vector(one, one, i32t.vec_type(DOT_LANES as u32).const_zero(), name).map_err(llvm_err)
}

impl<'a, 'ctx> KernelLowering<'a, 'ctx> {
    /// A [`Stmt::DotBlock`] as vector code: the 64 weight levels and activations as
    /// `<64 x i8>`, the 16 four-byte dot products by [`ByteDots`] (Q8_0's signed
    /// weights through `|w|` and `a * sign(w)` where the instructions multiply
    /// unsigned by signed bytes; activations are never -128); then converted,
    /// scaled per block and added to the f32 accumulator.
    pub(super) fn dot_block(&mut self, acc: LocalId, scales: &[Expr; 2], (weights, w_start): (ParamId, &Expr), form: DotForm, (act, act_start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let (i8t, i32t, f32t) = (self.context.i8_type(), self.context.i32_type(), self.context.f32_type());
        let lanes = DOT_LANES as u32;
        let values = DOT_VALUES as u32;
        let scale_a = self.expr(&scales[0])?.into_float_value();
        let scale_b = self.expr(&scales[1])?.into_float_value();
        let w_ptr = self.element_ptr(weights, w_start)?;
        let a_ptr = self.element_ptr(act, act_start)?;
        let w = match form {
            DotForm::Int8 => self.byte_load(i8t.vec_type(values), w_ptr)?,
            DotForm::NibblePairs => {
                let (low, high) = self.nibbles(self.byte_load(i8t.vec_type(values / 2), w_ptr)?)?;
                self.builder.build_shuffle_vector(low, high, shuffle_mask(self.context, &|i| i, values), "levels").map_err(llvm_err)?
            }
        };
        let a = self.byte_load(i8t.vec_type(values), a_ptr)?;
        let zero = i32t.vec_type(lanes).const_zero();
        let sums = match form {
            DotForm::Int8 if matches!(self.byte_dots(), ByteDots::Vnni { .. } | ByteDots::Madd { .. }) => {
                let (abs, signed) = self.sign_moved(w, a)?;
                self.dot_fours(zero, abs, signed, WeightBytes::Unsigned)?
            }
            DotForm::Int8 => self.dot_fours(zero, w, a, WeightBytes::Signed)?,
            DotForm::NibblePairs => self.dot_fours(zero, w, a, WeightBytes::Small)?,
        };
        let b = &self.builder;
        let sums = b.build_signed_int_to_float(sums, f32t.vec_type(lanes), "sums").map_err(llvm_err)?;
        let pair = f32t.vec_type(2).get_undef();
        let pair = b.build_insert_element(pair, scale_a, i32t.const_zero(), "scale_a").map_err(llvm_err)?;
        let pair = b.build_insert_element(pair, scale_b, i32t.const_int(1, false), "scale_b").map_err(llvm_err)?;
        let scale = b.build_shuffle_vector(pair, pair, shuffle_mask(self.context, &|g| form.block_of_lane(g as i64) as u32, lanes), "scales").map_err(llvm_err)?;
        // Without fast-math flags, as in `dot_rows`: a row's sum must not
        // depend on how the rows beside it let LLVM contract or reorder it.
        let scaled = b.build_float_mul(sums, scale, "scaled").map_err(llvm_err)?;
        let old = self.load_local(acc, scaled.get_type())?;
        let new = self.builder.build_float_add(old, scaled, "acc").map_err(llvm_err)?;
        self.store_local(acc, new)
    }

    /// A [`Stmt::PairDot`]: with AVX512_BF16 one `vdpbf16ps` (the two k rows'
    /// weights interleaved into pairs by one `vpermw`, the activation pair one
    /// 32-bit broadcast); elsewhere the weights widened to f32 and the two
    /// products (exact) added to the accumulator, the first activation's first.
    pub(super) fn pair_dot(&mut self, acc: LocalId, (weights, w_start): (ParamId, &Expr), (act, act_start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let (i16t, i32t, f32t) = (self.context.i16_type(), self.context.i32_type(), self.context.f32_type());
        let lanes = DOT_LANES as u32;
        let w_ptr = self.element_ptr(weights, w_start)?;
        let a_ptr = self.element_ptr(act, act_start)?;
        let w = self.builder.build_load(i16t.vec_type(2 * lanes), w_ptr, "bf16_weights").map_err(llvm_err)?;
        w.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
        let w = w.into_vector_value();
        let old = self.load_local(acc, f32t.vec_type(lanes))?;
        let bf16_dot = matches!(self.flavor, Flavor::Cpu(t) if t.has_avx512_bf16());
        let new = if bf16_dot {
            let b = &self.builder;
            // Lane l of the pairs: weight l of row kk, then weight l of row kk + 1.
            let pairs = b.build_shuffle_vector(w, w, shuffle_mask(self.context, &|j| if j % 2 == 0 { j / 2 } else { lanes + j / 2 }, 2 * lanes), "pairs").map_err(llvm_err)?;
            let a = b.build_load(i32t, a_ptr, "bf16_pair").map_err(llvm_err)?;
            a.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
            let one = b.build_insert_element(i32t.vec_type(lanes).get_undef(), a.into_int_value(), i32t.const_zero(), "pair").map_err(llvm_err)?;
            let broadcast = b.build_shuffle_vector(one, one, i32t.vec_type(lanes).const_zero(), "pair_broadcast").map_err(llvm_err)?;
            let bf16s = self.context.bf16_type().vec_type(2 * lanes);
            let pairs = b.build_bit_cast(pairs, bf16s, "w_bf16").map_err(llvm_err)?.into_vector_value();
            let broadcast = b.build_bit_cast(broadcast, bf16s, "x_bf16").map_err(llvm_err)?.into_vector_value();
            let f = self.declared("llvm.x86.avx512bf16.dpbf16ps.512", f32t.vec_type(lanes).fn_type(&[f32t.vec_type(lanes).into(), bf16s.into(), bf16s.into()], false), None);
            self.call_vector(f, &[old, broadcast, pairs])?
        } else {
            let widened = |v, name: &str| self.bf16_bits_widened(v, name);
            let b = &self.builder;
            let row = |r: u32| b.build_shuffle_vector(w, w, shuffle_mask(self.context, &|l| r * lanes + l, lanes), "row").map_err(llvm_err);
            let (w0, w1) = (widened(row(0)?, "w0")?, widened(row(1)?, "w1")?);
            let a = b.build_load(i16t.vec_type(2), a_ptr, "bf16_pair").map_err(llvm_err)?;
            a.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
            let x = widened(a.into_vector_value(), "x")?;
            let splat = |i: u32| b.build_shuffle_vector(x, x, shuffle_mask(self.context, &|_| i, lanes), "x_splat").map_err(llvm_err);
            let (x0, x1) = (splat(0)?, splat(1)?);
            // Without fast-math flags: no contraction, the products exact anyway.
            let sum = b.build_float_add(old, b.build_float_mul(x0, w0, "p0").map_err(llvm_err)?, "acc0").map_err(llvm_err)?;
            b.build_float_add(sum, b.build_float_mul(x1, w1, "p1").map_err(llvm_err)?, "acc1").map_err(llvm_err)?
        };
        self.store_local(acc, new)
    }

    /// A [`Stmt::WidenBf16`]: the 16 bfloat16 weights at `start` moved to the
    /// high halves of f32 lanes. On 256-bit AVX2 one `vpermq` (quadwords 0, 2,
    /// 1, 3) and two unpacks with zero (`vpunpcklwd` / `vpunpckhwd`, in-lane:
    /// the permute puts columns 0-3 and 4-7 in the two lanes of the low
    /// unpack), all shuffle-port work; LLVM's own widening is a `vpmovzxwd` and
    /// a `vpslld` per 8 values, and the shifts share ports 0 and 1 with the
    /// FMAs they feed (Intel Xeon VM, x86-64-v3 code, a 4-row x 16-column bf16
    /// tile at k 2048 in C: 64-66 GFLOP/s a core against 75-78 unpacked).
    /// Elsewhere the zero extension and shift (one `vpmovzxwd` and `vpslld` on
    /// zmm; NEON's `shll`).
    pub(super) fn widen_bf16(&mut self, dst: LocalId, (weights, start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let (i16t, i64t, f32t) = (self.context.i16_type(), self.context.i64_type(), self.context.f32_type());
        let lanes = DOT_LANES as u32;
        let w_ptr = self.element_ptr(weights, start)?;
        let w = self.builder.build_load(i16t.vec_type(lanes), w_ptr, "bf16_row").map_err(llvm_err)?;
        w.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
        let w = w.into_vector_value();
        let unpacked = matches!(self.flavor, Flavor::Cpu(t) if t.has_avx2() && !t.has_avx512());
        let b = &self.builder;
        let widened = if unpacked {
            let quads = b.build_bit_cast(w, i64t.vec_type(lanes / 4), "quads").map_err(llvm_err)?.into_vector_value();
            let order = [0, 2, 1, 3];
            let quads = b.build_shuffle_vector(quads, quads, shuffle_mask(self.context, &|q| order[q as usize], lanes / 4), "permuted").map_err(llvm_err)?;
            let words = b.build_bit_cast(quads, i16t.vec_type(lanes), "words").map_err(llvm_err)?.into_vector_value();
            let zero = i16t.vec_type(lanes).const_zero();
            // Result word 2j + 1 of 128-bit lane h (of the low or high half `half`):
            // word 4 half + j of the permuted lane h, which is column 8 half + 4 h + j.
            let half = |half: u32| {
                b.build_shuffle_vector(zero, words, shuffle_mask(self.context, &|r| if r % 2 == 0 { 0 } else { lanes + 8 * (r / 8) + 4 * half + (r % 8) / 2 }, lanes), "unpacked").map_err(llvm_err)
            };
            let (low, high) = (half(0)?, half(1)?);
            let joined = b.build_shuffle_vector(low, high, shuffle_mask(self.context, &|i| i, 2 * lanes), "joined").map_err(llvm_err)?;
            b.build_bit_cast(joined, f32t.vec_type(lanes), "widened").map_err(llvm_err)?.into_vector_value()
        } else {
            self.bf16_bits_widened(w, "widened")?
        };
        self.store_local(dst, widened)
    }

    /// bfloat16 bits `v` (i16 lanes) as f32: zero-extended and shifted into
    /// the high half (exact).
    fn bf16_bits_widened(&self, v: inkwell::values::VectorValue<'ctx>, name: &str) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i32t, f32t) = (self.context.i32_type(), self.context.f32_type());
        let n = v.get_type().get_size();
        let b = &self.builder;
        let wide = b.build_int_z_extend(v, i32t.vec_type(n), name).map_err(llvm_err)?;
        let shift = inkwell::types::VectorType::const_vector(&vec![i32t.const_int(16, false); n as usize]);
        let shifted = b.build_left_shift(wide, shift, name).map_err(llvm_err)?;
        Ok(b.build_bit_cast(shifted, f32t.vec_type(n), name).map_err(llvm_err)?.into_vector_value())
    }

    /// How this target computes four-byte dot products.
    pub(super) fn byte_dots(&self) -> ByteDots {
        match self.flavor {
            Flavor::Cpu(t) if t.has_avx512_vnni() => ByteDots::Vnni { zmm: true },
            Flavor::Cpu(t) if t.has_avx_vnni() => ByteDots::Vnni { zmm: false },
            Flavor::Cpu(t) if t.has_avx512_bw() => ByteDots::Madd { zmm: true },
            Flavor::Cpu(t) if t.has_avx2() => ByteDots::Madd { zmm: false },
            Flavor::Cpu(t) if t.is_aarch64() => ByteDots::Arm { sdot: t.has_dotprod() },
            _ => ByteDots::Widened,
        }
    }

    /// Signed weight bytes `w` and signed activations `a` as `(|w|, a * sign(w))`:
    /// the same products, with the weights unsigned (at most 128) as `vpdpbusd`
    /// and `vpmaddubsw` want them. Exact while no activation is -128 (quantized
    /// activations never are).
    ///
    /// On AVX2 (`ByteDots::Madd` on ymm) `a * sign(w)` is one `vpsignb` per 32
    /// bytes; elsewhere (AVX-512 has no zmm `vpsignb`) a compare, a negation and
    /// a select, which LLVM makes three instructions.
    pub(super) fn sign_moved(&self, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<(inkwell::values::VectorValue<'ctx>, inkwell::values::VectorValue<'ctx>), CodegenError> {
        let abs = self.intrinsic_typed("llvm.abs", &[w.into(), self.context.bool_type().const_zero().into()], &[w.get_type().into()])?.into_vector_value();
        if self.byte_dots() == (ByteDots::Madd { zmm: false }) && matches!(w.get_type().get_size(), 32 | 64) {
            let bytes = self.context.i8_type().vec_type(32);
            let f = self.declared("llvm.x86.avx2.psign.b", bytes.fn_type(&[bytes.into(), bytes.into()], false), None);
            let parts = self.lane_parts(&[a, w], 32)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
            return Ok((abs, self.joined(parts)?));
        }
        let b = &self.builder;
        let negative = b.build_int_compare(IntPredicate::SLT, w, w.get_type().const_zero(), "negative").map_err(llvm_err)?;
        let minus_a = b.build_int_neg(a, "minus_a").map_err(llvm_err)?;
        let signed = b.build_select(negative, minus_a, a, "signed").map_err(llvm_err)?.into_vector_value();
        Ok((abs, signed))
    }

    /// The low and high nibbles of a vector of bytes.
    pub(super) fn nibbles(&self, packed: inkwell::values::VectorValue<'ctx>) -> Result<(inkwell::values::VectorValue<'ctx>, inkwell::values::VectorValue<'ctx>), CodegenError> {
        let i8t = self.context.i8_type();
        let splat = |x: u64| inkwell::types::VectorType::const_vector(&vec![i8t.const_int(x, false); packed.get_type().get_size() as usize]);
        let b = &self.builder;
        Ok((b.build_and(packed, splat(15), "low").map_err(llvm_err)?, b.build_right_shift(packed, splat(4), false, "high").map_err(llvm_err)?))
    }

    /// `acc` plus, per i32 lane `g`, the sum of the products of bytes `4g..4g + 4`
    /// of `w` (read as `w_bytes` says) with the signed bytes of `a`: by
    /// [`ByteDots`] where the instruction reads `w` that way (x86: unsigned, on
    /// the `Madd` form at most 128, so that no pair of products saturates;
    /// NEON: signed), otherwise widened multiplies and a sum of each lane's
    /// four products.
    pub(super) fn dot_fours(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>, w_bytes: WeightBytes) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let full = w.get_type().get_size() == DOT_VALUES as u32;
        let unsigned = w_bytes != WeightBytes::Signed;
        match self.byte_dots() {
            ByteDots::Vnni { zmm } if unsigned && full => return self.vpdpbusd(acc, w, a, zmm),
            ByteDots::Madd { zmm } if unsigned && full => return self.pmadd_fours(acc, w, a, zmm),
            ByteDots::Arm { sdot } if w_bytes != WeightBytes::Unsigned && full => return if sdot { self.sdot(acc, w, a) } else { self.smull_fours(acc, w, a) },
            _ => {}
        }
        let wide = self.context.i32_type().vec_type(w.get_type().get_size());
        let b = &self.builder;
        let ww = if unsigned { b.build_int_z_extend(w, wide, "w32") } else { b.build_int_s_extend(w, wide, "w32") }.map_err(llvm_err)?;
        let aw = b.build_int_s_extend(a, wide, "a32").map_err(llvm_err)?;
        let products = b.build_int_mul(ww, aw, "products").map_err(llvm_err)?;
        let sums = self.sum_fours(products)?;
        self.builder.build_int_add(acc, sums, "acc").map_err(llvm_err)
    }

    /// `acc` plus the four-byte dot products of 64 unsigned bytes `u` (at most 128)
    /// with 64 signed bytes `s` without VNNI: [`Self::pair_products`] then
    /// [`Self::pair_sums`].
    pub(super) fn pmadd_fours(&self, acc: inkwell::values::VectorValue<'ctx>, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let fours = self.pair_sums(self.pair_products(u, s, zmm)?, zmm)?;
        self.builder.build_int_add(acc, fours, "acc").map_err(llvm_err)
    }

    /// `vpmaddubsw` of 64 unsigned bytes `u` with 64 signed bytes `s` (on one zmm
    /// register or two ymm halves): `<32 x i16>`, lane `j` the products of bytes
    /// `2j` and `2j + 1` summed with signed saturation (exact while `u` is at
    /// most 128: 2 * 128 * 128 fits).
    pub(super) fn pair_products(&self, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let name = if zmm { "llvm.x86.avx512.pmaddubs.w.512" } else { "llvm.x86.avx2.pmadd.ub.sw" };
        self.pairwise_in_parts(name, self.context.i8_type(), self.context.i16_type(), &[u, s], zmm)
    }

    /// An x86 instruction `name` that sums adjacent pairs of its inputs' lanes
    /// (elements `from`) into lanes of twice their width (elements `to`), on
    /// 512-bit parts of `args` (`zmm`) or 256-bit ones, the results laid end to end.
    pub(super) fn pairwise_in_parts(&self, name: &str, from: inkwell::types::IntType<'ctx>, to: inkwell::types::IntType<'ctx>, args: &[inkwell::values::VectorValue<'ctx>], zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let width = (if zmm { 512 } else { 256 }) / from.get_bit_width();
        let (input, output) = (from.vec_type(width), to.vec_type(width / 2));
        let f = self.declared(name, output.fn_type(&vec![input.into(); args.len()], false), None);
        let parts = self.lane_parts(args, width)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// `vpmaddwd` of 32 i16 lanes by ones: 16 i32 lanes, lane `g` the sum of
    /// lanes `2g` and `2g + 1` (so, after [`Self::pair_products`], of the
    /// products of bytes `4g..4g + 4`).
    pub(super) fn pair_sums(&self, pairs: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let ones = inkwell::types::VectorType::const_vector(&vec![self.context.i16_type().const_int(1, false); pairs.get_type().get_size() as usize]);
        self.word_pair_products(pairs, ones, zmm)
    }

    /// The vectors `of` cut into parts of `width` lanes, part by part (one part
    /// when they are that wide already).
    pub(super) fn lane_parts(&self, of: &[inkwell::values::VectorValue<'ctx>], width: u32) -> Result<Vec<Vec<inkwell::values::VectorValue<'ctx>>>, CodegenError> {
        let size = of[0].get_type().get_size();
        (0..size / width)
            .map(|h| {
                of.iter()
                    .map(|&v| if size == width { Ok(v) } else { self.builder.build_shuffle_vector(v, v, shuffle_mask(self.context, &|i| h * width + i, width), "part").map_err(llvm_err) })
                    .collect()
            })
            .collect()
    }

    /// Vectors of equal width laid end to end (a power of two of them).
    pub(super) fn joined(&self, mut parts: Vec<inkwell::values::VectorValue<'ctx>>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        assert!(parts.len().is_power_of_two(), "{} parts", parts.len());
        while parts.len() > 1 {
            parts = parts
                .chunks(2)
                .map(|p| self.builder.build_shuffle_vector(p[0], p[1], shuffle_mask(self.context, &|i| i, 2 * p[0].get_type().get_size()), "joined").map_err(llvm_err))
                .collect::<Result<_, _>>()?;
        }
        Ok(parts[0])
    }

    /// A call of `f` on vector arguments that returns a vector.
    pub(super) fn call_vector(&self, f: FunctionValue<'ctx>, args: &[inkwell::values::VectorValue<'ctx>]) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let args: Vec<_> = args.iter().map(|&a| a.into()).collect();
        let call = self.builder.build_call(f, &args, "call").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else { unreachable!("returns a vector") };
        Ok(v.into_vector_value())
    }

    /// A dot instruction's f32 accumulator, `local[0..16]`, as a vector.
    pub(super) fn load_local(&self, local: LocalId, ty: inkwell::types::VectorType<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let old = self.builder.build_load(ty, self.locals[local.index()], "acc").map_err(llvm_err)?;
        old.as_instruction_value().expect("a load").set_alignment(4).map_err(llvm_err)?;
        Ok(old.into_vector_value())
    }

    /// Stores `value` to a dot instruction's accumulator `local[0..16]`.
    pub(super) fn store_local(&self, local: LocalId, value: inkwell::values::VectorValue<'ctx>) -> Result<(), CodegenError> {
        let st = self.builder.build_store(self.locals[local.index()], value).map_err(llvm_err)?;
        st.set_alignment(4).map_err(llvm_err)?;
        Ok(())
    }

    /// A [`Stmt::DotRows`] as vector code: per 64-byte chunk of levels (16 rows x
    /// 4 values; nibbles give two, low and high), one dot step against the four
    /// activation bytes of those values broadcast to all 16 rows, chained into one
    /// i32 accumulator by [`ByteDots`] (levels unsigned, activations signed, as
    /// the instructions want; Q8_0's levels, `w + 128`, are too large for
    /// `vpmaddubsw`, so there the dot runs on the signed `w`, and with their
    /// `-128 S` minimum that signed dot is the whole term (the activation sums'
    /// contract, see [`RowDot`]); nibbles
    /// there keep their pair products in i16 over the whole block and widen them
    /// once). Byte planes take one such chain each ([`Self::byte_level_dots`]);
    /// words take word dots instead ([`Self::word_dots`]). Then, in 16-lane f32 vectors:
    /// converted, times the rows' scales (one vector load) and the activation
    /// scale, plus the rows' minimums times the activation sum, added to `acc`.
    /// With `prefetch_ahead` (CPU only), each chunk's load is preceded by a
    /// `prefetcht0` that many bytes further on.
    pub(super) fn dot_rows(&mut self, d: &RowDot) -> Result<(), CodegenError> {
        let (half_dots, folded_offset) = match (&d.act_levels, self.word_pair_vectors(d)) {
            (_, Some(zmm)) => (self.word_pair_dots(&[d], zmm)?.remove(0), self.folds_offset(d)),
            (ActLevels::Words | ActLevels::WordPairs, None) => {
                // Q8_0's minimum folded exactly where byte planes fold it (the
                // same `folds_offset`): a row decoded alone (words) and in a
                // batch (planes) then take the same float steps.
                let folded = self.folds_offset(d);
                (vec![self.word_dots(d, folded)?], folded)
            }
            _ => self.byte_level_dots(d)?,
        };
        self.dot_rows_epilogue(d, &half_dots, folded_offset)
    }

    /// The float epilogue of a [`Stmt::DotRows`] on its integer dots (one
    /// per half), with `folded_offset` as [`Self::byte_level_dots`] gives it.
    pub(super) fn dot_rows_epilogue(&mut self, d: &RowDot, half_dots: &[inkwell::values::VectorValue<'ctx>], folded_offset: bool) -> Result<(), CodegenError> {
        let f32t = self.context.f32_type();
        let lanes = DOT_LANES as u32;
        if half_dots.len() > 1 {
            return self.dot_rows_by_halves(d, half_dots);
        }
        let acc = half_dots[0];
        let f32v = f32t.vec_type(lanes);
        let act_scale = self.expr(&d.act_scales[0])?.into_float_value();
        let act_sum = self.expr(&d.act_scales[1])?.into_float_value();
        let row_scales = self.row_values(&d.row_scales, lanes)?;
        let mins = match &d.row_min {
            RowMin::Stored(m) | RowMin::Subtracted(m) => Some(self.row_values(m, lanes)?),
            RowMin::Offset(_) => None,
        };
        // No fast-math flags here: with them LLVM contracted and reassociated
        // this epilogue differently in a one-row GEMV and in a row tile (a
        // multiply whose result has one use fuses into an FMA, a shared one does
        // not), so a sequence decoded alone got other logits than the same
        // sequence in a batch step (about 1e-5 relative, enough to change
        // sampled tokens). The integer dots are exact; the fused steps are
        // spelled out as `llvm.fmuladd` (an FMA wherever the target has one, in
        // every loop shape alike), so a row's result is independent of the
        // rows beside it, at the operation count contraction gave before.
        let b = &self.builder;
        let dots = b.build_signed_int_to_float(acc, f32v, "dots").map_err(llvm_err)?;
        let (scale, sum) = (splat_lanes(b, act_scale, "act_scale")?, splat_lanes(b, act_sum, "act_sum")?);
        let scaled = b.build_float_mul(dots, scale, "scaled").map_err(llvm_err)?;
        let term = match (&d.row_min, mins) {
            // S * d * (signed dot)
            (RowMin::Offset(_), _) if folded_offset => b.build_float_mul(row_scales, scaled, "term").map_err(llvm_err)?,
            // S * (d * dot + offset * s)
            (RowMin::Offset(o), _) => {
                let inner = self.mul_add(sum, splat_lanes(b, f32t.const_float(*o as f64), "offset")?, scaled)?;
                self.builder.build_float_mul(row_scales, inner, "term").map_err(llvm_err)?
            }
            // S * d * dot +- M * s
            (RowMin::Stored(_) | RowMin::Subtracted(_), Some(mins)) => {
                let left = b.build_float_mul(row_scales, scaled, "left").map_err(llvm_err)?;
                let mins = match d.row_min {
                    RowMin::Subtracted(_) => b.build_float_neg(mins, "neg_mins").map_err(llvm_err)?,
                    _ => mins,
                };
                self.mul_add(mins, sum, left)?
            }
            (_, None) => unreachable!("loaded above"),
        };
        // One add on the accumulator's chain from block to block (fusing the
        // term's last product into it measured slower: two dependent FMAs per
        // block, SmolLM2 pp512 650-760 against 840-870 tok/s).
        let old = self.load_local(d.acc, f32v)?;
        let new = self.builder.build_float_add(old, term, "acc").map_err(llvm_err)?;
        self.store_local(d.acc, new)
    }

    /// The epilogue of a [`RowDot`] with two halves (Q6_K): `acc += act_scale *
    /// (S_0 * D_0 + S_1 * D_1)`, `D_h` the half's integer dot with its offset
    /// applied ([`Self::byte_level_dots`]) and `S_h` the rows' scales times the
    /// half's factors; no fast-math flags (see [`Self::dot_rows`]).
    pub(super) fn dot_rows_by_halves(&mut self, d: &RowDot, half_dots: &[inkwell::values::VectorValue<'ctx>]) -> Result<(), CodegenError> {
        let lanes = DOT_LANES as u32;
        let f32v = self.context.f32_type().vec_type(lanes);
        let act_scale = self.expr(&d.act_scales[0])?.into_float_value();
        let scales = (0..half_dots.len() as i64).map(|h| self.row_values_at(&d.row_scales, lanes, h)).collect::<Result<Vec<_>, _>>()?;
        let mut sum: Option<inkwell::values::VectorValue<'ctx>> = None;
        for (dot, scale) in half_dots.iter().zip(scales) {
            let dot = self.builder.build_signed_int_to_float(*dot, f32v, "half_dot").map_err(llvm_err)?;
            sum = Some(match sum {
                None => self.builder.build_float_mul(scale, dot, "half_term").map_err(llvm_err)?,
                Some(s) => self.mul_add(scale, dot, s)?,
            });
        }
        let act = splat_lanes(&self.builder, act_scale, "act_scale")?;
        let term = self.builder.build_float_mul(sum.expect("two halves"), act, "term").map_err(llvm_err)?;
        let old = self.load_local(d.acc, f32v)?;
        let new = self.builder.build_float_add(old, term, "acc").map_err(llvm_err)?;
        self.store_local(d.acc, new)
    }

    /// `a * b + c` as `llvm.fmuladd` without fast-math flags: fused where the
    /// target has FMA, the same way in every loop shape.
    pub(super) fn mul_add(&self, a: inkwell::values::VectorValue<'ctx>, b: inkwell::values::VectorValue<'ctx>, c: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        Ok(self.intrinsic_typed("llvm.fmuladd", &[a.into(), b.into(), c.into()], &[a.get_type().into()])?.into_vector_value())
    }

    /// Chunk `c` of a [`RowDot`]'s 64-byte chunks of levels (prefetched ahead if
    /// asked, on the CPU) as its dot steps: (the 64 unsigned levels, 16 rows x
    /// 4 values, and the position of the step's first activation value). Bytes
    /// are one step, nibbles two (low, then high).
    pub(super) fn chunk_steps(&mut self, d: &RowDot, c: i64) -> Result<Vec<(inkwell::values::VectorValue<'ctx>, i64)>, CodegenError> {
        let w_ptr = self.element_ptr(d.weights, &dsl::add(d.w_start.clone(), dsl::i(64 * c)))?;
        if let (Some(ahead), Flavor::Cpu(_)) = (d.prefetch_ahead, &self.flavor) {
            self.prefetch(w_ptr, ahead)?;
        }
        let chunk = self.byte_load(self.context.i8_type().vec_type(64), w_ptr)?;
        Ok(match d.form {
            RowsForm::Bytes => vec![(chunk, 4 * c)],
            RowsForm::Nibbles => {
                let (low, high) = self.nibbles(chunk)?;
                vec![(low, 8 * c), (high, 8 * c + 4)]
            }
            RowsForm::Nibbles5 | RowsForm::Nibbles6 => {
                let (low, high) = self.nibbles(chunk)?;
                vec![(self.with_high_bits(d, low, 8 * c)?, 8 * c), (self.with_high_bits(d, high, 8 * c + 4)?, 8 * c + 4)]
            }
        })
    }

    /// The 64 levels of a [`RowsForm::Nibbles5`] / [`RowsForm::Nibbles6`] dot
    /// step over values `first..first + 4` of the 16 rows: its nibbles `low4`
    /// with the high bits ORed in from the block's high bits
    /// ([`RowsForm::high_bit_of`]). Nibbles5: bit `first / 4` of each byte
    /// (lane `g` is row `g`'s) shifted to bit 4 in i32 lanes (one shift for all
    /// 64 bytes, as no bit crosses a byte at the mask), masked and ORed in
    /// (x86: `vpsrld` / `vpslld`, then `vpternlogd` with AVX-512). Nibbles6:
    /// the two bits side by side, one byte shift to bits 4-5. The 64 bytes are
    /// loaded once per block (the loads of the block's steps are one value to
    /// LLVM).
    pub(super) fn with_high_bits(&mut self, d: &RowDot, low4: inkwell::values::VectorValue<'ctx>, first: i64) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (param, start) = d.high_bits.as_ref().expect("the verifier gives these forms their high bits");
        if d.form == RowsForm::Nibbles6 {
            // Both bits of the step side by side in its pair's 64 bytes
            // (`RowsForm::high_bit_of`): one byte shift to bits 4-5 and a mask.
            let i8t = self.context.i8_type();
            let ptr = self.element_ptr(*param, &dsl::add(start.clone(), dsl::i(64 * (first / 16))))?;
            let bits = self.byte_load(i8t.vec_type(64), ptr)?;
            let base = RowsForm::six_bit_base((first / 8) % 2 == 1, first % 8 >= 4);
            let splat = |x: u64| inkwell::types::VectorType::const_vector(&vec![i8t.const_int(x, false); 64]);
            let moved = self.bits_moved(bits, base, 4)?;
            let b = &self.builder;
            let masked = b.build_and(moved, splat(0x30), "high").map_err(llvm_err)?;
            return b.build_or(low4, masked, "levels6").map_err(llvm_err);
        }
        // Nibbles5: bit `step` of each byte to bit 4.
        let i32t = self.context.i32_type();
        let step = first / 4;
        let splat = |x: u64| inkwell::types::VectorType::const_vector(&vec![i32t.const_int(x, false); 16]);
        let ptr = self.element_ptr(*param, start)?;
        let bits = self.byte_load(self.context.i8_type().vec_type(64), ptr)?;
        let words = self.builder.build_bit_cast(bits, i32t.vec_type(16), "fifth_words").map_err(llvm_err)?.into_vector_value();
        let moved = self.bits_moved(words, step, 4)?;
        let b = &self.builder;
        let masked = b.build_and(moved, splat(0x1010_1010), "fifth").map_err(llvm_err)?;
        let as_bytes = b.build_bit_cast(masked, low4.get_type(), "fifth_bytes").map_err(llvm_err)?.into_vector_value();
        b.build_or(low4, as_bytes, "levels5").map_err(llvm_err)
    }

    /// Integer vector `v` shifted so that its bits at `from` land at `to`, in
    /// every lane (logical right shift, left shift, or `v` itself). The
    /// callers mask what they take, so bits crossing into neighbouring bytes
    /// of a lane do not matter.
    fn bits_moved(&self, v: inkwell::values::VectorValue<'ctx>, from: i64, to: i64) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let lane = v.get_type().get_element_type().into_int_type();
        let by = |n: i64| inkwell::types::VectorType::const_vector(&vec![lane.const_int(n as u64, false); v.get_type().get_size() as usize]);
        let b = &self.builder;
        match from.cmp(&to) {
            std::cmp::Ordering::Equal => Ok(v),
            std::cmp::Ordering::Greater => b.build_right_shift(v, by(from - to), false, "bits_down").map_err(llvm_err),
            std::cmp::Ordering::Less => b.build_left_shift(v, by(to - from), "bits_up").map_err(llvm_err),
        }
    }

    /// The 16 rows' integer dots of a [`RowDot`] whose activations are words:
    /// per dot step the 64 levels widened to i16 (x86: `vpmovzxbw`) and the
    /// step's four activation words broadcast to every row. On x86, `vpmaddwd`
    /// (zmm or ymm parts) gives 32 i32 lanes, lane `2g + h` row `g`'s products
    /// of values `2h, 2h + 1` of the step, summed over the block (at most 16
    /// products of 255 * 32512: exact) and folded into the 16 rows once at its
    /// end; on NEON each lane's widened products summed over the block and
    /// folded once; elsewhere widened multiplies summed per step. The levels are the
    /// stored unsigned ones (Q8_0's minimum stays a term of its own), or with
    /// `signed_levels` Q8_0's signed `u - 128`, sign-extended (its minimum folded
    /// into the dot, as byte planes fold it without VNNI).
    pub(super) fn word_dots(&mut self, d: &RowDot, signed_levels: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i16t, i32t) = (self.context.i16_type(), self.context.i32_type());
        let zmm = match self.byte_dots() {
            ByteDots::Vnni { zmm } | ByteDots::Madd { zmm } => Some(zmm),
            ByteDots::Arm { .. } | ByteDots::Widened => None,
        };
        // NEON: the products (`smull` / `smlal` on 4-lane parts) summed per lane
        // over the block (at most 8 of 255 * 32512: exact) and folded into the
        // 16 rows once at its end, instead of a row fold per step.
        let arm = matches!(self.byte_dots(), ByteDots::Arm { .. });
        let mut pairs = i32t.vec_type(2 * DOT_LANES as u32).const_zero();
        let mut fours = i32t.vec_type(DOT_LANES as u32).const_zero();
        let mut products_sum = i32t.vec_type(4 * DOT_LANES as u32).const_zero();
        for c in 0..d.form.chunks() {
            for (levels, first) in self.chunk_steps(d, c)? {
                let a_ptr = self.element_ptr(d.act, &dsl::add(d.act_start.clone(), dsl::i(2 * first)))?;
                let four = self.builder.build_load(i16t.vec_type(4), a_ptr, "act_words").map_err(llvm_err)?;
                four.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
                let four = four.into_vector_value();
                let b = &self.builder;
                // Word pairs hold values 0 2 1 3: value `t` is word `word_pair_position(t)`.
                let word_pairs = d.act_levels == ActLevels::WordPairs;
                let broadcast = b.build_shuffle_vector(four, four, shuffle_mask(self.context, &|i| if word_pairs { word_pair_position((i % 4) as i64) as u32 } else { i % 4 }, 64), "acts").map_err(llvm_err)?;
                let words = if signed_levels {
                    let bias = inkwell::types::VectorType::const_vector(&vec![self.context.i8_type().const_int(0x80, false); 64]);
                    let signed = b.build_xor(levels, bias, "signed_levels").map_err(llvm_err)?;
                    b.build_int_s_extend(signed, i16t.vec_type(64), "level_words").map_err(llvm_err)?
                } else {
                    b.build_int_z_extend(levels, i16t.vec_type(64), "level_words").map_err(llvm_err)?
                };
                match zmm {
                    Some(zmm) => {
                        let products = self.word_pair_products(words, broadcast, zmm)?;
                        pairs = self.builder.build_int_add(pairs, products, "pairs").map_err(llvm_err)?;
                    }
                    None => {
                        let wide = i32t.vec_type(64);
                        let ww = if signed_levels { b.build_int_s_extend(words, wide, "w32") } else { b.build_int_z_extend(words, wide, "w32") }.map_err(llvm_err)?;
                        let aw = b.build_int_s_extend(broadcast, wide, "a32").map_err(llvm_err)?;
                        let products = b.build_int_mul(ww, aw, "products").map_err(llvm_err)?;
                        if arm {
                            products_sum = b.build_int_add(products_sum, products, "products_sum").map_err(llvm_err)?;
                            continue;
                        }
                        let sums = self.sum_fours(products)?;
                        fours = self.builder.build_int_add(fours, sums, "fours").map_err(llvm_err)?;
                    }
                }
            }
        }
        if arm {
            return self.sum_fours(products_sum);
        }
        if zmm.is_none() {
            return Ok(fours);
        }
        let b = &self.builder;
        let even = b.build_shuffle_vector(pairs, pairs, shuffle_mask(self.context, &|g| 2 * g, DOT_LANES as u32), "even").map_err(llvm_err)?;
        let odd = b.build_shuffle_vector(pairs, pairs, shuffle_mask(self.context, &|g| 2 * g + 1, DOT_LANES as u32), "odd").map_err(llvm_err)?;
        b.build_int_add(even, odd, "dots").map_err(llvm_err)
    }

    /// Whether a [`RowDot`] takes the word-pair dots of
    /// [`Self::word_pair_dots`]: any levels (nibbles, Q5's five-bit and Q6_K's
    /// six-bit ones, Q8_0's bytes) with [`ActLevels::WordPairs`] on x86 with
    /// AVX2 or AVX-512 (`Some(zmm)`: whether on 512-bit vectors).
    pub(super) fn word_pair_vectors(&self, d: &RowDot) -> Option<bool> {
        match self.byte_dots() {
            ByteDots::Vnni { zmm } | ByteDots::Madd { zmm } if d.act_levels == ActLevels::WordPairs => Some(zmm),
            _ => None,
        }
    }

    /// Whether `b` is another row of `a`'s register tile whose word-pair dots
    /// can share `a`'s masked levels: the same weights at the same place.
    pub(super) fn word_pairs_share_levels(&self, a: &RowDot, b: &RowDot) -> bool {
        self.word_pair_vectors(a).is_some() && self.word_pair_vectors(b).is_some() && a.weights == b.weights && a.w_start == b.w_start && a.high_bits == b.high_bits && a.prefetch_ahead == b.prefetch_ahead
    }

    /// A register tile's [`Stmt::DotRows`] of one block with word-pair
    /// activations ([`Self::word_pairs_share_levels`]): each chunk's levels
    /// masked once and met by every row's activations before the next chunk,
    /// then each row's epilogue. The same integers and float steps per row as
    /// alone (so the same bits); lowered row after row, LLVM kept all 32
    /// masked level vectors of a block live across the rows and spilled
    /// (`llc -mcpu=znver3`: 147 stack accesses per 128 `vpmaddwd` in the 1.17B
    /// Q4_K 4 x 1 block loop).
    pub(super) fn word_pair_tile(&mut self, ds: &[&RowDot]) -> Result<(), CodegenError> {
        let zmm = self.word_pair_vectors(ds[0]) == Some(true);
        let dots = self.word_pair_dots(ds, zmm)?;
        for (d, half_dots) in ds.iter().zip(dots) {
            let folded = self.folds_offset(d);
            self.dot_rows_epilogue(d, &half_dots, folded)?;
        }
        Ok(())
    }

    /// The integer dots of [`RowDot`]s of nibbles or Q8_0 bytes whose
    /// activations are word pairs ([`ActLevels::WordPairs`]), rows of one tile over the same 16
    /// weight rows (one row alone in a GEMV), on x86 (`zmm`: one 512-bit
    /// vector per 32 words, else two 256-bit halves of 8 weight rows each).
    /// Each 64-byte chunk of levels read as 32 words holds in word `j` weight
    /// row `j / 2`'s values `2 (j % 2)` and `2 (j % 2) + 1` of the chunk's two
    /// steps, one per nibble; masked and shifted in 16-bit lanes (`x & 15`, `x
    /// >> 8 & 15`, `x >> 4 & 15`, `x >> 12`: three shifts and four masks, no
    /// byte shuffles) they become four vectors whose adjacent lanes are one
    /// weight row's values `0, 2` or `1, 3` of a step. Each meets the matching
    /// pair of activation words (consecutive in the `0 2 1 3` order: one
    /// 32-bit broadcast from memory) in one `vpmaddwd`, whose i32 lane `g` is
    /// then weight row `g`'s: the 16 rows' sums accumulate over the block (at
    /// most 32 * 15 * 32512: exact) with no fold and no planes to combine, the
    /// integers byte planes give. Q6_K's six-bit levels add their two high
    /// bits per value from the block's high bits ([`RowsForm::high_bit_of`]),
    /// read as words at the same places: a step's nibbles masked as
    /// `0x0f0f` and its bits moved to 4-5 and 12-13 and masked as `0x3030`
    /// give both bytes' levels in one OR, split into the two pair vectors
    /// (`& 255`, `>> 8`); Q5's five-bit levels alike, the step's one bit
    /// (bit `s` of each byte for step `s`) moved to 4 and 12 and masked as
    /// `0x1010`. Q6_K's dots are kept per half (16 values, two chunks)
    /// with the offset applied through the half's activation sum, as byte
    /// planes apply it (at most 16 * 63 * 32512 per half: exact). Q8_0's
    /// chunk is one step: word `j` holds
    /// row `j / 2`'s values `2 (j % 2)` and `2 (j % 2) + 1` as its low and high
    /// byte, two vectors (signed `u - 128` where [`Self::takes_signed_levels`],
    /// as the decode GEMV's words: the same integers) against the step's two
    /// pairs. Per chunk and half, the masked vectors
    /// are used by every row before the next half's are made; a tile on
    /// 256-bit vectors runs the whole block's first half, then its second.
    /// Returns each row's dots, one per half of the form ([`RowsForm::halves`]).
    pub(super) fn word_pair_dots(&mut self, ds: &[&RowDot], zmm: bool) -> Result<Vec<Vec<inkwell::values::VectorValue<'ctx>>>, CodegenError> {
        let (i8t, i16t, i32t) = (self.context.i8_type(), self.context.i16_type(), self.context.i32_type());
        let parts: u32 = if zmm { 1 } else { 2 };
        let (words, sums) = (i16t.vec_type(32 / parts), i32t.vec_type(16 / parts));
        let splat = |x: u64| inkwell::types::VectorType::const_vector(&vec![i16t.const_int(x, false); (32 / parts) as usize]);
        let name = if zmm { "llvm.x86.avx512.pmaddw.d.512" } else { "llvm.x86.avx2.pmadd.wd" };
        let pmaddwd = self.declared(name, sums.fn_type(&[words.into(), words.into()], false), None);
        let d0 = ds[0];
        let halves = d0.form.halves();
        let chunks_per_half = d0.form.chunks() / halves;
        // Per row, half and vector part.
        let mut accs = vec![vec![vec![sums.const_zero(); parts as usize]; halves as usize]; ds.len()];
        // A tile on 256-bit vectors takes the block half by half (weight rows
        // 0-7 over every chunk, then 8-15), each half's activation pairs
        // broadcast again from memory: chunk by chunk, the 16 broadcasts of a
        // chunk were shared by both halves and LLVM kept them live between the
        // halves and spilled them (about 100 stack stores per 128 `vpmaddwd`
        // in the 4 x 1 block loop, `llc -mcpu=znver3`). The second half reads
        // the activations through a copy of each row's pointer that LLVM
        // cannot see through (an empty inline asm), so that it does not merge
        // the halves' loads back into one.
        let by_halves = parts == 2 && ds.len() > 1;
        let order: Vec<(i64, u32)> = if by_halves {
            (0..parts).flat_map(|part| (0..d0.form.chunks()).map(move |c| (c, part))).collect()
        } else {
            (0..d0.form.chunks()).flat_map(|c| (0..parts).map(move |part| (c, part))).collect()
        };
        let mut second_half_rows: Vec<Option<PointerValue<'ctx>>> = vec![None; ds.len()];
        for (c, part) in order {
            if part == 0 {
                let w_ptr = self.element_ptr(d0.weights, &dsl::add(d0.w_start.clone(), dsl::i(64 * c)))?;
                if let (Some(ahead), Flavor::Cpu(_)) = (d0.prefetch_ahead, &self.flavor) {
                    self.prefetch(w_ptr, ahead)?;
                }
            }
            let ptr = self.element_ptr(d0.weights, &dsl::add(d0.w_start.clone(), dsl::i(64 * c + (64 / parts as i64) * part as i64)))?;
            let bytes = self.byte_load(i8t.vec_type(64 / parts), ptr)?;
            let b = &self.builder;
            let x = b.build_bit_cast(bytes, words, "level_words").map_err(llvm_err)?.into_vector_value();
            let fields = match d0.form {
                // Q8_0: word `j` holds row `j / 2`'s values `2 (j % 2)` (low
                // byte) and `2 (j % 2) + 1` (high byte) of the chunk's step;
                // signed `u - 128` where the decode GEMV's words take them so
                // (`takes_signed_levels`: the same integers, the same bits).
                RowsForm::Bytes if self.takes_signed_levels(d0) => {
                    let signed = b.build_xor(x, splat(0x8080), "signed_levels").map_err(llvm_err)?;
                    vec![
                        b.build_right_shift(b.build_left_shift(signed, splat(8), "low_up").map_err(llvm_err)?, splat(8), true, "low_02").map_err(llvm_err)?,
                        b.build_right_shift(signed, splat(8), true, "high_13").map_err(llvm_err)?,
                    ]
                }
                RowsForm::Bytes => vec![b.build_and(x, splat(255), "low_02").map_err(llvm_err)?, b.build_right_shift(x, splat(8), false, "high_13").map_err(llvm_err)?],
                RowsForm::Nibbles5 | RowsForm::Nibbles6 => {
                    // The high bits as words at the nibbles' places: Q6_K's
                    // pair of chunks' 64 bytes, Q5's block's 64.
                    let six = d0.form == RowsForm::Nibbles6;
                    let (param, start) = d0.high_bits.as_ref().expect("the verifier gives five- and six-bit levels their high bits");
                    let bits_at = if six { 64 * (c / 2) } else { 0 };
                    let h_ptr = self.element_ptr(*param, &dsl::add(start.clone(), dsl::i(bits_at + (64 / parts as i64) * part as i64)))?;
                    let h_bytes = self.byte_load(i8t.vec_type(64 / parts), h_ptr)?;
                    let h = self.builder.build_bit_cast(h_bytes, words, "high_bit_words").map_err(llvm_err)?.into_vector_value();
                    let mut fields = Vec::with_capacity(4);
                    for high_step in [false, true] {
                        // Six bits: bits `base, base + 1` of both bytes to
                        // 4-5 and 12-13; five: the step's bit to 4 and 12.
                        let (base, mask) = if six { (RowsForm::six_bit_base(c % 2 == 1, high_step), 0x3030) } else { (2 * c + high_step as i64, 0x1010) };
                        let moved = self.bits_moved(h, base, 4)?;
                        let b = &self.builder;
                        let nibbles = if high_step { b.build_right_shift(x, splat(4), false, "high_nibbles").map_err(llvm_err)? } else { x };
                        let nibbles = b.build_and(nibbles, splat(0x0f0f), "step_nibbles").map_err(llvm_err)?;
                        let bits = b.build_and(moved, splat(mask), "step_bits").map_err(llvm_err)?;
                        let levels = b.build_or(nibbles, bits, "levels").map_err(llvm_err)?;
                        fields.push(b.build_and(levels, splat(255), "levels_02").map_err(llvm_err)?);
                        fields.push(b.build_right_shift(levels, splat(8), false, "levels_13").map_err(llvm_err)?);
                    }
                    fields
                }
                _ => vec![
                    b.build_and(x, splat(15), "low_02").map_err(llvm_err)?,
                    b.build_and(b.build_right_shift(x, splat(8), false, "byte1").map_err(llvm_err)?, splat(15), "low_13").map_err(llvm_err)?,
                    b.build_and(b.build_right_shift(x, splat(4), false, "nibble1").map_err(llvm_err)?, splat(15), "high_02").map_err(llvm_err)?,
                    b.build_right_shift(x, splat(12), false, "high_13").map_err(llvm_err)?,
                ],
            };
            // Activation bytes per chunk: two per value, 8 values (nibbles:
            // two steps) or 4 (bytes: one step).
            let act_chunk_bytes = 4 * fields.len() as i64;
            let half = (c / chunks_per_half) as usize;
            for ((d, acc), row) in ds.iter().zip(accs.iter_mut()).zip(second_half_rows.iter_mut()) {
                if by_halves && part == 1 && row.is_none() {
                    let start = self.element_ptr(d.act, &d.act_start)?;
                    *row = Some(self.opaque_copy(start)?);
                }
                // The chunk's activation words in 0 2 1 3 order (nibbles: values
                // 8c..8c + 8; bytes: 4c..4c + 4): one pair per field, each
                // broadcast as an i32.
                for (f, field) in fields.iter().enumerate() {
                    let a_ptr = match row {
                        Some(start) if part == 1 => {
                            // SAFETY: within the row's activations, as the element_ptr it copies.
                            unsafe { self.builder.build_in_bounds_gep(i8t, *start, &[self.context.i64_type().const_int((act_chunk_bytes * c + 4 * f as i64) as u64, false)], "act_pair_at") }.map_err(llvm_err)?
                        }
                        _ => self.element_ptr(d.act, &dsl::add(d.act_start.clone(), dsl::i(act_chunk_bytes * c + 4 * f as i64)))?,
                    };
                    let pair = self.builder.build_load(i32t, a_ptr, "act_pair").map_err(llvm_err)?;
                    pair.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
                    let b = &self.builder;
                    let one = b.build_insert_element(sums.get_undef(), pair.into_int_value(), i32t.const_zero(), "act_pair").map_err(llvm_err)?;
                    let all = b.build_shuffle_vector(one, one, sums.const_zero(), "act_pairs").map_err(llvm_err)?;
                    let all = b.build_bit_cast(all, words, "act_words").map_err(llvm_err)?.into_vector_value();
                    let products = self.call_vector(pmaddwd, &[*field, all])?;
                    acc[half][part as usize] = self.builder.build_int_add(acc[half][part as usize], products, "acc").map_err(llvm_err)?;
                }
            }
        }
        let mut dots = Vec::with_capacity(ds.len());
        for (d, per_half) in ds.iter().zip(accs) {
            let mut row_dots = Vec::with_capacity(per_half.len());
            for (half, parts) in per_half.into_iter().enumerate() {
                let mut dot = self.joined(parts)?;
                // Two halves (the verifier gives only them half sums): the
                // offset times the half's activation level sum.
                if let (Some((param, start)), &RowMin::Offset(o)) = (&d.half_sums, &d.row_min) {
                    dot = self.offset_by_half_sum(dot, *param, start, half as i64, o)?;
                }
                row_dots.push(dot);
            }
            dots.push(row_dots);
        }
        Ok(dots)
    }

    /// `vpmaddwd` of 64 i16 lanes `a` and `b` (one zmm per 32 or two ymm per 16
    /// lanes): 32 i32 lanes, lane `j` the sum of the products of lanes `2j` and
    /// `2j + 1`.
    pub(super) fn word_pair_products(&self, a: inkwell::values::VectorValue<'ctx>, b: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let name = if zmm { "llvm.x86.avx512.pmaddw.d.512" } else { "llvm.x86.avx2.pmadd.wd" };
        self.pairwise_in_parts(name, self.context.i16_type(), self.context.i32_type(), &[a, b], zmm)
    }

    /// `ptr` through an empty inline asm: the same address, which LLVM cannot
    /// prove equal to `ptr` (loads through it are not merged with loads
    /// through `ptr`). No instruction beyond a register copy.
    pub(super) fn opaque_copy(&self, ptr: PointerValue<'ctx>) -> Result<PointerValue<'ctx>, CodegenError> {
        let ptr_type = ptr.get_type();
        let fn_type = ptr_type.fn_type(&[ptr_type.into()], false);
        let asm = self.context.create_inline_asm(fn_type, String::new(), "=r,0".to_string(), false, false, None, false);
        let call = self.builder.build_indirect_call(fn_type, asm, &[ptr.into()], "opaque_ptr").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else {
            return Err(CodegenError::Llvm("the pointer copy's asm returns nothing".into()));
        };
        Ok(v.into_pointer_value())
    }

    /// Whether a [`RowDot`]'s Q8_0 bytes go in as signed levels `u - 128` on
    /// this target: where the dot instructions multiply them as signed
    /// (`vpmaddubsw` without VNNI, with its 128 bound; NEON's `sdot` / `smull`).
    pub(super) fn takes_signed_levels(&self, d: &RowDot) -> bool {
        d.form == RowsForm::Bytes && matches!(self.byte_dots(), ByteDots::Madd { .. } | ByteDots::Arm { .. })
    }

    /// Whether the signed levels' dot already holds Q8_0's -128 minimum: with
    /// the activation sums `act_scales[1]` are (RowDot's contract),
    /// `S * (d * sum u * a - 128 * d * sum a)` is `S * d * sum (u - 128) * a`,
    /// the signed dot itself, so neither the 128 * sum a added back nor the
    /// offset term is needed. Byte planes and words decide it here alike.
    pub(super) fn folds_offset(&self, d: &RowDot) -> bool {
        self.takes_signed_levels(d) && d.row_min == RowMin::Offset(-128.0)
    }

    /// The 16 rows' integer dots of a [`RowDot`] whose activations are bytes or
    /// byte planes (see [`Self::dot_rows`]), one per half of the block
    /// ([`RowsForm::halves`]), and whether they already hold Q8_0's -128
    /// minimum (`folded_offset`: the signed levels' dot). With two halves
    /// (Q6_K) each half's dot has the integer offset applied exactly: the
    /// half's activation level sum ([`RowDot::half_sums`]) times the offset,
    /// the start of the half's last plane's accumulator. (Summing the
    /// activations here instead, a dot of ones against the same broadcasts per
    /// step and plane, cost a third more dot instructions: 1.17B Q4_K_M pp512
    /// 0.96x, Intel Xeon VM.)
    pub(super) fn byte_level_dots(&mut self, d: &RowDot) -> Result<(Vec<inkwell::values::VectorValue<'ctx>>, bool), CodegenError> {
        let (i8t, i32t) = (self.context.i8_type(), self.context.i32_type());
        let lanes = DOT_LANES as u32;
        // Without VNNI (`Some(zmm)`): Q8_0 as sum u * a = sum (u - 128) * a + 128 * sum a
        // (the second term cancels against the -128 minimum: `folded_offset`);
        // nibbles with their pair products summed in i16 over the whole block
        // (8 steps of at most 2 * 15 * 128: below 2^15), widened once after it
        // (five-bit levels: every 4 steps; six-bit: every 2).
        let madd = match self.byte_dots() {
            ByteDots::Madd { zmm } => Some(zmm),
            _ => None,
        };
        let arm = matches!(self.byte_dots(), ByteDots::Arm { .. });
        let signed_levels = self.takes_signed_levels(d);
        let folded_offset = self.folds_offset(d);
        let halves = d.form.halves() as usize;
        let per_half = RowsForm::VALUES / halves as i64;
        // One accumulator per half and activation byte plane (16-bit
        // activations have a high and a low one), each fed the same unpacked levels.
        let low = match &d.act_levels {
            ActLevels::Planes { low } => Some(low),
            _ => None,
        };
        let planes: Vec<&Expr> = std::iter::once(&d.act_start).chain(low).collect();
        let zero = i32t.vec_type(lanes).const_zero();
        let mut accs = vec![Vec::with_capacity(planes.len()); halves];
        for (half, acc) in accs.iter_mut().enumerate() {
            for (p, &start) in planes.iter().enumerate() {
                acc.push(if signed_levels && !folded_offset {
                    self.splat_act_sum(d.act, start, 128)?
                } else if let (Some((param, sums_at)), &RowMin::Offset(o), true) = (&d.half_sums, &d.row_min, p + 1 == planes.len()) {
                    // Two halves (Q6_K): the half's last (or only) plane
                    // starts at the offset times the half's activation level
                    // sum, read once per row and block rather than summed
                    // again for every 16 weight rows (with planes, `255 high +
                    // (low + o s)`: the same integer, at most 32 * 16 * 32512).
                    // Added up front rather than after the dots, it costs no
                    // add per tile cell and no register held to the block's end.
                    self.offset_splat(*param, sums_at, half as i64, o)?
                } else {
                    zero
                });
            }
        }
        let bias = inkwell::types::VectorType::const_vector(&vec![i8t.const_int(0x80, false); 64]);
        let mut nibble_pairs: Vec<Option<inkwell::values::VectorValue<'ctx>>> = vec![None; planes.len()];
        // Steps whose i16 pair sums add up without saturating: 8 for nibbles
        // (8 * 2 * 15 * 127 < 2^15), 4 for five-bit levels (4 * 2 * 31 * 127),
        // 2 for six-bit ones (2 * 2 * 63 * 127).
        let pair_steps = match d.form {
            RowsForm::Nibbles5 => 4,
            RowsForm::Nibbles6 => 2,
            _ => 8,
        };
        let mut steps_in_pairs = 0;
        for c in 0..d.form.chunks() {
            for (levels, first) in self.chunk_steps(d, c)? {
                let half = (first / per_half) as usize;
                // Q8_0's signed levels, once for both planes.
                let signed = if signed_levels { Some(self.builder.build_xor(levels, bias, "signed_levels").map_err(llvm_err)?) } else { None };
                let mut paired = false;
                for (p, &start) in planes.iter().enumerate() {
                    let a_ptr = self.element_ptr(d.act, &dsl::add(start.clone(), dsl::i(first)))?;
                    let four = self.byte_load(i8t.vec_type(4), a_ptr)?;
                    let broadcast = self.builder.build_shuffle_vector(four, four, shuffle_mask(self.context, &|i| i % 4, 64), "acts").map_err(llvm_err)?;
                    if let (RowsForm::Nibbles | RowsForm::Nibbles5 | RowsForm::Nibbles6, Some(zmm)) = (d.form, madd) {
                        let products = self.pair_products(levels, broadcast, zmm)?;
                        nibble_pairs[p] = Some(match nibble_pairs[p] {
                            None => products,
                            Some(w) => self.builder.build_int_add(w, products, "pairs").map_err(llvm_err)?,
                        });
                        paired = true;
                        continue;
                    }
                    accs[half][p] = match signed {
                        Some(signed) if arm => self.dot_fours(accs[half][p], signed, broadcast, WeightBytes::Signed)?,
                        Some(signed) => {
                            let (abs, moved) = self.sign_moved(signed, broadcast)?;
                            self.dot_fours(accs[half][p], abs, moved, WeightBytes::Unsigned)?
                        }
                        None if d.form != RowsForm::Bytes => self.dot_fours(accs[half][p], levels, broadcast, WeightBytes::Small)?,
                        None => self.dot_fours(accs[half][p], levels, broadcast, WeightBytes::Unsigned)?,
                    };
                }
                // Pair sums widened into the step's half before they could saturate
                // (a half is a whole number of `pair_steps`).
                steps_in_pairs += paired as i64;
                if let (Some(zmm), true) = (madd, paired && steps_in_pairs == pair_steps) {
                    for (acc, words) in accs[half].iter_mut().zip(nibble_pairs.iter_mut()) {
                        let fours = self.pair_sums(words.take().expect("pairs summed"), zmm)?;
                        *acc = self.builder.build_int_add(*acc, fours, "acc").map_err(llvm_err)?;
                    }
                    steps_in_pairs = 0;
                }
            }
        }
        debug_assert!(nibble_pairs.iter().all(Option::is_none), "every form's steps are whole `pair_steps`");
        // 16-bit activations: 255 times the high plane's dots plus the low one's
        // (at most 32 * 255 * 32512 in magnitude: exact in i32). (Two halves:
        // the offset is in the accumulators' start, above.)
        let mut dots = Vec::with_capacity(halves);
        for per_plane in accs {
            dots.push(match per_plane[..] {
                [acc] => acc,
                [high, low] => {
                    let weight = inkwell::types::VectorType::const_vector(&vec![i32t.const_int(HIGH_PLANE_WEIGHT as u64, false); lanes as usize]);
                    let scaled = self.builder.build_int_mul(high, weight, "high").map_err(llvm_err)?;
                    self.builder.build_int_add(scaled, low, "dots16").map_err(llvm_err)?
                }
                _ => unreachable!("one or two activation planes"),
            });
        }
        Ok((dots, folded_offset))
    }

    /// `dot` plus the integer offset `o` times half `half`'s activation level
    /// sum (element `start + half` of the i32 parameter `param`), in every lane.
    fn offset_by_half_sum(&mut self, dot: inkwell::values::VectorValue<'ctx>, param: ParamId, start: &Expr, half: i64, o: f32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let offsets = self.offset_splat(param, start, half, o)?;
        self.builder.build_int_add(dot, offsets, "offset_dot").map_err(llvm_err)
    }

    /// The integer offset `o` times half `half`'s activation level sum
    /// (element `start + half` of the i32 parameter `param`), in every lane.
    fn offset_splat(&mut self, param: ParamId, start: &Expr, half: i64, o: f32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let sum = self.half_sum(param, start, half)?;
        let offset = self.context.i32_type().const_int(o as i64 as u64, true);
        let b = &self.builder;
        let moved = b.build_int_mul(sum, offset, "offset_sum").map_err(llvm_err)?;
        splat_lanes(b, moved, "offset_all")
    }

    /// Half `half`'s activation level sum of a [`RowDot`]: element `start +
    /// half` of the i32 parameter `param`.
    fn half_sum(&mut self, param: ParamId, start: &Expr, half: i64) -> Result<inkwell::values::IntValue<'ctx>, CodegenError> {
        let ptr = self.element_ptr(param, &dsl::add(start.clone(), dsl::i(half)))?;
        Ok(self.builder.build_load(self.context.i32_type(), ptr, "half_sum").map_err(llvm_err)?.into_int_value())
    }

    /// `times` the sum of the [`RowsForm::VALUES`] activation bytes from `start`, in all
    /// 16 i32 lanes.
    pub(super) fn splat_act_sum(&mut self, act: ParamId, start: &Expr, times: u64) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i8t, i32t) = (self.context.i8_type(), self.context.i32_type());
        let ptr = self.element_ptr(act, start)?;
        let bytes = self.byte_load(i8t.vec_type(RowsForm::VALUES as u32), ptr)?;
        let wide = self.builder.build_int_s_extend(bytes, i32t.vec_type(RowsForm::VALUES as u32), "act32").map_err(llvm_err)?;
        let sum = self.intrinsic_typed("llvm.vector.reduce.add", &[wide.into()], &[wide.get_type().into()])?.into_int_value();
        let b = &self.builder;
        let sum = b.build_int_mul(sum, i32t.const_int(times, false), "act_sum").map_err(llvm_err)?;
        splat_lanes(b, sum, "act_sums")
    }

    /// A [`RowScale`]'s `lanes` values as f32: the float values, times the byte
    /// factors if any (read as their element type: `u8` unsigned, `i8` signed).
    pub(super) fn row_values(&mut self, r: &RowScale, lanes: u32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        self.row_values_at(r, lanes, 0)
    }

    /// [`Self::row_values`] with the factors of half `half` (at `16 half` past
    /// the factors' start; [`RowsForm::halves`]).
    pub(super) fn row_values_at(&mut self, r: &RowScale, lanes: u32, half: i64) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let values = self.float_vector(r.values.0, &r.values.1, lanes)?;
        let Some((param, start)) = &r.factors else { return Ok(values) };
        let signed = self.kernel.params[param.index()].elem == ElemType::I8;
        let ptr = self.element_ptr(*param, &dsl::add(start.clone(), dsl::i(DOT_LANES * half)))?;
        let bytes = self.byte_load(self.context.i8_type().vec_type(lanes), ptr)?;
        let b = &self.builder;
        let f32v = self.context.f32_type().vec_type(lanes);
        let factors = if signed { b.build_signed_int_to_float(bytes, f32v, "factors") } else { b.build_unsigned_int_to_float(bytes, f32v, "factors") }.map_err(llvm_err)?;
        Ok(self.fast(b.build_float_mul(values, factors, "row_values").map_err(llvm_err)?.into()).into_vector_value())
    }

    /// `lanes` consecutive elements of float parameter `param` from `start`, as f32.
    pub(super) fn float_vector(&mut self, param: ParamId, start: &Expr, lanes: u32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let elem = self.kernel.params[param.index()].elem;
        let ptr = self.element_ptr(param, start)?;
        let (i32t, f32v) = (self.context.i32_type(), self.context.f32_type().vec_type(lanes));
        let b = &self.builder;
        let raw = match elem {
            ElemType::F32 => f32v,
            ElemType::F16 => self.context.f16_type().vec_type(lanes),
            ElemType::BF16 => self.context.i16_type().vec_type(lanes),
            other => unreachable!("{other:?} is not a float element (validated)"),
        };
        let v = b.build_load(raw, ptr, "row_values").map_err(llvm_err)?;
        v.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
        let v = v.into_vector_value();
        Ok(match elem {
            ElemType::F16 => b.build_float_ext(v, f32v, "fpext").map_err(llvm_err)?,
            // bfloat16 is the top half of an f32: zero-extend, shift, reinterpret.
            ElemType::BF16 => {
                let wide = b.build_int_z_extend(v, i32t.vec_type(lanes), "zext").map_err(llvm_err)?;
                let shift = inkwell::types::VectorType::const_vector(&vec![i32t.const_int(16, false); lanes as usize]);
                let shifted = b.build_left_shift(wide, shift, "shl").map_err(llvm_err)?;
                b.build_bit_cast(shifted, f32v, "bf16").map_err(llvm_err)?.into_vector_value()
            }
            _ => v,
        })
    }

    /// A vector of bytes loaded from `ptr` (no alignment assumed).
    pub(super) fn byte_load(&self, ty: inkwell::types::VectorType<'ctx>, ptr: PointerValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let v = self.builder.build_load(ty, ptr, "bytes").map_err(llvm_err)?;
        v.as_instruction_value().expect("a load").set_alignment(1).map_err(llvm_err)?;
        Ok(v.into_vector_value())
    }

    /// VNNI `vpdpbusd`: 16 i32 lanes, lane `g` of `acc` plus the sum of the products
    /// of unsigned bytes `4g..4g + 4` of `u` with the signed bytes of `s`, on one
    /// zmm register or two ymm halves.
    pub(super) fn vpdpbusd(&self, acc: inkwell::values::VectorValue<'ctx>, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (width, name) = if zmm { (DOT_LANES as u32, "llvm.x86.avx512.vpdpbusd.512") } else { (DOT_LANES as u32 / 2, "llvm.x86.avx512.vpdpbusd.256") };
        let (part, whole) = (self.context.i32_type().vec_type(width), acc.get_type());
        let f = self.declared(name, part.fn_type(&[part.into(), part.into(), part.into()], false), None);
        let b = &self.builder;
        let (u, s) = (b.build_bit_cast(u, whole, "u").map_err(llvm_err)?, b.build_bit_cast(s, whole, "s").map_err(llvm_err)?);
        let parts = self.lane_parts(&[acc, u.into_vector_value(), s.into_vector_value()], width)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// aarch64 `sdot` (FEAT_DotProd): 16 i32 lanes, lane `g` of `acc` plus the sum
    /// of the products of signed bytes `4g..4g + 4` of `w` and `a`, in four
    /// 128-bit parts (the same lane order as [`Self::vpdpbusd`]).
    pub(super) fn sdot(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (quad, bytes) = (self.context.i32_type().vec_type(4), self.context.i8_type().vec_type(16));
        let f = self.declared("llvm.aarch64.neon.sdot.v4i32.v16i8", quad.fn_type(&[quad.into(), bytes.into(), bytes.into()], false), None);
        let accs = self.lane_parts(&[acc], 4)?;
        let operands = self.lane_parts(&[w, a], 16)?;
        let parts = accs.into_iter().zip(operands).map(|(acc, wa)| self.call_vector(f, &[acc[0], wa[0], wa[1]])).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// NEON without dotprod: the same sums as [`Self::sdot`] (signed bytes; every
    /// product fits i16, at most 128 * 128 in magnitude), per 16 bytes `smull` /
    /// `smull2` into i16 products, `saddlp` into i32 pair sums and `addp` of the
    /// two halves' pairs into the four sums.
    pub(super) fn smull_fours(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i8t, i16t, i32t) = (self.context.i8_type(), self.context.i16_type(), self.context.i32_type());
        let (eight, words, quad) = (i8t.vec_type(8), i16t.vec_type(8), i32t.vec_type(4));
        let smull = self.declared("llvm.aarch64.neon.smull.v8i16", words.fn_type(&[eight.into(), eight.into()], false), None);
        let saddlp = self.declared("llvm.aarch64.neon.saddlp.v4i32.v8i16", quad.fn_type(&[words.into()], false), None);
        let addp = self.declared("llvm.aarch64.neon.addp.v4i32", quad.fn_type(&[quad.into(), quad.into()], false), None);
        let halves = self.lane_parts(&[w, a], 8)?;
        let pairs = halves.iter().map(|wa| self.call_vector(smull, wa).and_then(|p| self.call_vector(saddlp, &[p]))).collect::<Result<Vec<_>, _>>()?;
        let fours = pairs.chunks(2).map(|p| self.call_vector(addp, p)).collect::<Result<Vec<_>, _>>()?;
        let sums = self.joined(fours)?;
        self.builder.build_int_add(acc, sums, "acc").map_err(llvm_err)
    }

    /// `<64 x i32>` products -> 16 lanes, lane `g` the sum of products `4g..4g + 4`.
    pub(super) fn sum_fours(&self, products: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let b = &self.builder;
        let mut sum: Option<inkwell::values::VectorValue<'ctx>> = None;
        for t in 0..4 {
            let part = b.build_shuffle_vector(products, products, shuffle_mask(self.context, &|g| 4 * g + t, DOT_LANES as u32), "part").map_err(llvm_err)?;
            sum = Some(match sum {
                None => part,
                Some(s) => b.build_int_add(s, part, "sum").map_err(llvm_err)?,
            });
        }
        Ok(sum.expect("four parts"))
    }
}
