//! The `moe` op's launches: the router's logits (`moe_router`) and top-k
//! (`moe_route`), the step's
//! (row, rank) slots grouped by expert (`moe_group`), the rows gathered in
//! that order (`moe_gather`), the experts' gate-and-up matmul on the grouped
//! rows, SwiGLU (gpt-oss: the clamped one, after each expert's gate-and-up
//! bias), the down matmul, and each row's weighted sum in rank order
//! (`moe_combine`). A grouped matmul reads an expert's weights only when rows
//! chose it, once per step for all of them (llama.cpp's `mul_mat_id`), in
//! the layout the dense matmuls would give the weights: float panels,
//! interleaved blocks with integer activations, or row-major.

use maxc_kernels::library::moe::{over_slots, moe_activation, moe_combine, MoeActivation, moe_gather, moe_group, moe_matmul_interleaved, moe_matmul_panel, moe_matmul_panel_rows, moe_matmul_rows, moe_route, moe_router};
use maxc_kernels::library::dequant::rows_form;

use super::*;

impl Scheduler<'_, '_, '_> {
    /// An output buffer of `bytes` whatever the step's rows (the groups' offsets).
    fn sized(&mut self, buffer: Arg, bytes: u64) {
        let Arg::Arena { offset } = buffer else { unreachable!("outputs are arena buffers") };
        self.buffers[offset as usize].bytes = bytes;
    }

    /// Node `node`, a `moe`, scheduled for `seq`.
    pub(super) fn moe(&mut self, node: &crate::graph::Node, (experts, top_k, routing): (u64, u64, crate::graph::MoeRouting), (activation, biased, shared): (MoeActivation, bool, bool), seq: SeqMode) -> Result<Arg> {
        let graph = self.graph;
        let (x, router, gate_up, down) = (node.inputs[0], node.inputs[1], node.inputs[2], node.inputs[3]);
        // The weights: all but the input and a shared expert's output.
        let weights_end = node.inputs.len() - shared as usize;
        if node.inputs[1..weights_end].iter().any(|&w| !self.interp.is_constant(w)) {
            return Err(unsupported("a mixture of experts whose router or expert projections are not weights".into()));
        }
        let h = graph.ty(x).last_dim().expect("static width");
        let f = graph.ty(down).last_dim().expect("static width");
        let none = TaskCount { per_seq: 0, fixed: 0 };
        let xa = self.input(x)?;
        let mut args = vec![xa];
        args.extend(self.weight_parts_in(router, Layout::RowMajor)?);
        // gpt-oss's biases, float32 (the quantize pass encodes only the projections).
        let biases = if biased { Some((self.input(node.inputs[4])?, self.input(node.inputs[5])?, self.input(node.inputs[6])?)) } else { None };
        if let Some((router_bias, _, _)) = biases {
            args.push(router_bias);
        }
        let la = self.launch(moe_router(h, experts, graph.ty(router).quant, biased), args, experts);
        // The chosen experts and their weights (the last output, f32, as `--check-nan` reads it).
        let routed = self.launch_outputs(moe_route(experts, top_k, routing), vec![la], &[top_k * 4, top_k * 4], TaskCount { per_seq: top_k, fixed: 0 });
        let (ids, weights) = (routed[0], routed[1]);
        let grouped = self.launch_outputs(moe_group(experts, top_k), vec![ids], &[4, 4, top_k * 4, top_k * 4], none);
        let (offsets, cursor, order, place) = (grouped[0], grouped[1], grouped[2], grouped[3]);
        self.sized(offsets, (experts + 1) * 4);
        self.sized(cursor, experts * 4);
        let xg = self.launch_outputs(moe_gather(h, top_k), vec![xa, order], &[top_k * h * 4], TaskCount { per_seq: top_k * h, fixed: 0 })[0];
        let gu = self.expert_matmul(xg, gate_up, offsets, (h, 2 * f, experts, top_k), seq)?;
        let act = match (activation, biases) {
            (MoeActivation::SwiGlu, None) => {
                let (kernel, gpu) = (over_slots(swiglu(f, seq), top_k), over_slots(swiglu_gpu(f, seq), top_k));
                self.kernels.set_gpu_form(&kernel, gpu);
                self.launch_outputs(kernel, vec![gu], &[top_k * f * 4], TaskCount { per_seq: top_k * f, fixed: 0 })[0]
            }
            (_, None) => self.launch_outputs(moe_activation(f, top_k, activation, None), vec![gu], &[top_k * f * 4], TaskCount { per_seq: top_k * f, fixed: 0 })[0],
            (_, Some((_, gate_up_bias, _))) => {
                let kernel = moe_activation(f, top_k, activation, Some(experts));
                self.launch_outputs(kernel, vec![gu, order, ids, gate_up_bias], &[top_k * f * 4], TaskCount { per_seq: top_k * f, fixed: 0 })[0]
            }
        };
        let y = self.expert_matmul(act, down, offsets, (f, h, experts, top_k), seq)?;
        let mut args = vec![y, place, weights];
        if let Some((_, _, down_bias)) = biases {
            args.extend([ids, down_bias]);
        }
        if shared {
            // Qwen2-MoE's shared expert: the input, its gate, its output.
            let at = if biased { 7 } else { 4 };
            args.extend([xa, self.input(node.inputs[at])?, self.input(node.inputs[at + 1])?]);
        }
        Ok(self.launch(moe_combine(h, top_k, biased.then_some(experts), shared), args, h))
    }

    /// `x` (`[seq * top_k, k]`, grouped by expert) times each group's expert
    /// of `w` (`[experts * n, k]`) -> `[seq * top_k, n]`: interleaved blocks
    /// with integer activations where the dense matmul would take them, float
    /// panels where the experts' rows are whole panels, else row-major
    /// weights decoded value by value (and always in GPU-only artifacts).
    fn expert_matmul(&mut self, x: Arg, w: ValueId, offsets: Arg, (k, n, experts, top_k): (u64, u64, u64, u64), seq: SeqMode) -> Result<Arg> {
        let encoding = self.graph.ty(w).quant;
        let tile = self.weights.register_tile;
        let interleaved = !self.weights.row_major_only && rows_form(encoding, n, k).is_some();
        let levels = self.integer_levels(encoding, (n, k), seq).filter(|_| interleaved);
        if let Some(levels) = levels {
            let scale_elems = 2 * (k / 32);
            let quantize = quantize_to(k, levels, DotForm::Int8, seq);
            let q = self.launch_outputs(over_slots(quantize, top_k), vec![x], &[top_k * k * levels.bytes(), top_k * scale_elems * 4], TaskCount { per_seq: top_k * scale_elems, fixed: 0 });
            let mut args = vec![q[0], q[1]];
            if maxc_kernels::library::matmul_interleaved::reads_half_sums(encoding, n, k) {
                let sums = k / 16;
                args.push(self.launch_outputs(over_slots(level_half_sums(k, levels, seq), top_k), vec![q[0]], &[top_k * sums * 4], TaskCount { per_seq: top_k * sums, fixed: 0 })[0]);
            }
            args.push(offsets);
            args.extend(self.weight_parts_in(w, Layout::Interleaved16)?);
            let kernel = moe_matmul_interleaved(k, n, experts, encoding, seq, tile, levels);
            return Ok(self.launch_outputs(kernel, args, &[top_k * n * 4], TaskCount { per_seq: top_k * n, fixed: 0 })[0]);
        }
        let panels = PanelWeights::of(encoding).filter(|_| !self.weights.row_major_only && n % 16 == 0 && Layout::Panel16.admits(encoding, &[experts * n, k]));
        let (kernel, layout) = match panels {
            Some(weights) => (moe_matmul_panel(k, n, experts, weights, seq, tile), Layout::Panel16),
            None => (moe_matmul_rows(k, n, experts, encoding), Layout::RowMajor),
        };
        let mut args = vec![x, offsets];
        args.extend(self.weight_parts_in(w, layout)?);
        if let Some(weights) = panels {
            self.kernels.set_gpu_form(&kernel, moe_matmul_panel_rows(k, n, experts, weights));
        }
        Ok(self.launch_outputs(kernel, args, &[top_k * n * 4], TaskCount { per_seq: top_k * n, fixed: 0 })[0])
    }
}
