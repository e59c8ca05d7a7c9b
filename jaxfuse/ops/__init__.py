"""The op layer: the fused primitives and everything below the pass.

  primitive -- add_relu_p and epilogue_p: abstract evaluation, JVP, transpose, batching
  lowering  -- per-platform lowering: our kernels' FFI custom calls, or XLA's own ops
  kernels   -- loading the native modules and registering their FFI targets
  numerics  -- how XLA rounds each dtype on each platform (what the kernels reproduce)
  isa       -- the instruction set XLA:CPU targets here
  env       -- the JAXFUSE_* environment switches, parsed once
  sharding  -- custom partitioning of the fused calls
  facts     -- what a fused site records for its lowering (SiteFacts), and where on
               each platform the kernel beats XLA's loop (the measured thresholds)
  pacing    -- when a CPU call is handed a pacing value

Nothing here imports the pass (jaxfuse.fusion); tests/test_import_graph.py holds that.
"""
