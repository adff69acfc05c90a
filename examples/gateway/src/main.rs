//! `kvroute`: the example gateway binary.
fn main() {}
