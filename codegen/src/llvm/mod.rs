//! The LLVM backend (inkwell, LLVM 19): kernel IR -> LLVM IR -> an optimized x86-64
//! or aarch64 object (the AArch64 backend cross-compiles from any build machine),
//! or PTX text for NVIDIA GPUs through the NVPTX backend (same emitter).

pub mod lower;

use inkwell::context::Context;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;
use maxc_kernels::Kernel;

use crate::{link::link_shared_for, CodegenError, CompiledCode, CpuTarget, GpuTarget};
use lower::Flavor;

fn target_machine(target: &CpuTarget) -> Result<TargetMachine, CodegenError> {
    if target.is_aarch64() {
        Target::initialize_aarch64(&InitializationConfig::default());
    } else {
        Target::initialize_x86(&InitializationConfig::default());
    }
    let triple = TargetTriple::create(&target.triple);
    let t = Target::from_triple(&triple).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    t.create_target_machine(&triple, &target.cpu, &target.features, OptimizationLevel::Aggressive, RelocMode::PIC, CodeModel::Default)
        .ok_or_else(|| CodegenError::Llvm(format!("no target machine for {} / {}", target.triple, target.cpu)))
}

/// The optimized LLVM IR of `kernels` as text (for `--emit-llvm` and tests).
pub fn emit_llvm_ir(kernels: &[Kernel], target: &CpuTarget) -> Result<String, CodegenError> {
    let context = Context::create();
    let tm = target_machine(target)?;
    let module = lower::lower_module(&context, kernels, Flavor::Cpu(target), &tm)?;
    Ok(module.print_to_string().to_string())
}

/// Compiles `kernels` into an object file for `target`.
pub fn compile_object(kernels: &[Kernel], target: &CpuTarget) -> Result<Vec<u8>, CodegenError> {
    let context = Context::create();
    let tm = target_machine(target)?;
    let module = lower::lower_module(&context, kernels, Flavor::Cpu(target), &tm)?;
    let buf = tm.write_to_memory_buffer(&module, FileType::Object).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    Ok(buf.as_slice().to_vec())
}

/// The optimized assembly of `kernels` for `target` as text (tests read it).
pub fn emit_assembly(kernels: &[Kernel], target: &CpuTarget) -> Result<String, CodegenError> {
    let context = Context::create();
    let tm = target_machine(target)?;
    let module = lower::lower_module(&context, kernels, Flavor::Cpu(target), &tm)?;
    let buf = tm.write_to_memory_buffer(&module, FileType::Assembly).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    String::from_utf8(buf.as_slice().to_vec()).map_err(|e| CodegenError::Llvm(format!("assembly is not UTF-8: {e}")))
}

/// Compiles and links `kernels` into a shared object (for an aarch64 target from
/// an x86-64 machine, with the cross linker: `link::link_shared_for`).
pub fn compile_shared(kernels: &[Kernel], target: &CpuTarget) -> Result<CompiledCode, CodegenError> {
    let object = compile_object(kernels, target)?;
    let shared_object = link_shared_for(&object, &target.triple)?;
    Ok(CompiledCode { shared_object, symbols: kernels.iter().map(|k| k.name.clone()).collect() })
}

fn nvptx_machine(target: &GpuTarget) -> Result<TargetMachine, CodegenError> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let t = Target::from_triple(&triple).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    // No PTX version feature: LLVM picks the lowest ISA version the SM needs.
    t.create_target_machine(&triple, &target.arch, "", OptimizationLevel::Aggressive, RelocMode::Default, CodeModel::Default)
        .ok_or_else(|| CodegenError::Llvm(format!("no NVPTX target machine for {}", target.arch)))
}

/// Compiles `kernels` to one PTX module (text) for `target`. Every kernel is a
/// `.entry` with the CPU ABI's parameters; GPU thread `i` of a launch runs task
/// `task_begin + i`.
pub fn compile_ptx(kernels: &[Kernel], target: &GpuTarget) -> Result<String, CodegenError> {
    let context = Context::create();
    let tm = nvptx_machine(target)?;
    let module = lower::lower_module(&context, kernels, Flavor::Nvptx, &tm)?;
    let buf = tm.write_to_memory_buffer(&module, FileType::Assembly).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    String::from_utf8(buf.as_slice().to_vec()).map_err(|e| CodegenError::Llvm(format!("PTX is not UTF-8: {e}")))
}

/// Runs LLVM's O3 pipeline over the module.
pub(crate) fn optimize(module: &inkwell::module::Module<'_>, tm: &TargetMachine) -> Result<(), CodegenError> {
    module.run_passes("default<O3>", tm, PassBuilderOptions::create()).map_err(|e| CodegenError::Llvm(e.to_string()))
}
