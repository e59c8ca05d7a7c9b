"""What makes a site unsafe to fuse bit for bit: where XLA would round its
arithmetic differently from the fused op (`rounding`)."""
