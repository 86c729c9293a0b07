//! The graph reference interpreter: plain f32 Rust, the oracle for every pass and backend.
//!
//! It favours obviously-correct code over speed, but runs matmuls over threads so
//! that a 135M-parameter model answers in seconds in tests. Values that depend only
//! on weights and constants (e.g. the stacked Q/K/V weight) are computed once and
//! kept for later steps; attention keeps one KV cache per layer across calls.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::graph::rope::inv_freq;
use crate::graph::{BinaryOp, Dim, Graph, Op, UnaryOp};

/// A dense row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

/// Element storage of a [`Tensor`].
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Arc<Vec<f32>>),
    I32(Arc<Vec<i32>>),
}

impl Tensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data: Data::F32(Arc::new(data)) }
    }

    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data: Data::I32(Arc::new(data)) }
    }

    pub fn as_f32(&self) -> &[f32] {
        match &self.data {
            Data::F32(v) => v,
            Data::I32(_) => panic!("expected an f32 tensor"),
        }
    }

    pub fn as_i32(&self) -> &[i32] {
        match &self.data {
            Data::I32(v) => v,
            Data::F32(_) => panic!("expected an i32 tensor"),
        }
    }
}

/// Where the interpreter gets weights from.
pub trait WeightSource {
    fn weight_f32(&self, name: &str) -> Result<Vec<f32>>;

    /// The weight stored in `scheme` (rows of `cols`): quantized from its f32
    /// values unless the source already holds it in that encoding.
    fn weight_encoded(&self, name: &str, scheme: crate::graph::WeightEncoding, cols: usize) -> Result<crate::quant::Encoded> {
        Ok(crate::quant::encode(scheme, &self.weight_f32(name)?, cols))
    }
}

impl WeightSource for crate::import::WeightStore {
    fn weight_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.to_f32(name)
    }

    fn weight_encoded(&self, name: &str, scheme: crate::graph::WeightEncoding, _cols: usize) -> Result<crate::quant::Encoded> {
        self.encoded(name, scheme)
    }
}

impl WeightSource for HashMap<String, Vec<f32>> {
    fn weight_f32(&self, name: &str) -> Result<Vec<f32>> {
        self.get(name).cloned().ok_or_else(|| Error::Verify(format!("no weight `{name}`")))
    }
}

/// Runs one graph repeatedly, keeping the KV cache between calls.
pub struct Interpreter<'a> {
    graph: &'a Graph,
    weights: &'a dyn WeightSource,
    constant_cache: HashMap<usize, Tensor>,
    is_constant: Vec<bool>,
    kv: HashMap<u32, (Vec<f32>, Vec<f32>)>,
}

impl<'a> Interpreter<'a> {
    pub fn new(graph: &'a Graph, weights: &'a dyn WeightSource) -> Self {
        let mut is_constant = vec![false; graph.nodes.len()];
        for (i, n) in graph.nodes.iter().enumerate() {
            is_constant[i] = match n.op {
                Op::Weight { .. } | Op::Constant { .. } => true,
                Op::Input { .. } => false,
                _ => !n.op.has_side_effects() && n.inputs.iter().all(|v| is_constant[v.index()]),
            };
        }
        Interpreter { graph, weights, constant_cache: HashMap::new(), is_constant, kv: HashMap::new() }
    }

    /// The value of a node that depends only on weights and constants (cached).
    pub fn constant_value(&mut self, id: crate::graph::ValueId) -> Result<Tensor> {
        let i = id.index();
        assert!(self.is_constant[i], "%{i} is not a constant node");
        if let Some(t) = self.constant_cache.get(&i) {
            return Ok(t.clone());
        }
        let inputs = self.graph.nodes[i].inputs.clone();
        let args: Vec<Tensor> = inputs.iter().map(|&v| self.constant_value(v)).collect::<Result<_>>()?;
        let t = self.eval(i, args.iter().collect(), &HashMap::new())?;
        self.constant_cache.insert(i, t.clone());
        Ok(t)
    }

    /// Whether a node depends only on weights and constants.
    pub fn is_constant(&self, id: crate::graph::ValueId) -> bool {
        self.is_constant[id.index()]
    }

    /// Forgets the KV cache (a new sequence).
    pub fn reset(&mut self) {
        self.kv.clear();
    }

    /// Runs the graph on `inputs` (by input name) and returns the outputs by name.
    pub fn run(&mut self, inputs: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        let g = self.graph;
        let mut last_use = vec![0usize; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            for v in &n.inputs {
                last_use[v.index()] = i;
            }
        }
        for (_, v) in &g.outputs {
            last_use[v.index()] = usize::MAX;
        }
        let mut values: Vec<Option<Tensor>> = vec![None; g.nodes.len()];
        for (i, node) in g.nodes.iter().enumerate() {
            let result = if let Some(t) = self.constant_cache.get(&i) {
                t.clone()
            } else {
                let args: Vec<&Tensor> =
                    node.inputs.iter().map(|v| values[v.index()].as_ref().expect("input computed and alive")).collect();
                let t = self.eval(i, args, inputs)?;
                if self.is_constant[i] {
                    self.constant_cache.insert(i, t.clone());
                }
                t
            };
            // Check the concrete shape against the static type: a cheap invariant check.
            let ty = &node.ty;
            let ok = ty.shape.len() == result.shape.len()
                && ty.shape.iter().zip(&result.shape).all(|(d, &n)| match d {
                    Dim::Fixed(f) => *f as usize == n,
                    Dim::Sym(_) => true,
                });
            assert!(ok, "%{i} ({}) produced shape {:?} for type {:?}", node.op.mnemonic(), result.shape, ty.shape);
            values[i] = Some(result);
            for v in &node.inputs {
                if last_use[v.index()] == i {
                    values[v.index()] = None;
                }
            }
        }
        Ok(g.outputs.iter().map(|(name, v)| (name.clone(), values[v.index()].clone().expect("output alive"))).collect())
    }

    fn eval(&mut self, index: usize, args: Vec<&Tensor>, inputs: &HashMap<String, Tensor>) -> Result<Tensor> {
        let node = &self.graph.nodes[index];
        let f = |k: usize| args[k].as_f32();
        Ok(match &node.op {
            Op::Input { name, ty } => {
                let t = inputs.get(name).ok_or_else(|| Error::Verify(format!("missing input `{name}`")))?;
                if t.shape.len() != ty.shape.len() {
                    return Err(Error::Verify(format!("input `{name}` has rank {}", t.shape.len())));
                }
                t.clone()
            }
            Op::Weight { name, ty, shard } => {
                let shape: Vec<usize> = ty.shape.iter().map(|d| d.fixed().expect("weights are static") as usize).collect();
                // The checkpoint tensor's shape: a shard holds one of `devices` parts of it.
                let mut full = shape.clone();
                if let Some(sh) = shard {
                    full[sh.axis as usize] *= sh.devices as usize;
                }
                // A quantized weight is seen as the values its encoding stores.
                let values = match ty.quant {
                    crate::graph::WeightEncoding::Float32 => self.weights.weight_f32(name)?,
                    q => {
                        let cols = *full.last().expect("weights have a shape");
                        crate::quant::decode(q, &self.weights.weight_encoded(name, q, cols)?, cols)
                    }
                };
                match shard {
                    Some(sh) => {
                        let len = shape[sh.axis as usize];
                        Tensor::f32(shape, slice_axis(&values, &full, sh.axis as usize, sh.index as usize * len, len))
                    }
                    None => Tensor::f32(shape, values),
                }
            }
            Op::Constant { values, ty } => {
                Tensor::f32(ty.shape.iter().map(|d| d.fixed().unwrap() as usize).collect(), values.clone())
            }
            Op::Embedding => {
                let (table, ids) = (args[0], args[1].as_i32());
                let h = table.shape[1];
                let mut out = Vec::with_capacity(ids.len() * h);
                for &id in ids {
                    let id = id as usize;
                    if id >= table.shape[0] {
                        return Err(Error::Verify(format!("token id {id} is outside the vocabulary of {}", table.shape[0])));
                    }
                    out.extend_from_slice(&table.as_f32()[id * h..(id + 1) * h]);
                }
                Tensor::f32(vec![ids.len(), h], out)
            }
            Op::MatMul => {
                let (m, k, n) = (args[0].shape[0], args[0].shape[1], args[1].shape[0]);
                Tensor::f32(vec![m, n], matmul(f(0), f(1), m, k, n))
            }
            Op::MatMulAdd => {
                let (m, k, n) = (args[0].shape[0], args[0].shape[1], args[1].shape[0]);
                let mut y = matmul(f(0), f(1), m, k, n);
                let r = f(2);
                y.iter_mut().enumerate().for_each(|(i, v)| *v += r[i % r.len()]);
                Tensor::f32(vec![m, n], y)
            }
            Op::LayerNorm { eps } => {
                let (x, w, b) = (f(0), f(1), f(2));
                let h = w.len();
                let mut out = Vec::with_capacity(x.len());
                for row in x.chunks(h) {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
                    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
                    let r = 1.0 / (var + *eps as f64).sqrt();
                    out.extend(row.iter().zip(w).zip(b).map(|((&v, &wv), &bv)| ((v as f64 - mean) * r) as f32 * wv + bv));
                }
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::MeanRows => {
                let (rows, w) = (args[0].shape[0], args[0].shape[1]);
                let x = f(0);
                let out = (0..w).map(|c| (0..rows).map(|r| x[r * w + c] as f64).sum::<f64>() / rows as f64).map(|v| v as f32).collect();
                Tensor::f32(vec![1, w], out)
            }
            Op::L2Normalize => {
                let w = args[0].shape[1];
                let mut out = Vec::with_capacity(f(0).len());
                for row in f(0).chunks(w) {
                    let norm = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt().max(1e-12);
                    out.extend(row.iter().map(|&v| (v as f64 / norm) as f32));
                }
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::Transpose => {
                let (r, c) = (args[0].shape[0], args[0].shape[1]);
                let x = f(0);
                let mut out = vec![0.0; r * c];
                for i in 0..r {
                    for j in 0..c {
                        out[j * r + i] = x[i * c + j];
                    }
                }
                Tensor::f32(vec![c, r], out)
            }
            Op::SwiGlu => {
                let (rows, w) = (args[0].shape[0], args[0].shape[1]);
                let h = w / 2;
                let x = f(0);
                let mut out = Vec::with_capacity(rows * h);
                for r in 0..rows {
                    let row = &x[r * w..(r + 1) * w];
                    out.extend((0..h).map(|c| unary(UnaryOp::Silu, row[c]) * row[h + c]));
                }
                Tensor::f32(vec![rows, h], out)
            }
            Op::Unary(u) => {
                let out = f(0).iter().map(|&x| unary(*u, x)).collect();
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::Binary(b) => {
                let (a, bb) = (f(0), f(1));
                let out = a.iter().enumerate().map(|(i, &x)| binary(*b, x, bb[i % bb.len()])).collect();
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::RmsNorm { eps } => {
                let (x, w) = (f(0), f(1));
                let h = w.len();
                let mut out = Vec::with_capacity(x.len());
                // Rows are contiguous, so groups of `h` along the last dim are chunks.
                for row in x.chunks(h) {
                    let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / h as f64;
                    let r = (1.0 / (ms + *eps as f64).sqrt()) as f32;
                    out.extend(row.iter().zip(w).map(|(&v, &wv)| v * r * wv));
                }
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::Rope { head_dim, theta, scaling } => {
                let (x, pos) = (f(0), args[1].as_i32());
                let freqs = inv_freq(*head_dim, *theta, scaling);
                let (hd, half) = (*head_dim as usize, *head_dim as usize / 2);
                let width = args[0].shape[1];
                let mut out = x.to_vec();
                for (s, &p) in pos.iter().enumerate() {
                    let cs: Vec<(f32, f32)> = freqs.iter().map(|&fr| {
                        let a = p as f32 * fr;
                        (a.cos(), a.sin())
                    }).collect();
                    for head in 0..width / hd {
                        let base = s * width + head * hd;
                        for i in 0..half {
                            let (x0, x1) = (x[base + i], x[base + half + i]);
                            let (c, sn) = cs[i];
                            out[base + i] = x0 * c - x1 * sn;
                            out[base + half + i] = x1 * c + x0 * sn;
                        }
                    }
                }
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::Attention { layer, heads, kv_heads, head_dim, scale, window, softcap, causal, sinks } => {
                let (q, k, v, pos) = (f(0), f(1), f(2), args[3].as_i32());
                let (nh, nkv, hd) = (*heads as usize, *kv_heads as usize, *head_dim as usize);
                let kvw = nkv * hd;
                let (kc, vc) = self.kv.entry(*layer).or_default();
                for (s, &p) in pos.iter().enumerate() {
                    let p = p as usize;
                    if kc.len() < (p + 1) * kvw {
                        kc.resize((p + 1) * kvw, 0.0);
                        vc.resize((p + 1) * kvw, 0.0);
                    }
                    kc[p * kvw..(p + 1) * kvw].copy_from_slice(&k[s * kvw..(s + 1) * kvw]);
                    vc[p * kvw..(p + 1) * kvw].copy_from_slice(&v[s * kvw..(s + 1) * kvw]);
                }
                let group = nh / nkv;
                let mut out = vec![0.0f32; pos.len() * nh * hd];
                let last = *pos.last().expect("a step has tokens") as usize;
                for (s, &p) in pos.iter().enumerate() {
                    // Causal: keys up to this token; otherwise every key of the sequence.
                    let p = if *causal { p as usize } else { last };
                    let start = window.map_or(0, |w| (p + 1).saturating_sub(w as usize));
                    for hh in 0..nh {
                        let kvh = hh / group;
                        let qv = &q[(s * nh + hh) * hd..(s * nh + hh + 1) * hd];
                        let scores: Vec<f32> = (start..=p)
                            .map(|j| {
                                let kv = &kc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd];
                                let s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                                match softcap {
                                    Some(c) => (s / c).tanh() * c,
                                    None => s,
                                }
                            })
                            .collect();
                        let sink = if *sinks { Some(args[4].as_f32()[hh]) } else { None };
                        let max = scores.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
                        let exps: Vec<f32> = scores.iter().map(|&x| (x - max).exp()).collect();
                        let sum: f32 = exps.iter().sum::<f32>() + sink.map_or(0.0, |z| (z - max).exp());
                        let o = &mut out[(s * nh + hh) * hd..(s * nh + hh + 1) * hd];
                        for (j, e) in (start..=p).zip(&exps) {
                            let vv = &vc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd];
                            for d in 0..hd {
                                o[d] += e / sum * vv[d];
                            }
                        }
                    }
                }
                Tensor::f32(vec![pos.len(), nh * hd], out)
            }
            Op::Concat { axis } => {
                let axis = *axis as usize;
                let outer: usize = args[0].shape[..axis].iter().product();
                let mut out = Vec::new();
                for o in 0..outer {
                    for a in &args {
                        let inner: usize = a.shape[axis..].iter().product();
                        out.extend_from_slice(&a.as_f32()[o * inner..(o + 1) * inner]);
                    }
                }
                let mut shape = args[0].shape.clone();
                shape[axis] = args.iter().map(|a| a.shape[axis]).sum();
                Tensor::f32(shape, out)
            }
            Op::Slice { axis, start, len } => {
                let (axis, start, len) = (*axis as usize, *start as usize, *len as usize);
                let x = args[0];
                let mut shape = x.shape.clone();
                shape[axis] = len;
                Tensor::f32(shape, slice_axis(x.as_f32(), &x.shape, axis, start, len))
            }
            Op::ShardSlice { axis, index, devices } => {
                let (axis, x) = (*axis as usize, args[0]);
                let len = x.shape[axis] / *devices as usize;
                let mut shape = x.shape.clone();
                shape[axis] = len;
                Tensor::f32(shape, slice_axis(x.as_f32(), &x.shape, axis, *index as usize * len, len))
            }
            Op::Moe { experts, top_k, routing, activation, biases, shared } => {
                let (x, router, gate_up, down) = (f(0), f(1), f(2), f(3));
                let (rows, h, e) = (args[0].shape[0], args[0].shape[1], *experts as usize);
                let mut logits = matmul(x, router, rows, h, e);
                let ff = args[3].shape[1];
                // gpt-oss's biases: the router's, then each expert's gate-and-up and down.
                let no_bias = vec![0.0f32; e * 2 * ff.max(h)];
                let (router_bias, gate_up_bias, down_bias) = if *biases { (f(4), f(5), f(6)) } else { (&no_bias[..e], &no_bias[..e * 2 * ff], &no_bias[..e * h]) };
                for (l, b) in logits.iter_mut().zip(router_bias.iter().cycle()) {
                    *l += b;
                }
                let mut out = vec![0.0f32; rows * h];
                // Qwen2-MoE's shared expert: its output and the gate of its sigmoid.
                let at = if *biases { 7 } else { 4 };
                let shared = shared.then(|| (f(at), f(at + 1)));
                for r in 0..rows {
                    let xr = &x[r * h..(r + 1) * h];
                    let o = &mut out[r * h..(r + 1) * h];
                    for (expert, p) in route(&logits[r * e..(r + 1) * e], *top_k as usize, *routing) {
                        let mut gu = matmul(xr, &gate_up[expert * 2 * ff * h..(expert + 1) * 2 * ff * h], 1, h, 2 * ff);
                        for (v, b) in gu.iter_mut().zip(&gate_up_bias[expert * 2 * ff..]) {
                            *v += b;
                        }
                        let act: Vec<f32> = (0..ff).map(|c| moe_activation(*activation, gu[c], gu[ff + c])).collect();
                        let y = matmul(&act, &down[expert * h * ff..(expert + 1) * h * ff], 1, ff, h);
                        for ((o, y), b) in o.iter_mut().zip(y).zip(&down_bias[expert * h..]) {
                            *o += p * (y + b);
                        }
                    }
                    if let Some((gate, shared_out)) = shared {
                        let s: f64 = xr.iter().zip(gate).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let sigmoid = (1.0 / (1.0 + (-s).exp())) as f32;
                        for (o, v) in o.iter_mut().zip(&shared_out[r * h..(r + 1) * h]) {
                            *o += sigmoid * v;
                        }
                    }
                }
                Tensor::f32(args[0].shape.clone(), out)
            }
            Op::AllReduce | Op::AllGather { .. } => {
                return Err(Error::Verify(format!(
                    "`{}` exchanges data between devices; the interpreter runs one device's graph (test sharded graphs through maxrun)",
                    node.op.mnemonic()
                )))
            }
        })
    }
}

/// An expert's activation of one gate output `g` and up output `u` (gpt-oss's in f64).
fn moe_activation(activation: crate::graph::MoeActivation, g: f32, u: f32) -> f32 {
    match activation {
        crate::graph::MoeActivation::SwiGlu => unary(UnaryOp::Silu, g) * u,
        crate::graph::MoeActivation::ClampedSwiGlu { alpha, limit } => {
            let (g, u) = ((g as f64).min(limit as f64), (u as f64).clamp(-limit as f64, limit as f64));
            ((u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp())) as f32
        }
    }
}

/// The experts one row's router `logits` choose and their weights, in rank
/// order: the `top_k` largest (ties to the lower expert index), weighted by
/// `routing`'s rule, in f64.
pub fn route(logits: &[f32], top_k: usize, routing: crate::graph::MoeRouting) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // A stable sort keeps equal logits in index order.
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap_or(std::cmp::Ordering::Equal));
    let chosen = &order[..top_k];
    let max = logits[order[0]] as f64;
    let exp = |e: usize| (logits[e] as f64 - max).exp();
    let (all, picked): (f64, f64) = ((0..logits.len()).map(exp).sum(), chosen.iter().map(|&e| exp(e)).sum());
    let denominator = match routing {
        crate::graph::MoeRouting::SoftmaxTopK { renormalize: false } => all,
        crate::graph::MoeRouting::SoftmaxTopK { renormalize: true } | crate::graph::MoeRouting::TopKSoftmax => picked,
    };
    chosen.iter().map(|&e| (e, (exp(e) / denominator) as f32)).collect()
}

/// `len` entries from `start` along `axis` of a row-major tensor of `shape`.
pub fn slice_axis(x: &[f32], shape: &[usize], axis: usize, start: usize, len: usize) -> Vec<f32> {
    let outer: usize = shape[..axis].iter().product();
    let dim = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = (o * dim + start) * inner;
        out.extend_from_slice(&x[base..base + len * inner]);
    }
    out
}

/// `x[m,k] @ w[n,k]^T`, parallel over output columns.
pub fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out_t = vec![0.0f32; n * m];
    out_t.par_chunks_mut(m).enumerate().for_each(|(j, col)| {
        let wr = &w[j * k..(j + 1) * k];
        for (i, o) in col.iter_mut().enumerate() {
            *o = dot(&x[i * k..(i + 1) * k], wr);
        }
    });
    let mut out = vec![0.0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = out_t[j * m + i];
        }
    }
    out
}

/// A dot product with eight independent accumulators (vectorizes without fast-math).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

pub fn unary(op: UnaryOp, x: f32) -> f32 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Silu => x / (1.0 + (-x).exp()),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
        UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x as f64) as f32),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Tanh => x.tanh(),
    }
}

/// The error function to double precision (W. J. Cody's rational approximations
/// via erfc for large |x|; used only by the reference interpreter).
pub fn erf(x: f64) -> f64 {
    // Abramowitz & Stegun 7.1.28 is too coarse for an oracle; use the series for
    // small |x| and the continued fraction of erfc for large |x|.
    let ax = x.abs();
    let r = if ax < 2.5 {
        let mut term = ax;
        let mut sum = ax;
        let x2 = ax * ax;
        for n in 1..80 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(x) = exp(-x^2) / (x sqrt(pi)) * 1 / (1 + 1/(2x^2) / (1 + 2/(2x^2) / (1 + ...)))
        let mut f = 0.0;
        for n in (1..60).rev() {
            f = n as f64 / 2.0 / (ax + f);
        }
        1.0 - (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f)
    };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

pub fn binary(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Max => a.max(b),
    }
}

/// Runs a decoder graph over `ids` (positions `start..`) and returns the `[seq, vocab]` logits.
pub fn run_tokens(interp: &mut Interpreter<'_>, ids: &[u32], start: usize) -> Result<Tensor> {
    let n = ids.len();
    let mut inputs = HashMap::new();
    inputs.insert("tokens".to_string(), Tensor::i32(vec![n], ids.iter().map(|&i| i as i32).collect()));
    inputs.insert("positions".to_string(), Tensor::i32(vec![n], (start..start + n).map(|p| p as i32).collect()));
    let mut out = interp.run(&inputs)?;
    Ok(out.remove("logits").expect("decoder graphs output logits"))
}

/// Greedy generation with the interpreter: prefill `prompt`, then `n` decode steps.
pub fn greedy(interp: &mut Interpreter<'_>, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let argmax = |row: &[f32]| row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32;
    let logits = run_tokens(interp, prompt, 0)?;
    let vocab = logits.shape[1];
    let mut next = argmax(&logits.as_f32()[(prompt.len() - 1) * vocab..]);
    let mut out = vec![next];
    for step in 1..n {
        let logits = run_tokens(interp, &[next], prompt.len() + step - 1)?;
        next = argmax(logits.as_f32());
        out.push(next);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head, one token whose score is 1: with a sink logit `z` its weight
    /// is `e / (e + e^z)`, and the sink's share goes to no value.
    #[test]
    fn attention_sinks_join_the_softmax_denominator_once() {
        let text = r#"graph "sinks" {
  %0 = input "q" : f32[seq, 2]
  %1 = input "k" : f32[seq, 2]
  %2 = input "v" : f32[seq, 2]
  %3 = input "positions" : i32[seq]
  %4 = weight "sinks" : f32[1]
  %5 = attention %0, %1, %2, %3, %4 {layer = 0, heads = 1, kv_heads = 1, head_dim = 2, scale = 1.0, window = none, sinks = true} : f32[seq, 2]
  output "out" = %5
}
"#;
        let g = crate::graph::text::parse(text).unwrap();
        assert_eq!(crate::graph::text::print(&g), text);
        for (z, w) in [(1.0f32, 0.5f32), (1.0 + 2f32.ln(), 1.0 / 3.0), (-1e4, 1.0)] {
            let weights: HashMap<String, Vec<f32>> = [("sinks".to_string(), vec![z])].into();
            let mut it = Interpreter::new(&g, &weights);
            let t = |d: Vec<f32>| Tensor::f32(vec![1, 2], d);
            let inputs: HashMap<String, Tensor> = [
                ("q".to_string(), t(vec![1.0, 0.0])),
                ("k".to_string(), t(vec![1.0, 0.0])),
                ("v".to_string(), t(vec![2.0, 4.0])),
                ("positions".to_string(), Tensor::i32(vec![1], vec![0])),
            ]
            .into();
            let out = it.run(&inputs).unwrap()["out"].as_f32().to_vec();
            assert!((out[0] - 2.0 * w).abs() < 1e-5 && (out[1] - 4.0 * w).abs() < 1e-5, "sink {z}: {out:?}");
        }
    }
}
