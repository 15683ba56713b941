"""K/V memory: `allocator` decides who owns which block (no torch); `pool` holds the tensors."""
