//! maxc-codegen: backends that lower kernel IR to machine code.
