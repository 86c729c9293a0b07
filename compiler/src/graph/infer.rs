//! Type inference: shape and dtype (one exhaustive `match` over [`Op`]), and
//! placement on one device's graph (another).
//!
//! The same function types nodes as builders add them and re-checks every node
//! in the verifier, so a pass cannot leave a node whose stored type disagrees
//! with what its op and inputs imply.
//!
//! Placement inference is the sharding rules (`sharding/rules/`) read the other
//! way: a rule decides on the global graph which placements an op's inputs must
//! have and what its result then is; here the per-device graph, already
//! sharded, says what its inputs have and the result follows. The two are kept
//! in step by hand: a rule's result must be what [`output_placement`] gives for
//! the inputs the rule asks for (the snapshots under tests/ir/shard show every
//! sharded node's placement).

use super::ir::*;

/// Infers the result type of `op` applied to `inputs` in `graph`: shape and dtype
/// here, placement from [`output_placement`].
pub fn infer_type(graph: &Graph, op: &Op, inputs: &[ValueId]) -> Result<TensorType, String> {
    let mut ty = infer_shape(graph, op, inputs)?;
    if !matches!(op, Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. }) {
        let have: Vec<Placement> = inputs.iter().map(|&i| graph.ty(i).placement).collect();
        ty.placement = output_placement(op, &have);
    }
    Ok(ty)
}

/// The placement of the result of `op` given its inputs' placements `have`.
fn output_placement(op: &Op, have: &[Placement]) -> Placement {
    let first = have.first().copied().unwrap_or_default();
    match op {
        Op::Input { ty, .. } | Op::Weight { ty, .. } | Op::Constant { ty, .. } => ty.placement,
        // A vocabulary-sharded table gathers partial rows (zeros off the shard).
        Op::Embedding => match first {
            Placement::Sharded { axis: 0 } => Placement::PartialSum,
            _ => Placement::Replicated,
        },
        // Weights split by output rows give column-sharded results; split by the
        // reduced dimension, partial sums.
        Op::MatMul | Op::MatMulAdd => match have.get(1) {
            Some(Placement::Sharded { axis: 0 }) => Placement::Sharded { axis: 1 },
            Some(Placement::Sharded { axis: 1 }) => Placement::PartialSum,
            _ => Placement::Replicated,
        },
        Op::Unary(_) | Op::Binary(_) if have.contains(&Placement::PartialSum) => Placement::PartialSum,
        Op::Unary(_) | Op::Binary(_) => first,
        Op::Concat { .. } if have.iter().all(|p| *p == first) => first,
        Op::Concat { .. } | Op::Transpose | Op::AllReduce | Op::AllGather { .. } => Placement::Replicated,
        Op::ShardSlice { axis, .. } => Placement::Sharded { axis: *axis },
        Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::L2Normalize | Op::MeanRows | Op::Rope { .. } | Op::Attention { .. } | Op::SwiGlu | Op::Slice { .. } | Op::Moe { .. } => first,
    }
}

fn infer_shape(graph: &Graph, op: &Op, inputs: &[ValueId]) -> Result<TensorType, String> {
    if let Some(n) = op.arity() {
        if inputs.len() != n {
            return Err(format!("expects {n} inputs, got {}", inputs.len()));
        }
    }
    for &i in inputs {
        if i.index() >= graph.nodes.len() {
            return Err(format!("input {i} does not exist"));
        }
    }
    let t = |k: usize| graph.ty(inputs[k]);
    match op {
        Op::Input { ty, .. } | Op::Weight { ty, .. } => Ok(ty.clone()),
        Op::Constant { values, ty } => {
            let n = ty.num_elements().ok_or("constant shapes must be static")?;
            if n as usize != values.len() {
                return Err(format!("constant has {} values for {} elements", values.len(), n));
            }
            Ok(ty.clone())
        }
        Op::Embedding => {
            let (table, ids) = (t(0), t(1));
            expect_rank(table, 2, "embedding table")?;
            if table.num_elements().is_none() {
                return Err("the embedding table must be static".into());
            }
            expect_rank(ids, 1, "embedding ids")?;
            if ids.dtype != DType::I32 {
                return Err("embedding ids must be i32".into());
            }
            Ok(TensorType::new(table.dtype, vec![ids.shape[0], table.shape[1]]))
        }
        Op::LayerNorm { eps } => {
            let (x, w, b) = (t(0), t(1), t(2));
            expect_rank(w, 1, "layer_norm weight")?;
            if x.shape.last() != w.shape.first() || w.shape != b.shape {
                return Err("layer_norm weight and bias must match the last dim".into());
            }
            if eps.is_nan() || *eps < 0.0 {
                return Err("layer_norm eps must be >= 0".into());
            }
            same_float(x, w)?;
            same_float(x, b)?;
            Ok(plain(x))
        }
        Op::MeanRows => {
            let x = t(0);
            expect_rank(x, 2, "mean_rows input")?;
            Ok(TensorType::new(x.dtype, vec![Dim::Fixed(1), x.shape[1]]))
        }
        Op::L2Normalize => {
            let x = t(0);
            expect_rank(x, 2, "l2_normalize input")?;
            Ok(plain(x))
        }
        Op::Transpose => {
            let x = t(0);
            expect_rank(x, 2, "transpose input")?;
            Ok(TensorType::new(x.dtype, vec![x.shape[1], x.shape[0]]))
        }
        Op::SwiGlu => {
            let x = t(0);
            expect_rank(x, 2, "swiglu input")?;
            let w = x.last_dim().ok_or("swiglu width must be static")?;
            if w % 2 != 0 || !x.dtype.is_float() {
                return Err(format!("swiglu needs an even float width, got {w}"));
            }
            Ok(TensorType::new(x.dtype, vec![x.shape[0], Dim::Fixed(w / 2)]))
        }
        Op::MatMulAdd => {
            let mm = infer_type(graph, &Op::MatMul, &inputs[..2])?;
            let r = t(2);
            same_float(&mm, r)?;
            let row = r.shape.len() == 1 && r.shape[0] == mm.shape[1];
            if !(r.shape == mm.shape || row) {
                return Err(format!("matmul_add addend {} must be {} or [{}]", shape_str(&r.shape), shape_str(&mm.shape), mm.shape[1]));
            }
            Ok(mm)
        }
        Op::MatMul => {
            let (x, w) = (t(0), t(1));
            expect_rank(x, 2, "matmul lhs")?;
            expect_rank(w, 2, "matmul weight")?;
            if x.last_dim().is_none() {
                return Err("matmul inner dim must be static".into());
            }
            if x.shape[1] != w.shape[1] {
                return Err(format!("matmul inner dims differ: {} vs {}", x.shape[1], w.shape[1]));
            }
            same_float(x, w)?;
            Ok(TensorType::new(x.dtype, vec![x.shape[0], w.shape[0]]))
        }
        Op::Unary(_) => {
            let x = t(0);
            if !x.dtype.is_float() {
                return Err("unary ops need a float operand".into());
            }
            Ok(plain(x))
        }
        Op::Binary(_) => {
            let (a, b) = (t(0), t(1));
            same_float(a, b)?;
            let scalar = b.num_elements() == Some(1);
            // Leading dims of 1 broadcast too ([1, h] over [seq, h]).
            let lead = b.shape.iter().take_while(|d| **d == Dim::Fixed(1)).count().min(b.shape.len().saturating_sub(1));
            let core = &b.shape[lead..];
            let suffix = core.len() <= a.shape.len() && a.shape[a.shape.len() - core.len()..] == core[..];
            if !(scalar || suffix) {
                return Err(format!(
                    "rhs shape {} does not broadcast to lhs shape {}",
                    shape_str(&b.shape),
                    shape_str(&a.shape)
                ));
            }
            Ok(plain(a))
        }
        Op::RmsNorm { eps } => {
            let (x, w) = (t(0), t(1));
            expect_rank(w, 1, "rms_norm weight")?;
            // The weight's length is the group normalized together: the whole last
            // dim, or each head of it (Qwen3's per-head q/k norms).
            let (width, group) = (x.last_dim().ok_or("rms_norm width must be static")?, w.last_dim().ok_or("rms_norm weight must be static")?);
            if group == 0 || width % group != 0 {
                return Err(format!("rms_norm weight length {group} does not divide the last dim {width}"));
            }
            if eps.is_nan() || *eps < 0.0 {
                return Err("rms_norm eps must be >= 0".into());
            }
            same_float(x, w)?;
            Ok(plain(x))
        }
        Op::Rope { head_dim, .. } => {
            let (x, pos) = (t(0), t(1));
            expect_rank(x, 2, "rope input")?;
            expect_positions(pos, x.shape[0])?;
            let width = x.last_dim().ok_or("rope width must be static")?;
            if *head_dim == 0 || head_dim % 2 != 0 || width % *head_dim as u64 != 0 {
                return Err(format!("rope head_dim {head_dim} must be even and divide the width {width}"));
            }
            Ok(plain(x))
        }
        Op::Attention { heads, kv_heads, head_dim, sinks, .. } => {
            let (q, k, v, pos) = (t(0), t(1), t(2), t(3));
            if *sinks && (t(4).rank() != 1 || t(4).last_dim() != Some(*heads as u64)) {
                return Err(format!("attention sinks must be [heads] = [{heads}]"));
            }
            for (x, what) in [(q, "q"), (k, "k"), (v, "v")] {
                expect_rank(x, 2, what)?;
                if x.shape[0] != q.shape[0] {
                    return Err(format!("attention {what} has a different sequence dim"));
                }
            }
            expect_positions(pos, q.shape[0])?;
            if *kv_heads == 0 || heads % kv_heads != 0 {
                return Err(format!("heads {heads} is not a multiple of kv_heads {kv_heads}"));
            }
            let hd = *head_dim as u64;
            if q.last_dim() != Some(*heads as u64 * hd) {
                return Err(format!("q width must be heads*head_dim = {}", *heads as u64 * hd));
            }
            if k.last_dim() != Some(*kv_heads as u64 * hd) || v.last_dim() != k.last_dim() {
                return Err(format!("k and v widths must be kv_heads*head_dim = {}", *kv_heads as u64 * hd));
            }
            same_float(q, k)?;
            same_float(q, v)?;
            Ok(plain(q))
        }
        Op::Concat { axis } => {
            let first = inputs.first().ok_or("concat needs at least one input")?;
            let first = graph.ty(*first);
            let axis = *axis as usize;
            if axis >= first.rank() {
                return Err(format!("concat axis {axis} out of range for rank {}", first.rank()));
            }
            let mut total = 0u64;
            for &i in inputs {
                let x = graph.ty(i);
                if x.dtype != first.dtype || x.rank() != first.rank() {
                    return Err("concat inputs differ in dtype or rank".into());
                }
                for d in 0..x.rank() {
                    if d != axis && x.shape[d] != first.shape[d] {
                        return Err(format!("concat inputs differ in dim {d}"));
                    }
                }
                total += x.shape[axis].fixed().ok_or("concat axis must be static")?;
            }
            let mut shape = first.shape.clone();
            shape[axis] = Dim::Fixed(total);
            let mut ty = TensorType::new(first.dtype, shape);
            // Concatenated weights keep their common storage encoding.
            if inputs.iter().all(|&i| graph.ty(i).quant == first.quant) {
                ty.quant = first.quant;
            }
            Ok(ty)
        }
        Op::Moe { experts, top_k, .. } => {
            let (x, router, gate_up, down) = (t(0), t(1), t(2), t(3));
            expect_rank(x, 2, "moe input")?;
            expect_rank(router, 2, "moe router")?;
            expect_rank(gate_up, 2, "moe gate_up weight")?;
            expect_rank(down, 2, "moe down weight")?;
            let e = *experts as u64;
            if e == 0 || *top_k == 0 || top_k > experts {
                return Err(format!("moe routes each row to top_k = {top_k} of {experts} experts: needs 1 <= top_k <= experts"));
            }
            let h = x.last_dim().ok_or("moe width must be static")?;
            if router.shape != [Dim::Fixed(e), Dim::Fixed(h)] {
                return Err(format!("moe router must be [{e}, {h}], got {}", shape_str(&router.shape)));
            }
            let rows = gate_up.shape[0].fixed().ok_or("moe gate_up must be static")?;
            if rows % (2 * e) != 0 || gate_up.last_dim() != Some(h) {
                return Err(format!("moe gate_up must be [{e} * 2f, {h}] (each expert's gate and up rows), got {}", shape_str(&gate_up.shape)));
            }
            let f = rows / (2 * e);
            if down.shape[0] != Dim::Fixed(e * h) || down.last_dim() != Some(f) {
                return Err(format!("moe down must be [{e} * {h}, {f}], got {}", shape_str(&down.shape)));
            }
            if let Op::Moe { biases: true, .. } = op {
                for (i, want, what) in [(4, vec![e], "router bias"), (5, vec![e, 2 * f], "gate_up bias"), (6, vec![e, h], "down bias")] {
                    let b = t(i);
                    if b.shape != want.iter().map(|&d| Dim::Fixed(d)).collect::<Vec<_>>() {
                        return Err(format!("moe {what} must be {}, got {}", shape_str(&want.iter().map(|&d| Dim::Fixed(d)).collect::<Vec<_>>()), shape_str(&b.shape)));
                    }
                    same_float(x, b)?;
                }
            }
            if let Op::Moe { shared: true, biases, .. } = op {
                let at = if *biases { 7 } else { 4 };
                let (gate, out) = (t(at), t(at + 1));
                if gate.shape != [Dim::Fixed(1), Dim::Fixed(h)] {
                    return Err(format!("moe shared expert gate must be [1, {h}], got {}", shape_str(&gate.shape)));
                }
                if out.shape != x.shape {
                    return Err(format!("moe shared expert output must be {} like the input, got {}", shape_str(&x.shape), shape_str(&out.shape)));
                }
                same_float(x, gate)?;
                same_float(x, out)?;
            }
            same_float(x, router)?;
            same_float(x, gate_up)?;
            same_float(x, down)?;
            Ok(plain(x))
        }
        Op::AllReduce => Ok(plain(t(0))),
        Op::AllGather { axis, devices } | Op::ShardSlice { axis, devices, .. } => {
            let x = t(0);
            let a = *axis as usize;
            let dim = x.shape.get(a).and_then(|d| d.fixed()).ok_or(format!("axis {axis} must be a static dim"))?;
            let mut shape = x.shape.clone();
            shape[a] = Dim::Fixed(match op {
                Op::AllGather { .. } => dim * *devices as u64,
                _ if *devices == 0 || dim % *devices as u64 != 0 => return Err(format!("dim {dim} does not split into {devices} equal parts")),
                _ => dim / *devices as u64,
            });
            Ok(TensorType::new(x.dtype, shape))
        }
        Op::Slice { axis, start, len } => {
            let x = t(0);
            let axis = *axis as usize;
            if axis >= x.rank() {
                return Err(format!("slice axis {axis} out of range for rank {}", x.rank()));
            }
            let dim = x.shape[axis].fixed().ok_or("slice axis must be static")?;
            if *len == 0 || start + len > dim {
                return Err(format!("slice {start}..{} out of range 0..{dim}", start + len));
            }
            let mut shape = x.shape.clone();
            shape[axis] = Dim::Fixed(*len);
            Ok(TensorType::new(x.dtype, shape))
        }
    }
}

fn plain(x: &TensorType) -> TensorType {
    TensorType::new(x.dtype, x.shape.clone())
}

fn expect_rank(x: &TensorType, rank: usize, what: &str) -> Result<(), String> {
    if x.rank() != rank {
        return Err(format!("{what} must have rank {rank}, has shape {}", shape_str(&x.shape)));
    }
    Ok(())
}

fn expect_positions(pos: &TensorType, seq: Dim) -> Result<(), String> {
    if pos.dtype != DType::I32 || pos.shape != [seq] {
        return Err(format!("positions must be i32[{seq}], got {}{}", pos.dtype.name(), shape_str(&pos.shape)));
    }
    Ok(())
}

fn same_float(a: &TensorType, b: &TensorType) -> Result<(), String> {
    if a.dtype != b.dtype || !a.dtype.is_float() {
        return Err(format!("operands must share a float dtype, got {} and {}", a.dtype.name(), b.dtype.name()));
    }
    Ok(())
}

/// Formats a shape as `[a, b]`.
pub fn shape_str(shape: &[Dim]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}
