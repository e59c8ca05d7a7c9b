"""The built-in patterns: add -> ReLU and the BatchNorm / scale-shift / residual
epilogues around it (`epilogues`), the ReLU spellings (`relu`) and a gradient's
derivative masks rewritten from the fused outputs (`masks`)."""
