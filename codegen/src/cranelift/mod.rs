//! The Cranelift backend: kernel IR -> Cranelift IR -> x86-64 object (scalar code,
//! baseline x86-64), linked like the LLVM object. It compiles an order of magnitude
//! faster than LLVM and is an independent implementation to test LLVM against.

pub mod lower;

use cranelift_codegen::isa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_module::default_libcall_names;
use cranelift_object::{ObjectBuilder, ObjectModule};
use maxc_kernels::Kernel;

use crate::{link::link_shared, CodegenError, CompiledCode};

fn err(e: impl std::fmt::Display) -> CodegenError {
    CodegenError::Llvm(format!("cranelift: {e}"))
}

/// The CPU features Cranelift's baseline x86-64 code may use.
pub const REQUIRED_FEATURES: &[&str] = &["sse", "sse2"];

/// Compiles `kernels` into an object file.
pub fn compile_object(kernels: &[Kernel]) -> Result<Vec<u8>, CodegenError> {
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(err)?;
    flags.set("is_pic", "true").map_err(err)?;
    let isa = isa::lookup_by_name("x86_64-unknown-linux-gnu").map_err(err)?.finish(settings::Flags::new(flags)).map_err(err)?;
    let builder = ObjectBuilder::new(isa, "maxc_kernels", default_libcall_names()).map_err(err)?;
    let mut module = ObjectModule::new(builder);
    for k in kernels {
        lower::lower_kernel(&mut module, k)?;
    }
    module.finish().emit().map_err(err)
}

/// Compiles and links `kernels` into a shared object.
pub fn compile_shared(kernels: &[Kernel]) -> Result<CompiledCode, CodegenError> {
    let object = compile_object(kernels)?;
    let shared_object = link_shared(&object)?;
    Ok(CompiledCode { shared_object, symbols: kernels.iter().map(|k| k.name.clone()).collect() })
}
