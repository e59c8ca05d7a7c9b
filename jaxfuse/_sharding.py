"""How the SPMD partitioner may split the fused op.

The op is elementwise, so every output dimension is a pass-through factor
shared with each operand dimension of the same size. A size-1 (broadcast)
operand dimension gets a factor of its own, of size 1, so a bias `(1, C)`
sharded along C partitions with the output's C and is never gathered. Without
this, the partitioner treats the custom call as opaque and all-gathers it.

Shardy (the default partitioner) reads the rule from the custom call's
`sdy.sharding_rule` attribute. GSPMD, where a jax still offers it, cannot: there
the call is wrapped in `custom_partitioning`, whose partition callback hands
every device its own shards.
"""

from __future__ import annotations

import functools

from jax._src import config as _config
from jax._src.custom_partitioning_sharding_rule import (
    ArrayMapping,
    SdyShardingRule,
    sdy_sharding_rule_to_mlir,
)
from jax._src.sharding_impls import ShardingContext
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec


def _factor(i: int) -> str:
    return f"d{i}"


def elementwise_rule(operand_shapes, out_shape) -> SdyShardingRule:
    """The Shardy rule for a size-1-broadcasting elementwise op."""
    results = (ArrayMapping(*(_factor(i) for i in range(len(out_shape)))),)
    operands = []
    for k, shape in enumerate(operand_shapes):
        names = [
            _factor(i) if d == o else f"b{k}x{i}"  # broadcast: a size-1 factor of its own
            for i, (d, o) in enumerate(zip(shape, out_shape))
        ]
        operands.append(ArrayMapping(*names))
    return SdyShardingRule(tuple(operands), results)


def attach_sharding_rule(op, ctx: mlir.LoweringRuleContext) -> None:
    """Attaches the Shardy rule to the custom call `op`."""
    rule = elementwise_rule([aval.shape for aval in ctx.avals_in], ctx.avals_out[0].shape)
    op.attributes["sdy.sharding_rule"] = sdy_sharding_rule_to_mlir(
        rule, [v.type for v in op.operands], [r.type for r in op.results]
    )


# ------------------------------------------------------------------------ GSPMD
def needs_gspmd_partitioning(ctx: mlir.LoweringRuleContext) -> bool:
    """True when GSPMD (not Shardy) will partition this module across devices."""
    if _config.use_shardy_partitioner.value:
        return False
    axis_context = ctx.module_context.axis_context
    return isinstance(axis_context, ShardingContext) and axis_context.num_devices > 1


def _spec_entries(sharding, rank):
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (rank - len(spec))


def _operand_spec(shape, out_shape, out_entries) -> PartitionSpec:
    # A broadcast (size-1) dimension cannot be split; every other dimension is
    # split exactly like the output's.
    return PartitionSpec(
        *(e if d == o else None for d, o, e in zip(shape, out_shape, out_entries))
    )


def _infer(mesh, arg_shapes, result_shape):
    # Each output dimension follows the first operand that is not broadcast there.
    rank = len(result_shape.shape)
    entries = []
    for i, o in enumerate(result_shape.shape):
        entry = None
        for arg in arg_shapes:
            if len(arg.shape) == rank and arg.shape[i] == o:
                entry = _spec_entries(arg.sharding, rank)[i]
                break
        entries.append(entry)
    return NamedSharding(mesh, PartitionSpec(*entries))


@functools.lru_cache(maxsize=None)
def gspmd_partitioned(local_call):
    """`local_call(a, b)` wrapped so GSPMD runs it on each device's shards."""

    @custom_partitioning
    def call(a, b):
        return local_call(a, b)

    def partition(mesh, arg_shapes, result_shape):
        out_shape = result_shape.shape
        out_sharding = result_shape.sharding
        entries = _spec_entries(out_sharding, len(out_shape))
        arg_shardings = tuple(
            NamedSharding(mesh, _operand_spec(a.shape, out_shape, entries)) for a in arg_shapes
        )
        return mesh, local_call, out_sharding, arg_shardings

    call.def_partition(partition=partition, infer_sharding_from_operands=_infer)
    return call


def lower_gspmd(ctx, a, b, local_call):
    return mlir.lower_fun(gspmd_partitioned(local_call), multiple_results=False)(ctx, a, b)


__all__ = ["attach_sharding_rule", "elementwise_rule", "needs_gspmd_partitioning", "lower_gspmd"]
